//! The HTTP endpoint on `metrics.listen`: `/metrics`, `/healthz`,
//! `/readyz`, and for users without Grafana a live page at `/` that
//! refreshes itself from `/stats.json` (self-contained: no CDN, no external
//! file).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use prometheus::proto::MetricFamily;
use prometheus::proto::MetricType;
use tokio::net::TcpListener;

use crate::cache::Unfresh;
use tracing::{debug, warn};

use crate::App;
use crate::metrics::{counter, family, labelled};

/// Statements and tables exported with their own labels: the busiest ones.
const TOP_STATEMENTS: usize = 50;
const TOP_TABLES: usize = 50;

/// The text exposition format, with gauges brought up to date.
fn render(app: &App) -> String {
    let m = &app.metrics;
    for (name, db) in app.cache.databases.all() {
        let labels = [name.as_str()];
        m.replication
            .up
            .with_label_values(&labels)
            .set(i64::from(db.stream.is_current()));
        m.replication
            .lag_seconds
            .with_label_values(&labels)
            .set(db.stream.lag().as_secs_f64());
        m.replication
            .lag_bytes
            .with_label_values(&labels)
            .set(db.stream.lag_bytes() as i64);
        m.replication
            .restarts
            .with_label_values(&labels)
            .set(db.stream.starts() as i64);
        let (ddl_transactions, ddl_rounds) = db.stream.ddl();
        m.replication
            .ddl_transactions
            .with_label_values(&labels)
            .set(ddl_transactions as i64);
        m.replication
            .ddl_rounds
            .with_label_values(&labels)
            .set(ddl_rounds as i64);
        m.replication
            .unpublished_tables
            .with_label_values(&labels)
            .set(db.stream.unpublished() as i64);
        m.replication
            .heartbeats
            .with_label_values(&labels)
            .set(db.stream.demand.beats() as i64);
        m.replication
            .slot_kept
            .with_label_values(&labels)
            .set(db.stream.slot_kept().unwrap_or(-1));
        let resting = db.stream.freshness() == Err(Unfresh::Resting);
        m.replication
            .resting
            .with_label_values(&labels)
            .set(i64::from(resting));
    }
    m.local_entries.set(app.cache.local.entry_count() as i64);
    if let Some(shared) = app.cache.shared() {
        m.shared.up.set(i64::from(shared.is_up()));
        m.shared_breaker_open.set(i64::from(shared.breaker_open()));
    }
    m.local_bytes.set(app.cache.local.weighted_bytes() as i64);
    let mut extra = top_statements(app);
    extra.push(top_tables(app));
    m.encode(extra)
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
    for (name, db) in app.cache.databases.all() {
        all.extend(db.versions.tables().into_iter().map(|f| (name.clone(), f)));
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
        .databases
        .all()
        .into_iter()
        .map(|(name, db)| {
            serde_json::json!({
                "name": name,
                "state": app.cache.stream_state(&db),
                "lag_ms": db.stream.lag().as_millis() as u64,
                "lag_bytes": db.stream.lag_bytes(),
            })
        })
        .collect();
    let statements = statements_json(app);
    let (mean_hit_ms, mean_miss_ms) = m.mean_latency_ms();
    let bypass_reasons: Vec<serde_json::Value> = m
        .bypass_breakdown()
        .into_iter()
        .map(|(reason, count)| serde_json::json!({ "reason": reason, "count": count }))
        .collect();
    serde_json::json!({
        "time_ms": crate::cache::unix_ms(),
        "lookups": { "hit": hits, "miss": misses, "bypass": m.bypasses.get() },
        "latency_ms": { "hit": mean_hit_ms, "miss": mean_miss_ms },
        "bypass_reasons": bypass_reasons,
        "hit_ratio": if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
        "local": {
            "hits": m.tiers.local.hits.get(),
            "entries": app.cache.local.entry_count(),
            "bytes": app.cache.local.weighted_bytes(),
        },
        "shared": {
            "configured": app.cache.shared().is_some(),
            "up": app.cache.shared().is_some_and(|t| t.is_up()),
            "hits": m.tiers.shared.hits.get(),
        },
        "disk": {
            "configured": app.cache.disk().is_some(),
            "up": app.cache.disk().is_some_and(|t| t.is_up()),
            "hits": m.tiers.disk.hits.get(),
            "bytes": m.disk.bytes.get(),
            "capacity": m.disk.capacity.get(),
        },
        "shadow": {
            "on": app.policy().mode == crate::config::CacheMode::Shadow,
            "match": m.shadow_match.get(),
            "mismatch": m.shadow_mismatch.get(),
            "saved_ms": m.shadow_saved.get() * 1e3,
        },
        "verify": {
            "match": m.verify.matched.get(),
            "mismatch": m.verify.mismatch.get(),
            "ttl_expected": m.verify.ttl_expected.get(),
            "changed": m.verify.changed.get(),
            "skipped": m.verify.skipped.get(),
        },
        "pool": pool_json(app),
        "replicas": replicas_json(app),
        "databases": databases,
        "statements": statements,
    })
}

/// The 20 statements with the most calls, with their advice.
fn statements_json(app: &App) -> Vec<serde_json::Value> {
    app.cache
        .stats
        .top(20)
        .into_iter()
        .map(|q| {
            let advice = crate::cache::advice::advise(&q, app.policy().mode);
            let lookups = q.hits + q.misses;
            serde_json::json!({
                "query_id": format!("{:016x}", q.id),
                "query": q.text,
                "calls": q.calls,
                "hits": q.hits,
                "misses": q.misses,
                "hit_ratio": if lookups == 0 { 0.0 } else { q.hits as f64 / lookups as f64 },
                "would_hits": q.would_hits,
                "would_save_ms": q.would_save_ms,
                "shadow_mismatches": q.mismatches,
                "verify_mismatches": q.verify_mismatches,
                "backend_ms": q.backend_ms,
                "invalidations": q.invalidations,
                "suspensions": q.suspensions,
                "not_admitted": q.not_admitted,
                "advice": advice.action,
                "why": advice.why,
                "hint": advice.hint,
            })
        })
        .collect()
}

/// Each read replica: in rotation or why not, its lag, the reads it took.
fn replicas_json(app: &App) -> Vec<serde_json::Value> {
    app.replicas
        .servers
        .iter()
        .map(|r| {
            let health = r.health();
            serde_json::json!({
                "server": r.name,
                "state": health.out.map_or_else(|| "in rotation".to_owned(), |why| format!("out: {why}")),
                "lag_ms": health.lag.as_millis() as u64,
                "lag_bytes": health.lag_bytes,
                "routed": r.metrics.routed.get(),
                "fills_refused": r.metrics.refused_fills.get(),
                "retries": r.metrics.retries.get(),
                "connections": r.connections.all().len(),
            })
        })
        .collect()
}

/// Client sessions and transaction-mode server connections.
fn pool_json(app: &App) -> serde_json::Value {
    use crate::pool::clients::Activity;
    let clients = app.clients.all();
    let count = |a: Activity| clients.iter().filter(|c| c.state() == a).count();
    let m = &app.metrics.pooled;
    serde_json::json!({
        "mode": match app.config().pool.mode {
            crate::config::PoolMode::Session => "session",
            crate::config::PoolMode::Transaction => "transaction",
        },
        "clients": { "active": count(Activity::Active), "waiting": count(Activity::Waiting), "idle": count(Activity::Idle) },
        "servers": { "active": m.active.get(), "idle": m.idle.get(), "open": m.open.get() },
        "checkouts": m.checkouts.get(),
        "wait_timeouts": m.wait_timeouts.get(),
        "pins": clients.iter().filter(|c| !c.pinned().is_empty()).count(),
    })
}

async fn text_route(app: &App, path: &str) -> (StatusCode, String) {
    match path {
        "/metrics" => (StatusCode::OK, render(app)),
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

/// Why the instance is not ready.
#[derive(Debug, thiserror::Error)]
enum NotReady {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("replication stream of {0:?} is not up")]
    Stream(String),
    #[error("replication stream of {0:?} is stale: no heartbeat back for {1:?}")]
    Stale(String, Duration),
}

/// Ready: PostgreSQL accepts connections and, with replication on, every
/// database pgcache holds has its stream up within its staleness lease (a
/// database pgcache let go of has no stream until a client uses it again).
async fn readiness(app: &App) -> Result<(), NotReady> {
    crate::backend::reachable(&app.upstream, Duration::from_secs(1)).await?;
    if app.cache.replication_on() {
        for (name, db) in app.cache.databases.all() {
            if !db.stream.is_claimed() {
                continue;
            }
            match db.stream.freshness() {
                // Resting: current as soon as a lookup needs it.
                Ok(()) | Err(Unfresh::Resting) => {}
                Err(Unfresh::Down) => return Err(NotReady::Stream(name)),
                Err(Unfresh::Stale) => return Err(NotReady::Stale(name, db.stream.lag())),
            }
        }
    }
    Ok(())
}
