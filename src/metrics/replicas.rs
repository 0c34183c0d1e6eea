//! The read replicas' metrics ([`crate::replica`]): each server's state and
//! lag, the reads routed to it, the fills refused for it and the retries
//! on the primary.

use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

use super::Registrar;

/// The families, labelled by server (a replica's host:port, or `primary`).
pub struct ReplicaFamilies {
    up: IntGaugeVec,
    lag_seconds: GaugeVec,
    lag_bytes: IntGaugeVec,
    routed: IntCounterVec,
    refused_fills: IntCounterVec,
    retries: IntCounterVec,
}

/// One server's handles, resolved once.
#[derive(Clone)]
pub struct ReplicaMetrics {
    pub up: IntGauge,
    pub lag_seconds: Gauge,
    pub lag_bytes: IntGauge,
    /// Reads routed to it.
    pub routed: IntCounter,
    /// Fills it answered that were not stored: it had not replayed past
    /// the bumps of the tables read.
    pub refused_fills: IntCounter,
    /// Reads it failed that were retried on the primary.
    pub retries: IntCounter,
}

impl ReplicaFamilies {
    pub(super) fn new(r: &Registrar<'_>) -> Self {
        let server = &["server"];
        Self {
            up: r.add(
                IntGaugeVec::new(
                    Opts::new("pgcache_replica_up", "1 while the replica is in rotation"),
                    server,
                )
                .expect("valid metric"),
            ),
            lag_seconds: r.add(
                GaugeVec::new(
                    Opts::new(
                        "pgcache_replica_lag_seconds",
                        "How long ago the primary was where the replica has replayed to, from \
                         pgcache's own samples of the primary's position",
                    ),
                    server,
                )
                .expect("valid metric"),
            ),
            lag_bytes: r.add(
                IntGaugeVec::new(
                    Opts::new(
                        "pgcache_replica_lag_bytes",
                        "WAL bytes between the primary's flushed position and the replica's replay position",
                    ),
                    server,
                )
                .expect("valid metric"),
            ),
            routed: r.counter_vec(
                "pgcache_reads_routed_total",
                "Reads routed by replicas.routing, by the server that took them (a replica, or primary)",
                server,
            ),
            refused_fills: r.counter_vec(
                "pgcache_replica_fills_refused_total",
                "Answers of a replica not stored in the cache: it had not replayed past the last \
                 change of every table the read depends on",
                server,
            ),
            retries: r.counter_vec(
                "pgcache_replica_retries_total",
                "Reads a replica failed (recovery conflict, shutdown, lost connection...) retried on the primary",
                server,
            ),
        }
    }

    /// The handles of server `name`.
    pub fn of(&self, name: &str) -> ReplicaMetrics {
        let l = &[name];
        ReplicaMetrics {
            up: self.up.with_label_values(l),
            lag_seconds: self.lag_seconds.with_label_values(l),
            lag_bytes: self.lag_bytes.with_label_values(l),
            routed: self.routed.with_label_values(l),
            refused_fills: self.refused_fills.with_label_values(l),
            retries: self.retries.with_label_values(l),
        }
    }
}
