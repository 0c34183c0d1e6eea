//! Cache hints in SQL comments, the caching policy, miss coalescing and
//! refresh-ahead.

mod common;

use std::time::Duration;

use common::*;
use tokio_postgres::Client;

const TABLE: &str = "CREATE TABLE t(id int PRIMARY KEY, v int); \
                     INSERT INTO t SELECT g, g * 10 FROM generate_series(1, 20) g";

async fn setup(name: &str, config: pgcache::Config) -> (String, Proxy, Client) {
    let db = pg().create_db(name);
    pg().psql_db(&db, TABLE);
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    (db, proxy, client)
}

/// Runs `sql` twice (simple protocol) and returns how many hits that made.
async fn hits_of_two(proxy: &Proxy, client: &Client, sql: &str) -> u64 {
    let before = proxy.hits();
    let first = scalar(client, sql).await;
    let second = scalar(client, sql).await;
    assert_eq!(first, second, "{sql}");
    proxy.hits() - before
}

/// The same with the extended protocol and a parameter (one prepared
/// statement: tokio-postgres closes a dropped one in the background, and a
/// read racing with that Close is forwarded).
async fn extended_hits_of_two(proxy: &Proxy, client: &Client, sql: &str) -> u64 {
    let stmt = client.prepare(sql).await.unwrap();
    let before = proxy.hits();
    for _ in 0..2 {
        let row = client.query_one(&stmt, &[&3i32]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 30);
    }
    proxy.hits() - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nocache_hints_keep_a_statement_out_of_the_cache_in_both_protocols() {
    let (_db, proxy, client) = setup("hint_nocache", pg().proxy_config()).await;
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM t WHERE id = 1").await,
        1
    );
    for sql in [
        "/*+ nocache */ SELECT v FROM t WHERE id = 1",
        "SELECT v FROM t /*NO QUERY CACHE*/ WHERE id = 1",
        "/*+ cache */ /*+ nocache */ SELECT v FROM t WHERE id = 1",
    ] {
        assert_eq!(hits_of_two(&proxy, &client, sql).await, 0, "{sql}");
    }
    let sql = "SELECT v FROM t WHERE id = $1 /*+ nocache */";
    assert_eq!(extended_hits_of_two(&proxy, &client, sql).await, 0);
    let sql = "SELECT v FROM t WHERE id = $1";
    assert_eq!(extended_hits_of_two(&proxy, &client, sql).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_in_mode_caches_only_hinted_statements_and_never_unsafe_ones() {
    let mut config = pg().proxy_config();
    config.cache.mode = pgcache::config::CacheMode::OptIn;
    let (_db, proxy, client) = setup("hint_optin", config).await;
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM t WHERE id = 1").await,
        0
    );
    for sql in [
        "/*+ cache */ SELECT v FROM t WHERE id = 1",
        "/*FORCE QUERY CACHE*/ SELECT v FROM t WHERE id = 2",
        "SELECT v FROM t WHERE id = 4 /*+ cache ttl=5m tier=local */",
    ] {
        assert_eq!(hits_of_two(&proxy, &client, sql).await, 1, "{sql}");
    }
    let sql = "/*+ cache */ SELECT v FROM t WHERE id = $1";
    assert_eq!(extended_hits_of_two(&proxy, &client, sql).await, 1);
    // A hint never makes an unsafe statement cacheable.
    for sql in [
        "/*+ cache */ SELECT random() > 2",
        "/*+ cache */ SELECT v FROM t WHERE id = 1 FOR UPDATE",
        "/*FORCE QUERY CACHE*/ SELECT now() < '2000-01-01'",
    ] {
        let before = proxy.hits();
        client.simple_query(sql).await.unwrap();
        client.simple_query(sql).await.unwrap();
        assert_eq!(proxy.hits(), before, "{sql}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_hint_bounds_how_long_an_entry_is_served() {
    let (_db, proxy, client) = setup("hint_ttl", pg().proxy_config()).await;
    let sql = "/*+ cache ttl=300ms */ SELECT v FROM t WHERE id = 5";
    assert_eq!(hits_of_two(&proxy, &client, sql).await, 1);
    let plain = "SELECT v FROM t WHERE id = 6";
    assert_eq!(hits_of_two(&proxy, &client, plain).await, 1);
    let stores = proxy.stores();
    eventually(Duration::from_secs(10), "the entry to expire", || async {
        assert_eq!(scalar(&client, sql).await.as_deref(), Some("50"));
        (proxy.stores() > stores).then_some(())
    })
    .await;
    // The entry without a hint keeps the default TTL (300 s).
    let before = proxy.hits();
    scalar(&client, plain).await;
    assert_eq!(proxy.hits(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_are_cached_only_with_a_ttl_from_a_hint_or_a_table_rule() {
    let db = pg().create_db("hint_view");
    pg().psql_db(
        &db,
        &format!(
            "{TABLE}; CREATE VIEW tv AS SELECT id, v FROM t; CREATE VIEW other AS SELECT id FROM t"
        ),
    );
    let mut config = pg().proxy_config();
    config.cache.tables.push(pgcache::config::TableRule {
        name: "public.tv".into(),
        cache: true,
        ttl_secs: Some(60),
        ttl_only: true,
    });
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT count(*) FROM other").await,
        0
    );
    let hinted = "/*+ cache ttl=60s */ SELECT count(*) FROM other";
    assert_eq!(hits_of_two(&proxy, &client, hinted).await, 1);
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM tv WHERE id = 2").await,
        1
    );
    // Temporary relations stay uncacheable, hint or not.
    client
        .batch_execute("CREATE TEMP TABLE tmp AS SELECT 1 AS x")
        .await
        .unwrap();
    assert_eq!(
        hits_of_two(&proxy, &client, "/*+ cache ttl=60s */ SELECT x FROM tmp").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_role_and_database_rules_turn_caching_off() {
    let db = pg().create_db("policy_rules");
    pg().psql_db(
        &db,
        &format!(
            "{TABLE}; CREATE TABLE secret(id int PRIMARY KEY, s text); INSERT INTO secret VALUES (1, 'x'); \
             GRANT SELECT ON t, secret TO {MD5_USER}"
        ),
    );
    let off_db = pg().create_db("policy_off");
    pg().psql_db(&off_db, TABLE);
    let mut config = pg().proxy_config();
    config.cache.tables.push(pgcache::config::TableRule {
        name: "secret".into(),
        cache: false,
        ttl_secs: None,
        ttl_only: false,
    });
    config.cache.roles.insert(MD5_USER.into(), false);
    config.cache.databases.insert(off_db.clone(), false);
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT s FROM secret WHERE id = 1").await,
        0
    );
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM t WHERE id = 1").await,
        1
    );

    let md5 = connect_dsn(&format!(
        "{} password={MD5_PASSWORD}",
        proxy.dsn(MD5_USER, &db)
    ))
    .await
    .unwrap();
    assert_eq!(
        hits_of_two(&proxy, &md5, "SELECT v FROM t WHERE id = 2").await,
        0
    );
    // SET ROLE changes current_user, and the rule follows it.
    client
        .batch_execute(&format!("SET ROLE {MD5_USER}"))
        .await
        .unwrap();
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM t WHERE id = 3").await,
        0
    );
    client.batch_execute("RESET ROLE").await.unwrap();
    assert_eq!(
        hits_of_two(&proxy, &client, "SELECT v FROM t WHERE id = 3").await,
        1
    );

    let off = proxy.connect(&off_db).await;
    assert_eq!(
        hits_of_two(&proxy, &off, "SELECT v FROM t WHERE id = 1").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_unknown_hints_warn_once_per_statement_and_the_query_still_runs() {
    let (db, proxy, _client) = setup("hint_bad", pg().proxy_config()).await;
    let psql = pg().bin("psql");
    let port = proxy.addr.port().to_string();
    let out = run_tool(
        &psql,
        &[
            "-X",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-d",
            &db,
            "-At",
            "-c",
            "/*+ cache ttl=abc */ SELECT v FROM t WHERE id = 1",
            "-c",
            "/*+ cache ttl=abc */ SELECT v FROM t WHERE id = 1",
            "-c",
            "/*+ cash */ SELECT v FROM t WHERE id = 2",
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["10", "10", "20"]);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("WARNING"))
        .collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(warnings[0].contains("ttl=abc"), "{stderr}");
    assert!(warnings[1].contains("unknown hint"), "{stderr}");
    assert_eq!(proxy.app.metrics.hint_problems.get(), 2);
    // A malformed hint changes nothing: the statement was cached as usual.
    assert_eq!(proxy.hits(), 1);

    // The extended protocol too.
    let (client, mut notices) = connect_with_notices(&proxy.dsn("postgres", &db)).await;
    let sql = "SELECT v FROM t WHERE id = $1 /*+ cache tier=disk */";
    for _ in 0..2 {
        let row = client.query_one(sql, &[&3i32]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 30);
    }
    let notice = notices.recv().await.unwrap();
    assert!(
        notice.starts_with("WARNING") && notice.contains("tier=disk"),
        "{notice}"
    );
    assert!(
        notices.try_recv().is_err(),
        "warned once per statement text"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_of_one_key_make_one_backend_query() {
    let (db, proxy, client) = setup("coalesce", pg().proxy_config()).await;
    const N: usize = 5;
    let sql = "SELECT sum(v) FROM t WHERE id <= 10";
    let mut clients = Vec::new();
    for _ in 0..N {
        let c = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
        // Settings and catalog are learnt before the table is locked.
        scalar(&c, "SELECT v FROM t WHERE id = 20").await;
        clients.push(c);
    }
    let locker = pg().direct(&db).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let hits = proxy.hits();
    let mut tasks = Vec::new();
    for c in clients {
        tasks.push(tokio::spawn(async move { scalar(&c, sql).await }));
    }
    // One of them reached PostgreSQL and waits for the lock; the others
    // wait for it inside pgcache.
    let observer = pg().direct(&db).await;
    eventually(Duration::from_secs(20), "one waiting query, four coalesced", || async {
        let waiting: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE query = $1 AND wait_event_type = 'Lock'",
                &[&sql],
            )
            .await
            .unwrap()
            .get(0);
        assert!(waiting <= 1, "{waiting} queries reached PostgreSQL");
        (waiting == 1 && proxy.app.metrics.coalesced.get() == (N - 1) as u64).then_some(())
    })
    .await;
    locker.batch_execute("COMMIT").await.unwrap();
    for t in tasks {
        assert_eq!(t.await.unwrap().as_deref(), Some("550"));
    }
    assert_eq!(proxy.hits(), hits + (N - 1) as u64);
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_due_for_refresh_is_served_while_it_is_refreshed() {
    let (db, proxy, client) = setup("refresh", pg().proxy_config()).await;
    let sql = "/*+ cache ttl=60s refresh=200ms */ SELECT v FROM t WHERE id = 7";
    assert_eq!(scalar(&client, sql).await.as_deref(), Some("70"));
    let stores = proxy.stores();
    // While PostgreSQL cannot answer, hits keep coming from the cache; one
    // of them, once the entry is 200 ms old, starts the refresh.
    let locker = pg().direct(&db).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let m = &proxy.app.metrics;
    eventually(Duration::from_secs(10), "a refresh", || async {
        let v = tokio::time::timeout(Duration::from_secs(5), scalar(&client, sql))
            .await
            .expect("a hit does not wait for PostgreSQL");
        assert_eq!(v.as_deref(), Some("70"));
        (m.refreshes.get() == 1).then_some(())
    })
    .await;
    assert_eq!(proxy.stores(), stores, "the refresh waits for the lock");
    locker.batch_execute("COMMIT").await.unwrap();
    eventually(Duration::from_secs(10), "the refreshed entry", || async {
        (proxy.stores() == stores + 1).then_some(())
    })
    .await;
    // The session goes on normally, and the fresh entry is served.
    let hits = proxy.hits();
    assert_eq!(scalar(&client, sql).await.as_deref(), Some("70"));
    assert_eq!(proxy.hits(), hits + 1);
    assert_eq!(m.refreshes.get(), 1, "a fresh entry is not refreshed again");

    // The extended protocol, with a statement the cache answered before.
    let stmt = "/*+ cache ttl=60s refresh=200ms */ SELECT v FROM t WHERE id = $1";
    let row = client.query_one(stmt, &[&8i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 80);
    eventually(Duration::from_secs(10), "an extended refresh", || async {
        let row = client.query_one(stmt, &[&8i32]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 80);
        (m.refreshes.get() == 2).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "the refreshed entry", || async {
        (proxy.stores() == stores + 3).then_some(())
    })
    .await;
    let prepared = client.prepare(stmt).await.unwrap();
    for id in [8i32, 9, 8] {
        let row = client.query_one(&prepared, &[&id]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), id * 10);
    }
    client
        .batch_execute("UPDATE t SET v = 81 WHERE id = 8")
        .await
        .unwrap();
    let row = client.query_one(&prepared, &[&8i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 81);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refresh_after_secs_refreshes_entries_without_a_hint() {
    let mut config = pg().proxy_config();
    config.cache.refresh_after_secs = 1;
    let (_db, proxy, client) = setup("refresh_config", config).await;
    let sql = "SELECT v FROM t WHERE id = 9";
    assert_eq!(scalar(&client, sql).await.as_deref(), Some("90"));
    let stores = proxy.stores();
    let m = &proxy.app.metrics;
    eventually(Duration::from_secs(10), "a refresh", || async {
        assert_eq!(scalar(&client, sql).await.as_deref(), Some("90"));
        (m.refreshes.get() == 1).then_some(())
    })
    .await;
    eventually(Duration::from_secs(10), "the refreshed entry", || async {
        (proxy.stores() == stores + 1).then_some(())
    })
    .await;
}
