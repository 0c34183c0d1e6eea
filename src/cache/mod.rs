//! The cache: what may be served, under which key, and what invalidates it.
//!
//! - **Keys** ([`key`]) hash everything that can change a result: the
//!   session's identity and settings, the statement and its parameters, the
//!   protocol flavour, and the *versions* of the tables it reads plus the
//!   database's epoch.
//! - **Invalidation is a version bump** ([`versions`]): a write bumps the
//!   versions of the tables it touched; anything pgcache cannot see through
//!   bumps the database's epoch. Old entries become unreachable at once and
//!   age out of the LRU. Versions are read *before* a miss is forwarded, so a
//!   result computed before a write lands under the old version and can
//!   never be served after the bump (race-free fill).
//! - **Two tiers**: [`local`] (moka, bounded in bytes) and [`shared`]
//!   (Redis, shared by every instance).
//!
//! [`Cache`] is the one door: a session asks [`Cache::lookup`] and gets a
//! hit, a miss (a [`Fill`] that owns coalescing and the versions the key was
//! made from) or a bypass; it hands the fill back to [`Cache::store`], and
//! its writes to [`Cache::invalidate`]. The session only does the I/O.

pub mod admission;
pub mod advice;
pub mod analysis;
pub mod carry;
pub mod catalog;
pub mod database;
pub mod demand;
pub mod disk;
pub mod fill;
pub mod hold;
pub mod key;
pub mod local;
pub mod lookup;
pub mod rowkey;
pub mod sampler;
pub mod shared;
pub mod stats;
pub mod stream;
pub mod versions;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::classify::BypassReason;
use crate::metrics::{DbMetrics, Metrics};
pub use analysis::{Analyzed, MAX_ANALYZED_SQL};
pub use catalog::Catalog;
pub use database::{Databases, DbState, Unfresh};
pub use fill::{Claim, Fill, FillGuard, Fills};
pub use key::RequestKey;
pub use local::{CachedResponse, Lifetime, LocalCache};
pub use lookup::{Lookup, Request, Source, Wait, Waited};
use shared::{Pending, SharedTier};
use stats::{QueryStats, StatsRegistry};
pub use versions::{Bumps, Ddl, Family, Version, unix_ms};

/// The version counters a cacheable read depends on: its tables and tags.
/// Shared by the plan, its fills and its sampler checks.
pub type Reads = Arc<[Arc<Family>]>;

/// Everything cache-related shared by the sessions of one pgcache.
pub struct Cache {
    pub local: LocalCache,
    /// The shared tier, when `redis.url` is set and caching is on; set once
    /// at start-up, when the cluster's name is known.
    shared: OnceLock<Arc<SharedTier>>,
    /// The disk tier, when `cache.disk.path` is set; opened at start-up.
    disk: OnceLock<Arc<disk::DiskTier>>,
    pub databases: Arc<Databases>,
    fills: Arc<Fills>,
    analyses: analysis::Analyses,
    pub stats: StatsRegistry,
    /// Which hits the correctness sampler checks.
    pub sampler: sampler::Sampler,
    /// Which statement shapes are stored.
    pub admission: admission::Admission,
    metrics: Arc<Metrics>,
    /// Replication streams invalidate (checked at start-up): entries are
    /// served only while their database's stream is current.
    replication: AtomicBool,
}

/// Invalidations applied locally, still to be sent to Redis and the other
/// instances: [`Publication::send`] before the client is told its write
/// completed.
#[must_use]
pub struct Publication(Option<(Arc<SharedTier>, Arc<DbState>, Bumps, Pending)>);

impl Publication {
    pub async fn send(self) {
        if let Some((tier, db, bumps, pending)) = self.0 {
            tier.publish(&db, &bumps, pending).await;
        }
    }
}

impl Cache {
    pub fn new(local: LocalCache, metrics: Arc<Metrics>) -> Self {
        Self {
            local,
            shared: OnceLock::new(),
            disk: OnceLock::new(),
            databases: Arc::default(),
            fills: Arc::default(),
            analyses: analysis::Analyses::new(10_000),
            stats: StatsRegistry::new(10_000),
            sampler: sampler::Sampler::default(),
            admission: admission::Admission::default(),
            metrics,
            replication: AtomicBool::new(false),
        }
    }

    /// `cache.shared.consistency = "read_your_writes"`, with a shared tier.
    pub fn read_your_writes(&self) -> bool {
        self.shared().is_some_and(|t| t.read_your_writes)
    }

    pub fn set_shared(&self, tier: Arc<SharedTier>) {
        let _ = self.shared.set(tier);
    }

    pub fn shared(&self) -> Option<&Arc<SharedTier>> {
        self.shared.get()
    }

    pub fn set_disk(&self, tier: Arc<disk::DiskTier>) {
        let _ = self.disk.set(tier);
    }

    pub fn disk(&self) -> Option<&Arc<disk::DiskTier>> {
        self.disk.get()
    }

    pub fn set_replication(&self, on: bool) {
        self.replication.store(on, Ordering::Release);
    }

    pub fn replication_on(&self) -> bool {
        self.replication.load(Ordering::Acquire)
    }

    /// Cached results of `db` may be served: replication is off (TTL-only
    /// by configuration), or its stream is up within its staleness lease.
    /// Else why not.
    /// `now`: when the request arrived.
    pub fn freshness(&self, db: &DbState, now: Instant) -> Result<(), BypassReason> {
        if !self.replication_on() {
            return Ok(());
        }
        // A lookup needs the stream's heartbeats.
        db.stream.demand.note();
        match db.stream.freshness_at(now) {
            Ok(()) => Ok(()),
            Err(Unfresh::Resting) => Err(BypassReason::ReplicationStale),
            // Another instance's stream keeps Redis's counters current,
            // and this instance's mirrors of them (see `SharedTier::usable`).
            Err(_) if self.vouched(db) => Ok(()),
            Err(Unfresh::Down) => Err(BypassReason::ReplicationDown),
            Err(Unfresh::Stale) => Err(BypassReason::ReplicationStale),
        }
    }

    /// Another instance vouches for `db`, whose own stream is not current;
    /// its heartbeats are asked for through Redis meanwhile.
    fn vouched(&self, db: &DbState) -> bool {
        let Some(tier) = self.shared() else {
            return false;
        };
        if db.stream.demand.want_vouch() {
            tier.want_heartbeats();
        }
        db.stream.vouched() && tier.usable(db)
    }

    /// Whether a statement of `db` may wait (`cache.first_read_wait_ms`)
    /// for the cache to be able to answer it: only with a shared tier that
    /// could (it may still be connecting), or disk entries carried from the
    /// last run, and only for the database's first statements.
    pub fn may_warm(&self, db: &DbState, wait: Duration) -> bool {
        !wait.is_zero()
            && db.stream.is_warming()
            && (db.carried || self.shared().is_some_and(|t| !t.breaker_open()))
    }

    /// Whether a statement that names tables or functions whose facts are
    /// not known yet may wait (`cache.first_read_wait_ms`) for their
    /// fetch: with a shared tier that could answer it once they are known.
    /// Not only a database's first statements: an instance restarted while
    /// another kept Redis filled answers its first read of each table from
    /// Redis, even while the table is locked.
    pub fn may_wait_for_facts(&self, wait: Duration) -> bool {
        !wait.is_zero() && self.shared().is_some_and(|t| !t.breaker_open())
    }

    /// Waits up to `at_most` for the catalog facts of `rels` and `funcs`.
    pub async fn wait_for_facts(
        &self,
        db: &DbState,
        (rels, funcs): (&[&str], &[&str]),
        at_most: Duration,
    ) {
        let known = || db.catalog.knows(rels, funcs);
        lookup::warm_until(db, &db.catalog.settled, at_most, known).await;
    }

    /// The state of `db`'s replication stream, as the admin console and
    /// the live page show it.
    pub fn stream_state(&self, db: &DbState) -> &'static str {
        if !self.replication_on() {
            "off (TTL only)"
        } else if db.stream.is_current() {
            "streaming"
        } else if db.stream.is_streaming() {
            "stale"
        } else if !db.stream.is_claimed() {
            "released"
        } else {
            "down"
        }
    }

    pub fn db(&self, name: &str) -> Arc<DbState> {
        self.databases.get_or_add(name)
    }

    /// [`Analyses::scan`]: the cheap half of a statement's analysis.
    pub fn scan(&self, hash: u128, sql: &[u8]) -> analysis::Scanned {
        self.analyses.scan(hash, sql)
    }

    /// [`Analyses::finish`]: the rest of it, parsed once per shape.
    pub fn analyzed(&self, scanned: analysis::Scanned, sql: &[u8]) -> Arc<Analyzed> {
        self.analyses.finish(scanned, sql, &self.stats)
    }

    pub fn db_metrics<'a>(&self, db: &'a DbState) -> &'a DbMetrics {
        db.metrics.get_or_init(|| self.metrics.database(&db.name))
    }

    /// Counts a bypass (the session decided, or the cache did).
    pub fn bypassed(&self, db: &DbState, reason: BypassReason) {
        if reason != BypassReason::NotSelect {
            tracing::debug!(reason = reason.label(), "cache bypass");
        }
        self.metrics.bypassed(reason);
        self.db_metrics(db).bypass.inc();
    }

    /// Stores a forwarded read's complete answer.
    pub fn store(&self, fill: Fill, bytes: &[u8]) {
        tracing::trace!(key = ?fill.local, len = bytes.len(), "store");
        self.metrics.stores.inc();
        if let Some(key) = fill.local {
            self.local.insert(key, bytes, fill.lifetime);
            if let Some(tier) = self.disk() {
                tier.store(fill.disk, bytes, fill.lifetime);
            }
        }
        if let (Some(tier), Some((key, versions))) = (self.shared(), &fill.shared) {
            tier.put(*key, versions, bytes, fill.lifetime.ttl);
        }
        for f in fill.reads.iter() {
            f.version.note_entry();
        }
    }

    /// This instance began keying `table` of `db` by row: its mirrors of
    /// the rows' counters are read from Redis (raised where behind), after
    /// which its reads by row use the shared tier. Without a shared tier,
    /// at once.
    pub async fn mirror_rows(&self, db: &DbState, table: &versions::Family) {
        let Some(rows) = table.rows() else {
            return;
        };
        if let Some(tier) = self.shared()
            && let Err(e) = tier.mirror(db, rows.families()).await
        {
            tracing::debug!(database = %db.name, table = %table.name, error = %e,
                "cannot read the rows' counters from Redis: reads by row stay local");
            return;
        }
        rows.mirrored();
    }

    /// Applies invalidations, counted under `source`: the local counters at
    /// once; with a shared tier, the returned publication carries them to
    /// Redis and every other instance. While it is under way the shared
    /// tier is not read, so no instance can serve what the bump retired.
    pub fn invalidate(
        &self,
        db: &Arc<DbState>,
        bumps: Bumps,
        source: &prometheus::IntCounter,
    ) -> Publication {
        source.inc();
        let m = &self.metrics.invalidations;
        for family in &bumps.families {
            match family.scope {
                versions::Scope::Row => m.rows.inc(),
                versions::Scope::Wide => m.whole_tables.inc(),
                versions::Scope::Table => m.tables.inc(),
            }
        }
        match self.shared() {
            None => {
                db.apply_local(&bumps);
                Publication(None)
            }
            Some(tier) => {
                let pending = tier.begin(db);
                db.apply_local(&bumps);
                Publication(Some((Arc::clone(tier), Arc::clone(db), bumps, pending)))
            }
        }
    }
}
