//! Test harness: a throwaway PostgreSQL and redis-server per test binary,
//! and pgcache started in-process on port 0.
//!
//! - The shared PostgreSQL is created once per test binary (`initdb` into a
//!   temp dir, a free port, `wal_level=logical`, users for md5 and SCRAM).
//!   Each test makes its own database with [`Pg::create_db`], so tests run in
//!   parallel. Fault tests that stop PostgreSQL start a [`Pg::dedicated`] one.
//! - Servers are stopped and their directories removed when the test process
//!   exits, by a small watchdog process (statics are never dropped in Rust).
//! - `TEST_DATABASE_URL` is not needed: nothing here touches services the
//!   machine happens to run.

// Each test binary uses a part of the harness; the rest would warn there.
#![allow(dead_code)]

mod pg;
mod process;
mod proxy;
mod redis;
mod relay;
mod tls;
pub mod wire;

use std::net::TcpListener as StdListener;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

pub use pg::*;
#[allow(unused_imports)]
pub use process::{Stopped, pg_bindir, scratch_dir};
pub use proxy::Proxy;
// Only the fault tests relay connections.
#[allow(unused_imports)]
pub use relay::{Faults, refusing_relay, relay};
// Not every test binary starts Redis or makes certificates.
#[allow(unused_imports)]
pub use redis::*;
#[allow(unused_imports)]
pub use tls::*;

/// Polls `check` until it returns `Some`, or panics after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A port connections to are refused, which nothing else can take while
/// the returned socket lives (bound, never listening). A port from
/// [`free_port`] is free again at once: pgcache's own listener could be
/// given it, and connect to itself.
pub fn refused_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = socket.local_addr().unwrap().port();
    (socket, port)
}

/// Holds `table` under ACCESS EXCLUSIVE on a direct connection until the
/// returned client is dropped or rolls back: a forwarded read of it would
/// block, a cached one returns at once.
pub async fn lock_table(db: &str, table: &str) -> tokio_postgres::Client {
    let locker = pg().direct(db).await;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
        ))
        .await
        .unwrap();
    locker
}

/// Connects with tokio-postgres and drives the connection in the background.
pub async fn connect_dsn(dsn: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Runs an external client (psql, pgbench) to completion.
pub async fn run_tool(program: &Path, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(program)
        .args(args)
        .env("PGCONNECT_TIMEOUT", "10")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

/// The first column of the first row of a simple query, as text.
pub async fn scalar(client: &tokio_postgres::Client, sql: &str) -> Option<String> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).map(str::to_owned)),
            _ => None,
        })
        .flatten()
}

/// Stops (SIGSTOP) the walsender of pgcache's slot on `db` until the
/// returned guard is dropped.
pub async fn stop_walsender(direct: &tokio_postgres::Client, db: &str) -> Stopped {
    let pid = scalar(
        direct,
        &format!("SELECT active_pid FROM pg_replication_slots WHERE database = '{db}'"),
    )
    .await
    .expect("pgcache's slot is active")
    .parse()
    .unwrap();
    Stopped::new(pid)
}

/// Reads `sql` through `client` until it returns `want` (a change made
/// directly arrives within the replication stream's lag).
pub async fn eventually_reads(client: &tokio_postgres::Client, sql: &str, want: &str) {
    eventually(
        Duration::from_secs(10),
        &format!("{sql} to return {want}"),
        || async { (scalar(client, sql).await.as_deref() == Some(want)).then_some(()) },
    )
    .await;
}

/// A database made by `sql`, pgcache streaming it, a client through
/// pgcache and one straight to PostgreSQL.
pub async fn setup_streaming(
    name: &str,
    sql: &str,
) -> (
    String,
    Proxy,
    tokio_postgres::Client,
    tokio_postgres::Client,
) {
    let db = pg().create_db(name);
    pg().psql_db(&db, sql);
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let direct = pg().direct(&db).await;
    (db, proxy, client, direct)
}

/// All rows of a simple query, as text.
pub async fn rows(client: &tokio_postgres::Client, sql: &str) -> Vec<Vec<Option<String>>> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}

pub fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// The metric families the Grafana dashboard queries that `/metrics`
/// (its text, `body`) lacks, and how many references were checked. A
/// histogram's `_bucket`, `_sum` and `_count` count as its family.
pub fn dashboard_metrics_missing(body: &str) -> (Vec<String>, usize) {
    let families: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("config/grafana/dashboards/pgcache.json").unwrap(),
    )
    .unwrap();
    let mut missing = Vec::new();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for name in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("pgcache_"))
            {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .filter(|base| families.contains(base))
                    .unwrap_or(name);
                if !families.contains(&family) {
                    missing.push(name.to_owned());
                }
                checked += 1;
            }
        }
    }
    (missing, checked)
}

/// Metric families that exist only where read replicas are configured
/// (their series are per replica).
pub fn is_replica_metric(name: &str) -> bool {
    name.starts_with("pgcache_replica_") || name == "pgcache_reads_routed_total"
}

/// Waits until `standby` has replayed everything `primary` had written when
/// called: a read routed there from then on sees it, and its answer may be
/// stored.
pub async fn standby_caught_up(primary: &Pg, standby: &Pg) {
    let target = primary.psql_admin("SELECT pg_current_wal_insert_lsn()");
    let sql = format!(
        "SELECT pg_last_wal_replay_lsn() >= '{}'::pg_lsn",
        target.trim()
    );
    eventually(Duration::from_secs(30), "the standby to catch up", || {
        let done = standby.psql_admin(&sql).trim() == "t";
        async move { done.then_some(()) }
    })
    .await;
}

/// Connects and forwards what `pick` keeps of the server's asynchronous
/// messages (notices, notifications) to a channel.
pub async fn connect_picking<T: Send + 'static>(
    dsn: &str,
    pick: fn(tokio_postgres::AsyncMessage) -> Option<T>,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<T>,
) {
    use futures_util::StreamExt;
    let (client, mut conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let Some(kept) = pick(message) {
                let _ = tx.send(kept);
            }
        }
    });
    (client, rx)
}

/// Connects and collects the notices the server sends, as
/// `SEVERITY: message`.
pub async fn connect_with_notices(
    dsn: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    connect_picking(dsn, |message| match message {
        tokio_postgres::AsyncMessage::Notice(n) => {
            Some(format!("{}: {}", n.severity(), n.message()))
        }
        _ => None,
    })
    .await
}
