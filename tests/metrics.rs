//! The Prometheus endpoint: exact counts, replication lag, health and readiness.

mod common;

use common::*;

/// GET `path` on pgcache's metrics port; returns (status, body).
async fn get(proxy: &Proxy, path: &str) -> (u16, String) {
    proxy.http_get(path).await
}

/// The value of one sample line, by its full name and labels.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn metrics_report_the_exact_lookups_of_a_known_workload() {
    let db = pg().create_db("metrics");
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY); INSERT INTO t VALUES (1)",
    );
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    for _ in 0..3 {
        client.simple_query("SELECT id FROM t").await.unwrap();
    }
    client.simple_query("SELECT now()").await.unwrap();
    let (status, body) = get(&proxy, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(
        sample(&body, r#"pgcache_cache_lookups_total{result="miss"}"#),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, r#"pgcache_cache_lookups_total{result="hit"}"#),
        Some(2.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, r#"pgcache_cache_lookups_total{result="bypass"}"#),
        Some(1.0),
        "{body}"
    );
    assert_eq!(sample(&body, "pgcache_cache_stores_total"), Some(1.0));
    assert_eq!(sample(&body, "pgcache_client_connections"), Some(1.0));
    assert!(sample(&body, "pgcache_cache_entries").unwrap() >= 1.0);
    let labels = format!(r#"{{database="{db}"}}"#);
    assert_eq!(
        sample(&body, &format!("pgcache_replication_up{labels}")),
        Some(1.0),
        "{body}"
    );
    assert!(
        sample(&body, &format!("pgcache_replication_lag_seconds{labels}")).is_some(),
        "{body}"
    );
    assert!(
        sample(&body, &format!("pgcache_replication_lag_bytes{labels}")).is_some(),
        "{body}"
    );
    let exact = |series: &str, want: f64| {
        assert_eq!(sample(&body, series), Some(want), "{series}\n{body}");
    };
    exact(r#"pgcache_cache_hits_total{tier="local"}"#, 2.0);
    exact(r#"pgcache_cache_hits_total{tier="shared"}"#, 0.0);
    exact(
        r#"pgcache_cache_bypasses_total{reason="volatile_function"}"#,
        1.0,
    );
    exact(r#"pgcache_cache_bypasses_total{reason="not_select"}"#, 0.0);
    exact(
        &format!(r#"pgcache_database_lookups_total{{database="{db}",result="hit"}}"#),
        2.0,
    );
    exact(
        &format!(r#"pgcache_database_lookups_total{{database="{db}",result="miss"}}"#),
        1.0,
    );
    exact(
        &format!(r#"pgcache_database_lookups_total{{database="{db}",result="bypass"}}"#),
        1.0,
    );
    exact(
        r#"pgcache_request_duration_seconds_count{outcome="hit"}"#,
        2.0,
    );
    exact(
        r#"pgcache_request_duration_seconds_count{outcome="miss"}"#,
        1.0,
    );
    exact("pgcache_backend_connections", 1.0);
    assert!(sample(&body, r#"pgcache_client_bytes_total{direction="in"}"#).unwrap() > 0.0);
    assert!(sample(&body, r#"pgcache_client_bytes_total{direction="out"}"#).unwrap() > 0.0);
    // The statement, by its query_id, and the id's text.
    let info = body
        .lines()
        .find(|l| {
            l.starts_with("pgcache_statement_info{") && l.contains(r#"query="SELECT id FROM t""#)
        })
        .unwrap_or_else(|| panic!("statement info: {body}"));
    let id = info
        .split("query_id=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    exact(
        &format!(r#"pgcache_statement_calls_total{{query_id="{id}"}}"#),
        3.0,
    );
    exact(
        &format!(r#"pgcache_statement_hits_total{{query_id="{id}"}}"#),
        2.0,
    );
    exact(
        &format!(r#"pgcache_statement_misses_total{{query_id="{id}"}}"#),
        1.0,
    );

    // A write through pgcache: one invalidation from a write.
    client
        .simple_query("INSERT INTO t VALUES (2)")
        .await
        .unwrap();
    let (_, body) = get(&proxy, "/metrics").await;
    assert_eq!(
        sample(&body, r#"pgcache_invalidations_total{source="write"}"#),
        Some(1.0),
        "{body}"
    );
    assert!(
        body.lines().any(|l| l.starts_with(&format!(
            r#"pgcache_table_invalidations_total{{database="{db}",table="t"}}"#
        ))),
        "{body}"
    );
}

#[tokio::test]
async fn health_and_readiness() {
    let proxy = Proxy::start(pg().proxy_config()).await;
    // A fresh instance, before any client: no statements, no tables yet.
    let (status, body) = get(&proxy, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("pgcache_cache_lookups_total"), "{body}");
    assert_eq!(get(&proxy, "/healthz").await.0, 200);
    assert_eq!(get(&proxy, "/readyz").await.0, 200);
    assert_eq!(get(&proxy, "/nope").await.0, 404);
    let mut config = pg().proxy_config();
    let (_reserved, port) = refused_port();
    config.upstream.url = format!("postgres://postgres@127.0.0.1:{port}");
    let down = Proxy::start(config).await;
    let (status, body) = get(&down, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("could not connect"), "{body}");
    assert_eq!(get(&down, "/healthz").await.0, 200);
}

/// Every metric the Grafana dashboard queries exists in a live `/metrics`
/// (those of read replicas: in tests/replicas.rs).
#[tokio::test]
async fn every_metric_in_the_dashboard_exists() {
    let db = pg().create_db("dashboard");
    pg().psql_db(&db, "CREATE TABLE t(id int PRIMARY KEY)");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    client.simple_query("SELECT id FROM t").await.unwrap();
    let (_, body) = get(&proxy, "/metrics").await;
    let (missing, checked) = dashboard_metrics_missing(&body);
    // Without replicas their families have no series (tests/replicas.rs
    // checks them against a standby).
    let missing: Vec<_> = missing.iter().filter(|m| !is_replica_metric(m)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses {missing:?}, which /metrics lacks"
    );
    assert!(checked >= 8, "only {checked} metric references found");
}

/// docker-compose.yml only names files and ports that exist in the repo.
#[test]
fn docker_compose_refers_only_to_what_the_repository_has() {
    let compose = std::fs::read_to_string("docker-compose.yml").unwrap();
    for service in ["postgres:", "redis:", "pgcache:", "prometheus:", "grafana:"] {
        assert!(
            compose.contains(&format!("\n  {service}")),
            "service {service} missing"
        );
    }
    let mut mounts = 0;
    for line in compose.lines() {
        let line = line.trim().trim_start_matches("- ");
        if let Some(path) = line.strip_prefix("./") {
            let path = path.split(':').next().unwrap();
            assert!(
                std::path::Path::new(path).exists(),
                "docker-compose.yml mounts missing ./{path}"
            );
            mounts += 1;
        }
    }
    assert!(mounts >= 3);
    assert!(compose.contains("build: .") && std::path::Path::new("Dockerfile").exists());
    assert!(compose.contains("wal_level=logical"));
    assert!(compose.contains("\"6432:6432\"") && compose.contains("9187:9187"));
    let prometheus = std::fs::read_to_string("config/prometheus.yml").unwrap();
    assert!(
        prometheus.contains("pgcache:9187"),
        "Prometheus scrapes pgcache's metrics port"
    );
}
