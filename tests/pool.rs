//! Server connections parked between sessions: a client gets a parked
//! connection only when it cannot tell, and parked connections never stand
//! in the way of a database-level statement.

mod common;

use std::time::Duration;

use common::*;
use pgcache::config::{AuthMode, Config};

const WAIT: Duration = Duration::from_secs(15);

/// Reuse is off by default: these tests turn it on.
fn reusing(pg: &Pg) -> Config {
    let mut config = pg.proxy_config();
    config.pool.max_idle_servers = 16;
    config
}

/// Whether PostgreSQL still has a backend of this process id.
async fn alive(direct: &tokio_postgres::Client, pid: &str) -> bool {
    let sql = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
    scalar(direct, &sql).await.as_deref() == Some("1")
}

/// As directly: a client that disconnects and connects again gets a new
/// backend, and the old one is gone (pool libraries that replace a broken
/// connection check that its backend changed).
#[tokio::test]
async fn by_default_every_connection_gets_a_new_backend() {
    let pg = pg();
    let db = pg.create_db("pool_default_fresh");
    let proxy = Proxy::start(pg.proxy_config()).await;
    let direct = pg.direct(&db).await;
    let dsn = proxy.dsn("postgres", &db);
    let mut pids = Vec::new();
    for _ in 0..3 {
        let client = connect_dsn(&dsn).await.unwrap();
        let pid = backend_pid(&client).await;
        assert!(!pids.contains(&pid), "{pid} again after {pids:?}");
        drop(client);
        eventually(WAIT, "the backend to end with its client", || async {
            (!alive(&direct, &pid).await).then_some(())
        })
        .await;
        pids.push(pid);
    }
    assert_eq!(proxy.app.metrics.pool.parked.get(), 0);
}

async fn backend_pid(client: &tokio_postgres::Client) -> String {
    scalar(client, "SELECT pg_backend_pid()").await.unwrap()
}

/// Parked connections, plus the ones closed instead: every session end
/// with a Terminate adds one once the pool has decided.
fn decided(proxy: &Proxy) -> u64 {
    let m = &proxy.app.metrics.pool;
    m.parked.get()
        + m.closed_stale.get()
        + m.closed_failed.get()
        + m.closed_full.get()
        + m.closed_evicted.get()
        + m.closed_tainted.get()
}

/// Ends a session through pgcache and waits for the pool to decide about
/// its connection; true if it was parked.
async fn end(proxy: &Proxy, client: tokio_postgres::Client) -> bool {
    let before = decided(proxy);
    let parked = proxy.app.metrics.pool.parked.get();
    drop(client);
    eventually(WAIT, "the pool to decide", || async {
        (decided(proxy) > before).then_some(())
    })
    .await;
    proxy.app.metrics.pool.parked.get() > parked
}

/// Runs `work` in a session of its own and ends it. Returns the session's
/// backend pid and whether the connection was parked.
async fn session(proxy: &Proxy, dsn: &str, work: &str) -> (String, bool) {
    let client = connect_dsn(dsn).await.unwrap();
    let pid = backend_pid(&client).await;
    if !work.is_empty() {
        client.batch_execute(work).await.unwrap();
    }
    (pid, end(proxy, client).await)
}

/// A connection parked for `dsn`'s login, that the next such login will
/// get. The first connection pgcache reuses is closed instead (nothing
/// was seen of the role settings before it logged in), so the pool is
/// warmed with two sessions first.
async fn park(proxy: &Proxy, dsn: &str, work: &str) -> String {
    if proxy.app.metrics.pool.reused.get() + proxy.app.metrics.pool.closed_stale.get() == 0 {
        session(proxy, dsn, "").await;
        session(proxy, dsn, "").await;
    }
    match session(proxy, dsn, work).await {
        (pid, true) => pid,
        _ => panic!("the connection was not parked"),
    }
}

#[tokio::test]
async fn a_new_client_gets_the_parked_connection_without_the_last_ones_state() {
    let pg = pg();
    let db = pg.create_db("pool_reuse");
    let proxy = Proxy::start(reusing(pg)).await;
    let pid = park(
        &proxy,
        &proxy.dsn("postgres", &db),
        "SET work_mem = '1MB'; PREPARE p AS SELECT 1; \
         LISTEN somewhere; SELECT pg_advisory_lock(4242)",
    )
    .await;
    // While parked, it holds nothing: DISCARD ALL let the lock go.
    let direct = pg.direct(&db).await;
    assert_eq!(
        scalar(&direct, "SELECT pg_try_advisory_lock(4242)")
            .await
            .as_deref(),
        Some("t")
    );
    drop(direct);

    let reused = proxy.app.metrics.pool.reused.get();
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    assert_eq!(
        backend_pid(&client).await,
        pid,
        "the parked connection was reused"
    );
    assert_eq!(proxy.app.metrics.pool.reused.get(), reused + 1);
    assert_eq!(
        scalar(&client, "SHOW work_mem").await.as_deref(),
        Some("4MB")
    );
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM pg_prepared_statements")
            .await
            .as_deref(),
        Some("0")
    );
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM pg_listening_channels()")
            .await
            .as_deref(),
        Some("0")
    );
    // A session on a reused connection still cancels its own queries.
    let cancel = client.cancel_token();
    let sleeper = tokio::spawn(async move {
        let r = client.simple_query("SELECT pg_sleep(30)").await;
        r.err().and_then(|e| e.code().map(|c| c.code().to_owned()))
    });
    eventually(WAIT, "the sleep to start", || async {
        let direct = pg.direct(&db).await;
        let n = scalar(
            &direct,
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)'",
        )
        .await;
        (n.as_deref() == Some("1")).then_some(())
    })
    .await;
    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    assert_eq!(sleeper.await.unwrap().as_deref(), Some("57014"));
}

#[tokio::test]
async fn a_reused_connection_needs_no_settings_query_and_keys_results_alike() {
    let pg = pg();
    let db = pg.create_db("pool_settings");
    pg.psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 7)",
    );
    let proxy = Proxy::start(reusing(pg)).await;
    proxy.connect(&db).await; // the stream up and the table known
    let read = "SELECT v FROM t WHERE id = 1";
    let pid = park(&proxy, &proxy.dsn("postgres", &db), read).await;
    let queries = proxy.app.metrics.settings_queries.get();
    let hits = proxy.hits();
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("7"));
    assert_eq!(
        proxy.hits(),
        hits + 1,
        "the earlier session's entry, under the same key"
    );
    assert_eq!(proxy.app.metrics.settings_queries.get(), queries);
    assert_eq!(backend_pid(&client).await, pid);
    // Once the session changes a setting, it is asked again.
    client
        .batch_execute("SET DateStyle = 'German'")
        .await
        .unwrap();
    scalar(&client, read).await;
    assert_eq!(proxy.app.metrics.settings_queries.get(), queries + 1);
}

#[tokio::test]
async fn a_session_that_defined_a_custom_setting_or_a_temp_schema_leaves_no_trace() {
    let pg = pg();
    let db = pg.create_db("pool_custom");
    let proxy = Proxy::start(reusing(pg)).await;
    park(&proxy, &proxy.dsn("postgres", &db), "").await;
    let (pid, parked) = session(&proxy, &proxy.dsn("postgres", &db), "SET app.tenant = '7'").await;
    assert!(
        !parked,
        "a connection with a custom setting defined is not parked"
    );
    assert!(proxy.app.metrics.pool.closed_tainted.get() >= 1);
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    assert_ne!(backend_pid(&client).await, pid);
    // A fresh backend has never heard of it: NULL, not ''.
    assert_eq!(
        scalar(&client, "SELECT current_setting('app.tenant', true)").await,
        None
    );
    end(&proxy, client).await;
    // A temporary schema, once made, stays with its backend.
    let tainted = proxy.app.metrics.pool.closed_tainted.get();
    let (_, parked) = session(
        &proxy,
        &proxy.dsn("postgres", &db),
        "CREATE TEMP TABLE s(a int)",
    )
    .await;
    assert!(
        !parked,
        "a connection that made a temporary schema is not parked"
    );
    assert_eq!(proxy.app.metrics.pool.closed_tainted.get(), tainted + 1);
}

#[tokio::test]
async fn role_settings_changed_directly_reach_the_next_client() {
    let pg = pg();
    let db = pg.create_db("pool_role");
    let role = format!("pool_role_{}", rand_suffix());
    pg.psql_admin(&format!("CREATE ROLE {role} LOGIN"));
    let proxy = Proxy::start(reusing(pg)).await;

    // Changed while a connection is parked: the parked one is not used.
    let pid = park(&proxy, &proxy.dsn(&role, &db), "").await;
    pg.psql_admin(&format!("ALTER ROLE {role} SET work_mem = '3MB'"));
    let client = connect_dsn(&proxy.dsn(&role, &db)).await.unwrap();
    assert_ne!(backend_pid(&client).await, pid);
    assert_eq!(
        scalar(&client, "SHOW work_mem").await.as_deref(),
        Some("3MB")
    );
    end(&proxy, client).await;

    // Changed while a connection serves: it is not reused afterwards.
    let pid = park(&proxy, &proxy.dsn(&role, &db), "").await;
    let client = connect_dsn(&proxy.dsn(&role, &db)).await.unwrap();
    assert_eq!(backend_pid(&client).await, pid);
    pg.psql_admin(&format!("ALTER ROLE {role} SET work_mem = '5MB'"));
    end(&proxy, client).await;
    let client = connect_dsn(&proxy.dsn(&role, &db)).await.unwrap();
    assert_ne!(
        backend_pid(&client).await,
        pid,
        "reused with outdated settings"
    );
    assert_eq!(
        scalar(&client, "SHOW work_mem").await.as_deref(),
        Some("5MB")
    );
}

#[tokio::test]
async fn drop_database_through_pgcache_is_not_blocked_by_parked_connections() {
    let pg = pg();
    let db = pg.create_db("pool_drop");
    // Without caching: a replication slot would hold the database too.
    let mut config = reusing(pg);
    config.cache.enabled = false;
    let proxy = Proxy::start(config).await;
    park(&proxy, &proxy.dsn("postgres", &db), "").await;
    assert_eq!(proxy.app.pool.idle_count(), 1);
    let admin = connect_dsn(&proxy.dsn("postgres", "postgres"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("DROP DATABASE {db}"))
        .await
        .expect("DROP DATABASE succeeds while a connection to it was parked");
    assert_eq!(proxy.app.pool.idle_count(), 0);
}

/// With caching on, a session knows a text it ran before, and what its
/// word scan found, without scanning it again: the second `DROP DATABASE`
/// of the same text must still close the connections parked for it.
#[tokio::test]
async fn a_repeated_database_statement_still_closes_parked_connections() {
    let pg = pg();
    // With caching on, the marks are kept with the text's plan; with it
    // off, in a memo of their own.
    for caching in [true, false] {
        let mut config = reusing(pg);
        config.cache.enabled = caching;
        let proxy = Proxy::start(config).await;
        let db = format!("t_pool_redrop_{}", rand_suffix());
        let admin = connect_dsn(&proxy.dsn("postgres", "postgres"))
            .await
            .unwrap();
        let drop_it = format!("DROP DATABASE {db}");
        for round in 1..=2 {
            pg.psql_admin(&format!("CREATE DATABASE {db}"));
            park(&proxy, &proxy.dsn("postgres", &db), "").await;
            assert!(proxy.app.pool.idle_count() >= 1);
            admin.batch_execute(&drop_it).await.unwrap_or_else(|e| {
                panic!("caching {caching}, DROP DATABASE, time {round}: {e:?}")
            });
            assert_eq!(
                proxy.app.pool.idle_count(),
                0,
                "caching {caching}, time {round}"
            );
        }
    }
}

#[tokio::test]
async fn a_parked_connection_that_died_is_replaced_unseen() {
    let pg = pg();
    let db = pg.create_db("pool_dead");
    let proxy = Proxy::start(reusing(pg)).await;
    let pid = park(&proxy, &proxy.dsn("postgres", &db), "").await;
    let direct = pg.direct(&db).await;
    scalar(&direct, &format!("SELECT pg_terminate_backend({pid})")).await;
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    assert_ne!(backend_pid(&client).await, pid);
    assert_eq!(scalar(&client, "SELECT 1").await.as_deref(), Some("1"));
    assert!(proxy.app.metrics.pool.closed_failed.get() >= 1);
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_idle_timeout() {
    let pg = pg();
    let db = pg.create_db("pool_idle");
    let mut config = reusing(pg);
    config.pool.server_idle_timeout_secs = 1;
    let proxy = Proxy::start(config).await;
    let pid = park(&proxy, &proxy.dsn("postgres", &db), "").await;
    let direct = pg.direct(&db).await;
    eventually(WAIT, "the parked backend to exit", || async {
        let n = scalar(
            &direct,
            &format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"),
        )
        .await;
        (n.as_deref() == Some("0")).then_some(())
    })
    .await;
    assert_eq!(proxy.app.pool.idle_count(), 0);
    assert!(proxy.app.metrics.pool.closed_expired.get() >= 1);
}

#[tokio::test]
async fn password_logins_are_reused_only_when_pgcache_checked_the_password() {
    let pg = pg();
    let db = pg.create_db("pool_password");
    // Passthrough: PostgreSQL asked this client for a password, so its
    // connection may serve no one else.
    let proxy = Proxy::start(reusing(pg)).await;
    let dsn = format!("{} password={MD5_PASSWORD}", proxy.dsn(MD5_USER, &db));
    for _ in 0..3 {
        let client = connect_dsn(&dsn).await.unwrap();
        scalar(&client, "SELECT 1").await;
    }
    let wrong = format!("{} password=wrong", proxy.dsn(MD5_USER, &db));
    let Err(refused) = connect_dsn(&wrong).await else {
        panic!("a wrong password is refused");
    };
    assert_eq!(refused.code().map(|c| c.code()), Some("28P01"));
    assert_eq!(proxy.app.metrics.pool.reused.get(), 0);
    assert_eq!(proxy.app.pool.idle_count(), 0);

    // Terminate mode: pgcache checked the password, so it may reuse.
    let mut config = reusing(pg);
    config.auth.mode = AuthMode::Terminate;
    config
        .auth
        .users
        .insert(MD5_USER.to_owned(), MD5_PASSWORD.to_owned());
    let proxy = Proxy::start(config).await;
    let dsn = format!("{} password={MD5_PASSWORD}", proxy.dsn(MD5_USER, &db));
    let pid = park(&proxy, &dsn, "").await;
    let client = connect_dsn(&dsn).await.unwrap();
    assert_eq!(backend_pid(&client).await, pid);
    let wrong = format!("{} password=wrong", proxy.dsn(MD5_USER, &db));
    assert!(connect_dsn(&wrong).await.is_err());
}
