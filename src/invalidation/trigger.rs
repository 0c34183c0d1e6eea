//! The DDL event trigger pgcache installs in each database it streams:
//! it announces DDL in the stream, so DDL made outside pgcache invalidates
//! too, and keeps a table that loses its replica identity out of the
//! publication within the DDL itself. DDL a client sent through pgcache is
//! announced with the instance that carried it, whose session handled it
//! ([`origin_mark`]).

use tracing::warn;

use super::DDL_MESSAGE_PREFIX;
use super::control::quote_literal;
use crate::origin::ORIGIN_SETTING;

/// The trigger's first step with `managed` (the publication pgcache
/// keeps): a table that loses its replica identity leaves the publication
/// in the same transaction, since PostgreSQL refuses UPDATE and DELETE on a
/// published table without one and waiting for the stream would leave that
/// window open. ALTER TABLE names its table; DROP INDEX does not (the index
/// is gone when the trigger runs), so after one the published tables that
/// use an identity index are checked, and those left without one are named
/// in the message (`unpublished`).
fn unpublish_step(managed: Option<&str>) -> String {
    match managed {
        Some(publication) => format!(
            "IF tg_tag = 'ALTER TABLE' THEN
               BEGIN
                 FOR rel IN SELECT DISTINCT c.oid::regclass::text FROM pg_event_trigger_ddl_commands() d
                     JOIN pg_class c ON d.classid = 'pg_class'::regclass AND c.oid = d.objid
                     JOIN pg_publication_rel pr ON pr.prrelid = c.oid
                     JOIN pg_publication p ON p.oid = pr.prpubid AND p.pubname = {name}
                   WHERE NOT {identity} LOOP
                   EXECUTE format('ALTER PUBLICATION %I DROP TABLE %s', {name}, rel);
                 END LOOP;
               EXCEPTION WHEN OTHERS THEN NULL;
               END;
             ELSIF tg_tag = 'DROP INDEX' AND tg_event = 'sql_drop' THEN
               BEGIN
                 FOR rel, bare IN SELECT c.oid::regclass::text, c.relname::text FROM pg_publication p
                     JOIN pg_publication_rel pr ON pr.prpubid = p.oid
                     JOIN pg_class c ON c.oid = pr.prrelid
                   WHERE p.pubname = {name} AND c.relreplident = 'i' AND NOT {identity} LOOP
                   EXECUTE format('ALTER PUBLICATION %I DROP TABLE %s', {name}, rel);
                   unpublished := concat_ws(E'\\n', unpublished, bare);
                 END LOOP;
               EXCEPTION WHEN OTHERS THEN NULL;
               END;
             END IF;",
            name = quote_literal(publication),
            identity = has_identity!(),
        ),
        None => String::new(),
    }
}

/// The message's `!origin` (NULL for none): the instance whose
/// session's connection ran the DDL ([`ORIGIN_SETTING`]), when the DDL is
/// the client's statement itself: the query holds one statement and it
/// starts with the command's verb. The session handled that statement;
/// DDL run inside one (a function a SELECT calls, a DO block, a CALL) is
/// not what its analysis named.
fn origin_mark() -> String {
    format!(
        "CASE WHEN upper(substring(ltrim(current_query(), E' \\t\\r\\n') FROM '^[A-Za-z]+')) = split_part(tg_tag, ' ', 1)
             AND strpos(rtrim(current_query(), E' \\t\\r\\n;'), ';') = 0
           THEN '!' || nullif(current_setting('{ORIGIN_SETTING}', true), '') END"
    )
}

/// The body of `pgcache.announce_ddl()`: see [`install_ddl_trigger`].
fn function_body(managed: Option<&str>) -> String {
    let unpublish = unpublish_step(managed);
    // The message's first line is the command tag, then " -" if the
    // trigger took a table out of the publication, " ~" if it left out the
    // objects a command created or altered, then " !" and the instance
    // whose session sent the DDL (its connections carry ORIGIN_SETTING;
    // that instance handled the DDL already). The objects are left out for
    // DDL an instance's session sent when no other instance streams the
    // database (one slot of pgcache's at most): listing them is most of
    // the trigger's cost, and only other instances need them; one that
    // starts streaming meanwhile takes " ~" for a change of anything.
    // Then one line per thing changed: a dropped object's bare name, the
    // bare name of a table the trigger took out of the publication,
    // "@classid,objid,objsubid" for an object a command created or altered
    // (named later, by [`Control::after_ddl`], off the user's transaction:
    // naming it here costed a third more per DDL statement), "*" for
    // anything. The tag alone means anything.
    let no_facts = no_facts!();
    let origin = origin_mark();
    format!(
        "
           DECLARE
             names text;
             rel text;
             bare text;
             unpublished text;
             origin text;
             omitted bool := false;
           BEGIN
             {unpublish}
             BEGIN
               origin := {origin};
               IF tg_event = 'sql_drop' THEN
                 SELECT string_agg(CASE WHEN cardinality(o.address_names) < 2 THEN '*'
                     ELSE o.address_names[2] END, E'\\n')
                   INTO names FROM pg_event_trigger_dropped_objects() o
                   WHERE o.object_type NOT IN ({no_facts});
               ELSIF origin IS NOT NULL AND (SELECT count(*) FROM pg_replication_slots
                   WHERE database = current_database() AND slot_name LIKE 'pgcache\\_%') <= 1 THEN
                 omitted := true;
               ELSE
                 SELECT string_agg('@' || c.classid::oid::int8 || ',' || c.objid::oid::int8 || ',' || c.objsubid, E'\\n')
                   INTO names FROM pg_event_trigger_ddl_commands() c;
               END IF;
               PERFORM pg_logical_emit_message(true, '{DDL_MESSAGE_PREFIX}',
                 tg_tag || CASE WHEN unpublished IS NULL THEN '' ELSE ' -' END
                   || CASE WHEN omitted THEN ' ~' ELSE '' END || coalesce(' ' || origin, '')
                   || E'\\n' || concat_ws(E'\\n', names, unpublished));
             EXCEPTION WHEN OTHERS THEN
               PERFORM pg_logical_emit_message(true, '{DDL_MESSAGE_PREFIX}', tg_tag);
             END;
           EXCEPTION WHEN OTHERS THEN NULL;
           END"
    )
}

/// Installs an event trigger that announces DDL in the stream, so DDL made
/// outside pgcache invalidates too. Needs superuser; without it pgcache logs
/// a warning and notices outside DDL only through the TTL. The function can
/// never fail the user's DDL. With `managed`, it also keeps the publication
/// free of tables without a replica identity ([`unpublish_step`]).
pub async fn install_ddl_trigger(
    ctl: &tokio_postgres::Client,
    database: &str,
    managed: Option<&str>,
) {
    let body = function_body(managed);
    // Installing is DDL, which the trigger announces and every instance
    // treats as a change of everything: only when it differs.
    if installed(ctl, &body).await {
        return;
    }
    let sql = format!(
        "CREATE SCHEMA IF NOT EXISTS pgcache;
         CREATE OR REPLACE FUNCTION pgcache.announce_ddl() RETURNS event_trigger
           LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $pgcache${body}$pgcache$;
         DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl') THEN
             CREATE EVENT TRIGGER pgcache_ddl ON ddl_command_end EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl_drop') THEN
             CREATE EVENT TRIGGER pgcache_ddl_drop ON sql_drop EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
         END $$;"
    );
    if let Err(e) = ctl.batch_execute(&sql).await {
        warn!(database, error = %e, "cannot install the DDL event trigger (needs superuser): DDL made outside pgcache is not seen");
    }
}

/// Whether the DDL trigger is in place with the function body `body`.
async fn installed(ctl: &tokio_postgres::Client, body: &str) -> bool {
    const INSTALLED: &str =
        "SELECT p.prosrc = $1 AND (SELECT count(*) FROM pg_catalog.pg_event_trigger
           WHERE evtname IN ('pgcache_ddl', 'pgcache_ddl_drop')) = 2
         FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'pgcache' AND p.proname = 'announce_ddl'";
    match ctl.query_opt(INSTALLED, &[&body]).await {
        Ok(Some(row)) => row.get::<_, Option<bool>>(0) == Some(true),
        _ => false,
    }
}
