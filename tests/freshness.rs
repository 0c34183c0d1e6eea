//! Freshness is proved, not assumed: heartbeats come back through the
//! replication stream, and a database's cache is served only while the
//! newest one is younger than `replication.max_staleness_ms`. Stalls are
//! real: a SIGSTOPped walsender, and a replication connection black-holed
//! by an in-test relay that stops forwarding without closing.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use pgcache::classify::BypassReason;

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
    let (status, body) = proxy.http_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("stale"), "{body}");
    let lag = proxy
        .database_metric("pgcache_replication_lag_seconds", db)
        .await;
    assert!(lag > STALENESS_MS as f64 / 1000.0, "lag {lag}");
    eprintln!("first fresh read {fresh_since:?} after the write (bound on stale reads {bound:?})");
}

#[tokio::test]
async fn a_stopped_walsender_stops_serving_within_the_lease_and_resumes_after() {
    let (db, proxy, client) = setup("fresh_stop", pg().port).await;
    let direct = pg().direct(&db).await;
    let stopped = stop_walsender(&direct, &db).await;
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

#[tokio::test]
async fn a_black_holed_stream_stops_serving_within_the_lease() {
    let faults = Faults {
        frozen_marker: b"replication\0",
        ..Faults::default()
    };
    let freeze = Arc::clone(&faults.freeze);
    let port = relay(pg().port, faults).await;
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

/// With nothing to do, a database's heartbeats rest (each costs PostgreSQL
/// a commit that every walsender decodes). The lease keeps its promise
/// across the rest: the next lookup sends a heartbeat and is served only
/// once it is back. Here the stream is black-holed during the rest, and a
/// direct write made then is never served stale; once the stream flows
/// again, hits come back.
#[tokio::test]
async fn resting_heartbeats_wake_for_a_lookup_which_is_served_only_once_one_is_back() {
    use pgcache::cache::database::Unfresh;
    let faults = Faults {
        frozen_marker: b"replication\0",
        ..Faults::default()
    };
    let freeze = Arc::clone(&faults.freeze);
    let port = relay(pg().port, faults).await;
    let (db, proxy, client) = setup("fresh_rest", port).await;
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(10), "the heartbeats to rest", || {
        let resting = state.stream.freshness() == Err(Unfresh::Resting);
        async move { resting.then_some(()) }
    })
    .await;
    assert!(
        state.stream.is_current(),
        "resting is not down: /readyz stays 200"
    );
    assert_eq!(proxy.http_get("/readyz").await.0, 200);
    let sent = state.stream.demand.beats();
    // Absence is not a condition to poll: three heartbeat intervals pass.
    tokio::time::sleep(Duration::from_millis(3 * HEARTBEAT_MS)).await;
    assert_eq!(
        state.stream.demand.beats(),
        sent,
        "no heartbeat while resting"
    );
    // A lookup after the rest, with the stream flowing: a hit, after one
    // heartbeat.
    let hits = proxy.hits();
    assert_eq!(scalar(&client, READ).await.as_deref(), Some("1"));
    assert_eq!(proxy.hits(), hits + 1, "served once a heartbeat was back");
    assert!(state.stream.demand.beats() > sent);
    // Rest again, black-hole the stream, and write directly.
    eventually(
        Duration::from_secs(10),
        "the heartbeats to rest again",
        || {
            let resting = state.stream.freshness() == Err(Unfresh::Resting);
            async move { resting.then_some(()) }
        },
    )
    .await;
    freeze.store(true, Ordering::Release);
    let direct = pg().direct(&db).await;
    direct.batch_execute("UPDATE t SET v = 2").await.unwrap();
    let hits = proxy.hits();
    assert_eq!(
        scalar(&client, READ).await.as_deref(),
        Some("2"),
        "no heartbeat back: PostgreSQL answers"
    );
    assert_eq!(proxy.hits(), hits);
    freeze.store(false, Ordering::Release);
    eventually(Duration::from_secs(10), "hits again", || async {
        let hits = proxy.hits();
        let read = scalar(&client, READ).await;
        assert_eq!(read.as_deref(), Some("2"), "never the old value");
        (proxy.hits() > hits).then_some(())
    })
    .await;
}

/// Heartbeats sent just before a rest may come back during it (the
/// stream was slow: here its walsender is stopped meanwhile). Their
/// return must not keep the next lookup from waking the heartbeats: past
/// the lease of those late heartbeats, reads are still served from the
/// cache, the first of them having woken the heartbeats.
#[tokio::test]
async fn heartbeats_back_late_during_a_rest_do_not_keep_the_next_lookup_from_waking_them() {
    use pgcache::cache::database::Unfresh;
    let (db, proxy, client) = setup("fresh_late", pg().port).await;
    let state = proxy.app.cache.db(&db);
    let direct = pg().direct(&db).await;
    // Heartbeats go on for a while after the setup's reads; from now on
    // they are stuck in the WAL until the walsender runs again.
    let stopped = stop_walsender(&direct, &db).await;
    let stopped_at = Instant::now();
    eventually(Duration::from_secs(10), "the heartbeats to rest", || {
        let resting = state.stream.freshness() == Err(Unfresh::Resting);
        async move { resting.then_some(()) }
    })
    .await;
    assert!(!state.stream.proved(stopped_at), "nothing came back yet");
    drop(stopped);
    let resumed = Instant::now();
    // No read until the late heartbeats are back: none noted a need.
    eventually(Duration::from_secs(10), "the late heartbeats back", || {
        let back = state.stream.proved(stopped_at);
        async move { back.then_some(()) }
    })
    .await;
    let past_their_lease = Duration::from_millis(STALENESS_MS) + SLACK;
    eventually(
        Duration::from_secs(10),
        "a hit past the late heartbeats' lease",
        || async {
            let hits = proxy.hits();
            assert_eq!(scalar(&client, READ).await.as_deref(), Some("1"));
            (proxy.hits() > hits && resumed.elapsed() > past_their_lease).then_some(())
        },
    )
    .await;
}
