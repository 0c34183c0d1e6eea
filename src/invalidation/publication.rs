//! pgcache's publication: the tables it watches. It lists the tables
//! with a replica identity that statements through pgcache use (every such
//! table when a stream starts, later ones when a statement first names
//! them), never one without (its UPDATE/DELETE would fail); after DDL the
//! stream takes out tables that lost their identity.

use std::sync::Arc;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tracing::{debug, info, warn};

use super::ReplicationError;
use super::control::{Control, PUBLISHABLE, Publishable, full_message, quote_ident};
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
        mut found: Option<Publishable>,
    ) -> Result<Synced, ReplicationError> {
        let ctl = &self.client;
        let quoted = quote_ident(publication);
        let mut created = false;
        let tables = loop {
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
                // FOR ALL TABLES: PostgreSQL decides; nothing to manage.
                Some(true) => return Ok(Synced::default()),
                None if !created => {
                    ctl.batch_execute(&format!(
                        "CREATE PUBLICATION {quoted} WITH (publish_via_partition_root = true)"
                    ))
                    .await?;
                    info!(publication, "created publication");
                    created = true;
                }
                _ => break publishable.tables,
            }
        };
        let mut to_add = Vec::new();
        let mut added = Vec::new();
        let mut to_drop = Vec::new();
        let mut unpublishable = Vec::new();
        for table in tables {
            match (table.published, table.identity) {
                (false, true) if add => {
                    to_add.push(table.qualified);
                    added.push(table.name);
                }
                (true, false) => {
                    to_drop.push(table.qualified.clone());
                    unpublishable.push((table.qualified, table.name));
                }
                (false, false) => unpublishable.push((table.qualified, table.name)),
                (false, true) | (true, true) => {}
            }
        }
        if !to_add.is_empty() {
            ctl.batch_execute(&format!(
                "ALTER PUBLICATION {quoted} ADD TABLE {}",
                to_add.join(", ")
            ))
            .await?;
            debug!(
                publication,
                tables = to_add.len(),
                "added tables to the publication"
            );
        }
        if !to_drop.is_empty() {
            ctl.batch_execute(&format!(
                "ALTER PUBLICATION {quoted} DROP TABLE {}",
                to_drop.join(", ")
            ))
            .await?;
        }
        Ok(Synced {
            unpublished: unpublishable,
            added,
        })
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
