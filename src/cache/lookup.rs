//! A lookup: what a session asks of the cache for one read, and what it
//! gets back (a hit, a miss with its fill, a bypass, or something to wait
//! for first).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{
    BypassReason, Cache, Claim, DbState, Fill, Lifetime, QueryStats, Reads, RequestKey, Unfresh,
    disk, shared, unix_ms,
};
use crate::hints::Tier;

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
    /// The stored response (RowDescription … CommandComplete), and the
    /// tier it came from; with a fill when the entry is due for a refresh
    /// and nobody refreshes it yet.
    Hit {
        bytes: Bytes,
        refresh: Option<Fill>,
        from: Source,
        /// From the request's arrival to the answer found.
        took: Duration,
    },
    /// Forward it, and store the answer with this fill.
    Miss(Fill),
    /// Forward it; the cache may not answer it now.
    Bypass(BypassReason),
    /// Shadow mode: the cache holds this answer, but the request goes to
    /// PostgreSQL all the same, to be checked against it.
    WouldHit(Bytes),
}

/// The tier a hit came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Memory,
    Disk,
    Redis,
}

impl Source {
    pub fn label(self) -> &'static str {
        match self {
            Source::Memory => "memory",
            Source::Disk => "disk",
            Source::Redis => "Redis",
        }
    }
}

/// What a lookup needs before it can answer.
pub enum Wait {
    /// `read_your_writes`: the read's versions confirmed with Redis.
    Confirm { db: Arc<DbState>, reads: Reads },
    /// The disk tier's entry for this key.
    Disk { key: u128 },
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
    /// What the disk tier holds under a local key.
    disk: Option<(u128, Option<Box<disk::Stored>>)>,
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
            && self.disk.is_none()
            && self.shared.is_none()
            && !self.filled
            && !self.warmed
            && !self.beat
    }
}

impl Cache {
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
        if let Some(unconfirmed) = self.unconfirmed(req, waited)? {
            return Ok(unconfirmed);
        }
        // Local counters first, then the shared tier's state, then its
        // counters: see `SharedTier::usable`.
        let local = req.key.local(&req.db.versions.epoch, req.reads);
        if let Some(hit) = self.local_hit(req, local) {
            return Ok(hit);
        }
        if let Some(hit) = self.disk_hit(req, local, waited)? {
            return Ok(hit);
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

    /// Under `read_your_writes`: the versions a read depends on must be
    /// confirmed current first ([`Wait::Confirm`]); a bypass if they could
    /// not be.
    fn unconfirmed(&self, req: &Request<'_>, waited: &Waited) -> Result<Option<Lookup>, Wait> {
        if !self.read_your_writes() {
            return Ok(None);
        }
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
                Err(Wait::Confirm {
                    db: Arc::clone(req.db),
                    reads,
                })
            }
            Some(false) => {
                self.bypassed(req.db, BypassReason::Unconfirmed);
                Ok(Some(Lookup::Bypass(BypassReason::Unconfirmed)))
            }
            Some(true) => Ok(None),
        }
    }

    /// The local tier's answer under key `local`, if it holds one.
    fn local_hit(&self, req: &Request<'_>, local: u128) -> Option<Lookup> {
        if !req.tier.local() {
            return None;
        }
        let entry = self.local.get(local)?;
        if req.admission {
            self.admission.served(req.key);
        }
        if req.shadow {
            return Some(Lookup::WouldHit(entry.bytes.clone()));
        }
        let took = self.count_hit(req, entry.bytes.len(), Source::Memory);
        let refresh = entry
            .wants_refresh()
            .then(|| self.refresh_fill(req))
            .flatten();
        Some(Lookup::Hit {
            bytes: entry.bytes.clone(),
            refresh,
            from: Source::Memory,
            took,
        })
    }

    /// The disk tier's answer under key `local`, promoted to memory, if it
    /// holds one; asks for it first ([`Wait::Disk`]).
    fn disk_hit(
        &self,
        req: &Request<'_>,
        local: u128,
        waited: &mut Waited,
    ) -> Result<Option<Lookup>, Wait> {
        if self.disk().is_none_or(|t| !req.tier.local() || !t.is_up()) {
            return Ok(None);
        }
        let key = local ^ req.db.disk_nonce;
        let stored = match &mut waited.disk {
            Some((k, found)) if *k == key => found.take(),
            _ => return Err(Wait::Disk { key }),
        };
        let Some((stored, (lifetime, age))) = stored.and_then(|s| s.lifetime().map(|l| (s, l)))
        else {
            return Ok(None);
        };
        self.local
            .insert_aged(local, &stored.payload, lifetime, age);
        if req.admission {
            self.admission.served(req.key);
        }
        if req.shadow {
            return Ok(Some(Lookup::WouldHit(stored.payload)));
        }
        let took = self.count_hit(req, stored.payload.len(), Source::Disk);
        let refresh = lifetime
            .refresh
            .is_some_and(|r| age >= r)
            .then(|| self.refresh_fill(req))
            .flatten();
        Ok(Some(Lookup::Hit {
            bytes: stored.payload,
            refresh,
            from: Source::Disk,
            took,
        }))
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
            Wait::Disk { key } => {
                let found = match self.disk() {
                    Some(tier) => match tier.get(key).await {
                        disk::Read::Hit(stored) => Some(Box::new(stored)),
                        disk::Read::Miss | disk::Read::Failed => None,
                    },
                    None => None,
                };
                waited.disk = Some((key, found));
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
        let took = self.count_hit(req, entry.payload.len(), Source::Redis);
        let refresh = req
            .lifetime
            .refresh
            .is_some_and(|r| age >= r)
            .then(|| self.refresh_fill(req))
            .flatten();
        Lookup::Hit {
            bytes: entry.payload,
            refresh,
            from: Source::Redis,
            took,
        }
    }

    /// Counted before the client can see the answer; how long it took.
    fn count_hit(&self, req: &Request<'_>, bytes: usize, from: Source) -> Duration {
        let took = req.started.elapsed();
        let m = &self.metrics;
        m.hits.inc();
        let tier = match from {
            Source::Memory => &m.tiers.local,
            Source::Disk => &m.tiers.disk,
            Source::Redis => &m.tiers.shared,
        };
        tier.hits.inc();
        tier.latency.observe(took.as_secs_f64());
        m.latency_hit.observe(took.as_secs_f64());
        // The stored frames and the ReadyForQuery after them.
        m.client_bytes_out.inc_by(bytes as u64 + 6);
        self.db_metrics(req.db).hit.inc();
        req.stats.hit(took, bytes);
        took
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
}

/// Waits up to `at_most` for `ready`, looking again whenever `changed` is
/// signalled. If it runs out, `db`'s next statements wait no more.
pub(super) async fn warm_until(
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
