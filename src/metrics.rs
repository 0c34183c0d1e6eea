//! Prometheus metrics and the HTTP endpoint that serves them on
//! `metrics.listen`: `/metrics`, `/healthz`, `/readyz`, and for users
//! without Grafana a live page at `/` that refreshes itself from
//! `/stats.json` (self-contained: no CDN, no external file).
//!
//! Counters on the hot path are label handles resolved once at start-up, so
//! recording one is a single atomic add. Per-database replication gauges are
//! filled in when Prometheus scrapes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::App;
use crate::classify::BypassReason;

/// Statements and tables exported with their own labels: the busiest ones.
const TOP_STATEMENTS: usize = 50;
const TOP_TABLES: usize = 50;

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
    pub client_connections: IntGauge,
    pub backend_connections: IntGauge,
    /// Hits by tier.
    pub hits_local: IntCounter,
    pub hits_shared: IntCounter,
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
    shared_breaker_open: IntGauge,
    replication_up: IntGaugeVec,
    replication_lag_seconds: GaugeVec,
    replication_lag_bytes: IntGaugeVec,
    replication_restarts: IntGaugeVec,
    unpublished_tables: IntGaugeVec,
    local_entries: IntGauge,
    local_bytes: IntGauge,
    pub shared: SharedMetrics,
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
    pub peer: IntCounter,
    pub resync: IntCounter,
}

/// One database's lookups, resolved once per database.
#[derive(Clone)]
pub struct DbMetrics {
    pub hit: IntCounter,
    pub miss: IntCounter,
    pub bypass: IntCounter,
}

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
    fn new(registry: &Registry) -> Self {
        let counter_vec = |name: &str, help: &str, label: &str| {
            register(
                registry,
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric"),
            )
        };
        let counter = |name: &str, help: &str| {
            register(registry, IntCounter::new(name, help).expect("valid metric"))
        };
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
            up: register(
                registry,
                IntGauge::new(
                    "pgcache_shared_up",
                    "1 while the shared tier is in use: subscribed, in sync, breaker closed",
                )
                .expect("valid metric"),
            ),
        }
    }
}

/// `pgcache_auth_failures_total`, one handle per stage.
#[derive(Clone)]
pub struct AuthFailures {
    pub client: IntCounter,
    pub backend: IntCounter,
    pub relay: IntCounter,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: T) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let lookups = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "pgcache_cache_lookups_total",
                    "Cache lookups by result (hit, miss, bypass)",
                ),
                &["result"],
            )
            .expect("valid metric"),
        );
        let stores = register(
            &registry,
            IntCounter::new(
                "pgcache_cache_stores_total",
                "Results stored in the local tier",
            )
            .expect("valid metric"),
        );
        let auth_failures = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "pgcache_auth_failures_total",
                    "Logins that failed in pgcache: a wrong password or unknown user (client), \
                     a login to PostgreSQL for an authenticated client (backend), SCRAM that \
                     cannot be relayed across two TLS legs (relay)",
                ),
                &["stage"],
            )
            .expect("valid metric"),
        );
        let hint_problems = register(
            &registry,
            IntCounter::new(
                "pgcache_hint_problems_total",
                "Malformed or unknown cache hints (each reported to its client once per statement text)",
            )
            .expect("valid metric"),
        );
        let coalesced = register(
            &registry,
            IntCounter::new(
                "pgcache_cache_coalesced_total",
                "Misses that waited for a concurrent miss of the same key instead of querying PostgreSQL",
            )
            .expect("valid metric"),
        );
        let refreshes = register(
            &registry,
            IntCounter::new(
                "pgcache_cache_refreshes_total",
                "Entries refreshed in the background while still being served",
            )
            .expect("valid metric"),
        );
        let client_connections = register(
            &registry,
            IntGauge::new("pgcache_client_connections", "Client connections open")
                .expect("valid metric"),
        );
        let db = |name: &str, help: &str| Opts::new(name, help);
        let counter_vec = |name: &str, help: &str, label: &str| {
            register(
                &registry,
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric"),
            )
        };
        let hits_by_tier = counter_vec(
            "pgcache_cache_hits_total",
            "Requests answered from the cache, by tier",
            "tier",
        );
        let bypasses = counter_vec(
            "pgcache_cache_bypasses_total",
            "Requests that could not use the cache, by reason",
            "reason",
        );
        let evictions = counter_vec(
            "pgcache_cache_evictions_total",
            "Local-tier entries removed, by cause (size, expired, replaced, explicit)",
            "cause",
        );
        let invalidations = counter_vec(
            "pgcache_invalidations_total",
            "Invalidations applied, by source (write, replication, admin, peer, resync, ttl)",
            "source",
        );
        let client_bytes = counter_vec(
            "pgcache_client_bytes_total",
            "Bytes received from and sent to clients",
            "direction",
        );
        let latency = register(
            &registry,
            HistogramVec::new(
                HistogramOpts::new(
                    "pgcache_request_duration_seconds",
                    "Time to answer a cacheable request: from the cache (hit) or PostgreSQL (miss)",
                )
                .buckets(
                    prometheus::exponential_buckets(0.000_025, 2.5, 12).expect("valid buckets"),
                ),
                &["outcome"],
            )
            .expect("valid metric"),
        );
        Self {
            hits_local: hits_by_tier.with_label_values(&["local"]),
            hits_shared: hits_by_tier.with_label_values(&["shared"]),
            bypass_reasons: BypassReason::ALL
                .iter()
                .map(|r| bypasses.with_label_values(&[r.label()]))
                .collect(),
            latency_hit: latency.with_label_values(&["hit"]),
            latency_miss: latency.with_label_values(&["miss"]),
            evictions: Evictions {
                size: evictions.with_label_values(&["size"]),
                expired: evictions.with_label_values(&["expired"]),
                ttl: invalidations.with_label_values(&["ttl"]),
                replaced: evictions.with_label_values(&["replaced"]),
                explicit: evictions.with_label_values(&["explicit"]),
            },
            invalidations: Invalidations {
                write: invalidations.with_label_values(&["write"]),
                replication: invalidations.with_label_values(&["replication"]),
                admin: invalidations.with_label_values(&["admin"]),
                peer: invalidations.with_label_values(&["peer"]),
                resync: invalidations.with_label_values(&["resync"]),
            },
            client_bytes_in: client_bytes.with_label_values(&["in"]),
            client_bytes_out: client_bytes.with_label_values(&["out"]),
            database_lookups: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "pgcache_database_lookups_total",
                        "Cache lookups per database, by result (hit, miss, bypass)",
                    ),
                    &["database", "result"],
                )
                .expect("valid metric"),
            ),
            backend_connections: register(
                &registry,
                IntGauge::new(
                    "pgcache_backend_connections",
                    "Connections to PostgreSQL serving client sessions",
                )
                .expect("valid metric"),
            ),
            shared_breaker_open: register(
                &registry,
                IntGauge::new(
                    "pgcache_shared_breaker_open",
                    "1 while the circuit breaker keeps pgcache from trying Redis",
                )
                .expect("valid metric"),
            ),
            hits: lookups.with_label_values(&["hit"]),
            misses: lookups.with_label_values(&["miss"]),
            bypasses: lookups.with_label_values(&["bypass"]),
            stores,
            hint_problems,
            coalesced,
            auth_failures: AuthFailures {
                client: auth_failures.with_label_values(&["client"]),
                backend: auth_failures.with_label_values(&["backend"]),
                relay: auth_failures.with_label_values(&["relay"]),
            },
            refreshes,
            client_connections,
            replication_up: register(
                &registry,
                IntGaugeVec::new(
                    db(
                        "pgcache_replication_up",
                        "1 while the database's replication stream is up and current",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            replication_lag_seconds: register(
                &registry,
                GaugeVec::new(
                    db(
                        "pgcache_replication_lag_seconds",
                        "Delay between a transaction's commit and its receipt by pgcache",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            replication_lag_bytes: register(
                &registry,
                IntGaugeVec::new(
                    db(
                        "pgcache_replication_lag_bytes",
                        "WAL the server has sent or announced beyond what pgcache has applied",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            replication_restarts: register(
                &registry,
                IntGaugeVec::new(
                    db(
                        "pgcache_replication_stream_starts",
                        "Times the database's stream (re)started",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            unpublished_tables: register(
                &registry,
                IntGaugeVec::new(
                    db(
                        "pgcache_unpublished_tables",
                        "Tables without a replica identity: never published, never cached",
                    ),
                    &["database"],
                )
                .expect("valid metric"),
            ),
            local_entries: register(
                &registry,
                IntGauge::new("pgcache_cache_entries", "Entries in the local tier")
                    .expect("valid metric"),
            ),
            local_bytes: register(
                &registry,
                IntGauge::new(
                    "pgcache_cache_bytes",
                    "Bytes charged to the local tier (entries and bookkeeping)",
                )
                .expect("valid metric"),
            ),
            shared: SharedMetrics::new(&registry),
            registry,
        }
    }

    /// A request that could not use the cache.
    pub fn bypassed(&self, reason: BypassReason) {
        self.bypasses.inc();
        self.bypass_reasons[reason as usize].inc();
    }

    /// The handles of one database's lookups (resolve once, keep them).
    pub fn database(&self, name: &str) -> DbMetrics {
        DbMetrics {
            hit: self.database_lookups.with_label_values(&[name, "hit"]),
            miss: self.database_lookups.with_label_values(&[name, "miss"]),
            bypass: self.database_lookups.with_label_values(&[name, "bypass"]),
        }
    }

    /// The text exposition format, with gauges brought up to date.
    pub fn render(&self, app: &App) -> String {
        for (name, db) in app.cache.databases() {
            let labels = [name.as_str()];
            self.replication_up
                .with_label_values(&labels)
                .set(i64::from(db.is_current()));
            self.replication_lag_seconds
                .with_label_values(&labels)
                .set(db.lag_ms() as f64 / 1000.0);
            self.replication_lag_bytes
                .with_label_values(&labels)
                .set(db.lag_bytes() as i64);
            self.replication_restarts
                .with_label_values(&labels)
                .set(db.stream_starts() as i64);
            self.unpublished_tables
                .with_label_values(&labels)
                .set(db.unpublished() as i64);
        }
        self.local_entries.set(app.cache.local.entry_count() as i64);
        if let Some(shared) = &app.shared {
            self.shared.up.set(i64::from(shared.is_up()));
            self.shared_breaker_open
                .set(i64::from(shared.breaker_open()));
        }
        self.local_bytes
            .set(app.cache.local.weighted_bytes() as i64);
        let mut families = self.registry.gather();
        // The encoder refuses a family without samples (a fresh instance).
        families.extend(
            top_statements(app)
                .into_iter()
                .chain([top_tables(app)])
                .filter(|f| !f.get_metric().is_empty()),
        );
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("encoding metrics into memory cannot fail");
        String::from_utf8(out).unwrap_or_default()
    }
}

fn labelled(labels: &[(&str, &str)]) -> Metric {
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

fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_owned());
    f.set_help(help.to_owned());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}

fn counter(labels: &[(&str, &str)], value: u64) -> Metric {
    let mut m = labelled(labels);
    let mut c = prometheus::proto::Counter::default();
    c.set_value(value as f64);
    m.set_counter(c);
    m
}

/// Per-statement counters for the busiest statements, labelled by
/// `query_id`; `pgcache_statement_info` maps an id to its normalised text.
fn top_statements(app: &App) -> Vec<MetricFamily> {
    let top = app.cache.stats.top(TOP_STATEMENTS);
    let (mut calls, mut hits, mut misses, mut info) = (vec![], vec![], vec![], vec![]);
    for q in &top {
        let id = format!("{:016x}", q.id);
        let l = [("query_id", id.as_str())];
        calls.push(counter(&l, q.calls));
        hits.push(counter(&l, q.hits));
        misses.push(counter(&l, q.misses));
        let text: String = q.text.chars().take(200).collect();
        let mut m = labelled(&[("query_id", id.as_str()), ("query", text.as_str())]);
        let mut g = prometheus::proto::Gauge::default();
        g.set_value(1.0);
        m.set_gauge(g);
        info.push(m);
    }
    vec![
        family(
            "pgcache_statement_calls_total",
            "Calls of the busiest statements, by normalised text's query_id",
            MetricType::COUNTER,
            calls,
        ),
        family(
            "pgcache_statement_hits_total",
            "Cache hits of the busiest statements",
            MetricType::COUNTER,
            hits,
        ),
        family(
            "pgcache_statement_misses_total",
            "Cache misses of the busiest statements",
            MetricType::COUNTER,
            misses,
        ),
        family(
            "pgcache_statement_info",
            "Maps query_id to the statement's normalised text (first 200 characters)",
            MetricType::GAUGE,
            info,
        ),
    ]
}

/// Invalidations of the most often invalidated tables.
fn top_tables(app: &App) -> MetricFamily {
    let mut all: Vec<(String, std::sync::Arc<crate::cache::Family>)> = Vec::new();
    for (name, db) in app.cache.databases() {
        all.extend(db.families().into_iter().map(|f| (name.clone(), f)));
    }
    all.sort_by_key(|(_, f)| std::cmp::Reverse(f.version.changes()));
    all.truncate(TOP_TABLES);
    let metrics = all
        .iter()
        .map(|(db, f)| counter(&[("database", db), ("table", &f.name)], f.version.changes()))
        .collect();
    family(
        "pgcache_table_invalidations_total",
        "Invalidations of the most often invalidated tables",
        MetricType::COUNTER,
        metrics,
    )
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves the endpoint until shutdown.
pub async fn serve(app: Arc<App>, listener: TcpListener) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = app.drain.cancelled() => return,
        };
        let app = Arc::clone(&app);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let app = Arc::clone(&app);
                async move { Ok::<_, Infallible>(route(&app, req).await) }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                debug!(error = %e, "metrics connection ended");
            }
        });
    }
}

/// The live page, compiled in.
const LIVE_PAGE: &str = include_str!("live.html");

async fn route(app: &App, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body, kind) = match req.uri().path() {
        "/" => (
            StatusCode::OK,
            LIVE_PAGE.to_owned(),
            "text/html; charset=utf-8",
        ),
        "/stats.json" => (
            StatusCode::OK,
            stats_json(app).to_string(),
            "application/json",
        ),
        path => {
            let (status, body) = text_route(app, path).await;
            (status, body, "text/plain; version=0.0.4; charset=utf-8")
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(kind),
    );
    response
}

/// What the live page shows, as JSON.
pub fn stats_json(app: &App) -> serde_json::Value {
    let m = &app.metrics;
    let (hits, misses) = (m.hits.get(), m.misses.get());
    let databases: Vec<serde_json::Value> = app
        .cache
        .databases()
        .into_iter()
        .map(|(name, db)| {
            serde_json::json!({
                "name": name,
                "state": app.stream_state(&db),
                "lag_ms": db.lag_ms(),
                "lag_bytes": db.lag_bytes(),
            })
        })
        .collect();
    let statements: Vec<serde_json::Value> = app
        .cache
        .stats
        .top(20)
        .into_iter()
        .map(|q| {
            let lookups = q.hits + q.misses;
            serde_json::json!({
                "query_id": format!("{:016x}", q.id),
                "query": q.text,
                "calls": q.calls,
                "hits": q.hits,
                "misses": q.misses,
                "hit_ratio": if lookups == 0 { 0.0 } else { q.hits as f64 / lookups as f64 },
            })
        })
        .collect();
    serde_json::json!({
        "time_ms": crate::cache::unix_ms(),
        "lookups": { "hit": hits, "miss": misses, "bypass": m.bypasses.get() },
        "hit_ratio": if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
        "local": {
            "hits": m.hits_local.get(),
            "entries": app.cache.local.entry_count(),
            "bytes": app.cache.local.weighted_bytes(),
        },
        "shared": {
            "configured": app.shared.is_some(),
            "up": app.shared.as_ref().is_some_and(|t| t.is_up()),
            "hits": m.hits_shared.get(),
        },
        "databases": databases,
        "statements": statements,
    })
}

async fn text_route(app: &App, path: &str) -> (StatusCode, String) {
    match path {
        "/metrics" => (StatusCode::OK, app.metrics.render(app)),
        "/healthz" => (StatusCode::OK, "ok\n".to_owned()),
        "/readyz" => match readiness(app).await {
            Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
            Err(why) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {why}\n"),
            ),
        },
        _ => (StatusCode::NOT_FOUND, "not found\n".to_owned()),
    }
}

/// Ready: PostgreSQL accepts connections and, with replication on, every
/// database's stream is up.
async fn readiness(app: &App) -> Result<(), String> {
    crate::backend::reachable(&app.upstream, Duration::from_secs(1))
        .await
        .map_err(|e| e.to_string())?;
    if app.replication_on() {
        for (name, db) in app.cache.databases() {
            if !db.is_current() {
                return Err(format!("replication stream of {name:?} is not up"));
            }
        }
    }
    Ok(())
}
