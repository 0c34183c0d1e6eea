//! Shadow mode (`cache.mode = "shadow"`): nothing is served from the
//! cache, yet everything else is done as if it were, and every would-be
//! hit is checked against PostgreSQL's answer.

mod common;

use std::time::Duration;

use common::*;
use pgcache::config::CacheMode;

fn shadow_config() -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.cache.mode = CacheMode::Shadow;
    config
}

/// The statistics of the statement whose text contains `needle`.
fn stats_of(proxy: &Proxy, needle: &str) -> pgcache::cache::stats::QueryRow {
    proxy
        .app
        .cache
        .stats
        .top(100)
        .into_iter()
        .find(|q| q.text.contains(needle))
        .unwrap_or_else(|| panic!("statistics for {needle}"))
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
    let q = stats_of(&proxy, "FROM t WHERE");
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
    assert_eq!(stats_of(&proxy, "FROM tv WHERE").mismatches, 1);
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
