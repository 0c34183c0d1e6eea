//! Trusting the cache: shadow mode (`cache.mode = "shadow"`: nothing is
//! served from the cache, yet everything else is done as if it were, and
//! every would-be hit is checked against PostgreSQL's answer) and the
//! correctness sampler (served hits checked against PostgreSQL after the
//! fact).

mod common;

use std::time::Duration;

use common::*;
use pgcache::config::CacheMode;

fn shadow_config() -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.cache.mode = CacheMode::Shadow;
    config
}

#[tokio::test]
async fn shadow_mode_serves_nothing_yet_counts_and_checks_every_would_be_hit() {
    let db = pg().create_db("shadow");
    pg().psql_db(
        &db,
        "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a'), (2, 'b')",
    );
    let proxy = Proxy::start(shadow_config()).await;
    let client = proxy.connect(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    // The first read fills, the next three would have been hits.
    for _ in 0..4 {
        assert_eq!(rows(&client, read).await, [[Some("a".into())]]);
    }
    let m = &proxy.app.metrics;
    assert_eq!(proxy.hits(), 0, "nothing served");
    assert_eq!((m.shadow_match.get(), m.shadow_mismatch.get()), (3, 0));
    let q = proxy.statement("FROM t WHERE");
    assert_eq!((q.hits, q.misses, q.would_hits, q.mismatches), (0, 1, 3, 0));
    assert!(q.would_save_ms > 0.0);

    // A would-be hit still goes to PostgreSQL: a lock there holds it up.
    let locker = lock_table(&db, "t").await;
    let reader = tokio::spawn({
        let client = proxy.connect(&db).await;
        async move { rows(&client, read).await }
    });
    let direct = pg().direct(&db).await;
    eventually(Duration::from_secs(10), "the read to wait for the lock", || async {
        let waiting: i64 = direct
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE query = $1 AND wait_event_type = 'Lock'",
                &[&read],
            )
            .await
            .unwrap()
            .get(0);
        (waiting == 1).then_some(())
    })
    .await;
    locker.batch_execute("COMMIT").await.unwrap();
    assert_eq!(reader.await.unwrap(), [[Some("a".into())]]);
    assert_eq!((m.shadow_match.get(), proxy.hits()), (4, 0));

    // A stale entry is caught: a view cached by TTL (replication cannot
    // watch it) whose table changed.
    direct
        .batch_execute("CREATE VIEW tv AS SELECT id, v FROM t")
        .await
        .unwrap();
    proxy.wait_streaming(&db).await;
    let by_ttl = "/*+ cache ttl=600 */ SELECT v FROM tv WHERE id = 2";
    assert_eq!(rows(&client, by_ttl).await, [[Some("b".into())]]);
    direct
        .batch_execute("UPDATE t SET v = 'B' WHERE id = 2")
        .await
        .unwrap();
    assert_eq!(
        rows(&client, by_ttl).await,
        [[Some("B".into())]],
        "PostgreSQL's answer"
    );
    assert_eq!(
        m.shadow_mismatch.get(),
        1,
        "the stored answer was not PostgreSQL's"
    );
    assert_eq!(proxy.statement("FROM tv WHERE").mismatches, 1);
    assert_eq!(proxy.hits(), 0);
}

#[tokio::test]
async fn reload_switches_from_shadow_to_serving_without_a_restart() {
    let db = pg().create_db("shadowreload");
    pg().psql_db(
        &db,
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)",
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pgcache.toml");
    let base = pg().proxy_config();
    let write = |mode: &str| {
        std::fs::write(
            &file,
            format!(
                "[upstream]\nurl = \"{}\"\n[server]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
                 [replication]\nmax_staleness_ms = 5000\n[cache]\nmode = \"{mode}\"\n",
                base.upstream.url
            ),
        )
        .unwrap()
    };
    write("shadow");
    let config = pgcache::Config::load(Some(&file), &Default::default()).unwrap();
    let proxy = Proxy::start(config).await;
    proxy
        .app
        .set_config_source(Some(file.clone()), Default::default());
    let client = proxy.connect(&db).await;
    let read = "SELECT id FROM t WHERE id = 1";
    for _ in 0..3 {
        rows(&client, read).await;
    }
    assert_eq!(proxy.hits(), 0);
    assert_eq!(proxy.app.metrics.shadow_match.get(), 2);
    write("auto");
    let restart = proxy.app.reload().expect("reloaded");
    assert!(restart.is_empty(), "no restart needed: {restart:?}");
    // The entry the shadow filled is served at once.
    assert_eq!(rows(&client, read).await, [[Some("1".into())]]);
    assert_eq!(proxy.hits(), 1);
}

fn sampler_config() -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.cache.verify_sample_rate = 1.0;
    config.cache.verify_max_per_sec = 1_000_000;
    config
}

/// The sampler's outcomes so far: (match, mismatch, ttl_expected, changed,
/// skipped), once every drawn check has one.
async fn verdicts(proxy: &Proxy) -> (u64, u64, u64, u64, u64) {
    let m = proxy.app.metrics.verify.clone();
    let sampler = &proxy.app.cache.sampler;
    eventually(Duration::from_secs(20), "every check judged", || {
        let v = (
            m.matched.get(),
            m.mismatch.get(),
            m.ttl_expected.get(),
            m.changed.get(),
            m.skipped.get(),
        );
        let judged = v.0 + v.1 + v.2 + v.3 + v.4;
        let drawn = sampler.drawn();
        async move { (judged == drawn).then_some(v) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sampler_finds_no_mismatch_under_concurrent_reads_and_writes() {
    let db = pg().create_db("verify");
    pg().psql_db(
        &db,
        "CREATE TABLE acc (id int PRIMARY KEY, v int); INSERT INTO acc SELECT g, 0 FROM generate_series(1, 20) g",
    );
    let proxy = Proxy::start(sampler_config()).await;
    proxy.connect(&db).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for reader in 0..3 {
        let client = proxy.connect(&db).await;
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while std::time::Instant::now() < deadline {
                let id = (n % 5) as i32 + 1 + reader;
                client
                    .query_one("SELECT v FROM acc WHERE id = $1", &[&id])
                    .await
                    .unwrap();
                n += 1;
            }
        }));
    }
    // Writes through pgcache and straight to PostgreSQL.
    for through_pgcache in [true, false] {
        let client = if through_pgcache {
            proxy.connect(&db).await
        } else {
            pg().direct(&db).await
        };
        tasks.push(tokio::spawn(async move {
            let mut n = 0i32;
            while std::time::Instant::now() < deadline {
                client
                    .execute("UPDATE acc SET v = v + 1 WHERE id = $1", &[&(n % 8 + 1)])
                    .await
                    .unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (matched, mismatch, ttl_expected, changed, _skipped) = verdicts(&proxy).await;
    assert!(proxy.hits() > 100, "a workload of hits: {}", proxy.hits());
    assert!(matched > 100, "hits checked: {matched}");
    assert_eq!(
        (mismatch, ttl_expected),
        (0, 0),
        "changed meanwhile: {changed}"
    );
}

#[tokio::test]
async fn session_mode_checks_hits_on_a_pool_connection_in_the_clients_settings() {
    let db = pg().create_db("verifyoffpath");
    pg().psql_db(
        &db,
        "CREATE SCHEMA other; \
         CREATE TABLE items (id int PRIMARY KEY, name text, at timestamptz); \
         CREATE TABLE other.items (id int PRIMARY KEY, name text, at timestamptz); \
         INSERT INTO items VALUES (1, 'public', '2026-01-01 00:00+00'); \
         INSERT INTO other.items VALUES (1, 'other', '2026-01-01 00:00+00')",
    );
    let proxy = Proxy::start(sampler_config()).await;
    let client = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    // Both change the answer: a check run in the pool connection's own
    // settings would find a mismatch.
    client
        .batch_execute("SET search_path = other; SET TimeZone = 'Asia/Tokyo'")
        .await
        .unwrap();
    let read = client
        .prepare("SELECT name, at::text FROM items WHERE id = $1")
        .await
        .unwrap();
    eventually(Duration::from_secs(20), "the read to be cached", || async {
        let before = proxy.hits();
        client.query_one(&read, &[&1i32]).await.unwrap();
        (proxy.hits() > before).then_some(())
    })
    .await;
    let hits = proxy.hits();
    // Twenty reads pipelined on one connection: a check sent on the
    // client's own connection would make the reads behind it bypass the
    // cache (`pipelined`).
    let reads = (0..20).map(|_| client.query_one(&read, &[&1i32]));
    for row in futures_util::future::join_all(reads).await {
        let row = row.unwrap();
        assert_eq!(row.get::<_, &str>(0), "other");
        assert_eq!(row.get::<_, &str>(1), "2026-01-01 09:00:00+09");
    }
    assert_eq!(proxy.hits(), hits + 20, "every pipelined read a hit");
    let (matched, mismatch, ttl_expected, _, skipped) = verdicts(&proxy).await;
    assert_eq!((mismatch, ttl_expected, skipped), (0, 0, 0));
    assert!(matched >= 20, "{matched} checks matched");
    // On a connection of the pool of the client's database and user.
    let pool = proxy
        .app
        .pool
        .pooled
        .all()
        .into_iter()
        .find(|p| p.row().database == db)
        .expect("a pool for the checks");
    assert!(pool.row().checkouts >= 20);
}

#[tokio::test]
async fn a_ttl_cached_view_that_lags_its_table_is_reported_as_expected_not_as_an_error() {
    let db = pg().create_db("verifyttl");
    pg().psql_db(
        &db,
        "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a'); \
         CREATE VIEW tv AS SELECT id, v FROM t",
    );
    let proxy = Proxy::start(sampler_config()).await;
    let client = proxy.connect(&db).await;
    let read = "/*+ cache ttl=600 */ SELECT v FROM tv WHERE id = 1";
    for _ in 0..2 {
        assert_eq!(rows(&client, read).await, [[Some("a".into())]]);
    }
    assert_eq!(verdicts(&proxy).await, (1, 0, 0, 0, 0));
    pg().direct(&db)
        .await
        .batch_execute("UPDATE t SET v = 'b'")
        .await
        .unwrap();
    // Served from the cache under its TTL, and checked.
    assert_eq!(rows(&client, read).await, [[Some("a".into())]]);
    assert_eq!(verdicts(&proxy).await, (1, 0, 1, 0, 0));
    assert_eq!(proxy.statement("FROM tv WHERE").verify_mismatches, 0);
}

#[tokio::test]
async fn the_sampler_keeps_to_its_budget() {
    let db = pg().create_db("verifybudget");
    pg().psql_db(
        &db,
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)",
    );
    let mut config = sampler_config();
    config.cache.verify_max_per_sec = 2;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    let started = std::time::Instant::now();
    for _ in 0..21 {
        rows(&client, "SELECT id FROM t WHERE id = 1").await;
    }
    let seconds = started.elapsed().as_secs() + 1;
    let (matched, mismatch, _, changed, skipped) = verdicts(&proxy).await;
    // A statement sent while a check is still in flight on the connection
    // goes to PostgreSQL (pipelined), so not all of the 20 are hits.
    let hits = proxy.hits();
    assert!(hits >= 10, "{hits} hits");
    assert_eq!(
        matched + mismatch + changed + skipped,
        hits,
        "every hit drawn at rate 1"
    );
    assert!(
        matched + changed <= 2 * (seconds + 1),
        "{matched} checks in {seconds} s"
    );
    assert!(skipped >= hits - 2 * (seconds + 1));
}

#[tokio::test]
async fn advice_for_a_known_workload_names_the_right_statements() {
    let db = pg().create_db("advice");
    pg().psql_db(
        &db,
        "CREATE TABLE calm (id int PRIMARY KEY, v int); INSERT INTO calm VALUES (1, 1); \
         CREATE TABLE busy (id int PRIMARY KEY, v int); INSERT INTO busy VALUES (1, 1); \
         CREATE VIEW calm_view AS SELECT id, v FROM calm",
    );
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    for _ in 0..20 {
        rows(&client, "SELECT v FROM calm WHERE id = 1").await;
        rows(&client, "SELECT v FROM calm_view WHERE id = 1").await;
        rows(&client, "SELECT v FROM busy WHERE id = 1").await;
        client
            .batch_execute("UPDATE busy SET v = v + 1 WHERE id = 1")
            .await
            .unwrap();
        rows(&client, "SELECT v, random() FROM calm WHERE id = 1").await;
    }
    let (status, body) = proxy.http_get("/stats.json").await;
    assert_eq!(status, 200);
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    let advice_for = |needle: &str| {
        let q = stats["statements"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["query"].as_str().unwrap().contains(needle))
            .unwrap_or_else(|| panic!("{needle} in {body}"));
        (
            q["advice"].as_str().unwrap().to_owned(),
            q["hint"].as_str().unwrap().to_owned(),
        )
    };
    assert_eq!(advice_for("SELECT v FROM calm WHERE").0, "cache");
    assert_eq!(
        advice_for("FROM busy WHERE"),
        ("leave".into(), "/*+ nocache */".into())
    );
    assert_eq!(
        advice_for("FROM calm_view"),
        ("ttl".into(), "/*+ cache ttl=60s */".into())
    );
    assert_eq!(advice_for("random()").0, "leave");
}
