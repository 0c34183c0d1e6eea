//! pgcache's publication: the tables it watches. It lists the tables
//! with a replica identity that statements through pgcache use (every such
//! table when a stream starts, later ones when a statement first names
//! them), never one without (its UPDATE/DELETE would fail); after DDL the
//! stream takes out tables that lost their identity.

use std::sync::Arc;

use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tracing::{debug, info, warn};

use super::ReplicationError;
use super::control::{
    Control, PUBLISHABLE, Publishable, Table, full_message, quote_ident, quote_literal,
};
use super::replication::Streams;
use crate::cache::{DbState, Ddl};

impl Control {
    /// Creates the publication if needed, takes out of it the tables that
    /// have no replica identity and, with `add`, puts in the tables that
    /// have one: of every table, or (after DDL that named them, or reads
    /// that found them missing) of the tables of these names, so that the
    /// cost of a DDL statement does not grow with the database. `found`:
    /// the publication as a round after DDL already found it.
    pub async fn sync_publication(
        &self,
        publication: &str,
        only: Option<&[String]>,
        add: bool,
        found: Option<Publishable>,
    ) -> Result<Synced, ReplicationError> {
        let ctl = &self.client;
        let Some(tables) = self.publishable(publication, only, found).await? else {
            // FOR ALL TABLES: PostgreSQL decides; nothing to manage.
            return Ok(Synced::default());
        };
        // (qualified name, bare name) of each table to change.
        let mut to_add = Vec::new();
        let mut to_drop = Vec::new();
        let mut unpublishable = Vec::new();
        for table in tables {
            match (table.published, table.identity) {
                (false, true) if add => to_add.push((table.qualified, table.name)),
                (true, false) => {
                    to_drop.push((table.qualified.clone(), table.name.clone()));
                    unpublishable.push((table.qualified, table.name));
                }
                (false, false) => unpublishable.push((table.qualified, table.name)),
                (false, true) | (true, true) => {}
            }
        }
        let mut synced = Synced {
            unpublished: unpublishable,
            ..Synced::default()
        };
        for (verb, tables) in [(Alter::Add, to_add), (Alter::Drop, to_drop)] {
            if tables.is_empty() {
                continue;
            }
            let refused = alter_tables(ctl, publication, verb, &tables).await?;
            for (qualified, name) in tables {
                let refused = refused.iter().find(|r| r.table == qualified);
                // Added, by this change or another instance's.
                let added = refused.is_none_or(|r| r.code == SqlState::DUPLICATE_OBJECT.code());
                if verb == Alter::Add && added {
                    synced.added.push(name.clone());
                }
                match refused {
                    None => {}
                    Some(r) if r.code == SqlState::LOCK_NOT_AVAILABLE.code() => {
                        synced.waited.push(name)
                    }
                    Some(r) if RACES.contains(&r.code.as_str()) => {
                        debug!(publication, table = %qualified, error = %r.message, "publication change raced with other DDL");
                    }
                    Some(r) => {
                        warn!(publication, table = %qualified, code = %r.code, error = %r.message, "could not change the publication")
                    }
                }
            }
        }
        if !synced.added.is_empty() {
            debug!(
                publication,
                tables = synced.added.len(),
                "added tables to the publication"
            );
        }
        Ok(synced)
    }

    /// The tables of the database (or those named `only`) as publication
    /// `publication` has them, creating it first if it does not exist;
    /// `None` if it is `FOR ALL TABLES`. `found`: as a round after DDL
    /// already found them.
    async fn publishable(
        &self,
        publication: &str,
        only: Option<&[String]>,
        mut found: Option<Publishable>,
    ) -> Result<Option<Vec<Table>>, ReplicationError> {
        let ctl = &self.client;
        let quoted = quote_ident(publication);
        let mut created = false;
        loop {
            let publishable = match (found.take(), only) {
                (Some(found), _) => found,
                (None, Some(names)) => Publishable::from_rows(
                    &ctl.query(&self.publishable, &[&publication, &names])
                        .await?,
                    0,
                ),
                (None, None) => Publishable::from_rows(
                    &ctl.query_typed(PUBLISHABLE, &[(&publication, Type::TEXT)])
                        .await?,
                    0,
                ),
            };
            match publishable.all {
                Some(true) => return Ok(None),
                None if !created => {
                    // Another instance may make it first: then it is there.
                    ctl.batch_execute(&format!(
                        "DO $pgcache$ BEGIN \
                           CREATE PUBLICATION {quoted} WITH (publish_via_partition_root = true); \
                         EXCEPTION WHEN duplicate_object THEN NULL; END $pgcache$"
                    ))
                    .await?;
                    info!(publication, "created publication");
                    created = true;
                }
                _ => return Ok(Some(publishable.tables)),
            }
        }
    }
}

/// What [`Control::sync_publication`] did.
#[derive(Debug, Default)]
pub struct Synced {
    /// Tables it checked and left out for lack of a replica identity:
    /// (qualified name, bare name).
    pub unpublished: Vec<(String, String)>,
    /// Bare names of the tables it added.
    pub added: Vec<String>,
    /// Bare names of the tables it would have changed, but whose lock was
    /// not granted in time: to try again later.
    pub waited: Vec<String>,
}

/// How long pgcache's own change of the publication waits for a table's
/// lock (`ALTER PUBLICATION` takes SHARE UPDATE EXCLUSIVE): well under
/// PostgreSQL's `deadlock_timeout` (1 s by default), so that an
/// application's DDL that waits on pgcache's change, while pgcache waits on
/// it, sees pgcache give up first and is never failed with 40P01. The
/// change is tried again later, off every client's path.
const LOCK_TIMEOUT: &str = "100ms";

/// How long after a change that waited too long it is tried again.
const PUBLICATION_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Outcomes that only mean other DDL got there first (the table dropped,
/// its schema too, already added or taken out): what was intended holds.
const RACES: [&str; 4] = ["42P01", "42710", "42704", "3F000"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alter {
    Add,
    Drop,
}

/// A table the publication change left as it was, and why.
#[derive(Debug)]
pub struct Refused {
    pub table: String,
    pub code: String,
    pub message: String,
}

/// Takes `table` (a qualified name) of database `db` out of the
/// publication, for a session's `SET UNLOGGED`, which PostgreSQL refuses
/// for a published table; on pgcache's own connection, whose role owns
/// the publication. Nothing is reported back: a table not in the
/// publication, or locked (by the client's own transaction, say), leaves
/// the statement to meet PostgreSQL's answer. While unlogged the table is
/// not cached (replication cannot see it); `SET LOGGED` is DDL, after
/// which the publication sync adds it again.
pub async fn take_out_for_unlogged(
    upstream: &crate::upstream::Upstream,
    db: &str,
    publication: &str,
    table: &str,
) {
    let ctl = match upstream.control(db).await {
        Ok(ctl) => ctl,
        Err(e) => {
            debug!(error = %full_message(&e), "cannot take a table out of the publication");
            return;
        }
    };
    let tables = [(table.to_owned(), String::new())];
    match alter_tables(&ctl, publication, Alter::Drop, &tables).await {
        Ok(refused) if refused.is_empty() => {
            info!(
                table,
                "took the table out of the publication for SET UNLOGGED"
            )
        }
        Ok(refused) => debug!(table, outcome = ?refused, "publication unchanged"),
        Err(e) => debug!(table, error = %full_message(&e), "publication unchanged"),
    }
}

/// Adds `tables` (qualified names, first of each pair) to the publication
/// or drops them from it, one by one, each in a subtransaction that waits
/// at most [`LOCK_TIMEOUT`] for its lock. After a lock not granted in time
/// the rest are not tried (so that pgcache never holds one table's lock
/// while it waits for another's for long), and are refused as 55P03 too.
/// The errors are caught in PostgreSQL, so none is written to the server's
/// log; they come back as [`Refused`]. Where the role may, event triggers
/// are off for the change: the instance that makes it handles it itself,
/// and another instance learns of a table it wants added when its own
/// attempt finds it there already (42710).
pub async fn alter_tables(
    ctl: &tokio_postgres::Client,
    publication: &str,
    verb: Alter,
    tables: &[(String, String)],
) -> Result<Vec<Refused>, tokio_postgres::Error> {
    let verb = match verb {
        Alter::Add => "ADD",
        Alter::Drop => "DROP",
    };
    let names: Vec<String> = tables.iter().map(|(q, _)| quote_literal(q)).collect();
    let sql = format!(
        "BEGIN; \
         DO $pgcache$ DECLARE t text; waited boolean := false; outcome text := ''; BEGIN \
           PERFORM pg_catalog.set_config('lock_timeout', {timeout}, true); \
           BEGIN \
             PERFORM pg_catalog.set_config('session_replication_role', 'replica', true); \
           EXCEPTION WHEN insufficient_privilege THEN NULL; \
           END; \
           FOREACH t IN ARRAY ARRAY[{names}]::text[] LOOP \
             IF waited THEN \
               outcome := outcome || t || E'\\t55P03\\tnot tried after a lock wait\\n'; \
               CONTINUE; \
             END IF; \
             BEGIN \
               EXECUTE pg_catalog.format('ALTER PUBLICATION %I {verb} TABLE %s', {publication}, t); \
             EXCEPTION WHEN OTHERS THEN \
               waited := SQLSTATE = '55P03'; \
               outcome := outcome || t || E'\\t' || SQLSTATE || E'\\t' || \
                 pg_catalog.replace(SQLERRM, E'\\n', ' ') || E'\\n'; \
             END; \
           END LOOP; \
           PERFORM pg_catalog.set_config('pgcache.outcome', outcome, true); \
         END $pgcache$; \
         SELECT pg_catalog.current_setting('pgcache.outcome', true); \
         COMMIT",
        timeout = quote_literal(LOCK_TIMEOUT),
        names = names.join(", "),
        publication = quote_literal(publication),
    );
    let outcome = ctl
        .simple_query(&sql)
        .await?
        .into_iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default();
    Ok(outcome
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, '\t');
            Some(Refused {
                table: parts.next()?.to_owned(),
                code: parts.next()?.to_owned(),
                message: parts.next().unwrap_or_default().to_owned(),
            })
        })
        .collect())
}

impl Streams {
    /// Reads found tables missing from the publication: those with a
    /// replica identity join it, after which their facts are fetched
    /// again and their reads cached.
    pub(super) async fn publish_unwatched(&self, ctl: &Control, db: &Arc<DbState>) {
        let names: Vec<String> = db
            .catalog
            .take_unwatched()
            .into_iter()
            .filter(|name| !db.stream.settled_unpublished(name))
            .collect();
        if !names.is_empty() {
            debug!(database = %db.name, tables = ?names, "tables read that the publication lacks");
            self.sync_publication(ctl, db, Some(&names), true, None)
                .await;
        }
    }

    /// Brings the publication up to date for the tables of the bare names
    /// `only` (all with `None`), adding those that can join it if `add`;
    /// `found` is the publication as a round after DDL found it.
    pub(super) async fn sync_publication(
        &self,
        ctl: &Control,
        db: &Arc<DbState>,
        only: Option<&[String]>,
        add: bool,
        found: Option<Publishable>,
    ) {
        if !self.settings.manage_publication {
            return;
        }
        match ctl
            .sync_publication(&self.settings.publication, only, add, found)
            .await
        {
            Ok(synced) => {
                if !synced.waited.is_empty() {
                    debug!(database = %db.name, tables = ?synced.waited, "publication change waited too long for a lock: tried again later");
                    db.catalog.requeue_unwatched(synced.waited);
                    let db = Arc::clone(db);
                    tokio::spawn(async move {
                        tokio::time::sleep(PUBLICATION_RETRY).await;
                        db.catalog.unwatched_found.notify_one();
                    });
                }
                self.note_unpublished(db, only, synced.unpublished);
                // Facts fetched before a table joined the publication
                // say it cannot be watched.
                db.catalog.forget(&Ddl::objects(synced.added));
            }
            // A table dropped meanwhile, or added by another instance:
            // the outcome is the intended one.
            Err(ReplicationError::Control(e))
                if e.code().is_some_and(|c| {
                    *c == SqlState::UNDEFINED_TABLE || *c == SqlState::DUPLICATE_OBJECT
                }) =>
            {
                debug!(database = %db.name, error = %full_message(&e), "publication update raced with other DDL");
            }
            Err(ReplicationError::Control(e)) => {
                warn!(database = %db.name, error = %full_message(&e), "could not update the publication")
            }
            Err(e) => {
                warn!(database = %db.name, error = %e, "could not update the publication")
            }
        }
    }

    /// Keeps the count of unpublishable tables, and reports a table once,
    /// when it becomes one (not after every DDL that checks it again).
    pub(super) fn note_unpublished(
        &self,
        db: &DbState,
        checked: Option<&[String]>,
        found: Vec<(String, String)>,
    ) {
        let news = db.stream.note_unpublished(checked, found);
        if news.is_empty() {
            return;
        }
        debug!(database = %db.name, tables = %news.join(", "), "tables without a replica identity");
        let count = db.stream.unpublished();
        if db.stream.warn_unpublished(count, std::time::Instant::now()) {
            let mut some = news.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            if news.len() > 5 {
                some.push_str(", ...");
            }
            warn!(
                database = %db.name,
                count,
                tables = %some,
                "tables without a replica identity (no primary key, identity index or FULL) are not cached; SHOW TABLES lists them"
            );
        }
    }
}
