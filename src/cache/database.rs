//! What pgcache keeps per database: its versions, its catalog snapshot, the
//! health of its replication stream and its sync state with the shared tier.
//! Each is its own type, written by one party: sessions and the replication
//! stream bump versions, the stream reports its health, the shared tier
//! records its sync.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use super::catalog::Catalog;
use super::versions::{Bumps, Versions};
use crate::metrics::DbMetrics;

/// Everything pgcache keeps for one database.
#[derive(Default)]
pub struct DbState {
    pub name: String,
    pub versions: Versions,
    pub catalog: CatalogSlot,
    pub stream: StreamHealth,
    pub sync: SharedSync,
    /// This database's lookup counters, resolved once.
    pub metrics: OnceLock<DbMetrics>,
}

impl DbState {
    /// Bumps the local counters only (see [`super::Cache::invalidate`] for
    /// the order that keeps the shared tier coherent).
    pub fn apply_local(&self, bumps: &Bumps) {
        for f in &bumps.families {
            f.version.bump_local();
        }
        if bumps.schema {
            self.catalog.forget();
        }
        if bumps.schema || bumps.epoch {
            self.versions.epoch.bump_local();
        }
    }

    /// The families a replicated change to relation `name` invalidates: its
    /// own, and its partition tree's if the snapshot knows it.
    pub fn relation_families(&self, name: &str, bumps: &mut Bumps) {
        bumps.add_family(self.versions.family(name));
        if let Some((_, catalog)) = self.catalog.current()
            && let Some(facts) = catalog.relation(name)
            && facts.family != name
        {
            bumps.add_family(self.versions.family(&facts.family));
        }
    }
}

/// A query naming a relation the snapshot lacks reloads it at most this often.
const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The catalog snapshot and the generation that says whether it is current.
#[derive(Default)]
pub struct CatalogSlot {
    /// Bumped by DDL: the snapshot must be reloaded.
    generation: AtomicU64,
    snapshot: RwLock<Option<(u64, Arc<Catalog>)>>,
    /// When a reload for an unknown relation was last asked for.
    last_reload: Mutex<Option<Instant>>,
}

impl CatalogSlot {
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// DDL ran (here or on another instance): the snapshot is stale.
    pub fn forget(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// A query named a relation the snapshot does not know (created outside
    /// pgcache, or since): reload the snapshot, at most once a second.
    pub fn request_reload(&self) {
        let mut last = self.last_reload.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= RELOAD_INTERVAL) {
            *last = Some(Instant::now());
            self.forget();
        }
    }

    /// The snapshot, if it is current.
    pub fn current(&self) -> Option<(u64, Arc<Catalog>)> {
        let generation = self.generation();
        let guard = self.snapshot.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().filter(|(g, _)| *g == generation).cloned()
    }

    /// Installs a snapshot loaded while the generation was `generation`.
    pub fn set(&self, generation: u64, catalog: Arc<Catalog>) {
        let mut guard = self.snapshot.write().unwrap_or_else(|e| e.into_inner());
        *guard = Some((generation, catalog));
    }
}

/// The replication stream's health, as the stream reports it.
#[derive(Default)]
pub struct StreamHealth {
    /// A replication stream task exists for this database.
    claimed: AtomicBool,
    /// The stream is up and has flushed what it may have missed.
    streaming: AtomicBool,
    /// The last commit arrived later than `replication.max_lag_ms`.
    lagging: AtomicBool,
    /// Commit-to-receipt delay of the last transaction, in milliseconds.
    lag_ms: AtomicU64,
    /// WAL announced by the server beyond what has been applied.
    lag_bytes: AtomicU64,
    /// The last commit LSN applied.
    applied_lsn: AtomicU64,
    /// How many times the stream (re)started.
    starts: AtomicU64,
    /// Tables left out of the publication for lack of a replica identity.
    unpublished: AtomicU64,
}

impl StreamHealth {
    /// True for the one caller that should start this database's stream.
    pub fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }

    pub fn set_streaming(&self, up: bool) {
        self.streaming.store(up, Ordering::Release);
    }

    /// The stream is up and not lagging: cached results may be served.
    pub fn is_current(&self) -> bool {
        self.streaming.load(Ordering::Acquire) && !self.lagging.load(Ordering::Acquire)
    }

    pub fn is_streaming(&self) -> bool {
        self.streaming.load(Ordering::Acquire)
    }

    pub fn started(&self) {
        self.starts.fetch_add(1, Ordering::AcqRel);
    }

    pub fn starts(&self) -> u64 {
        self.starts.load(Ordering::Acquire)
    }

    pub fn set_lag(&self, lag_ms: u64, lagging: bool) {
        self.lag_ms.store(lag_ms, Ordering::Release);
        self.lagging.store(lagging, Ordering::Release);
    }

    pub fn lag_ms(&self) -> u64 {
        self.lag_ms.load(Ordering::Acquire)
    }

    pub fn set_lag_bytes(&self, bytes: u64) {
        self.lag_bytes.store(bytes, Ordering::Release);
    }

    pub fn lag_bytes(&self) -> u64 {
        self.lag_bytes.load(Ordering::Acquire)
    }

    pub fn set_applied_lsn(&self, lsn: u64) {
        self.applied_lsn.store(lsn, Ordering::Release);
    }

    pub fn applied_lsn(&self) -> u64 {
        self.applied_lsn.load(Ordering::Acquire)
    }

    pub fn set_unpublished(&self, tables: u64) {
        self.unpublished.store(tables, Ordering::Release);
    }

    pub fn unpublished(&self) -> u64 {
        self.unpublished.load(Ordering::Acquire)
    }
}

/// Where this database stands with the shared tier.
#[derive(Default)]
pub struct SharedSync {
    /// The shared tier's sync generation the versions were last read from
    /// Redis under; 0 = never.
    pub synced: AtomicU64,
    /// A bump of this instance never reached Redis.
    pub dirty: AtomicBool,
}

/// Every database this instance has served, by name.
#[derive(Default)]
pub struct Databases {
    map: Mutex<HashMap<String, Arc<DbState>>>,
}

impl Databases {
    /// Every database seen so far, for metrics and readiness.
    pub fn all(&self) -> Vec<(String, Arc<DbState>)> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }

    pub fn get_or_add(&self, name: &str) -> Arc<DbState> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(name.to_owned()).or_insert_with(|| {
            Arc::new(DbState {
                name: name.to_owned(),
                ..DbState::default()
            })
        }))
    }

    /// The state of a database this instance already serves.
    pub fn get(&self, name: &str) -> Option<Arc<DbState>> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get(name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_bumps_forget_the_catalog_and_move_the_epoch() {
        let db = DbState::default();
        db.catalog.set(0, Arc::new(Catalog::from_rows(&[])));
        assert!(db.catalog.current().is_some());
        let table = db.versions.family("t");
        let mut bumps = Bumps::default();
        bumps.add_family(Arc::clone(&table));
        db.apply_local(&bumps);
        assert_eq!((table.version.local(), db.versions.epoch.local()), (1, 0));
        assert!(db.catalog.current().is_some(), "a write keeps the catalog");
        db.apply_local(&Bumps::opaque());
        assert_eq!(db.versions.epoch.local(), 1);
        assert!(db.catalog.current().is_none(), "DDL forgets it");
    }
}
