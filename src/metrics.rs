//! Prometheus metrics and the HTTP endpoint that serves them (`/metrics`,
//! `/healthz`, `/readyz`), on `metrics.listen`.
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
use prometheus::{
    Encoder, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};
use tokio::net::TcpListener;
use tracing::{debug, warn};

use crate::App;

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
    /// Entries refreshed in the background while being served.
    pub refreshes: IntCounter,
    pub client_connections: IntGauge,
    replication_up: IntGaugeVec,
    replication_lag_seconds: GaugeVec,
    replication_lag_bytes: IntGaugeVec,
    replication_restarts: IntGaugeVec,
    unpublished_tables: IntGaugeVec,
    local_entries: IntGauge,
    local_bytes: IntGauge,
    pub shared: SharedMetrics,
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
        Self {
            hits: lookups.with_label_values(&["hit"]),
            misses: lookups.with_label_values(&["miss"]),
            bypasses: lookups.with_label_values(&["bypass"]),
            stores,
            hint_problems,
            coalesced,
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
        }
        self.local_bytes
            .set(app.cache.local.weighted_bytes() as i64);
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding metrics into memory cannot fail");
        String::from_utf8(out).unwrap_or_default()
    }
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

async fn route(app: &App, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body) = match req.uri().path() {
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
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// Ready: PostgreSQL accepts connections and, with replication on, every
/// database's stream is up.
async fn readiness(app: &App) -> Result<(), String> {
    crate::backend::connect(&app.upstream, Duration::from_secs(1))
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
