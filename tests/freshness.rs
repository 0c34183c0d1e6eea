//! Freshness is proved, not assumed: heartbeats come back through the
//! replication stream, and a database's cache is served only while the
//! newest one is younger than `replication.max_staleness_ms`. Stalls are
//! real: a SIGSTOPped walsender, and a replication connection black-holed
//! by an in-test relay that stops forwarding without closing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use pgcache::classify::BypassReason;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HEARTBEAT_MS: u64 = 100;
const STALENESS_MS: u64 = 1_000;
/// Scheduling slack on a loaded 2-core test machine.
const SLACK: Duration = Duration::from_millis(500);

fn config(upstream_port: u16) -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.upstream.url = format!("postgres://postgres@127.0.0.1:{upstream_port}");
    config.replication.heartbeat_ms = HEARTBEAT_MS;
    config.replication.max_staleness_ms = STALENESS_MS;
    config
}

/// A table `t` with one row (1, 1), pgcache streaming it, and the read
/// served from the cache.
async fn setup(name: &str, upstream_port: u16) -> (String, Proxy, tokio_postgres::Client) {
    let db = pg().create_db(name);
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    );
    let proxy = Proxy::start(config(upstream_port)).await;
    let client = proxy.connect(&db).await;
    scalar(&client, READ).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, READ).await.as_deref(), Some("1"));
    assert_eq!(proxy.hits(), hits + 1, "served from the cache");
    (db, proxy, client)
}

const READ: &str = "SELECT v FROM t WHERE id = 1";

/// With the stream stalled, updates `t` directly and reads through pgcache
/// until the new value comes back: the old one may be served only within
/// the lease (plus one heartbeat and slack), and never after the new one.
async fn stale_reads_end_within_the_lease(
    db: &str,
    proxy: &Proxy,
    client: &tokio_postgres::Client,
) {
    let direct = pg().direct(db).await;
    direct.batch_execute("UPDATE t SET v = 2").await.unwrap();
    let updated = Instant::now();
    let bound = Duration::from_millis(STALENESS_MS + HEARTBEAT_MS) + SLACK;
    let mut fresh_since = None;
    loop {
        let v = scalar(client, READ).await;
        let elapsed = updated.elapsed();
        match v.as_deref() {
            Some("2") => {
                fresh_since.get_or_insert(elapsed);
                if elapsed > bound + Duration::from_millis(300) {
                    break;
                }
            }
            Some("1") => {
                assert!(fresh_since.is_none(), "stale after a fresh read");
                assert!(elapsed < bound, "served stale {elapsed:?} after the write");
            }
            other => panic!("unexpected {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = proxy.app.cache.db(db);
    assert!(!state.stream.is_current());
    assert!(
        state.stream.lag() > Duration::from_millis(STALENESS_MS),
        "the lag grows during a stall: {:?}",
        state.stream.lag()
    );
    assert!(proxy.app.metrics.bypasses(BypassReason::ReplicationStale) > 0);
    eprintln!("first fresh read {fresh_since:?} after the write (bound on stale reads {bound:?})");
}

/// SIGCONTs the process when dropped, so a failing test never leaves a
/// stopped walsender behind.
struct Stopped(i32);

impl Stopped {
    fn new(pid: i32) -> Self {
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(sig: &str, pid: i32) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test]
async fn a_stopped_walsender_stops_serving_within_the_lease_and_resumes_after() {
    let (db, proxy, client) = setup("fresh_stop", pg().port).await;
    let direct = pg().direct(&db).await;
    let pid = scalar(
        &direct,
        &format!("SELECT active_pid FROM pg_replication_slots WHERE database = '{db}'"),
    )
    .await
    .expect("pgcache's slot is active")
    .parse()
    .unwrap();
    let stopped = Stopped::new(pid);
    stale_reads_end_within_the_lease(&db, &proxy, &client).await;
    drop(stopped);
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(10), "the lease to be renewed", || {
        let current = state.stream.is_current();
        async move { current.then_some(()) }
    })
    .await;
    assert!(state.stream.lag() < Duration::from_millis(STALENESS_MS));
    scalar(&client, READ).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, READ).await.as_deref(), Some("2"));
    assert_eq!(proxy.hits(), hits + 1, "served from the cache again");
}

/// Relays TCP connections to `target`. Once `freeze` is set, connections
/// that carried a replication startup stop forwarding, without closing:
/// what a network black hole does.
async fn relay(target: u16, freeze: Arc<AtomicBool>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
                continue;
            };
            let replication = Arc::new(AtomicBool::new(false));
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            let marks = Some(Arc::clone(&replication));
            tokio::spawn(pipe(
                ri,
                wo,
                marks,
                Arc::clone(&replication),
                Arc::clone(&freeze),
            ));
            tokio::spawn(pipe(ro, wi, None, replication, Arc::clone(&freeze)));
        }
    });
    port
}

/// Copies one direction; `marks` (client to server) notes a replication
/// startup.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    marks: Option<Arc<AtomicBool>>,
    replication: Arc<AtomicBool>,
    freeze: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(marks) = &marks
            && buf[..n].windows(12).any(|w| w == b"replication\0")
        {
            marks.store(true, Ordering::Release);
        }
        while replication.load(Ordering::Acquire) && freeze.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test]
async fn a_black_holed_stream_stops_serving_within_the_lease() {
    let freeze = Arc::new(AtomicBool::new(false));
    let port = relay(pg().port, Arc::clone(&freeze)).await;
    let (db, proxy, client) = setup("fresh_hole", port).await;
    freeze.store(true, Ordering::Release);
    stale_reads_end_within_the_lease(&db, &proxy, &client).await;
    freeze.store(false, Ordering::Release);
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(10), "the lease to be renewed", || {
        let current = state.stream.is_current();
        async move { current.then_some(()) }
    })
    .await;
    eventually_reads(&client, READ, "2").await;
}
