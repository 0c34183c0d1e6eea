//! Prometheus metrics: one owned registry per instance (two instances in
//! one test binary keep separate counters). [`crate::http`] serves them.
//!
//! Counters on the hot path are label handles resolved once at start-up, so
//! recording one is a single atomic add. Per-database replication gauges are
//! filled in when Prometheus scrapes.

use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::classify::BypassReason;

mod pools;
mod replicas;
mod shared;
mod tiers;

pub use pools::{PoolMetrics, TransactionPoolMetrics};
pub use replicas::{ReplicaFamilies, ReplicaMetrics};
pub use shared::SharedMetrics;
pub use tiers::{DiskMetrics, TierHits, Tiers};

/// `pgcache_settings_reused_total`'s help.
const SETTINGS_REUSED: &str = "Fresh sessions that took the settings of an earlier one that logged in \
     alike, a short probe having shown nothing they depend on changed";

pub struct Metrics {
    registry: Registry,
    /// Requests answered from the cache.
    pub hits: IntCounter,
    /// Cacheable requests forwarded to fill the cache.
    pub misses: IntCounter,
    /// Requests that could not use the cache.
    pub bypasses: IntCounter,
    /// Results stored in the local tier.
    pub stores: IntCounter,
    /// Malformed or unknown cache hints reported to clients.
    pub hint_problems: IntCounter,
    /// Misses that waited for a concurrent identical miss.
    pub coalesced: IntCounter,
    /// Logins pgcache refused or could not complete, by stage.
    pub auth_failures: AuthFailures,
    /// Entries refreshed in the background while being served.
    pub refreshes: IntCounter,
    /// Settings queries run on clients' connections.
    pub settings_queries: IntCounter,
    pub settings_reused: IntCounter,
    /// The correctness sampler's checks, by outcome.
    pub verify: VerifyMetrics,
    /// Shadow mode: would-be hits whose stored answer matched PostgreSQL's.
    pub shadow_match: IntCounter,
    /// Shadow mode: would-be hits whose stored answer did not.
    pub shadow_mismatch: IntCounter,
    /// Shadow mode: backend time the would-be hits would have saved.
    pub shadow_saved: prometheus::Counter,
    pub client_connections: IntGauge,
    pub backend_connections: IntGauge,
    /// Hits by tier, and their latency.
    pub tiers: Tiers,
    pub disk: DiskMetrics,
    bypass_reasons: Vec<IntCounter>,
    /// Time from a request's arrival to its answer: from the cache, or
    /// (a cacheable miss) from PostgreSQL.
    pub latency_hit: Histogram,
    pub latency_miss: Histogram,
    pub evictions: Evictions,
    pub invalidations: Invalidations,
    pub client_bytes_in: IntCounter,
    pub client_bytes_out: IntCounter,
    database_lookups: IntCounterVec,
    pub shared_breaker_open: IntGauge,
    pub replication: ReplicationGauges,
    pub local_entries: IntGauge,
    pub local_bytes: IntGauge,
    pub shared: SharedMetrics,
    pub pool: PoolMetrics,
    pub pooled: TransactionPoolMetrics,
    /// The read replicas', by server.
    pub replicas: ReplicaFamilies,
}

/// The correctness sampler's checks ([`crate::cache::sampler`]).
#[derive(Clone)]
pub struct VerifyMetrics {
    pub matched: IntCounter,
    pub mismatch: IntCounter,
    pub ttl_expected: IntCounter,
    pub changed: IntCounter,
    pub skipped: IntCounter,
}

/// Local-tier entries that left, by cause.
#[derive(Clone)]
pub struct Evictions {
    pub size: IntCounter,
    pub expired: IntCounter,
    /// Expiry counted again as an invalidation with source `ttl`.
    pub ttl: IntCounter,
    pub replaced: IntCounter,
    pub explicit: IntCounter,
}

/// Invalidations applied, by where they came from (one per statement,
/// transaction, replicated commit, command or announcement).
#[derive(Clone)]
pub struct Invalidations {
    pub write: IntCounter,
    pub replication: IntCounter,
    pub admin: IntCounter,
    /// `NOTIFY pgcache_invalidate` heard from PostgreSQL.
    pub notify: IntCounter,
    /// Entries the correctness sampler found wrong.
    pub verify: IntCounter,
    pub peer: IntCounter,
    pub resync: IntCounter,
    /// Of the invalidations applied, by what they reached: a stripe of a
    /// table's rows (reads by row of those rows), a table as a whole
    /// (every read of it, by row too), or a table's reads not by row.
    pub rows: IntCounter,
    pub whole_tables: IntCounter,
    pub tables: IntCounter,
}

/// One database's lookups, resolved once per database.
#[derive(Clone)]
pub struct DbMetrics {
    pub hit: IntCounter,
    pub miss: IntCounter,
    pub bypass: IntCounter,
}

/// `pgcache_auth_failures_total`, one handle per stage.
#[derive(Clone)]
pub struct AuthFailures {
    pub client: IntCounter,
    pub backend: IntCounter,
    pub relay: IntCounter,
}

/// Registers metrics in one registry; a name registered twice is a bug.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn add<T: prometheus::core::Collector + Clone + 'static>(&self, metric: T) -> T {
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric names are unique");
        metric
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help).expect("valid metric"))
    }

    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    /// A counter of seconds, or anything else not whole.
    fn float_counter(&self, name: &str, help: &str) -> prometheus::Counter {
        self.add(prometheus::Counter::new(name, help).expect("valid metric"))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help).expect("valid metric"))
    }

    /// A gauge per database.
    fn database_gauge(&self, name: &str, help: &str) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), &["database"]).expect("valid metric"))
    }
}

/// Per-database gauges of the replication streams, set at scrape time.
pub struct ReplicationGauges {
    pub up: IntGaugeVec,
    pub lag_seconds: GaugeVec,
    pub lag_bytes: IntGaugeVec,
    pub restarts: IntGaugeVec,
    pub ddl_transactions: IntGaugeVec,
    pub ddl_rounds: IntGaugeVec,
    pub unpublished_tables: IntGaugeVec,
    pub heartbeats: IntGaugeVec,
    pub resting: IntGaugeVec,
    pub slot_kept: IntGaugeVec,
}

impl ReplicationGauges {
    fn new(r: &Registrar<'_>) -> Self {
        Self {
            up: r.database_gauge(
                "pgcache_replication_up",
                "1 while the database's replication stream is up within its staleness lease",
            ),
            lag_seconds: r.add(
                GaugeVec::new(
                    Opts::new(
                        "pgcache_replication_lag_seconds",
                        "How far behind the database the cache may be: time since the newest \
                         heartbeat seen back through the stream was sent (grows during a stall)",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            lag_bytes: r.database_gauge(
                "pgcache_replication_lag_bytes",
                "WAL the server has sent or announced beyond what pgcache has applied",
            ),
            restarts: r.database_gauge(
                "pgcache_replication_stream_starts",
                "Times the database's stream (re)started",
            ),
            ddl_transactions: r.database_gauge(
                "pgcache_replication_ddl_transactions",
                "Transactions with DDL the stream saw commit and handled (named what they \
                 changed, checked the publication; DDL this instance sent, its clients' or its \
                 own, needs neither)",
            ),
            ddl_rounds: r.database_gauge(
                "pgcache_replication_ddl_rounds",
                "Rounds of queries the stream ran to handle DDL: transactions that arrive \
                 together share one",
            ),
            unpublished_tables: r.database_gauge(
                "pgcache_unpublished_tables",
                "Tables without a replica identity: never published, never cached",
            ),
            heartbeats: r.database_gauge(
                "pgcache_replication_heartbeats",
                "Heartbeats this instance sent through the database's streams since start",
            ),
            slot_kept: r.database_gauge(
                "pgcache_replication_slot_kept_bytes",
                "With a disk tier: the WAL the database's persistent slot had kept while pgcache \
                 was stopped, when this run resumed it (-1: not resumed)",
            ),
            resting: r.database_gauge(
                "pgcache_replication_resting",
                "1 while the database's heartbeats rest because nothing needs them (the next \
                 lookup sends one and waits for it)",
            ),
        }
    }
}

/// The buckets of every request-latency histogram: 25 µs to 1.5 s.
fn latency_buckets() -> Vec<f64> {
    prometheus::exponential_buckets(0.000_025, 2.5, 12).expect("valid buckets")
}

/// The labelled families whose handles [`Metrics`] resolves once.
struct Families {
    lookups: IntCounterVec,
    auth_failures: IntCounterVec,
    bypasses: IntCounterVec,
    invalidations: IntCounterVec,
    invalidation_scopes: IntCounterVec,
    evictions: IntCounterVec,
    client_bytes: IntCounterVec,
    latency: HistogramVec,
    shadow: IntCounterVec,
    verify: IntCounterVec,
}

impl Families {
    fn new(r: &Registrar<'_>) -> Self {
        Self {
            lookups: r.counter_vec(
                "pgcache_cache_lookups_total",
                "Cache lookups by result (hit, miss, bypass)",
                &["result"],
            ),
            auth_failures: r.counter_vec(
                "pgcache_auth_failures_total",
                "Logins that failed in pgcache: a wrong password or unknown user (client), \
                 a login to PostgreSQL for an authenticated client (backend), SCRAM that \
                 cannot be relayed across two TLS legs (relay)",
                &["stage"],
            ),
            bypasses: r.counter_vec(
                "pgcache_cache_bypasses_total",
                "Requests that could not use the cache, by reason",
                &["reason"],
            ),
            invalidation_scopes: r.counter_vec(
                "pgcache_invalidated_versions_total",
                "Versions moved by invalidations, by what each reaches: a stripe of a table's rows \
                 (row: only the reads by row of rows in it), a table as a whole (whole_table: \
                 its reads by row too), a table's reads not by row (table)",
                &["scope"],
            ),
            invalidations: r.counter_vec(
                "pgcache_invalidations_total",
                "Invalidations applied, by source (write, replication, admin, notify, verify, peer, resync, ttl)",
                &["source"],
            ),
            evictions: r.counter_vec(
                "pgcache_cache_evictions_total",
                "Local-tier entries removed, by cause (size, expired, replaced, explicit)",
                &["cause"],
            ),
            verify: r.counter_vec(
                "pgcache_verify_total",
                "Hits the correctness sampler checked against PostgreSQL, by outcome: match, mismatch (the \
                 entry was wrong and its tables were invalidated), ttl_expected (a relation cached by TTL), \
                 changed (a change committed between the hit and the check), skipped (over \
                 cache.verify_max_per_sec, or the stream did not catch up)",
                &["result"],
            ),
            shadow: r.counter_vec(
                "pgcache_shadow_hits_total",
                "Shadow mode (cache.mode = \"shadow\"): would-be hits, forwarded anyway, by whether the stored \
                 answer matched PostgreSQL's (match, mismatch)",
                &["result"],
            ),
            client_bytes: r.counter_vec(
                "pgcache_client_bytes_total",
                "Bytes received from and sent to clients",
                &["direction"],
            ),
            latency: r.add(
                HistogramVec::new(
                    HistogramOpts::new(
                        "pgcache_request_duration_seconds",
                        "Time to answer a cacheable request: from the cache (hit) or PostgreSQL (miss)",
                    )
                    .buckets(latency_buckets()),
                    &["outcome"],
                )
                .expect("valid metric"),
            ),
        }
    }
}

impl Evictions {
    /// `ttl` is the invalidations' counter that expiry also counts in.
    fn new(by_cause: &IntCounterVec, ttl: IntCounter) -> Self {
        let cause = |label: &str| by_cause.with_label_values(&[label]);
        Self {
            size: cause("size"),
            expired: cause("expired"),
            ttl,
            replaced: cause("replaced"),
            explicit: cause("explicit"),
        }
    }
}

impl Invalidations {
    fn new(by_source: &IntCounterVec, by_scope: &IntCounterVec) -> Self {
        let source = |label: &str| by_source.with_label_values(&[label]);
        let scope = |label: &str| by_scope.with_label_values(&[label]);
        Self {
            rows: scope("row"),
            whole_tables: scope("whole_table"),
            tables: scope("table"),
            write: source("write"),
            replication: source("replication"),
            admin: source("admin"),
            notify: source("notify"),
            verify: source("verify"),
            peer: source("peer"),
            resync: source("resync"),
        }
    }
}

impl VerifyMetrics {
    fn new(by_result: &IntCounterVec) -> Self {
        let result = |label: &str| by_result.with_label_values(&[label]);
        Self {
            matched: result("match"),
            mismatch: result("mismatch"),
            ttl_expected: result("ttl_expected"),
            changed: result("changed"),
            skipped: result("skipped"),
        }
    }
}

/// Counts a session's client and backend connections while it lives.
pub struct SessionGauge(IntGauge, IntGauge);

impl SessionGauge {
    pub fn new(metrics: &Metrics) -> Self {
        metrics.client_connections.inc();
        metrics.backend_connections.inc();
        let gauges = (&metrics.client_connections, &metrics.backend_connections);
        Self(gauges.0.clone(), gauges.1.clone())
    }
}

impl Drop for SessionGauge {
    fn drop(&mut self) {
        self.0.dec();
        self.1.dec();
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let f = Families::new(&r);
        let by = |family: &IntCounterVec, label: &str| family.with_label_values(&[label]);
        let invalidation = |source: &str| by(&f.invalidations, source);
        Self {
            hits: by(&f.lookups, "hit"),
            misses: by(&f.lookups, "miss"),
            bypasses: by(&f.lookups, "bypass"),
            tiers: Tiers::new(&r, latency_buckets()),
            disk: DiskMetrics::new(&r),
            bypass_reasons: BypassReason::ALL
                .iter()
                .map(|reason| by(&f.bypasses, reason.label()))
                .collect(),
            latency_hit: f.latency.with_label_values(&["hit"]),
            latency_miss: f.latency.with_label_values(&["miss"]),
            evictions: Evictions::new(&f.evictions, invalidation("ttl")),
            invalidations: Invalidations::new(&f.invalidations, &f.invalidation_scopes),
            client_bytes_in: by(&f.client_bytes, "in"),
            client_bytes_out: by(&f.client_bytes, "out"),
            auth_failures: AuthFailures {
                client: by(&f.auth_failures, "client"),
                backend: by(&f.auth_failures, "backend"),
                relay: by(&f.auth_failures, "relay"),
            },
            stores: r.counter("pgcache_cache_stores_total", "Results stored in the local tier"),
            hint_problems: r.counter(
                "pgcache_hint_problems_total",
                "Malformed or unknown cache hints (each reported to its client once per statement text)",
            ),
            coalesced: r.counter(
                "pgcache_cache_coalesced_total",
                "Misses that waited for a concurrent miss of the same key instead of querying PostgreSQL",
            ),
            refreshes: r.counter(
                "pgcache_cache_refreshes_total",
                "Entries refreshed in the background while still being served",
            ),
            settings_queries: r.counter(
                "pgcache_settings_queries_total",
                "Settings queries pgcache ran on clients' connections (a session's first cacheable \
                 read, and after a settings change; none on a reused connection's first read)",
            ),
            settings_reused: r.counter("pgcache_settings_reused_total", SETTINGS_REUSED),
            verify: VerifyMetrics::new(&f.verify),
            shadow_match: by(&f.shadow, "match"),
            shadow_mismatch: by(&f.shadow, "mismatch"),
            shadow_saved: r.float_counter(
                "pgcache_shadow_saved_seconds_total",
                "Shadow mode: PostgreSQL's time on the would-be hits, which serving them would have saved",
            ),
            client_connections: r.gauge("pgcache_client_connections", "Client connections open"),
            backend_connections: r.gauge(
                "pgcache_backend_connections",
                "Connections to PostgreSQL serving client sessions",
            ),
            database_lookups: r.counter_vec(
                "pgcache_database_lookups_total",
                "Cache lookups per database, by result (hit, miss, bypass)",
                &["database", "result"],
            ),
            shared_breaker_open: r.gauge(
                "pgcache_shared_breaker_open",
                "1 while the circuit breaker keeps pgcache from trying Redis",
            ),
            replication: ReplicationGauges::new(&r),
            local_entries: r.gauge("pgcache_cache_entries", "Entries in the local tier"),
            local_bytes: r.gauge(
                "pgcache_cache_bytes",
                "Bytes charged to the local tier (entries and bookkeeping)",
            ),
            shared: SharedMetrics::new(&r),
            pool: PoolMetrics::new(&r),
            pooled: TransactionPoolMetrics::new(&r),
            replicas: ReplicaFamilies::new(&r),
            registry,
        }
    }

    /// A request that could not use the cache.
    pub fn bypassed(&self, reason: BypassReason) {
        self.bypasses.inc();
        self.bypass_reasons[reason as usize].inc();
    }

    /// Bypasses counted for `reason`.
    pub fn bypasses(&self, reason: BypassReason) -> u64 {
        self.bypass_reasons[reason as usize].get()
    }

    /// Why statements did not use the cache: each reason counted so far,
    /// the most frequent first (the answer to "why is nothing cached?").
    pub fn bypass_breakdown(&self) -> Vec<(&'static str, u64)> {
        let mut counted: Vec<(&'static str, u64)> = BypassReason::ALL
            .iter()
            .map(|r| (r.label(), self.bypasses(*r)))
            .filter(|(_, n)| *n > 0)
            .collect();
        counted.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        counted
    }

    /// The mean time a hit and a miss took to answer, in milliseconds
    /// (`None` before the first).
    pub fn mean_latency_ms(&self) -> (Option<f64>, Option<f64>) {
        let mean = |h: &Histogram| {
            let n = h.get_sample_count();
            (n > 0).then(|| h.get_sample_sum() * 1e3 / n as f64)
        };
        (mean(&self.latency_hit), mean(&self.latency_miss))
    }

    /// The handles of one database's lookups (resolve once, keep them).
    pub fn database(&self, name: &str) -> DbMetrics {
        DbMetrics {
            hit: self.database_lookups.with_label_values(&[name, "hit"]),
            miss: self.database_lookups.with_label_values(&[name, "miss"]),
            bypass: self.database_lookups.with_label_values(&[name, "bypass"]),
        }
    }

    /// The text exposition format of the registry and of `extra`
    /// families (computed at scrape time); families without samples are
    /// left out, since the encoder refuses them.
    pub fn encode(&self, extra: Vec<MetricFamily>) -> String {
        let mut families = self.registry.gather();
        families.extend(extra.into_iter().filter(|f| !f.get_metric().is_empty()));
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("encoding metrics into memory cannot fail");
        String::from_utf8(out).unwrap_or_default()
    }
}

pub fn labelled(labels: &[(&str, &str)]) -> Metric {
    Metric::from_label(
        labels
            .iter()
            .map(|(k, v)| {
                let mut pair = LabelPair::default();
                pair.set_name((*k).to_owned());
                pair.set_value((*v).to_owned());
                pair
            })
            .collect(),
    )
}

pub fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_owned());
    f.set_help(help.to_owned());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}

pub fn counter(labels: &[(&str, &str)], value: u64) -> Metric {
    let mut m = labelled(labels);
    let mut c = prometheus::proto::Counter::default();
    c.set_value(value as f64);
    m.set_counter(c);
    m
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
