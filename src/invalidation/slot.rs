//! The replication slot a stream reads from. Without a disk tier it is
//! temporary: made with the stream's connection and gone with it. With
//! one it is persistent and named after the instance and the database, so
//! that a restarted pgcache reads from it every change made while it was
//! stopped (see [`crate::cache::carry`]), and dropped when pgcache lets go
//! of the database.
//!
//! A persistent slot keeps WAL while pgcache is stopped. At start, one
//! that kept more than `cache.disk.max_retained_wal_bytes`, or that
//! PostgreSQL gave up (`wal_status = 'lost'`, past
//! `max_slot_wal_keep_size`), is dropped and the database's carried
//! entries are not served.

use tracing::{info, warn};

use super::ReplicationError;
use crate::cache::{Cache, DbState};

/// The slot of one stream.
pub(super) struct Slot {
    pub name: String,
    pub persistent: bool,
    /// Read from where the last run left off, rather than made now.
    pub resume: bool,
    /// The WAL it kept meanwhile, when resumed.
    pub kept: Option<i64>,
}

impl Slot {
    /// The slot `db`'s next stream reads, ready to be read.
    pub async fn ready(
        cache: &Cache,
        ctl: &tokio_postgres::Client,
        db: &DbState,
    ) -> Result<Slot, ReplicationError> {
        let mut slot = Slot::for_db(cache, db);
        let max_wal = cache.disk().map_or(0, |d| d.max_retained_wal());
        slot.prepare(ctl, &db.name, max_wal).await?;
        if let Some(kept) = slot.kept {
            db.stream.set_slot_kept(kept);
        }
        Ok(slot)
    }

    /// [`drop_stale`], now and then while the stream runs.
    pub async fn drop_stale(&self, ctl: &tokio_postgres::Client, cache: &Cache) {
        if let (true, Some(disk)) = (self.persistent, cache.disk())
            && let Err(e) = drop_stale(ctl, &self.name, disk.max_retained_wal()).await
        {
            warn!(slot = %self.name, error = %e, "could not look for stale replication slots");
        }
    }

    /// The slot for `db`'s next stream.
    pub fn for_db(cache: &Cache, db: &DbState) -> Slot {
        let carried = db.resume.lock().unwrap_or_else(|e| e.into_inner()).take();
        match cache.disk() {
            Some(disk) => {
                let name = disk.slot_name(&db.name);
                let resume = carried.as_deref() == Some(name.as_str());
                Slot {
                    name,
                    persistent: true,
                    resume,
                    kept: None,
                }
            }
            None => Slot {
                name: format!("pgcache_{:08x}", rand::random::<u32>()),
                persistent: false,
                resume: false,
                kept: None,
            },
        }
    }

    /// Before the stream starts: a slot to resume must be there, kept by
    /// PostgreSQL, holding at most `max_wal` bytes, and free (the last
    /// run's walsender gone); otherwise it is dropped and made anew. A
    /// persistent slot not resumed is dropped if it is there (a run that
    /// was killed left it).
    pub async fn prepare(
        &mut self,
        ctl: &tokio_postgres::Client,
        db: &str,
        max_wal: u64,
    ) -> Result<(), ReplicationError> {
        if !self.persistent {
            return Ok(());
        }
        drop_stale(ctl, &self.name, max_wal).await?;
        if self.resume {
            match self.resumable(ctl, max_wal).await? {
                Ok(retained) => {
                    info!(database = db, slot = %self.name, retained_wal_bytes = retained,
                        "reading the changes made while pgcache was stopped");
                    self.kept = Some(retained);
                    return Ok(());
                }
                Err(why) => {
                    warn!(database = db, slot = %self.name,
                        "the disk tier's entries of this database are not served: {why}");
                    self.resume = false;
                }
            }
        }
        drop_inactive(ctl, &self.name).await
    }

    /// `Ok(retained bytes)`, or why the slot cannot be resumed.
    async fn resumable(
        &self,
        ctl: &tokio_postgres::Client,
        max_wal: u64,
    ) -> Result<Result<i64, String>, ReplicationError> {
        const SLOT: &str = "SELECT active, wal_status = 'lost',
                (pg_catalog.pg_current_wal_lsn() - restart_lsn)::bigint
            FROM pg_catalog.pg_replication_slots
            WHERE slot_name = $1 AND database = pg_catalog.current_database()";
        // The last run's walsender may take a moment to exit.
        for _ in 0..50 {
            let Some(row) = ctl.query_opt(SLOT, &[&self.name]).await? else {
                return Ok(Err("its replication slot is gone".into()));
            };
            let (active, lost, retained): (bool, Option<bool>, Option<i64>) =
                (row.get(0), row.get(1), row.get(2));
            if lost == Some(true) {
                return Ok(Err(
                    "PostgreSQL gave up its replication slot's WAL (max_slot_wal_keep_size)".into(),
                ));
            }
            let retained = retained.unwrap_or(i64::MAX);
            if u64::try_from(retained).unwrap_or(u64::MAX) > max_wal {
                return Ok(Err(format!(
                    "its replication slot kept {retained} bytes of WAL, over cache.disk.max_retained_wal_bytes ({max_wal})"
                )));
            }
            if !active {
                return Ok(Ok(retained));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        Ok(Err(
            "its replication slot stayed in use by another process".into()
        ))
    }

    /// The command that makes it, unless it is resumed.
    pub fn create(&self) -> Option<String> {
        let name = &self.name;
        match (self.persistent, self.resume) {
            (_, true) => None,
            (true, false) => Some(format!(
                "CREATE_REPLICATION_SLOT {name} LOGICAL pgoutput (SNAPSHOT 'nothing')"
            )),
            (false, _) => Some(format!(
                "CREATE_REPLICATION_SLOT {name} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'nothing')"
            )),
        }
    }
}

/// The persistent slots' names begin so; a temporary one's is
/// `pgcache_` and eight hexadecimal digits.
const PERSISTENT: &str = "pgcache_disk_";

/// The persistent slot of an instance (its disk tier's id) and database.
pub fn persistent_name(instance: u32, database: &str) -> String {
    let db = xxhash_rust::xxh3::xxh3_64(database.as_bytes()) as u32;
    format!("{PERSISTENT}{instance:08x}_{db:08x}")
}

pub(super) fn is_persistent(slot: &str) -> bool {
    slot.starts_with(PERSISTENT)
}

/// Waits until the walsender of `slot` (named `walsender`) has exited: a
/// temporary slot is dropped only then, and an active slot makes `DROP
/// DATABASE` fail; a persistent one is dropped then. A walsender that was
/// still making the slot is waited for too: it is visible by its
/// application name from before it reads the command, and it leaves
/// `pg_stat_activity` before its slot goes.
pub(super) async fn wait_gone(
    ctl: &tokio_postgres::Client,
    slot: &str,
    walsender: &str,
) -> Result<(), ReplicationError> {
    let persistent = is_persistent(slot);
    loop {
        let rows = ctl
            .query(
                "SELECT 1 FROM pg_catalog.pg_replication_slots \
                 WHERE slot_name = $1 AND (active OR NOT $3) \
                 UNION ALL \
                 SELECT 1 FROM pg_catalog.pg_stat_activity WHERE application_name = $2",
                &[&slot, &walsender, &persistent],
            )
            .await?;
        if rows.is_empty() {
            if persistent {
                drop_inactive(ctl, slot).await?;
            }
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Drops the persistent slots other pgcaches (stopped: no walsender uses
/// them) left in this database that keep more than `max_wal` bytes of WAL,
/// or that PostgreSQL gave up: their pgcache would refuse them when it
/// starts. While one pgcache with a disk tier streams the database, a
/// stopped one's slot keeps no more WAL than that, give or take
/// [`super::replication`]'s check interval.
pub(super) async fn drop_stale(
    ctl: &tokio_postgres::Client,
    own: &str,
    max_wal: u64,
) -> Result<(), ReplicationError> {
    let dropped = ctl
        .execute(
            "SELECT pg_catalog.pg_drop_replication_slot(slot_name)
             FROM pg_catalog.pg_replication_slots
             WHERE database = pg_catalog.current_database() AND NOT active
               AND slot_name LIKE 'pgcache\\_disk\\_%' AND slot_name <> $1
               AND (wal_status = 'lost'
                    OR pg_catalog.pg_current_wal_lsn() - restart_lsn > $2::bigint)",
            &[&own, &i64::try_from(max_wal).unwrap_or(i64::MAX)],
        )
        .await?;
    if dropped > 0 {
        warn!(
            slots = dropped,
            max_retained_wal_bytes = max_wal,
            "dropped stopped pgcaches' replication slots that kept too much WAL"
        );
    }
    Ok(())
}

/// The application name of the walsender streaming into `slot`: how
/// [`wait_gone`] finds one that is still being set up.
pub(super) fn walsender_name(slot: &str) -> String {
    format!("pgcache-invalidation {slot}")
}

/// Drops slot `name` if it is there and no walsender uses it.
pub async fn drop_inactive(
    ctl: &tokio_postgres::Client,
    name: &str,
) -> Result<(), ReplicationError> {
    ctl.execute(
        "SELECT pg_catalog.pg_drop_replication_slot(slot_name)
         FROM pg_catalog.pg_replication_slots WHERE slot_name = $1 AND NOT active",
        &[&name],
    )
    .await?;
    Ok(())
}
