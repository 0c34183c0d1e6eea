//! The metrics of the shared tier ([`crate::cache::shared`]): Redis's
//! answers, its errors and what was published through it.

use prometheus::{IntCounter, IntGauge};

use super::Registrar;

/// The shared tier's counters; label handles resolved once.
#[derive(Clone)]
pub struct SharedMetrics {
    pub hit: IntCounter,
    pub miss: IntCounter,
    /// An entry failed its checks: never served.
    pub rejected: IntCounter,
    pub error: IntCounter,
    /// Not asked: breaker open, not connected, or versions not in sync.
    pub skipped: IntCounter,
    pub rejected_format: IntCounter,
    pub rejected_checksum: IntCounter,
    pub rejected_key: IntCounter,
    pub rejected_versions: IntCounter,
    pub stored: IntCounter,
    pub store_failed: IntCounter,
    pub store_dropped: IntCounter,
    pub store_too_large: IntCounter,
    /// Bytes of values stored in Redis.
    pub stored_bytes: IntCounter,
    /// Commands (or pipelines, or scripts) sent to Redis.
    pub round_trips: IntCounter,
    pub invalidations_sent: IntCounter,
    pub invalidations_received: IntCounter,
    pub resyncs: IntCounter,
    pub breaker_opens: IntCounter,
    /// 1 while the shared tier is in use (subscribed, in sync, breaker closed).
    pub up: IntGauge,
}

impl SharedMetrics {
    pub(super) fn new(r: &Registrar<'_>) -> Self {
        let counter_vec = |name: &str, help: &str, label: &str| r.counter_vec(name, help, &[label]);
        let counter = |name: &str, help: &str| r.counter(name, help);
        let lookups = counter_vec(
            "pgcache_shared_lookups_total",
            "Shared-tier (Redis) lookups after a local miss, by result",
            "result",
        );
        let rejected = counter_vec(
            "pgcache_shared_rejected_total",
            "Redis values that failed a check and were treated as misses, by reason",
            "reason",
        );
        let stores = counter_vec(
            "pgcache_shared_stores_total",
            "Stores to the shared tier, by result",
            "result",
        );
        let invalidations = counter_vec(
            "pgcache_shared_invalidations_total",
            "Version bumps sent to or received from other instances through Redis",
            "direction",
        );
        Self {
            hit: lookups.with_label_values(&["hit"]),
            miss: lookups.with_label_values(&["miss"]),
            rejected: lookups.with_label_values(&["rejected"]),
            error: lookups.with_label_values(&["error"]),
            skipped: lookups.with_label_values(&["skipped"]),
            rejected_format: rejected.with_label_values(&["format"]),
            rejected_checksum: rejected.with_label_values(&["checksum"]),
            rejected_key: rejected.with_label_values(&["key"]),
            rejected_versions: rejected.with_label_values(&["versions"]),
            stored: stores.with_label_values(&["ok"]),
            store_failed: stores.with_label_values(&["error"]),
            store_dropped: stores.with_label_values(&["dropped"]),
            store_too_large: stores.with_label_values(&["too_large"]),
            stored_bytes: counter(
                "pgcache_shared_stored_bytes_total",
                "Bytes of values stored in the shared tier (Redis)",
            ),
            round_trips: counter(
                "pgcache_shared_round_trips_total",
                "Round trips to Redis (a pipeline or script counts once)",
            ),
            invalidations_sent: invalidations.with_label_values(&["sent"]),
            invalidations_received: invalidations.with_label_values(&["received"]),
            resyncs: counter(
                "pgcache_shared_resyncs_total",
                "Times a database's versions were read back from Redis after a gap",
            ),
            breaker_opens: counter(
                "pgcache_shared_breaker_opens_total",
                "Times the circuit breaker stopped pgcache from trying Redis",
            ),
            up: r.gauge(
                "pgcache_shared_up",
                "1 while the shared tier is in use: subscribed, in sync, breaker closed",
            ),
        }
    }
}
