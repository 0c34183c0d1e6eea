//! The metrics of the cache's tiers: hits and their latency by tier, and
//! the disk tier's own ([`crate::cache::disk`]).

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntGauge};

use super::Registrar;

/// Hits answered by one tier, and how long they took.
#[derive(Clone)]
pub struct TierHits {
    pub hits: IntCounter,
    pub latency: Histogram,
}

/// Hits by tier: memory (`local`), `disk`, Redis (`shared`).
#[derive(Clone)]
pub struct Tiers {
    pub local: TierHits,
    pub disk: TierHits,
    pub shared: TierHits,
}

impl Tiers {
    pub(super) fn new(r: &Registrar<'_>, buckets: Vec<f64>) -> Self {
        let hits = r.counter_vec(
            "pgcache_cache_hits_total",
            "Requests answered from the cache, by tier (local: memory, disk, shared: Redis)",
            &["tier"],
        );
        let latency = r.add(
            HistogramVec::new(
                HistogramOpts::new(
                    "pgcache_hit_duration_seconds",
                    "Time to answer a hit, from the request's arrival, by the tier that answered it",
                )
                .buckets(buckets),
                &["tier"],
            )
            .expect("valid metric"),
        );
        let tier = |name: &str| TierHits {
            hits: hits.with_label_values(&[name]),
            latency: latency.with_label_values(&[name]),
        };
        Self {
            local: tier("local"),
            disk: tier("disk"),
            shared: tier("shared"),
        }
    }
}

/// The disk tier's state and work.
#[derive(Clone)]
pub struct DiskMetrics {
    /// 1 while the tier is in use; 0 while its directory takes no writes.
    pub up: IntGauge,
    pub capacity: IntGauge,
    /// Bytes its files take on disk, as of the last probe.
    pub bytes: IntGauge,
    pub entries: IntGauge,
    pub stores: IntCounter,
    /// Stores dropped: the writer thread's queue was full.
    pub dropped: IntCounter,
    pub write_failures: IntCounter,
    pub misses: IntCounter,
    pub read_failures: IntCounter,
    pub read_timeouts: IntCounter,
    /// Times the tier was set aside because its directory took no writes.
    pub set_aside: IntCounter,
    /// Entries of an earlier run not served: it did not stop cleanly.
    pub discarded: IntCounter,
}

impl DiskMetrics {
    pub(super) fn new(r: &Registrar<'_>) -> Self {
        let reads = r.counter_vec(
            "pgcache_disk_reads_total",
            "Disk-tier reads after a memory miss that found nothing (miss), failed (error) or \
             ran past cache.disk.read_timeout_ms (timeout); hits are pgcache_cache_hits_total{tier=\"disk\"}",
            &["result"],
        );
        let stores = r.counter_vec(
            "pgcache_disk_stores_total",
            "Answers stored in the disk tier, by result: written, dropped (the writer's queue was full), \
             failed (the write failed)",
            &["result"],
        );
        Self {
            up: r.gauge(
                "pgcache_disk_up",
                "1 while the disk tier is in use; 0 while its directory takes no writes (full, read-only)",
            ),
            capacity: r.gauge("pgcache_disk_capacity_bytes", "cache.disk.max_bytes"),
            bytes: r.gauge(
                "pgcache_disk_bytes",
                "Bytes the disk tier's files take on disk (allocated blocks), as of the last probe",
            ),
            entries: r.gauge(
                "pgcache_disk_entries",
                "Entries in the disk tier (an estimate), as of the last probe",
            ),
            stores: stores.with_label_values(&["written"]),
            dropped: stores.with_label_values(&["dropped"]),
            write_failures: stores.with_label_values(&["failed"]),
            misses: reads.with_label_values(&["miss"]),
            read_failures: reads.with_label_values(&["error"]),
            read_timeouts: reads.with_label_values(&["timeout"]),
            discarded: r.counter(
                "pgcache_disk_discarded_entries_total",
                "Disk-tier entries of an earlier run that are not served: it did not stop cleanly, so they \
                 cannot be proven fresh",
            ),
            set_aside: r.counter(
                "pgcache_disk_set_aside_total",
                "Times the disk tier was set aside because its directory stopped taking writes",
            ),
        }
    }
}
