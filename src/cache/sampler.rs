//! The correctness sampler: a share of hits (`cache.verify_sample_rate`, at
//! most `cache.verify_max_per_sec`) is checked after it is served. The same
//! request goes to PostgreSQL as pgcache's own hidden request on the
//! client's connection (the one session certain to be equivalent: same
//! role, settings and database), and the answer is compared with the
//! stored one.
//!
//! A difference is not always a stale entry:
//! - a relation cached by TTL may lag within its TTL (`ttl_expected`);
//! - a change may have committed between the hit and the check. The check
//!   waits until the replication stream has applied everything committed
//!   before the check ran (a heartbeat sent after it came back): if the
//!   versions the hit was served under moved meanwhile, the difference is
//!   `changed`; if not, the stored answer was wrong (`mismatch`), and the
//!   tables it reads are invalidated, which retires the entry everywhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::warn;

use super::database::DbState;
use super::stats::QueryStats;
use super::versions::{Bumps, Family};
use super::{Cache, Reads};
use crate::metrics::VerifyMetrics;

/// Decides which hits are checked: a draw at the rate, within a budget per
/// second.
#[derive(Default)]
pub struct Sampler {
    /// The second (since `anchor`) the budget is counted for.
    second: AtomicU64,
    taken: AtomicU32,
    anchor: std::sync::OnceLock<Instant>,
    /// Hits drawn (over the budget or not): each ends in one outcome of
    /// `pgcache_verify_total`, unless PostgreSQL's answer could not be
    /// copied whole.
    drawn: AtomicU64,
}

impl Sampler {
    /// Whether to check this hit: `roll` (uniform in [0, 1), the caller's
    /// randomness) falls under `rate`, within the budget of the second
    /// `now` is in. A hit drawn over the budget is counted as skipped.
    pub fn draw(
        &self,
        (roll, now): (f64, Instant),
        rate: f64,
        max_per_sec: u32,
        metrics: &VerifyMetrics,
    ) -> bool {
        if rate <= 0.0 || roll >= rate {
            return false;
        }
        self.drawn.fetch_add(1, Ordering::Relaxed);
        let anchor = *self.anchor.get_or_init(|| now);
        let now = now.saturating_duration_since(anchor).as_secs();
        if self.second.swap(now, Ordering::AcqRel) != now {
            self.taken.store(0, Ordering::Release);
        }
        if self.taken.fetch_add(1, Ordering::AcqRel) >= max_per_sec {
            metrics.skipped.inc();
            return false;
        }
        true
    }

    pub fn drawn(&self) -> u64 {
        self.drawn.load(Ordering::Relaxed)
    }
}

/// One sampled hit, to judge when PostgreSQL's answer is in.
pub struct Check {
    pub db: Arc<DbState>,
    pub stats: Arc<QueryStats>,
    /// What the cache served (the stored entry).
    pub served: Bytes,
    pub reads: Reads,
    /// The epoch and the versions of `reads` the hit was served under.
    pub versions: Vec<u64>,
    /// It reads a relation cached by TTL.
    pub unwatched: bool,
}

impl Check {
    pub fn new(
        db: &Arc<DbState>,
        stats: &Arc<QueryStats>,
        served: Bytes,
        reads: &Reads,
        unwatched: bool,
    ) -> Self {
        Self {
            db: Arc::clone(db),
            stats: Arc::clone(stats),
            served,
            reads: Arc::clone(reads),
            versions: versions(db, reads),
            unwatched,
        }
    }

    /// PostgreSQL answered `answer`, complete at `done`. A difference is
    /// judged off the session's path.
    pub fn judge(self, cache: &Arc<Cache>, answer: &[u8], done: Instant) {
        let m = &cache.metrics.verify;
        if self.served == answer {
            m.matched.inc();
            return;
        }
        if self.unwatched || !cache.replication_on() {
            m.ttl_expected.inc();
            return;
        }
        let cache = Arc::clone(cache);
        tokio::spawn(async move { self.after_stream(&cache, done).await });
    }

    async fn after_stream(self, cache: &Arc<Cache>, done: Instant) {
        let m = &cache.metrics.verify;
        // The lease bounds how long the stream may lag while it is served.
        let caught_up = async {
            while !self.db.stream.covers(done) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), caught_up)
            .await
            .is_err()
        {
            m.skipped.inc();
            return;
        }
        if versions(&self.db, &self.reads) != self.versions {
            m.changed.inc();
            return;
        }
        m.mismatch.inc();
        self.stats.verify_mismatch();
        let tables: Vec<&str> = self.reads.iter().map(|f| &*f.name).collect();
        warn!(query = %self.stats.text, database = %self.db.name, ?tables, versions = ?self.versions,
            "the cache served an answer PostgreSQL did not give: its tables are invalidated");
        let mut bumps = Bumps::default();
        for f in self.reads.iter() {
            bumps.add_family(Arc::clone(f));
            // Its reads by row too, which read the table's `wide`.
            if f.scope == crate::cache::versions::Scope::Table {
                bumps.add_family(self.db.versions.wide(f));
            }
        }
        cache
            .invalidate(&self.db, bumps, &cache.metrics.invalidations.verify)
            .send()
            .await;
    }
}

fn versions(db: &DbState, reads: &[Arc<Family>]) -> Vec<u64> {
    std::iter::once(db.versions.epoch.local())
        .chain(reads.iter().map(|f| f.version.local()))
        .collect()
}
