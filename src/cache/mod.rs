//! The cache: what may be served, under which key, and what invalidates it.
//!
//! - **Keys** ([`key`]) hash everything that can change a result: the
//!   session's identity and settings, the statement and its parameters, the
//!   protocol flavour, and the *versions* of the tables it reads plus the
//!   database's epoch.
//! - **Invalidation is a version bump** ([`DbState`]): a write bumps the
//!   versions of the tables it touched; anything pgcache cannot see through
//!   bumps the database's epoch. Old entries become unreachable at once and
//!   age out of the LRU. Versions are read *before* a miss is forwarded, so a
//!   result computed before a write lands under the old version and can
//!   never be served after the bump (race-free fill).
//! - **The local tier** ([`local`]) is moka, bounded in bytes.
//! - **Two counters per version** ([`Version`]): `local` is bumped by every
//!   invalidation this instance learns of and keys the local tier; `shared`
//!   mirrors the counter in Redis and keys the shared tier. Only Redis hands
//!   out shared values, so two instances can never use one value for
//!   different states of a table (see [`crate::shared`]).

pub mod catalog;
pub mod key;
pub mod local;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::{Arc, Mutex, RwLock};

use crate::classify::Analysis;
pub use catalog::Catalog;
pub use local::{CachedResponse, Lifetime, LocalCache};

/// A version counter: see the module documentation.
#[derive(Debug, Default)]
pub struct Version {
    local: AtomicU64,
    shared: AtomicU64,
    /// Invalidations seen, and when the last one was (Unix milliseconds).
    changes: AtomicU64,
    last_change_ms: AtomicU64,
    /// Entries stored under the current version (expiry and eviction are
    /// not subtracted).
    entries: AtomicU64,
}

impl Version {
    pub fn local(&self) -> u64 {
        self.local.load(Ordering::Acquire)
    }

    pub fn shared(&self) -> u64 {
        self.shared.load(Ordering::Acquire)
    }

    pub fn bump_local(&self) {
        self.local.fetch_add(1, Ordering::AcqRel);
        self.changes.fetch_add(1, Ordering::Relaxed);
        self.last_change_ms.store(unix_ms(), Ordering::Relaxed);
        self.entries.store(0, Ordering::Relaxed);
    }

    pub fn note_entry(&self) {
        self.entries.fetch_add(1, Ordering::Relaxed);
    }

    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Unix milliseconds of the last invalidation; 0 = never.
    pub fn last_change_ms(&self) -> u64 {
        self.last_change_ms.load(Ordering::Relaxed)
    }

    /// Redis says the counter is `value`. If that is news, the local
    /// counter moves too: *after* the shared one, so a reader that sees the
    /// new local value also sees the new shared value.
    pub fn raise_shared(&self, value: u64) -> bool {
        let raised = self.shared.fetch_max(value, Ordering::AcqRel) < value;
        if raised {
            self.bump_local();
        }
        raised
    }
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The version of one table, or of a partition tree (its root's name).
#[derive(Debug)]
pub struct Family {
    pub name: Box<str>,
    pub version: Version,
}

/// Invalidations to apply: table versions, the epoch, the catalog.
#[derive(Debug, Default, Clone)]
pub struct Bumps {
    pub families: Vec<Arc<Family>>,
    /// Unknown effects: everything in the database may have changed.
    pub epoch: bool,
    /// DDL: the catalog snapshot is stale too (implies `epoch`).
    pub schema: bool,
}

impl Bumps {
    pub fn opaque() -> Self {
        Self {
            families: Vec::new(),
            epoch: true,
            schema: true,
        }
    }

    pub fn add_family(&mut self, family: Arc<Family>) {
        if !self.families.iter().any(|f| Arc::ptr_eq(f, &family)) {
            self.families.push(family);
        }
    }

    pub fn merge(&mut self, other: &Bumps) {
        for f in &other.families {
            self.add_family(Arc::clone(f));
        }
        self.epoch |= other.epoch;
        self.schema |= other.schema;
    }

    pub fn is_empty(&self) -> bool {
        self.families.is_empty() && !self.epoch && !self.schema
    }

    /// Bumps the local counters only.
    pub fn apply_local(&self, db: &DbState) {
        for f in &self.families {
            f.version.bump_local();
        }
        if self.schema {
            db.catalog_gen.fetch_add(1, Ordering::AcqRel);
        }
        if self.schema || self.epoch {
            db.epoch.bump_local();
        }
    }
}

/// Invalidation state of one database.
#[derive(Default)]
pub struct DbState {
    pub name: String,
    /// Bumped by statements whose effects pgcache cannot see: part of every key.
    pub epoch: Version,
    /// Bumped (in Redis) by DDL, so other instances reload their catalog.
    pub ddl: Version,
    /// Bumped by DDL: the catalog snapshot must be reloaded.
    catalog_gen: AtomicU64,
    catalog: RwLock<Option<(u64, Arc<Catalog>)>>,
    families: Mutex<HashMap<String, Arc<Family>>>,
    /// The shared tier's sync generation this database's versions were
    /// last read from Redis under; 0 = never.
    pub shared_synced: AtomicU64,
    /// A bump of this instance never reached Redis.
    pub shared_dirty: std::sync::atomic::AtomicBool,
    /// This database's lookup counters, resolved once.
    pub metrics: std::sync::OnceLock<crate::metrics::DbMetrics>,
    /// When a reload for an unknown relation was last asked for.
    last_reload: Mutex<Option<std::time::Instant>>,
    /// A replication stream task exists for this database.
    stream_claimed: std::sync::atomic::AtomicBool,
    /// The stream is up and has flushed what it may have missed.
    streaming: std::sync::atomic::AtomicBool,
    /// The last commit arrived later than `replication.max_lag_ms`.
    lagging: std::sync::atomic::AtomicBool,
    /// Commit-to-receipt delay of the last transaction, in milliseconds.
    lag_ms: AtomicU64,
    /// WAL announced by the server beyond what has been applied.
    lag_bytes: AtomicU64,
    /// The last commit LSN applied.
    applied_lsn: AtomicU64,
    /// How many times the stream (re)started.
    stream_starts: AtomicU64,
    /// Tables left out of the publication for lack of a replica identity.
    unpublished: AtomicU64,
}

/// A query naming a relation the snapshot lacks reloads it at most this often.
const RELOAD_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl DbState {
    pub fn catalog_gen(&self) -> u64 {
        self.catalog_gen.load(Ordering::Acquire)
    }

    /// A query named a relation the snapshot does not know (created outside
    /// pgcache, or since): reload the snapshot, at most once a second.
    pub fn request_reload(&self) {
        let mut last = self.last_reload.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= RELOAD_INTERVAL) {
            *last = Some(std::time::Instant::now());
            self.catalog_gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Another instance ran DDL: reload the catalog snapshot.
    pub fn reload_catalog(&self) {
        self.catalog_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// The families a replicated change to relation `name` invalidates: its
    /// own, and its partition tree's if the snapshot knows it.
    pub fn relation_families(&self, name: &str, bumps: &mut Bumps) {
        bumps.add_family(self.family(name));
        if let Some((_, catalog)) = self.catalog()
            && let Some(facts) = catalog.relation(name)
            && facts.family != name
        {
            bumps.add_family(self.family(&facts.family));
        }
    }

    /// True for the one caller that should start this database's stream.
    pub fn claim_stream(&self) -> bool {
        !self.stream_claimed.swap(true, Ordering::AcqRel)
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

    pub fn stream_started(&self) {
        self.stream_starts.fetch_add(1, Ordering::AcqRel);
    }

    pub fn stream_starts(&self) -> u64 {
        self.stream_starts.load(Ordering::Acquire)
    }

    pub fn set_lag(&self, lag_ms: u64, lagging: bool) {
        self.lag_ms.store(lag_ms, Ordering::Release);
        self.lagging.store(lagging, Ordering::Release);
    }

    pub fn set_unpublished(&self, tables: u64) {
        self.unpublished.store(tables, Ordering::Release);
    }

    pub fn unpublished(&self) -> u64 {
        self.unpublished.load(Ordering::Acquire)
    }

    pub fn set_lag_bytes(&self, bytes: u64) {
        self.lag_bytes.store(bytes, Ordering::Release);
    }

    pub fn set_applied_lsn(&self, lsn: u64) {
        self.applied_lsn.store(lsn, Ordering::Release);
    }

    pub fn applied_lsn(&self) -> u64 {
        self.applied_lsn.load(Ordering::Acquire)
    }

    pub fn lag_bytes(&self) -> u64 {
        self.lag_bytes.load(Ordering::Acquire)
    }

    pub fn lag_ms(&self) -> u64 {
        self.lag_ms.load(Ordering::Acquire)
    }

    /// The snapshot, if it is current.
    pub fn catalog(&self) -> Option<(u64, Arc<Catalog>)> {
        let generation = self.catalog_gen();
        let guard = self.catalog.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().filter(|(g, _)| *g == generation).cloned()
    }

    /// Installs a snapshot loaded while the catalog generation was `generation`.
    pub fn set_catalog(&self, generation: u64, catalog: Arc<Catalog>) {
        let mut guard = self.catalog.write().unwrap_or_else(|e| e.into_inner());
        *guard = Some((generation, catalog));
    }

    /// The version counter of a partition tree (or plain table).
    pub fn family(&self, name: &str) -> Arc<Family> {
        let mut map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = map.get(name) {
            return Arc::clone(f);
        }
        let f = Arc::new(Family {
            name: name.into(),
            version: Version::default(),
        });
        map.insert(name.to_owned(), Arc::clone(&f));
        f
    }

    /// Every family known, for a resynchronisation with Redis.
    pub fn families(&self) -> Vec<Arc<Family>> {
        let map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        map.values().cloned().collect()
    }
}

/// Everything cache-related shared by the sessions of one pgcache.
pub struct CacheState {
    pub local: LocalCache,
    dbs: Mutex<HashMap<String, Arc<DbState>>>,
    /// Statement analyses, memoised by the hash of their text.
    analyses: moka::sync::Cache<u128, Arc<Analyzed>>,
    pub stats: crate::stats::StatsRegistry,
    pub fills: Arc<Fills>,
}

/// What pgcache knows of a statement text, worked out once per text.
pub struct Analyzed {
    pub analysis: Analysis,
    pub scan: crate::hints::Scan,
    pub stats: Arc<crate::stats::QueryStats>,
}

/// Statements longer than this are not parsed (nor cached): their effects
/// are assumed unknown.
pub const MAX_ANALYZED_SQL: usize = 64 * 1024;

impl CacheState {
    pub fn new(local: LocalCache) -> Self {
        Self {
            local,
            dbs: Mutex::default(),
            analyses: moka::sync::Cache::new(10_000),
            stats: crate::stats::StatsRegistry::new(10_000),
            fills: Arc::default(),
        }
    }

    /// Every database seen so far, for metrics and readiness.
    pub fn databases(&self) -> Vec<(String, Arc<DbState>)> {
        let map = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }

    pub fn db(&self, name: &str) -> Arc<DbState> {
        let mut map = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(name.to_owned()).or_insert_with(|| {
            Arc::new(DbState {
                name: name.to_owned(),
                ..DbState::default()
            })
        }))
    }

    /// The state of a database this instance already serves.
    pub fn existing_db(&self, name: &str) -> Option<Arc<DbState>> {
        let map = self.dbs.lock().unwrap_or_else(|e| e.into_inner());
        map.get(name).cloned()
    }

    /// The analysis of `sql` (hash `hash`), parsed once per text.
    pub fn analysis(&self, hash: u128, sql: &[u8]) -> Arc<Analyzed> {
        if let Some(a) = self.analyses.get(&hash) {
            return a;
        }
        let (analysis, scan) = match std::str::from_utf8(sql) {
            Ok(text) if sql.len() <= MAX_ANALYZED_SQL => {
                (crate::classify::analyze(text), crate::hints::scan(text))
            }
            _ => (
                opaque_analysis(),
                crate::hints::scan(&String::from_utf8_lossy(&sql[..sql.len().min(4096)])),
            ),
        };
        let stats = self.stats.get(&scan.normalized);
        let analyzed = Arc::new(Analyzed {
            analysis,
            scan,
            stats,
        });
        self.analyses.insert(hash, Arc::clone(&analyzed));
        analyzed
    }
}

fn opaque_analysis() -> Analysis {
    let mut a = crate::classify::analyze("");
    a.statements.push(crate::classify::StatementInfo {
        effect: crate::classify::Effect::Opaque,
        cacheable: Err(crate::classify::BypassReason::TooLarge),
        relations: Vec::new(),
        functions: Default::default(),
        creates_temp: false,
    });
    a
}

/// Misses being filled now, by local key: concurrent identical misses wait
/// for the first one instead of all going to PostgreSQL.
#[derive(Default)]
pub struct Fills {
    filling: Mutex<HashMap<u128, tokio::sync::watch::Sender<()>>>,
}

/// Held by the one session filling a key; dropping it (after the store, or
/// when the fill fails) wakes the waiters.
pub struct FillGuard {
    fills: Arc<Fills>,
    key: u128,
}

impl Drop for FillGuard {
    fn drop(&mut self) {
        let mut map = self.fills.filling.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.key);
    }
}

pub enum Claim {
    /// Fill it; others wait for this guard to drop.
    Fill(FillGuard),
    /// Someone is filling it: wait until `changed()` fails (they finished).
    Wait(tokio::sync::watch::Receiver<()>),
}

impl Fills {
    pub fn claim(self: &Arc<Self>, key: u128) -> Claim {
        let mut map = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = map.get(&key) {
            return Claim::Wait(tx.subscribe());
        }
        map.insert(key, tokio::sync::watch::channel(()).0);
        Claim::Fill(FillGuard {
            fills: Arc::clone(self),
            key,
        })
    }

    /// Claims `key` only if nobody fills it now.
    pub fn try_claim(self: &Arc<Self>, key: u128) -> Option<FillGuard> {
        match self.claim(key) {
            Claim::Fill(guard) => Some(guard),
            Claim::Wait(_) => None,
        }
    }
}
