//! The metrics of the two pools: connections parked for reuse
//! ([`crate::pool`]) and transaction pooling ([`crate::pool::transaction`]).

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

use super::Registrar;

/// The server-connection pool ([`crate::pool`]).
#[derive(Clone)]
pub struct PoolMetrics {
    /// Connections parked for the next client now, and ever.
    pub idle: IntGauge,
    pub parked: IntCounter,
    /// Logins served by a parked connection, and by a new one.
    pub reused: IntCounter,
    pub fresh: IntCounter,
    /// Parked or returning connections closed, by why.
    pub closed_stale: IntCounter,
    pub closed_failed: IntCounter,
    pub closed_full: IntCounter,
    pub closed_expired: IntCounter,
    pub closed_evicted: IntCounter,
    pub closed_tainted: IntCounter,
}

impl PoolMetrics {
    pub(super) fn new(r: &Registrar<'_>) -> Self {
        let logins = r.counter_vec(
            "pgcache_pool_logins_total",
            "Client logins by the server connection they got: a parked one (reused) or a new one (fresh)",
            &["server"],
        );
        let closed = r.counter_vec(
            "pgcache_pool_closed_total",
            "Server connections closed instead of parked or reused, by reason: settings changed \
             or first seen (stale), reset or check failed (failed), pool full (full), idle too long \
             (expired), closed for a database statement (evicted), session state DISCARD ALL \
             keeps (tainted)",
            &["reason"],
        );
        let by = |family: &IntCounterVec, label: &str| family.with_label_values(&[label]);
        Self {
            idle: r.gauge(
                "pgcache_pool_idle_servers",
                "Server connections parked for the next client",
            ),
            parked: r.counter(
                "pgcache_pool_parked_total",
                "Server connections reset and parked when their session ended",
            ),
            reused: by(&logins, "reused"),
            fresh: by(&logins, "fresh"),
            closed_stale: by(&closed, "stale"),
            closed_failed: by(&closed, "failed"),
            closed_full: by(&closed, "full"),
            closed_expired: by(&closed, "expired"),
            closed_evicted: by(&closed, "evicted"),
            closed_tainted: by(&closed, "tainted"),
        }
    }
}

/// Transaction pooling ([`crate::pool::transaction`]).
#[derive(Clone)]
pub struct TransactionPoolMetrics {
    /// Clients waiting for a server connection now.
    pub waiting: IntGauge,
    pub wait: Histogram,
    pub wait_timeouts: IntCounter,
    pub checkouts: IntCounter,
    /// Server connections open, held by a client, idle.
    pub open: IntGauge,
    pub active: IntGauge,
    pub idle: IntGauge,
    pub logins: IntCounter,
    pub login_failures: IntCounter,
    pub closed_idle: IntCounter,
    pub closed_lifetime: IntCounter,
    pub closed_broken: IntCounter,
    pub closed_stale: IntCounter,
    pub closed_listening: IntCounter,
    /// Notifications for a channel the client holding the connection never
    /// listened on, not given to it.
    pub notifications_withheld: IntCounter,
    /// Sessions pinned to one server connection, by why.
    pub pins: IntCounterVec,
}

impl TransactionPoolMetrics {
    pub(super) fn new(r: &Registrar<'_>) -> Self {
        let closed = r.counter_vec(
            "pgcache_pool_server_closed_total",
            "Transaction-mode server connections closed, by reason: idle past \
             pool.server_idle_timeout_secs (idle), past pool.server_lifetime_secs (lifetime), \
             found dead or left in an unknown state (broken), logged in under role or database \
             settings that changed since (stale), delivering notifications of another \
             client's LISTEN (listening)",
            &["reason"],
        );
        let servers = r.add(
            IntGaugeVec::new(
                Opts::new(
                    "pgcache_pool_servers",
                    "Transaction-mode server connections, by state: held by a client (active), \
                     idle in the pool (idle), open in all (open)",
                ),
                &["state"],
            )
            .expect("valid metric"),
        );
        let by = |family: &IntCounterVec, label: &str| family.with_label_values(&[label]);
        Self {
            waiting: r.gauge(
                "pgcache_pool_waiting_clients",
                "Clients waiting for a transaction-mode server connection",
            ),
            wait: wait_histogram(r),
            wait_timeouts: r.counter(
                "pgcache_pool_wait_timeouts_total",
                "Statements failed with 57014 after pool.query_wait_timeout_secs",
            ),
            checkouts: r.counter(
                "pgcache_pool_checkouts_total",
                "Times a client took a transaction-mode server connection",
            ),
            open: servers.with_label_values(&["open"]),
            active: servers.with_label_values(&["active"]),
            idle: servers.with_label_values(&["idle"]),
            logins: r.counter(
                "pgcache_pool_server_logins_total",
                "Transaction-mode server connections opened",
            ),
            login_failures: r.counter(
                "pgcache_pool_server_login_failures_total",
                "Transaction-mode server connections that could not be opened",
            ),
            closed_idle: by(&closed, "idle"),
            closed_lifetime: by(&closed, "lifetime"),
            closed_broken: by(&closed, "broken"),
            closed_stale: by(&closed, "stale"),
            closed_listening: by(&closed, "listening"),
            notifications_withheld: r.counter(
                "pgcache_pool_notifications_withheld_total",
                "Notifications a transaction-mode server connection sent for a channel the client \
                 holding it never listened on, withheld from that client (its connection is then \
                 closed rather than given back)",
            ),
            pins: pins(r),
        }
    }
}

fn wait_histogram(r: &Registrar<'_>) -> Histogram {
    r.add(
        Histogram::with_opts(
            HistogramOpts::new(
                "pgcache_pool_wait_seconds",
                "Time clients waited for a transaction-mode server connection (waits only)",
            )
            .buckets(prometheus::exponential_buckets(0.000_1, 4.0, 10).expect("valid buckets")),
        )
        .expect("valid metric"),
    )
}

fn pins(r: &Registrar<'_>) -> IntCounterVec {
    let pins = r.counter_vec(
        "pgcache_pool_pins_total",
        "Transaction-mode sessions pinned to one server connection for the rest of the \
         session, by the feature that needs it",
        &["reason"],
    );
    // Every reason is exported from the start, at 0.
    for pin in crate::pool::marks::Pin::ALL {
        pins.with_label_values(&[pin.as_str()]);
    }
    pins
}
