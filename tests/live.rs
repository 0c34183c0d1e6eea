//! pgcache seen from outside: its live page in a real headless Chromium,
//! and its metrics scraped by a real Prometheus that answers every query
//! of the Grafana dashboard.

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET `path` from `addr`; returns (status, body).
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_http_get(addr, path)
        .await
        .unwrap_or_else(|e| panic!("GET {path} from {addr}: {e}"))
}

async fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A proxy with a shared tier, after a workload that touches every metric
/// the dashboard shows: hits, misses, bypasses, a write, a shared hit.
/// pgcache in front of a primary of its own and a standby of it, after a
/// workload: hits, misses read on the standby, a write.
struct Workload {
    proxy: Proxy,
    db: String,
    _servers: (Pg, Pg),
}

async fn proxy_after_a_workload(name: &str) -> Workload {
    let primary = Pg::dedicated();
    let db = primary.create_db(name);
    primary.psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t SELECT g, g FROM generate_series(1, 10) g",
    );
    let standby = primary.standby();
    let mut config = primary.proxy_config();
    config.redis.url = redis().url();
    config.cache.shared.timeout_ms = 1000;
    config.upstream.replicas = vec![pgcache::config::ReplicaConfig::Url(format!(
        "postgres://postgres@127.0.0.1:{}",
        standby.port
    ))];
    config.replicas.healthy_polls = 1;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    let tier = proxy.app.cache.shared().cloned().unwrap();
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(20), "the shared tier", || {
        let ready = tier.usable(&state);
        async move { ready.then_some(()) }
    })
    .await;
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(Duration::from_secs(30), "the standby in rotation", || {
        let up = replica.in_rotation();
        async move { up.then_some(()) }
    })
    .await;
    // Past every change the reads depend on: its answers are stored.
    standby_caught_up(&primary, &standby).await;
    for id in [1, 1, 1, 2, 2, 3] {
        scalar(&client, &format!("SELECT v FROM t WHERE id = {id}")).await;
    }
    assert!(
        replica.metrics.routed.get() > 0,
        "misses read on the standby"
    );
    scalar(&client, "SELECT now()").await;
    client
        .batch_execute("UPDATE t SET v = 0 WHERE id = 9")
        .await
        .unwrap();
    Workload {
        proxy,
        db,
        _servers: (primary, standby),
    }
}

fn metrics_addr(proxy: &Proxy) -> SocketAddr {
    *proxy
        .app
        .metrics_addr
        .get()
        .expect("metrics endpoint bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_draws_its_chart_and_matches_the_metrics_in_chromium() {
    let Workload { proxy, .. } = &proxy_after_a_workload("live_page").await;
    let addr = metrics_addr(proxy);
    let (status, json) = http_get(addr, "/stats.json").await;
    assert_eq!(status, 200);
    let stats: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(stats["lookups"]["hit"], 3);

    let profile = tempfile::tempdir().unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--virtual-time-budget=5000",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("http://{addr}/"))
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("chromium finished")
    .expect("chromium runs: install Debian's chromium package (scripts/test.sh does)");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("<h1>pgcache"),
        "no page: {dom}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let text_of = |id: &str| -> String {
        let start = dom
            .find(&format!("id=\"{id}\">"))
            .unwrap_or_else(|| panic!("#{id} missing: {dom}"));
        let rest = &dom[start..];
        let rest = &rest[rest.find('>').unwrap() + 1..];
        rest[..rest.find('<').unwrap()].to_owned()
    };
    let (_, metrics) = http_get(addr, "/metrics").await;
    for (id, series) in [
        ("hits", r#"pgcache_cache_lookups_total{result="hit"}"#),
        ("misses", r#"pgcache_cache_lookups_total{result="miss"}"#),
        (
            "bypasses",
            r#"pgcache_cache_lookups_total{result="bypass"}"#,
        ),
        ("local-entries", "pgcache_cache_entries"),
    ] {
        let shown: f64 = text_of(id)
            .parse()
            .unwrap_or_else(|_| panic!("#{id} shows {:?}", text_of(id)));
        assert_eq!(Some(shown), sample(&metrics, series), "#{id} vs {series}");
    }
    assert_eq!(text_of("hit-ratio"), "0.500");
    assert_eq!(text_of("shared-state"), "up");
    // Hits by tier, as the metrics count them; no disk tier here.
    let tier = |t: &str| {
        sample(
            &metrics,
            &format!("pgcache_cache_hits_total{{tier=\"{t}\"}}"),
        )
    };
    let by_tier = format!(
        "{} / {} / {}",
        tier("local").unwrap_or(-1.0),
        tier("disk").unwrap_or(-1.0),
        tier("shared").unwrap_or(-1.0)
    );
    assert_eq!(text_of("tier-hits"), by_tier);
    assert_eq!(text_of("disk-state"), "off");
    // Sizes with their unit, the mean hit and miss times, and why
    // statements went to PostgreSQL.
    let memory = text_of("local-bytes");
    assert!(
        [" B", " KiB", " MiB"].iter().any(|u| memory.ends_with(u)),
        "{memory}"
    );
    assert!(
        text_of("latency").contains(" ms / "),
        "{}",
        text_of("latency")
    );
    let reasons = stats["bypass_reasons"].as_array().expect("bypass reasons");
    assert!(
        reasons.iter().any(|r| r["reason"] == "volatile_function"),
        "SELECT now(): {reasons:?}"
    );
    assert!(
        dom.contains("<td class=\"text\">volatile_function</td>"),
        "the bypass reasons table: {dom}"
    );
    // Sessions of the workload may still be ending while the page loads:
    // the card must show what /stats.json said before or after.
    let (_, after) = http_get(addr, "/stats.json").await;
    let after: serde_json::Value = serde_json::from_str(&after).unwrap();
    let card = |s: &serde_json::Value| {
        let c = &s["pool"]["clients"];
        format!("{} / {} / {}", c["active"], c["waiting"], c["idle"])
    };
    let shown = text_of("clients");
    assert!(
        shown == card(&stats) || shown == card(&after),
        "clients card {shown:?}: {} then {}",
        card(&stats),
        card(&after)
    );
    assert_eq!(text_of("servers"), "session mode");

    // The standby, in rotation, with the reads it took.
    let part = &dom[dom.find("id=\"replicas-part\"").expect("the replicas part")..];
    assert!(
        !part[..part.find('>').unwrap()].contains("hidden"),
        "shown with a replica: {part}"
    );
    let table = &part[..part.find("</table>").unwrap()];
    let replica = &proxy.app.replicas.servers[0];
    assert!(
        table.contains(&format!(
            "<td class=\"text\">{}</td><td class=\"text\">in rotation</td>",
            replica.name
        )),
        "{table}"
    );

    // The chart: one point per refresh, drawn as an SVG polyline.
    let line = &dom[dom.find("id=\"ratio-line\"").expect("the chart's line")..];
    let line = &line[..line
        .find("/>")
        .or_else(|| line.find("</polyline>"))
        .unwrap()];
    let count: usize = line
        .split("data-points=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .expect("data-points");
    assert!(count >= 2, "only {count} points: {line}");
    let points = line
        .split("points=\"")
        .last()
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    assert_eq!(points.split_whitespace().count(), count, "{line}");
    assert!(
        dom.contains("SELECT v FROM t WHERE id = ?"),
        "top statements listed"
    );
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_pgcache_and_every_dashboard_query_returns_data() {
    let Workload { proxy, db, .. } = &proxy_after_a_workload("live_prometheus").await;
    let target = metrics_addr(proxy);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: pgcache\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let mut prometheus = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("prometheus runs: install Debian's prometheus package (scripts/test.sh does)");
    let api: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("config/grafana/dashboards/pgcache.json").unwrap(),
    )
    .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            // Grafana's interval variable, as Grafana would fill it in.
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m");
            queries.push((panel["title"].as_str().unwrap().to_owned(), expr));
        }
    }
    assert!(queries.len() >= 20, "{} queries", queries.len());
    // Keep traffic flowing while Prometheus collects samples.
    let client = connect_dsn(&proxy.dsn("postgres", db)).await.unwrap();
    for (title, expr) in &queries {
        let path = format!("/api/v1/query?query={}", url_encode(expr));
        eventually(
            Duration::from_secs(60),
            &format!("data for {title}: {expr}"),
            || async {
                scalar(&client, "SELECT v FROM t WHERE id = 1").await;
                let Ok(Ok((200, body))) =
                    tokio::time::timeout(Duration::from_secs(5), try_http_get(api, &path)).await
                else {
                    return None;
                };
                let reply: serde_json::Value = serde_json::from_str(&body).ok()?;
                assert_eq!(reply["status"], "success", "{expr}: {body}");
                let results = reply["data"]["result"].as_array()?;
                (!results.is_empty()).then_some(())
            },
        )
        .await;
    }
    prometheus.kill().await.ok();
}
