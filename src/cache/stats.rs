//! Per-statement statistics, by normalised text (see [`crate::hints`]):
//! what `SHOW QUERIES` lists. A statement's plan holds its `Arc<QueryStats>`,
//! so recording costs a few atomic adds and never a map lookup.
//!
//! The registry is bounded: past its capacity the least used statements
//! are forgotten.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::admission::Shape;
use super::database::DbState;
use super::versions::Family;
use crate::classify::BypassReason;

#[derive(Default)]
pub struct QueryStats {
    /// xxh3-64 of the normalised text.
    pub id: u64,
    pub text: String,
    calls: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_ns: AtomicU64,
    miss_ns: AtomicU64,
    /// Bytes of results served from the cache.
    hit_bytes: AtomicU64,
    /// Shadow mode: would-be hits, the backend time they took (which
    /// serving them would have saved), and those whose stored answer was
    /// not PostgreSQL's.
    would_hits: AtomicU64,
    would_save_ns: AtomicU64,
    mismatches: AtomicU64,
    /// Hits the correctness sampler found wrong.
    verify_mismatches: AtomicU64,
    /// Requests of it the cache could not answer, and why the last one.
    bypasses: AtomicU64,
    /// `BypassReason` index + 1; 0: none yet.
    last_bypass: AtomicU8,
    /// What it reads, for "last invalidation": set by the first plan.
    reads: Mutex<Option<Reads>>,
    /// Whether its answers are stored ([`super::admission`]).
    pub admission: Shape,
}

/// A statement's database, the tables it reads, and the sum of their
/// versions (and the epoch) when it was first planned: how often they were
/// invalidated since is the sum now less that.
type Reads = (Arc<DbState>, Vec<Arc<Family>>, u64);

fn version_sum(db: &DbState, families: &[Arc<Family>]) -> u64 {
    families
        .iter()
        .map(|f| f.version.local())
        .chain([db.versions.epoch.local()])
        .sum()
}

/// A snapshot of one statement's numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct QueryRow {
    pub id: u64,
    pub text: String,
    pub calls: u64,
    pub hits: u64,
    pub misses: u64,
    pub mean_hit_ms: f64,
    pub mean_miss_ms: f64,
    pub hit_bytes: u64,
    pub would_hits: u64,
    /// Backend time the would-be hits took, in milliseconds.
    pub would_save_ms: f64,
    pub mismatches: u64,
    pub verify_mismatches: u64,
    /// PostgreSQL's time on its cacheable reads (misses and would-be hits).
    pub backend_ms: f64,
    pub bypasses: u64,
    pub last_bypass: Option<BypassReason>,
    /// Invalidations of what it reads since it was first planned.
    pub invalidations: u64,
    /// Unix milliseconds of the last invalidation of what it reads; 0 = none.
    pub last_invalidation_ms: u64,
    /// Times adaptive admission stopped storing it, and its requests sent
    /// to PostgreSQL meanwhile.
    pub suspensions: u64,
    pub not_admitted: u64,
}

impl QueryStats {
    pub fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn hit(&self, took: Duration, bytes: usize) {
        self.hits.fetch_add(1, Ordering::Relaxed);
        self.hit_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.hit_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Shadow mode: a would-be hit PostgreSQL answered in `took`.
    pub fn would_hit(&self, took: Duration, matched: bool) {
        self.would_hits.fetch_add(1, Ordering::Relaxed);
        self.would_save_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if !matched {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The correctness sampler found a hit of it wrong.
    pub fn verify_mismatch(&self) {
        self.verify_mismatches.fetch_add(1, Ordering::Relaxed);
    }

    pub fn miss(&self, took: Duration) {
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.miss_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn bypassed(&self, reason: BypassReason) {
        self.bypasses.fetch_add(1, Ordering::Relaxed);
        self.last_bypass.store(reason as u8 + 1, Ordering::Relaxed);
    }

    pub fn set_reads(&self, db: &Arc<DbState>, families: &[Arc<Family>]) {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        if reads.is_none() {
            let base = version_sum(db, families);
            *reads = Some((Arc::clone(db), families.to_vec(), base));
        }
    }

    pub fn row(&self) -> QueryRow {
        let hits = self.hits.load(Ordering::Relaxed);
        let misses = self.misses.load(Ordering::Relaxed);
        let mean = |ns: &AtomicU64, n: u64| {
            if n == 0 {
                0.0
            } else {
                ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e6
            }
        };
        let (last_invalidation_ms, invalidations) = {
            let reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
            reads.as_ref().map_or((0, 0), |(db, families, base)| {
                let last = families
                    .iter()
                    .map(|f| f.version.last_change_ms())
                    .chain([db.versions.epoch.last_change_ms()])
                    .max()
                    .unwrap_or(0);
                (last, version_sum(db, families).saturating_sub(*base))
            })
        };
        let last_bypass = match self.last_bypass.load(Ordering::Relaxed) {
            0 => None,
            n => BypassReason::ALL.get(n as usize - 1).copied(),
        };
        QueryRow {
            id: self.id,
            text: self.text.clone(),
            calls: self.calls.load(Ordering::Relaxed),
            hits,
            misses,
            mean_hit_ms: mean(&self.hit_ns, hits),
            mean_miss_ms: mean(&self.miss_ns, misses),
            hit_bytes: self.hit_bytes.load(Ordering::Relaxed),
            would_hits: self.would_hits.load(Ordering::Relaxed),
            would_save_ms: self.would_save_ns.load(Ordering::Relaxed) as f64 / 1e6,
            mismatches: self.mismatches.load(Ordering::Relaxed),
            verify_mismatches: self.verify_mismatches.load(Ordering::Relaxed),
            backend_ms: (self.miss_ns.load(Ordering::Relaxed)
                + self.would_save_ns.load(Ordering::Relaxed)) as f64
                / 1e6,
            bypasses: self.bypasses.load(Ordering::Relaxed),
            last_bypass,
            invalidations,
            last_invalidation_ms,
            suspensions: self.admission.suspensions(),
            not_admitted: self.admission.not_admitted(),
        }
    }
}

pub struct StatsRegistry {
    /// Keyed by digests: foldhash, not SipHash.
    by_id: moka::sync::Cache<u64, Arc<QueryStats>, foldhash::fast::RandomState>,
}

impl StatsRegistry {
    pub fn new(capacity: u64) -> Self {
        Self {
            by_id: moka::sync::Cache::builder()
                .max_capacity(capacity)
                .build_with_hasher(foldhash::fast::RandomState::default()),
        }
    }

    /// The statistics of a normalised text, created on first use.
    pub fn get(&self, normalized: &str) -> Arc<QueryStats> {
        let id = query_id(normalized);
        self.by_id.get_with(id, || {
            Arc::new(QueryStats {
                id,
                text: normalized.to_owned(),
                ..QueryStats::default()
            })
        })
    }

    /// The `n` statements with the most calls.
    pub fn top(&self, n: usize) -> Vec<QueryRow> {
        let mut rows: Vec<QueryRow> = self.by_id.iter().map(|(_, s)| s.row()).collect();
        rows.sort_by(|a, b| b.calls.cmp(&a.calls).then(a.id.cmp(&b.id)));
        rows.truncate(n);
        rows
    }
}

pub fn query_id(normalized: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(normalized.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_normalised_text_and_top_by_calls() {
        let r = StatsRegistry::new(100);
        let a = r.get("SELECT ?");
        assert!(Arc::ptr_eq(&a, &r.get("SELECT ?")));
        let b = r.get("SELECT v FROM t");
        a.call();
        b.call();
        b.call();
        b.hit(Duration::from_millis(2), 10);
        b.miss(Duration::from_millis(6));
        let top = r.top(1);
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].text, "SELECT v FROM t");
        assert_eq!((top[0].calls, top[0].hits, top[0].misses), (2, 1, 1));
        assert!((top[0].mean_hit_ms - 2.0).abs() < 1e-9);
        assert!((top[0].mean_miss_ms - 6.0).abs() < 1e-9);
        assert_eq!(top[0].hit_bytes, 10);
        assert_eq!(top[0].id, query_id("SELECT v FROM t"));
    }
}
