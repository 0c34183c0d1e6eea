//! The shared tier: several pgcache instances sharing one Redis (or Redis
//! Cluster) serve each other's results, never serve what another instance
//! or a direct write invalidated, and carry on without Redis.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use tokio_postgres::Client;

fn config(redis_url: &str) -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.redis.url = redis_url.to_owned();
    // Generous for a loaded CI machine: a slow answer counts as a failure.
    config.cache.shared.timeout_ms = 1000;
    config
}

async fn stored(proxy: &Proxy, at_least: u64) {
    let m = proxy.app.metrics.shared.clone();
    eventually(Duration::from_secs(10), "a store to Redis", || {
        let n = m.stored.get();
        async move { (n >= at_least).then_some(()) }
    })
    .await;
}

/// Two instances on one Redis, both streaming and in sync for `db`.
async fn pair(redis_url: &str, db: &str) -> (Proxy, Client, Proxy, Client) {
    let a = Proxy::start(config(redis_url)).await;
    let b = Proxy::start(config(redis_url)).await;
    let ca = a.connect(db).await;
    let cb = b.connect(db).await;
    a.shared_ready(db).await;
    b.shared_ready(db).await;
    (a, ca, b, cb)
}

const ITEMS: &str = "CREATE TABLE items(id int PRIMARY KEY, v int); \
                     INSERT INTO items SELECT g, g * 10 FROM generate_series(1, 50) g";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_computed_by_one_instance_is_served_by_another_without_the_backend() {
    let db = pg().create_db("shared_fill");
    pg().psql_db(&db, ITEMS);
    let (a, ca, b, cb) = pair(&redis().url(), &db).await;
    // B learns its session settings before the table is locked.
    assert_eq!(scalar(&cb, "SELECT 1").await.as_deref(), Some("1"));

    let sql = "SELECT sum(v) FROM items WHERE id <= 20";
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("2100"));
    stored(&a, 1).await;

    // Locked: a read that reached PostgreSQL would wait.
    let locker = lock_table(&db, "items").await;
    let answer = tokio::time::timeout(Duration::from_secs(5), scalar(&cb, sql))
        .await
        .expect("B answers from Redis without touching PostgreSQL");
    assert_eq!(answer.as_deref(), Some("2100"));
    assert_eq!(b.app.metrics.shared.hit.get(), 1);
    assert_eq!(b.hits(), 1);
    drop(locker);

    // The shared hit filled B's local tier: the next one does not ask Redis
    // (every lookup there counts as one of these; the stream's own round
    // trips, a heartbeat's coverage say, may come meanwhile).
    let shared = &b.app.metrics.shared;
    let asked =
        || shared.hit.get() + shared.miss.get() + shared.rejected.get() + shared.error.get();
    let lookups = asked();
    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("2100"));
    assert_eq!(b.hits(), 2);
    assert_eq!(asked(), lookups);

    // Extended protocol too, with parameters.
    let stmt = "SELECT v FROM items WHERE id = $1";
    let row = ca.query_one(stmt, &[&7i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 70);
    stored(&a, 2).await;
    let before = b.app.metrics.shared.hit.get();
    let row = cb.query_one(stmt, &[&7i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 70);
    assert_eq!(b.app.metrics.shared.hit.get(), before + 1);
}

/// A read answered by `proxy`'s cache: its hit count moves.
async fn is_hit(proxy: &Proxy, client: &Client, sql: &str, want: &str) -> bool {
    let before = proxy.hits();
    assert_eq!(scalar(client, sql).await.as_deref(), Some(want));
    proxy.hits() > before
}

/// Starting an instance neither ignores what Redis holds nor voids what
/// another live instance keeps current. B starts while a direct session
/// holds ACCESS EXCLUSIVE on the table (B's own stream cannot start then:
/// its slot waits for that transaction); B's first read is answered from
/// Redis at once. A keeps its hits across B's start and B's restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_instance_answers_from_redis_and_voids_nothing_another_kept_current() {
    let db = pg().create_db("shared_start");
    pg().psql_db(&db, ITEMS);
    let url = redis().url();
    let a = Proxy::start(config(&url)).await;
    let ca = a.connect(&db).await;
    a.shared_ready(&db).await;
    a.wait_stream(&db).await;
    let sql = "SELECT sum(v) FROM items WHERE id <= 20";
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("2100"));
    stored(&a, 1).await;
    assert!(is_hit(&a, &ca, sql, "2100").await);
    let epoch = a.app.cache.db(&db).versions.epoch.shared();

    let locker = lock_table(&db, "items").await;
    let b = Proxy::start(config(&url)).await;
    // Not `connect`, which waits for B's stream and its catalog facts.
    let cb = connect_dsn(&b.dsn("postgres", &db)).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), scalar(&cb, sql)).await;
    let answer = answer.expect("B's first read is answered from Redis, not by PostgreSQL");
    assert_eq!(answer.as_deref(), Some("2100"));
    assert_eq!(b.app.metrics.shared.hit.get(), 1);
    assert!(
        !b.app.cache.db(&db).stream.is_streaming(),
        "B's own stream is still waiting for the lock"
    );
    drop(locker);

    b.wait_stream(&db).await;
    b.shared_ready(&db).await;
    assert_eq!(
        b.app.cache.db(&db).versions.epoch.shared(),
        epoch,
        "B's stream started without voiding Redis's entries"
    );
    assert!(is_hit(&a, &ca, sql, "2100").await, "A keeps its hits");

    drop(cb);
    drop(b);
    let b = Proxy::start(config(&url)).await;
    let cb = b.connect(&db).await;
    b.wait_stream(&db).await;
    b.shared_ready(&db).await;
    assert_eq!(
        b.app.cache.db(&db).versions.epoch.shared(),
        epoch,
        "restarted, B voided nothing"
    );
    assert!(
        is_hit(&a, &ca, sql, "2100").await,
        "A keeps its hits across B's restart"
    );
    assert!(
        is_hit(&b, &cb, sql, "2100").await,
        "and B answers from Redis"
    );

    // With no other live instance, a start still voids what Redis holds:
    // changes made while no stream ran were seen by no one.
    drop((ca, cb));
    drop((a, b));
    pg().psql_db(&db, "UPDATE items SET v = v + 1 WHERE id = 1");
    let c = Proxy::start(config(&url)).await;
    let cc = c.connect(&db).await;
    c.wait_stream(&db).await;
    assert!(
        c.app.cache.db(&db).versions.epoch.shared() > epoch,
        "the epoch moved"
    );
    assert_eq!(
        scalar(&cc, sql).await.as_deref(),
        Some("2101"),
        "never the old answer"
    );
}

/// The same with B's own stream up, and a health check's `SELECT 1` as
/// B's first statement: B's first read of the locked table still waits for
/// its catalog facts (not for the lock) and is answered from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_instance_answers_its_first_read_of_a_locked_table_from_redis() {
    let db = pg().create_db("shared_locked_read");
    pg().psql_db(&db, ITEMS);
    let url = redis().url();
    let a = Proxy::start(config(&url)).await;
    let ca = a.connect(&db).await;
    a.shared_ready(&db).await;
    let sql = "SELECT sum(v) FROM items WHERE id <= 20";
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("2100"));
    stored(&a, 1).await;

    let b = Proxy::start(config(&url)).await;
    // Not `connect`, which looks up every table's facts.
    let cb = connect_dsn(&b.dsn("postgres", &db)).await.unwrap();
    assert_eq!(scalar(&cb, "SELECT 1").await.as_deref(), Some("1"));
    b.wait_stream(&db).await;
    b.shared_ready(&db).await;
    let _locker = lock_table(&db, "items").await;
    let answer = tokio::time::timeout(Duration::from_secs(10), scalar(&cb, sql)).await;
    let answer = answer.expect("B's first read is answered from Redis, not by PostgreSQL");
    assert_eq!(answer.as_deref(), Some("2100"));
    assert_eq!(b.app.metrics.shared.hit.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_key_has_a_ttl_and_large_results_stay_local() {
    let redis = Redis::dedicated();
    let db = pg().create_db("shared_ttl");
    pg().psql_db(&db, ITEMS);
    let mut cfg = config(&redis.url());
    cfg.cache.shared.ttl_secs = 120;
    cfg.cache.shared.max_entry_bytes = 4096;
    let proxy = Proxy::start(cfg).await;
    let client = proxy.connect(&db).await;
    proxy.shared_ready(&db).await;
    scalar(&client, "SELECT v FROM items WHERE id = 1").await;
    stored(&proxy, 1).await;
    // Over 4 KiB: stored locally, not in Redis.
    rows(&client, "SELECT id, v, repeat('x', 200) FROM items").await;
    assert_eq!(proxy.app.metrics.shared.store_too_large.get(), 1);
    assert_eq!(proxy.stores(), 2);

    let mut conn = redis.client().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("pgcache:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let entries: Vec<&String> = keys.iter().filter(|k| k.contains(":e:")).collect();
    assert_eq!(entries.len(), 1, "{keys:?}");
    for key in &keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if key.contains(":e:") {
            assert!(ttl > 0 && ttl <= 120_000, "{key}: PTTL {ttl}");
        } else {
            assert!(
                key.contains(":v:"),
                "only entries and version hashes: {key}"
            );
        }
    }
}

/// Polls `client` until `sql` gives `want`, then checks it keeps giving it.
async fn converges(client: &Client, sql: &str, want: &str) {
    eventually(Duration::from_secs(10), "the new value", || async {
        (scalar(client, sql).await.as_deref() == Some(want)).then_some(())
    })
    .await;
    for _ in 0..5 {
        assert_eq!(scalar(client, sql).await.as_deref(), Some(want));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_another_instance_or_directly_are_not_served_stale() {
    let db = pg().create_db("shared_stale");
    pg().psql_db(&db, ITEMS);
    let (a, ca, b, cb) = pair(&redis().url(), &db).await;
    let sql = "SELECT v FROM items WHERE id = 3";
    // Both instances hold the result, locally and in Redis.
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("30"));
    stored(&a, 1).await;
    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("30"));
    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("30"));
    assert!(b.hits() >= 2);

    // A write through A: A itself never serves the old value again...
    ca.batch_execute("UPDATE items SET v = 31 WHERE id = 3")
        .await
        .unwrap();
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("31"));
    // ...and B stops serving it once the announcement arrives.
    converges(&cb, sql, "31").await;

    // A write made directly on PostgreSQL, seen by both replication streams.
    let direct = pg().direct(&db).await;
    direct
        .batch_execute("UPDATE items SET v = 32 WHERE id = 3")
        .await
        .unwrap();
    converges(&cb, sql, "32").await;
    converges(&ca, sql, "32").await;
    assert!(a.app.metrics.shared.invalidations_sent.get() >= 1);
    assert!(b.app.metrics.shared.invalidations_received.get() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_on_two_instances_never_leave_a_stale_result() {
    // Every write goes through one instance or the other; after each one,
    // its own instance must show it at once and the other one soon after.
    let db = pg().create_db("shared_race");
    pg().psql_db(
        &db,
        "CREATE TABLE c(id int PRIMARY KEY, n int); INSERT INTO c VALUES (1, 0)",
    );
    let (a, ca, b, cb) = pair(&redis().url(), &db).await;
    let sql = "SELECT n FROM c WHERE id = 1";
    // Readers on both instances keep filling the cache while the writes
    // land, so fills race with invalidations.
    let done = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for proxy in [&a, &b] {
        let reader = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
        let done = Arc::clone(&done);
        readers.push(tokio::spawn(async move {
            let mut reads = 0u64;
            while !done.load(Ordering::Acquire) {
                scalar(&reader, sql).await.unwrap();
                reads += 1;
            }
            reads
        }));
    }
    for i in 1..=40u64 {
        let (writer, other) = if i % 2 == 0 { (&ca, &cb) } else { (&cb, &ca) };
        writer
            .batch_execute(&format!("UPDATE c SET n = {i} WHERE id = 1"))
            .await
            .unwrap();
        assert_eq!(
            scalar(writer, sql).await.as_deref(),
            Some(i.to_string().as_str()),
            "the writing instance serves its own write at once"
        );
        converges(other, sql, &i.to_string()).await;
    }
    done.store(true, Ordering::Release);
    for r in readers {
        assert!(r.await.unwrap() > 0);
    }
    converges(&ca, sql, "40").await;
    converges(&cb, sql, "40").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_redis_value_is_rejected_and_never_served() {
    let redis = Redis::dedicated();
    let db = pg().create_db("shared_tamper");
    pg().psql_db(&db, ITEMS);
    let (a, ca, b, cb) = pair(&redis.url(), &db).await;
    let sql = "SELECT v FROM items WHERE id = 5";
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("50"));
    stored(&a, 1).await;

    let mut conn = redis.client().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("pgcache:*:e:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let value: Vec<u8> = redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    // The stored row says "50": make it say "99".
    let at = value
        .windows(2)
        .rposition(|w| w == b"50")
        .expect("the row is in the value");
    let _: () = redis::cmd("SETRANGE")
        .arg(&keys[0])
        .arg(at)
        .arg("99")
        .query_async(&mut conn)
        .await
        .unwrap();

    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("50"));
    let m = &b.app.metrics.shared;
    assert_eq!(m.rejected.get(), 1);
    assert_eq!(m.rejected_checksum.get(), 1);
    assert_eq!(m.hit.get(), 0);
    // B stores the right answer over the tampered one.
    stored(&b, 1).await;

    // A value moved to another key is rejected too.
    let other_sql = "SELECT v FROM items WHERE id = 6";
    assert_eq!(scalar(&ca, other_sql).await.as_deref(), Some("60"));
    stored(&a, 2).await;
    let now: Vec<String> = redis::cmd("KEYS")
        .arg("pgcache:*:e:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let other_key = now
        .iter()
        .find(|k| **k != keys[0])
        .expect("the second entry")
        .clone();
    let _: () = redis::cmd("COPY")
        .arg(&keys[0])
        .arg(&other_key)
        .arg("REPLACE")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(scalar(&cb, other_sql).await.as_deref(), Some("60"));
    assert_eq!(m.rejected_key.get(), 1);
    assert_eq!(m.hit.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_workload_costs_no_client_an_error_and_hits_resume() {
    let redis = Redis::dedicated();
    let db = pg().create_db("shared_kill");
    pg().psql_db(&db, ITEMS);
    let mut cfg = config(&redis.url());
    cfg.cache.shared.timeout_ms = 100;
    cfg.cache.shared.breaker_open_ms = 200;
    let a = Proxy::start(cfg.clone()).await;
    a.connect(&db).await;
    a.shared_ready(&db).await;

    // Four clients read (and sometimes write) without pause throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4i32 {
        let client = connect_dsn(&a.dsn("postgres", &db)).await.unwrap();
        let stop = Arc::clone(&stop);
        workers.push(tokio::spawn(async move {
            let mut queries = 0u64;
            let mut i = 0i32;
            while !stop.load(Ordering::Acquire) {
                i += 1;
                let id = (i % 50) + 1;
                if i % 25 == 0 {
                    client
                        .execute("UPDATE items SET v = v WHERE id = $1", &[&(w + 1)])
                        .await
                        .expect("write during the outage");
                }
                let row = client
                    .query_one("SELECT v FROM items WHERE id = $1", &[&id])
                    .await
                    .expect("read during the outage");
                assert_eq!(row.get::<_, i32>(0), id * 10);
                queries += 1;
            }
            queries
        }));
    }
    let m = a.app.metrics.shared.clone();
    let progress = |n: u64| {
        let m = m.clone();
        async move {
            eventually(Duration::from_secs(20), "shared-tier traffic", || {
                let trips = m.round_trips.get();
                async move { (trips >= n).then_some(()) }
            })
            .await
        }
    };
    progress(m.round_trips.get() + 20).await;
    redis.kill();
    // Failures are noticed, the breaker opens, and the workload goes on.
    eventually(Duration::from_secs(20), "the breaker to open", || {
        let opens = m.breaker_opens.get();
        async move { (opens >= 1).then_some(()) }
    })
    .await;
    let tier = a.app.cache.shared().cloned().unwrap();
    assert!(!tier.is_up());
    let hits = a.hits();
    eventually(Duration::from_secs(20), "local hits without Redis", || {
        let now = a.hits();
        async move { (now > hits + 20).then_some(()) }
    })
    .await;

    redis.restart();
    a.shared_ready(&db).await;
    let stored_before = m.stored.get();
    eventually(
        Duration::from_secs(20),
        "stores to the restarted Redis",
        || {
            let n = m.stored.get();
            async move { (n > stored_before).then_some(()) }
        },
    )
    .await;
    stop.store(true, Ordering::Release);
    for w in workers {
        assert!(w.await.expect("no client saw an error") > 0);
    }
    // A second instance, cold, is served from the restarted Redis.
    let b = Proxy::start(cfg).await;
    let cb = b.connect(&db).await;
    b.shared_ready(&db).await;
    let ca = a.connect(&db).await;
    let stmt = "SELECT v FROM items WHERE id = $1";
    for id in 1..=50i32 {
        ca.query_one(stmt, &[&id]).await.unwrap();
    }
    let mut id = 0i32;
    eventually(
        Duration::from_secs(20),
        "a shared hit after the restart",
        || {
            id = id % 50 + 1;
            let (cb, b) = (&cb, &b);
            async move {
                let row = cb.query_one(stmt, &[&id]).await.unwrap();
                assert_eq!(row.get::<_, i32>(0), id * 10);
                (b.app.metrics.shared.hit.get() > 0).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_leaves_the_local_tier_working() {
    let (_reserved, port) = refused_port();
    let db = pg().create_db("shared_down");
    pg().psql_db(&db, ITEMS);
    let proxy = Proxy::start(config(&format!("redis://127.0.0.1:{port}"))).await;
    let client = proxy.connect(&db).await;
    for _ in 0..3 {
        assert_eq!(
            scalar(&client, "SELECT v FROM items WHERE id = 9")
                .await
                .as_deref(),
            Some("90")
        );
    }
    assert_eq!(proxy.hits(), 2);
    assert!(!proxy.app.cache.shared().unwrap().is_up());
    assert!(proxy.app.metrics.shared.skipped.get() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_resynchronises_and_treats_the_gap_as_changed() {
    let redis = Redis::dedicated();
    let db = pg().create_db("shared_gap");
    pg().psql_db(&db, ITEMS);
    let (a, ca, b, cb) = pair(&redis.url(), &db).await;
    let sql = "SELECT v FROM items WHERE id = 4";
    assert_eq!(scalar(&ca, sql).await.as_deref(), Some("40"));
    stored(&a, 1).await;
    let epoch_before = b.app.cache.db(&db).versions.epoch.shared();
    let resyncs = b.app.metrics.shared.resyncs.get();

    // Redis drops every subscriber, as it does one that falls behind.
    let killed = redis.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert!(killed.trim().parse::<u32>().unwrap() >= 2, "{killed}");
    eventually(Duration::from_secs(20), "B to resynchronise", || {
        let n = b.app.metrics.shared.resyncs.get();
        async move { (n > resyncs).then_some(()) }
    })
    .await;
    b.shared_ready(&db).await;
    assert!(
        b.app.cache.db(&db).versions.epoch.shared() > epoch_before,
        "the gap counts as a change"
    );
    // What A stored before the gap is not served to B afterwards...
    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("40"));
    assert_eq!(b.app.metrics.shared.hit.get(), 0);
    // ...and new entries are shared again.
    a.shared_ready(&db).await;
    let other = "SELECT v FROM items WHERE id = 8";
    assert_eq!(scalar(&ca, other).await.as_deref(), Some("80"));
    stored(&a, 2).await;
    eventually(Duration::from_secs(10), "a shared hit", || async {
        assert_eq!(scalar(&cb, other).await.as_deref(), Some("80"));
        (b.app.metrics.shared.hit.get() == 1).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_serves_as_the_shared_tier() {
    let cluster = RedisCluster::start();
    let db = pg().create_db("shared_cluster");
    pg().psql_db(&db, ITEMS);
    let (a, ca, b, cb) = pair(&cluster.url(), &db).await;
    shared_across(&cluster, (&a, &ca), (&b, &cb), 30).await;
}

/// A fills `keys` entries, which land on several nodes of `cluster`; B hits
/// every one; a write through A reaches B.
async fn shared_across(
    cluster: &RedisCluster,
    (a, ca): (&Proxy, &Client),
    (b, cb): (&Proxy, &Client),
    keys: u64,
) {
    for id in 1..=keys {
        let sql = format!("SELECT v FROM items WHERE id = {id}");
        assert_eq!(scalar(ca, &sql).await, Some((id * 10).to_string()));
    }
    stored(a, keys).await;
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).trim().parse().unwrap())
        .collect();
    assert!(
        per_node.iter().filter(|n| **n > 0).count() >= 2,
        "keys spread over the nodes: {per_node:?}"
    );
    for id in 1..=keys {
        let sql = format!("SELECT v FROM items WHERE id = {id}");
        assert_eq!(scalar(cb, &sql).await, Some((id * 10).to_string()));
    }
    assert_eq!(b.app.metrics.shared.hit.get(), keys);
    ca.batch_execute("UPDATE items SET v = 0 WHERE id = 2")
        .await
        .unwrap();
    converges(cb, "SELECT v FROM items WHERE id = 2", "0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_password_carries_the_shared_tier() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_certificate(dir.path(), "redis");
    let tls_port = free_port();
    let redis = Redis::start_with(
        free_port(),
        &[
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &cert.display().to_string(),
            "--tls-key-file",
            &key.display().to_string(),
            "--tls-ca-cert-file",
            &ca.display().to_string(),
            "--tls-auth-clients",
            "no",
        ],
    );
    assert_eq!(
        redis
            .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
            .trim(),
        "OK"
    );
    let db = pg().create_db("shared_tls");
    pg().psql_db(&db, ITEMS);
    let url = format!("rediss://:s3cret@localhost:{tls_port}");
    let mut cfg = config(&url);
    cfg.redis.ca_file = ca.clone();
    let (a, ca_client, b, cb) = {
        let a = Proxy::start(cfg.clone()).await;
        let b = Proxy::start(cfg.clone()).await;
        let (ca_client, cb) = (a.connect(&db).await, b.connect(&db).await);
        a.shared_ready(&db).await;
        b.shared_ready(&db).await;
        (a, ca_client, b, cb)
    };
    let sql = "SELECT v FROM items WHERE id = 11";
    assert_eq!(scalar(&ca_client, sql).await.as_deref(), Some("110"));
    stored(&a, 1).await;
    assert_eq!(scalar(&cb, sql).await.as_deref(), Some("110"));
    assert_eq!(
        b.app.metrics.shared.hit.get(),
        1,
        "served over TLS from Redis"
    );

    // A wrong password: the shared tier stays down, clients see no errors.
    let mut wrong = cfg.clone();
    wrong.redis.url = format!("rediss://:nope@localhost:{tls_port}");
    let c = Proxy::start(wrong).await;
    let cc = c.connect(&db).await;
    for _ in 0..3 {
        assert_eq!(scalar(&cc, sql).await.as_deref(), Some("110"));
    }
    assert!(!c.app.cache.shared().unwrap().is_up());
    assert_eq!(c.hits(), 2, "the local tier works without Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_carries_the_shared_tier() {
    let dir = tempfile::tempdir().unwrap();
    let (ca_file, cert, key) = tls_certificate(dir.path(), "redis");
    let cluster = RedisCluster::start_tls(&ca_file, &cert, &key);
    let db = pg().create_db("shared_cluster_tls");
    pg().psql_db(&db, ITEMS);
    let mut cfg = config(&cluster.tls_url());
    cfg.redis.ca_file = ca_file.clone();
    let a = Proxy::start(cfg.clone()).await;
    let b = Proxy::start(cfg).await;
    let (ca, cb) = (a.connect(&db).await, b.connect(&db).await);
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    // Served over TLS, invalidated over TLS.
    shared_across(&cluster, (&a, &ca), (&b, &cb), 12).await;
}

/// Rounds of: read through B twice (the second a hit), write through A,
/// read through B at once. Readers on both instances run meanwhile and
/// check that no read returns less than what was acknowledged before it
/// began. Returns how many reads right after a write were stale, and B's
/// hits.
async fn write_through_a_read_through_b(
    consistency: pgcache::config::Consistency,
    rounds: u64,
) -> (u64, u64) {
    let db = pg().create_db("shared_ryw");
    pg().psql_db(
        &db,
        "CREATE TABLE c(id int PRIMARY KEY, n bigint); INSERT INTO c VALUES (1, 0)",
    );
    let mut config = config(&redis().url());
    config.cache.shared.consistency = consistency;
    let a = Proxy::start(config.clone()).await;
    // B hears Redis 5 ms late, as over a slow network: its pub/sub news
    // of A's writes arrives after B's client reads.
    let slow = Faults {
        delay: Duration::from_millis(5),
        ..Faults::default()
    };
    let port = relay(redis().port, slow).await;
    config.redis.url = format!("redis://127.0.0.1:{port}");
    if consistency == pgcache::config::Consistency::Eventual {
        // B's own replication stream hears of A's writes 20 ms late too:
        // on a loaded machine it could otherwise beat B's client reads
        // and close the window this run measures. B's hits never go to
        // PostgreSQL, so they are not slowed.
        let late = Faults {
            delay: Duration::from_millis(20),
            ..Faults::default()
        };
        let port = relay(pg().port, late).await;
        config.upstream.url = format!("postgres://postgres@127.0.0.1:{port}");
    }
    let b = Proxy::start(config).await;
    let ca = a.connect(&db).await;
    let cb = b.connect(&db).await;
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    let sql = "SELECT n FROM c WHERE id = 1";
    let acked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let mut checkers = Vec::new();
    // Many readers, so that confirmation rounds overlap and are shared.
    for proxy in [&a, &b, &a, &b, &a, &b, &a, &b, &a, &b, &a, &b] {
        let reader = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
        let (acked, done) = (Arc::clone(&acked), Arc::clone(&done));
        let strict = consistency == pgcache::config::Consistency::ReadYourWrites;
        checkers.push(tokio::spawn(async move {
            let mut behind = 0u64;
            while !done.load(Ordering::Acquire) {
                let floor = acked.load(Ordering::Acquire);
                let read = tokio::time::timeout(Duration::from_secs(10), scalar(&reader, sql));
                let n: u64 = read.await.expect("a read hung").unwrap().parse().unwrap();
                if n < floor {
                    assert!(!strict, "read {n} after {floor} was acknowledged");
                    behind += 1;
                }
            }
            behind
        }));
    }
    let mut stale = 0;
    for i in 1..=rounds {
        scalar(&cb, sql).await;
        scalar(&cb, sql).await;
        ca.batch_execute(&format!("UPDATE c SET n = {i} WHERE id = 1"))
            .await
            .unwrap();
        acked.store(i, Ordering::Release);
        if scalar(&cb, sql).await.as_deref() != Some(i.to_string().as_str()) {
            stale += 1;
        }
    }
    done.store(true, Ordering::Release);
    let mut behind = 0;
    for c in checkers {
        behind += c.await.unwrap();
    }
    eprintln!(
        "{consistency:?}: {stale} of {rounds} reads through B right after a write through A were \
         stale; concurrent readers saw {behind} reads older than an acknowledged write"
    );
    (stale, b.hits())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_your_writes_never_serves_a_state_older_than_an_acknowledged_write() {
    let rounds = 1000;
    let (stale, hits) =
        write_through_a_read_through_b(pgcache::config::Consistency::ReadYourWrites, rounds).await;
    assert_eq!(stale, 0);
    assert!(hits >= rounds / 2, "B served from its cache: {hits} hits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eventual_consistency_reports_its_window() {
    let rounds = 300;
    let (stale, hits) =
        write_through_a_read_through_b(pgcache::config::Consistency::Eventual, rounds).await;
    assert!(hits >= rounds / 2, "B served from its cache: {hits} hits");
    // The window read_your_writes closes is there: the same test with it
    // would fail.
    assert!(stale > 0, "no read was stale under eventual consistency");
}

/// Tags (`/*+ cache ttl=... tags=... */`): for what replication cannot see,
/// invalidated across instances by the admin console and by a NOTIFY sent
/// straight to PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_invalidate_across_instances_from_the_admin_console_and_a_notify() {
    let db = pg().create_db("shared_tags");
    pg().psql_db(
        &db,
        "CREATE TABLE prices(id int PRIMARY KEY, v int); INSERT INTO prices VALUES (1, 100); \
         CREATE VIEW eu_prices AS SELECT id, v FROM prices",
    );
    let mut with_admin = config(&redis().url());
    with_admin.admin.password = "tag-admin".to_owned();
    let a = Proxy::start(with_admin).await;
    let b = Proxy::start(config(&redis().url())).await;
    let (ca, cb) = (a.connect(&db).await, b.connect(&db).await);
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    let direct = pg().direct(&db).await;
    // A view: replication cannot see its changes, so only a TTL lets it be
    // cached, and only a tag lets it be invalidated sooner.
    let read = "/*+ cache ttl=10m tags=pricing,eu */ SELECT v FROM eu_prices WHERE id = 1";
    for (proxy, client) in [(&a, &ca), (&b, &cb)] {
        let hits = proxy.hits();
        for _ in 0..3 {
            assert_eq!(rows(client, read).await, [[Some("100".into())]]);
        }
        assert!(proxy.hits() > hits, "cached under its TTL");
    }
    let both_read = |want: &'static str| {
        let (ca, cb) = (&ca, &cb);
        async move {
            eventually(Duration::from_secs(10), want, || async {
                let fresh = rows(ca, read).await == [[Some(want.into())]]
                    && rows(cb, read).await == [[Some(want.into())]];
                fresh.then_some(())
            })
            .await
        }
    };

    // Changed directly: both instances still serve the old value (the TTL)...
    direct
        .batch_execute("UPDATE prices SET v = 200")
        .await
        .unwrap();
    assert_eq!(rows(&ca, read).await, [[Some("100".into())]]);
    assert_eq!(rows(&cb, read).await, [[Some("100".into())]]);
    // ... until the tag is invalidated on one instance's admin console.
    let admin = connect_dsn(&format!(
        "{} password=tag-admin",
        a.dsn("pgcache", &a.app.config().admin.database)
    ))
    .await
    .expect("admin console");
    admin.simple_query("INVALIDATE TAG pricing").await.unwrap();
    both_read("200").await;

    // Or by a NOTIFY from any session on PostgreSQL, naming a tag...
    direct
        .batch_execute("UPDATE prices SET v = 300")
        .await
        .unwrap();
    assert_eq!(
        rows(&cb, read).await,
        [[Some("200".into())]],
        "still cached"
    );
    direct
        .batch_execute("NOTIFY pgcache_invalidate, 'tag:eu'")
        .await
        .unwrap();
    both_read("300").await;
    // ... or the relation itself.
    direct
        .batch_execute("UPDATE prices SET v = 400")
        .await
        .unwrap();
    direct
        .batch_execute("SELECT pg_notify('pgcache_invalidate', 'table:eu_prices')")
        .await
        .unwrap();
    both_read("400").await;
    // Instance A's own listener heard both, though B's bumps (through
    // Redis) may have reached A first.
    eventually(
        Duration::from_secs(10),
        "A to hear both NOTIFYs",
        || async { (a.app.metrics.invalidations.notify.get() >= 2).then_some(()) },
    )
    .await;
}

/// The correctness sampler catches a wrong entry: one forged in Redis
/// (valid checksum, key and versions, another row), as a bug in pgcache
/// could have stored it. The hit is served, checked, found wrong, and its
/// table invalidated, so the next read is right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sampler_catches_a_wrong_entry_and_retires_it() {
    let db = pg().create_db("shared_verify");
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a')",
    );
    let redis = Redis::dedicated();
    // Both up first: an instance that starts streaming invalidates what was
    // stored before (it may have missed changes).
    let a = Proxy::start(config(&redis.url())).await;
    let mut checking = config(&redis.url());
    checking.cache.verify_sample_rate = 1.0;
    let b = Proxy::start(checking).await;
    let (ca, cb) = (a.connect(&db).await, b.connect(&db).await);
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(rows(&ca, read).await, [[Some("a".into())]]);
    stored(&a, 1).await;

    // Forge the stored row: 'a' becomes 'z', with a checksum to match.
    let mut conn = redis.client().await;
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut forged = 0;
    for key in keys {
        let Ok(value) = redis::cmd("GET")
            .arg(&key)
            .query_async::<Vec<u8>>(&mut conn)
            .await
        else {
            continue; // not a string: the versions
        };
        if !value.starts_with(b"PGC") {
            continue;
        }
        let entry_key = u128::from_le_bytes(value[12..28].try_into().unwrap());
        let n = u16::from_le_bytes([value[36], value[37]]) as usize;
        let versions: Vec<u64> = value[38..38 + n * 8]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let entry =
            pgcache::cache::shared::entry::decode(value.clone().into(), entry_key, &versions)
                .expect("a sound entry");
        let row = [b'D', 0, 0, 0, 11, 0, 1, 0, 0, 0, 1, b'a'];
        let at = entry
            .payload
            .windows(row.len())
            .position(|w| w == row)
            .expect("the row");
        let mut payload = entry.payload.to_vec();
        payload[at + row.len() - 1] = b'z';
        let value =
            pgcache::cache::shared::entry::encode(entry_key, entry.created_ms, &versions, &payload);
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(value)
            .query_async(&mut conn)
            .await
            .unwrap();
        forged += 1;
    }
    assert_eq!(forged, 1);

    // The other instance, checking every hit, serves it from Redis...
    assert_eq!(
        rows(&cb, read).await,
        [[Some("z".into())]],
        "the forged entry is served"
    );
    // ... finds it wrong, and retires it: the next read is PostgreSQL's.
    let m = b.app.metrics.verify.clone();
    eventually(Duration::from_secs(10), "the check's verdict", || {
        let found = m.mismatch.get();
        async move { (found == 1).then_some(()) }
    })
    .await;
    assert_eq!(rows(&cb, read).await, [[Some("a".into())]]);
    let statement = b.statement("FROM t WHERE");
    assert_eq!(statement.verify_mismatches, 1);
}
