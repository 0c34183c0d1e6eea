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
/// a statement the client sent, which its session analysed: run at the top
/// level (the trigger's call stack, `stack` from `PG_CONTEXT`, is the
/// trigger alone; DDL that a function, a DO block, a CALL or another event
/// trigger ran has their frames below it) and the query's first word,
/// after comments, is the command's verb.
fn origin_mark() -> String {
    format!(
        r"CASE WHEN current_setting('{ORIGIN_SETTING}', true) <> '' AND strpos(stack, E'\n') = 0
             AND upper(substring(current_query() FROM E'^(?:\\s|/\\*.*?\\*/|--[^\\n]*\\n)*([A-Za-z]+)'))
               = split_part(tg_tag, ' ', 1)
           THEN '!' || current_setting('{ORIGIN_SETTING}', true) END"
    )
}

/// The body of `pgcache.announce_ddl()`: see [`install_ddl_trigger`].
fn function_body(managed: Option<&str>, alone: bool) -> String {
    let unpublish = unpublish_step(managed);
    // The message's first line is the command tag, then " -" if the
    // trigger took a table out of the publication, " ~" if it left out the
    // objects a command created or altered, then " !" and the instance
    // whose session sent the DDL (its connections carry ORIGIN_SETTING;
    // that instance handled the DDL already). The objects are left out for
    // DDL an instance sent while it streams the database `alone`: listing
    // them is most of the trigger's cost, and only other instances need
    // them; one that starts streaming meanwhile takes " ~" for a change of
    // anything until it has installed the trigger anew. DDL on temporary
    // objects alone is not announced, and they are left out of a list:
    // they are their session's alone (a session of pgcache's tracks its
    // own), and one dropped at commit would be gone before it could be
    // named. Nor is a DROP at its command's end: sql_drop announced what
    // it dropped (DROP OWNED, which also revokes, is). Then one line per
    // thing changed: a dropped object's bare name, the bare name of a
    // table the trigger took out of the publication,
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
             stack text;
             omitted bool := false;
             temporary_only bool;
           BEGIN
             IF tg_event = 'ddl_command_end' AND tg_tag LIKE 'DROP %' AND tg_tag <> 'DROP OWNED' THEN
               RETURN;
             END IF;
             {unpublish}
             BEGIN
               GET DIAGNOSTICS stack = PG_CONTEXT;
               origin := {origin};
               IF tg_event = 'sql_drop' THEN
                 SELECT string_agg(CASE WHEN o.is_temporary OR o.object_type IN ({no_facts}) THEN NULL
                     WHEN cardinality(o.address_names) < 2 THEN '*' ELSE o.address_names[2] END, E'\\n'),
                   bool_and(o.is_temporary)
                   INTO names, temporary_only FROM pg_event_trigger_dropped_objects() o;
               ELSIF origin IS NOT NULL AND {alone} THEN
                 omitted := true;
               ELSE
                 SELECT string_agg(CASE WHEN t.is_temp THEN NULL ELSE
                     '@' || c.classid::oid::int8 || ',' || c.objid::oid::int8 || ',' || c.objsubid END, E'\\n'),
                   bool_and(t.is_temp)
                   INTO names, temporary_only FROM pg_event_trigger_ddl_commands() c
                   CROSS JOIN LATERAL (SELECT coalesce(c.schema_name ~ '^pg_(toast_)?temp(_[0-9]+)?$', false)) t(is_temp);
               END IF;
               IF temporary_only AND unpublished IS NULL THEN
                 RETURN;
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
/// free of tables without a replica identity ([`unpublish_step`]). With
/// `alone` (no other instance streams the database), it lists no objects
/// for DDL an instance sent ([`function_body`]).
pub async fn install_ddl_trigger(
    ctl: &tokio_postgres::Client,
    database: &str,
    managed: Option<&str>,
    alone: bool,
) {
    let body = function_body(managed, alone);
    if installed(ctl, &body).await {
        return;
    }
    // One statement, with event triggers off for it where the role may set
    // session_replication_role (local to the statement's transaction): what
    // pgcache installs changes no fact any instance keeps, and announced
    // it would read as a change of anything to other instances (its
    // CREATE SCHEMA IF NOT EXISTS lists no objects).
    let sql = format!(
        "DO $install$ BEGIN
           BEGIN
             PERFORM pg_catalog.set_config('session_replication_role', 'replica', true);
           EXCEPTION WHEN insufficient_privilege THEN NULL;
           END;
           CREATE SCHEMA IF NOT EXISTS pgcache;
           CREATE OR REPLACE FUNCTION pgcache.announce_ddl() RETURNS event_trigger
             LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $pgcache${body}$pgcache$;
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl') THEN
             CREATE EVENT TRIGGER pgcache_ddl ON ddl_command_end EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl_drop') THEN
             CREATE EVENT TRIGGER pgcache_ddl_drop ON sql_drop EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
         END $install$"
    );
    if let Err(e) = ctl.batch_execute(&sql).await {
        warn!(database, error = %e, "cannot install the DDL event trigger (needs superuser): DDL made outside pgcache is not seen");
    }
}

/// Whether this instance streams `ctl`'s database alone: no replication
/// slot of pgcache's there but its own (`own_slot`: made already).
/// Unknown, it is taken as not.
pub async fn streams_alone(ctl: &tokio_postgres::Client, own_slot: bool) -> bool {
    const SLOTS: &str = "SELECT count(*) <= $1 FROM pg_catalog.pg_replication_slots
        WHERE database = pg_catalog.current_database() AND slot_name LIKE 'pgcache\\_%'";
    match ctl.query_one(SLOTS, &[&i64::from(own_slot)]).await {
        Ok(row) => row.get(0),
        Err(_) => false,
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
