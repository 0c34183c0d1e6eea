//! `pgcache uninstall`: removes what pgcache leaves in the databases it
//! served (its publication, the `pgcache` schema with `announce_ddl()`,
//! and the event triggers `pgcache_ddl` and `pgcache_ddl_drop`), and the
//! persistent replication slots a disk tier keeps while pgcache is stopped
//! (`pgcache_disk_*`). Its other slots are temporary and go with its
//! connections.

use std::fmt;

use crate::upstream::Upstream;

/// What became of one database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Everything pgcache leaves was removed.
    Removed,
    /// None of it was there.
    Absent,
    /// A pgcache is still streaming from it; nothing was removed.
    Streaming,
    /// Removal failed with this server message.
    Failed(String),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Removed => write!(f, "removed"),
            Outcome::Absent => write!(f, "nothing to remove"),
            Outcome::Streaming => write!(
                f,
                "refused: a pgcache is streaming from it (stop it first, or pass --force)"
            ),
            Outcome::Failed(e) => write!(f, "failed: {e}"),
        }
    }
}

/// Removes pgcache's objects from every database that accepts connections,
/// skipping (unless `force`) those a pgcache still streams from. Returns
/// each database with its outcome; running it again changes nothing.
pub async fn uninstall(
    upstream: &Upstream,
    publication: &str,
    force: bool,
) -> Result<Vec<(String, Outcome)>, tokio_postgres::Error> {
    let home = upstream.control(upstream.default_database()).await?;
    let databases: Vec<String> = home
        .query(
            "SELECT datname::text FROM pg_catalog.pg_database WHERE datallowconn ORDER BY datname",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut outcomes = Vec::new();
    for db in databases {
        let streaming: i64 = home
            .query_one(
                "SELECT count(*) FROM pg_catalog.pg_replication_slots
                 WHERE database::text = $1 AND active AND slot_name LIKE 'pgcache\\_%'",
                &[&db],
            )
            .await?
            .get(0);
        let outcome = if streaming > 0 && !force {
            Outcome::Streaming
        } else {
            match remove(upstream, &db, publication).await {
                Ok(true) => Outcome::Removed,
                Ok(false) => Outcome::Absent,
                Err(e) => Outcome::Failed(
                    e.as_db_error()
                        .map(|d| d.message().to_owned())
                        .unwrap_or_else(|| e.to_string()),
                ),
            }
        };
        outcomes.push((db, outcome));
    }
    Ok(outcomes)
}

/// Removes pgcache's objects from `db`; false if none was there.
async fn remove(
    upstream: &Upstream,
    db: &str,
    publication: &str,
) -> Result<bool, tokio_postgres::Error> {
    let client = upstream.control(db).await?;
    let slots = client
        .execute(
            "SELECT pg_catalog.pg_drop_replication_slot(slot_name) FROM pg_catalog.pg_replication_slots
             WHERE database = pg_catalog.current_database() AND NOT active
               AND slot_name LIKE 'pgcache\\_disk\\_%'",
            &[],
        )
        .await?;
    let objects: bool = client
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_event_trigger
                            WHERE evtname IN ('pgcache_ddl', 'pgcache_ddl_drop'))
                 OR EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = 'pgcache')
                 OR EXISTS (SELECT FROM pg_catalog.pg_publication WHERE pubname = $1)",
            &[&publication],
        )
        .await?
        .get(0);
    if !objects {
        return Ok(slots > 0);
    }
    let publication = crate::invalidation::quote_ident(publication);
    // The schema is dropped without CASCADE: anything a user put there
    // stays, and the failure says so.
    client
        .batch_execute(&format!(
            "BEGIN;
             DROP EVENT TRIGGER IF EXISTS pgcache_ddl;
             DROP EVENT TRIGGER IF EXISTS pgcache_ddl_drop;
             DROP FUNCTION IF EXISTS pgcache.announce_ddl();
             DROP SCHEMA IF EXISTS pgcache;
             DROP PUBLICATION IF EXISTS {publication};
             COMMIT;"
        ))
        .await?;
    Ok(true)
}
