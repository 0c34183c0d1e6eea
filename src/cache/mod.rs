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
pub mod catalog;
pub mod database;
pub mod demand;
pub mod fill;
pub mod hold;
pub mod key;
pub mod local;
pub mod rowkey;
pub mod sampler;
pub mod shared;
pub mod stats;
pub mod versions;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::classify::BypassReason;
use crate::hints::Tier;
use crate::metrics::{DbMetrics, Metrics};
pub use analysis::{Analyzed, MAX_ANALYZED_SQL};
pub use catalog::Catalog;
pub use database::{Databases, DbState, Unfresh};
pub use fill::{Claim, Fill, FillGuard, Fills};
pub use key::RequestKey;
pub use local::{CachedResponse, Lifetime, LocalCache};
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

/// One read a session wants answered.
pub struct Request<'a> {
    pub db: &'a Arc<DbState>,
    pub key: RequestKey,
    /// The versions of the tables it reads (of its rows, for a read by
    /// row): its local key's.
    pub reads: &'a Reads,
    /// Its shared key's: the same, but for a read by row before this
    /// instance's mirrors of the table's rows were read from Redis
    /// ([`versions::RowVersions::shared_ready`]): the table's.
    pub shared_reads: &'a Reads,
    pub tier: Tier,
    pub lifetime: Lifetime,
    pub stats: &'a QueryStats,
    /// `cache.adaptive_admission`: its misses are judged (see
    /// [`admission`]).
    pub admission: bool,
    /// Inside a transaction block: stored only at COMMIT, so it neither
    /// waits for nor holds up other sessions, and is never refreshed.
    pub in_transaction: bool,
    pub coalesce_wait: Duration,
    /// `cache.first_read_wait_ms`.
    pub first_read_wait: Duration,
    pub started: Instant,
    /// Shadow mode: a hit is not served ([`Lookup::WouldHit`]).
    pub shadow: bool,
}

/// What a lookup found.
pub enum Lookup {
    /// The stored response (RowDescription … CommandComplete); with a fill
    /// when the entry is due for a refresh and nobody refreshes it yet.
    Hit { bytes: Bytes, refresh: Option<Fill> },
    /// Forward it, and store the answer with this fill.
    Miss(Fill),
    /// Forward it; the cache may not answer it now.
    Bypass(BypassReason),
    /// Shadow mode: the cache holds this answer, but the request goes to
    /// PostgreSQL all the same, to be checked against it.
    WouldHit(Bytes),
}

/// What a lookup needs before it can answer.
pub enum Wait {
    /// `read_your_writes`: the read's versions confirmed with Redis.
    Confirm { db: Arc<DbState>, reads: Reads },
    /// The shared tier's entry for this key and these versions.
    Shared { key: u128, stamp: Vec<u64> },
    /// The database's cache able to answer (its stream, or another
    /// instance's vouch), for at most so long.
    Warm { db: Arc<DbState>, at_most: Duration },
    /// A heartbeat back, the stream's heartbeats having rested for want of
    /// a need (see [`demand`]), for at most the lease.
    Beat { db: Arc<DbState> },
    /// The end of a concurrent identical miss, for at most so long.
    Fill {
        filled: tokio::sync::watch::Receiver<()>,
        at_most: Duration,
    },
}

/// What the waits of one lookup found, kept by the session from one try
/// of the lookup to the next.
#[derive(Default)]
pub struct Waited {
    confirmed: Option<bool>,
    /// Boxed: every session keeps a `Waited`, and Redis is waited on
    /// rarely next to the statements that never wait.
    #[allow(clippy::type_complexity)]
    shared: Option<Box<(u128, Vec<u64>, Option<shared::entry::Entry>)>>,
    filled: bool,
    warmed: bool,
    beat: bool,
}

impl Waited {
    /// The read's versions (and the writes watermark) were confirmed with
    /// Redis.
    pub fn confirmed(&self) -> bool {
        self.confirmed == Some(true)
    }

    pub fn is_empty(&self) -> bool {
        self.confirmed.is_none()
            && self.shared.is_none()
            && !self.filled
            && !self.warmed
            && !self.beat
    }
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
    /// could (it may still be connecting), and only for the database's
    /// first statements.
    pub fn may_warm(&self, db: &DbState, wait: Duration) -> bool {
        !wait.is_zero()
            && db.stream.is_warming()
            && self.shared().is_some_and(|t| !t.breaker_open())
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
        warm_until(db, &db.catalog.settled, at_most, known).await;
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

    /// Answers from the local tier, else from the shared tier (filling the
    /// local one), else returns the fill that will store the backend's
    /// answer. Never waits: what it needs first (Redis's answer, the end of
    /// a concurrent identical miss) it returns as a [`Wait`], which the
    /// session awaits with [`Cache::wait`] into `waited` before it asks
    /// again.
    pub fn lookup(&self, req: &Request<'_>, waited: &mut Waited) -> Result<Lookup, Wait> {
        if let Err(reason) = self.servable(req, waited)? {
            return Ok(Lookup::Bypass(reason));
        }
        if self.read_your_writes() {
            match waited.confirmed {
                None => {
                    let reads = match Arc::ptr_eq(req.reads, req.shared_reads) {
                        true => Arc::clone(req.reads),
                        false => req
                            .reads
                            .iter()
                            .chain(req.shared_reads.iter())
                            .cloned()
                            .collect(),
                    };
                    return Err(Wait::Confirm {
                        db: Arc::clone(req.db),
                        reads,
                    });
                }
                Some(false) => {
                    self.bypassed(req.db, BypassReason::Unconfirmed);
                    return Ok(Lookup::Bypass(BypassReason::Unconfirmed));
                }
                Some(true) => {}
            }
        }
        // Local counters first, then the shared tier's state, then its
        // counters: see `SharedTier::usable`.
        let local = req.key.local(&req.db.versions.epoch, req.reads);
        if req.tier.local()
            && let Some(entry) = self.local.get(local)
        {
            if req.admission {
                self.admission.served(req.key);
            }
            if req.shadow {
                return Ok(Lookup::WouldHit(entry.bytes.clone()));
            }
            self.count_hit(req, entry.bytes.len(), false);
            let refresh = entry
                .wants_refresh()
                .then(|| self.refresh_fill(req))
                .flatten();
            return Ok(Lookup::Hit {
                bytes: entry.bytes.clone(),
                refresh,
            });
        }
        let mut shared = None;
        if let Some(tier) = self.shared().filter(|_| req.tier.shared()) {
            if tier.usable(req.db) {
                let (key, stamp) = req.key.shared(&req.db.versions.epoch, req.shared_reads);
                // Redis's answer counts only for the key and versions it
                // was asked under.
                match waited.shared.take().map(|b| *b) {
                    Some((k, s, found)) if k == key && s == stamp => {
                        if let Some(entry) = found {
                            return Ok(self.shared_hit(req, local, entry));
                        }
                    }
                    _ => return Err(Wait::Shared { key, stamp }),
                }
                shared = Some((key, stamp));
            } else {
                tier.skipped();
            }
        }
        // Shadow mode never makes a client wait for another's fill.
        let guard = if waited.filled || req.in_transaction || req.shadow {
            None
        } else {
            match self.fills.claim(local) {
                Claim::Fill(guard) => Some(guard),
                Claim::Wait(filled) => {
                    tracing::trace!(key = local, "waiting for a concurrent fill");
                    self.metrics.coalesced.inc();
                    return Err(Wait::Fill {
                        filled,
                        at_most: req.coalesce_wait,
                    });
                }
            }
        };
        self.metrics.misses.inc();
        self.db_metrics(req.db).miss.inc();
        if req.admission {
            self.admission
                .missed(&req.stats.admission, req.key, req.started);
        }
        Ok(Lookup::Miss(Fill::new(req, local, shared, guard)))
    }

    /// Whether the database's cache may answer now (see
    /// [`Cache::freshness`]); a first statement waits a little for it.
    fn servable(
        &self,
        req: &Request<'_>,
        waited: &Waited,
    ) -> Result<Result<(), BypassReason>, Wait> {
        if let Err(reason) = self.freshness(req.db, req.started) {
            if !waited.warmed && self.may_warm(req.db, req.first_read_wait) {
                return Err(Wait::Warm {
                    db: Arc::clone(req.db),
                    at_most: req.first_read_wait,
                });
            }
            if !waited.beat && req.db.stream.freshness() == Err(Unfresh::Resting) {
                return Err(Wait::Beat {
                    db: Arc::clone(req.db),
                });
            }
            self.bypassed(req.db, reason);
            return Ok(Err(reason));
        }
        if req.db.stream.is_warming() {
            req.db.stream.warmed();
        }
        Ok(Ok(()))
    }

    /// Waits for what a [`Cache::lookup`] asked, and notes what came of it
    /// in `waited` for the lookup's next try.
    pub async fn wait(&self, wait: Wait, waited: &mut Waited) {
        match wait {
            Wait::Confirm { db, reads } => {
                let confirmed = match self.shared() {
                    Some(tier) => tier.confirm(&db, &reads).await,
                    None => Ok(()),
                };
                if let Err(e) = &confirmed {
                    tracing::debug!(error = %e, "cannot confirm versions with Redis");
                }
                waited.confirmed = Some(confirmed.is_ok());
            }
            Wait::Shared { key, stamp } => {
                let found = match self.shared() {
                    Some(tier) => tier.get(key, &stamp).await,
                    None => None,
                };
                waited.shared = Some(Box::new((key, stamp, found)));
            }
            Wait::Warm { db, at_most } => {
                let servable = || self.freshness(&db, Instant::now()).is_ok();
                warm_until(&db, &db.stream.changed, at_most, servable).await;
                waited.warmed = true;
            }
            Wait::Beat { db } => {
                // Resting ends once a heartbeat is back, or past the lease.
                let deadline = tokio::time::Instant::now() + db.stream.lease();
                loop {
                    let changed = db.stream.changed.notified();
                    if db.stream.freshness() != Err(Unfresh::Resting) {
                        break;
                    }
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        break;
                    }
                }
                waited.beat = true;
            }
            Wait::Fill {
                mut filled,
                at_most,
            } => {
                // Err: the filler finished (stored or failed).
                let _ = tokio::time::timeout(at_most, filled.changed()).await;
                waited.filled = true;
                // What Redis said before may be out of date now.
                waited.shared = None;
            }
        }
    }

    fn shared_hit(&self, req: &Request<'_>, local: u128, entry: shared::entry::Entry) -> Lookup {
        let age = Duration::from_millis(unix_ms().saturating_sub(entry.created_ms));
        if req.tier.local() {
            self.local
                .insert_aged(local, &entry.payload, req.lifetime, age);
        }
        if req.admission {
            self.admission.served(req.key);
        }
        if req.shadow {
            return Lookup::WouldHit(entry.payload);
        }
        self.count_hit(req, entry.payload.len(), true);
        let refresh = req
            .lifetime
            .refresh
            .is_some_and(|r| age >= r)
            .then(|| self.refresh_fill(req))
            .flatten();
        Lookup::Hit {
            bytes: entry.payload,
            refresh,
        }
    }

    /// Counted before the client can see the answer.
    fn count_hit(&self, req: &Request<'_>, bytes: usize, shared: bool) {
        let took = req.started.elapsed();
        let m = &self.metrics;
        m.hits.inc();
        if shared {
            m.hits_shared.inc();
        } else {
            m.hits_local.inc();
        }
        m.latency_hit.observe(took.as_secs_f64());
        // The stored frames and the ReadyForQuery after them.
        m.client_bytes_out.inc_by(bytes as u64 + 6);
        self.db_metrics(req.db).hit.inc();
        req.stats.hit(took, bytes);
    }

    /// The fill of a background refresh of an entry just served, under the
    /// versions read now; `None` if one is already under way.
    fn refresh_fill(&self, req: &Request<'_>) -> Option<Fill> {
        // Never inside the client's transaction: its locks and snapshot are
        // the client's business.
        if req.in_transaction {
            return None;
        }
        let local = req.key.local(&req.db.versions.epoch, req.reads);
        let guard = self.fills.try_claim(local)?;
        let shared = self
            .shared()
            .filter(|tier| req.tier.shared() && tier.usable(req.db))
            .map(|_| req.key.shared(&req.db.versions.epoch, req.shared_reads));
        self.metrics.refreshes.inc();
        Some(Fill::new(req, local, shared, Some(guard)))
    }

    /// Stores a forwarded read's complete answer.
    pub fn store(&self, fill: Fill, bytes: &[u8]) {
        tracing::trace!(key = ?fill.local, len = bytes.len(), "store");
        self.metrics.stores.inc();
        if let Some(key) = fill.local {
            self.local.insert(key, bytes, fill.lifetime);
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

/// Waits up to `at_most` for `ready`, looking again whenever `changed` is
/// signalled. If it runs out, `db`'s next statements wait no more.
async fn warm_until(
    db: &DbState,
    changed: &tokio::sync::Notify,
    at_most: Duration,
    ready: impl Fn() -> bool,
) {
    let deadline = tokio::time::Instant::now() + at_most;
    loop {
        let signalled = changed.notified();
        if ready() {
            return;
        }
        if tokio::time::timeout_at(deadline, signalled).await.is_err() {
            db.stream.warmed();
            return;
        }
    }
}
