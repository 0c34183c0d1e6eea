//! Transaction pooling (`pool.mode = "transaction"`): clients share a few
//! server connections, hold one only while they need it, keep their own
//! settings and prepared statements, and are pinned where a feature lives
//! in one backend. Real PostgreSQL, real tokio-postgres clients.

mod common;

use std::time::Duration;

use common::*;
use pgcache::config::{Config, PoolMode};

const WAIT: Duration = Duration::from_secs(20);

fn config(pg: &Pg, size: usize) -> Config {
    let mut config = pg.proxy_config();
    config.pool.mode = PoolMode::Transaction;
    config.pool.default_pool_size = size;
    config.server.max_client_connections = 1200;
    config
}

fn checkouts(proxy: &Proxy) -> u64 {
    proxy.app.metrics.pooled.checkouts.get()
}

async fn sqlstate_of(client: &tokio_postgres::Client, sql: &str) -> String {
    let e = client.batch_execute(sql).await.expect_err("an error");
    e.code().expect("a server error").code().to_owned()
}

#[tokio::test]
async fn a_thousand_clients_share_ten_server_connections() {
    let pg = pg();
    let db = pg.create_db("tx_thousand");
    let direct = pg.direct(&db).await;
    direct
        .batch_execute(
            "CREATE TABLE counters(id int PRIMARY KEY, n int NOT NULL); \
             INSERT INTO counters SELECT g, 0 FROM generate_series(0, 9) g",
        )
        .await
        .unwrap();
    let proxy = Proxy::start(config(pg, 10)).await;
    let dsn = proxy.dsn("postgres", &db);
    let mut tasks = Vec::new();
    for i in 0..1000i32 {
        let dsn = dsn.clone();
        tasks.push(tokio::spawn(async move {
            let client = connect_dsn(&dsn).await.expect("connects through pgcache");
            client
                .batch_execute(&format!(
                    "BEGIN; UPDATE counters SET n = n + 1 WHERE id = {}; COMMIT",
                    i % 10
                ))
                .await
                .unwrap();
            // A prepared statement, bound in a later batch: it may run on
            // another server connection than the one it was parsed on.
            let row = client.query_one("SELECT $1::int * 2", &[&i]).await.unwrap();
            assert_eq!(row.get::<_, i32>(0), i * 2);
            client
        }));
    }
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.unwrap());
    }
    let total = scalar(&direct, "SELECT sum(n) FROM counters").await;
    assert_eq!(
        total.as_deref(),
        Some("1000"),
        "every transaction committed"
    );
    let pooled = &proxy.app.metrics.pooled;
    assert!(
        pooled.open.get() <= 10,
        "{} server connections open for a pool of 10",
        pooled.open.get()
    );
    let servers = scalar(
        &direct,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' \
             AND backend_type = 'client backend' AND pid <> pg_backend_pid() \
             AND query NOT ILIKE '%pg_catalog.pg_class%'"
        ),
    )
    .await
    .unwrap();
    // pgcache's own: the replication stream, its control and listening
    // connections, the catalog fetcher.
    assert!(
        servers.parse::<i64>().unwrap() <= 14,
        "{servers} backends for 1000 clients (10 pooled, and pgcache's own)"
    );
    assert_eq!(clients.len(), 1000, "all clients still connected");
}

/// Found by pgbench -c 8 against a fresh pgcache: the clients that
/// arrive while the first one logs in are greeted on a pool connection
/// whose settings are set for them first, and the ParameterStatus of
/// that SET must not reach a client before its AuthenticationOk.
#[tokio::test]
async fn a_crowd_arriving_at_once_is_greeted_in_protocol_order() {
    let pg = pg();
    let db = pg.create_db("tx_crowd");
    let proxy = Proxy::start(config(pg, 4)).await;
    let dsn = format!("{} application_name=crowd", proxy.dsn("postgres", &db));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let dsn = dsn.clone();
        tasks.push(tokio::spawn(async move {
            let client = connect_dsn(&dsn).await.expect("logs in through pgcache");
            scalar(&client, "SELECT current_setting('application_name')").await
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap().as_deref(), Some("crowd"));
    }
}

#[tokio::test]
async fn settings_stay_with_their_client_on_a_shared_connection() {
    let pg = pg();
    let db = pg.create_db("tx_settings");
    let direct = pg.direct(&db).await;
    direct
        .batch_execute(
            "CREATE SCHEMA a; CREATE SCHEMA b; \
             CREATE TABLE a.t(v text); INSERT INTO a.t VALUES ('from a'); \
             CREATE TABLE b.t(v text); INSERT INTO b.t VALUES ('from b')",
        )
        .await
        .unwrap();
    let proxy = Proxy::start(config(pg, 1)).await;
    let tokyo = proxy.connect(&db).await;
    let utc = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    tokyo
        .batch_execute("SET TimeZone = 'Asia/Tokyo'; SET search_path = a")
        .await
        .unwrap();
    utc.batch_execute("SET TimeZone = 'UTC'; SET search_path = b")
        .await
        .unwrap();
    let time = "SELECT '2020-01-01 00:00:00+00'::timestamptz::text";
    for _ in 0..3 {
        assert_eq!(
            scalar(&tokyo, time).await.as_deref(),
            Some("2020-01-01 09:00:00+09")
        );
        assert_eq!(
            scalar(&utc, time).await.as_deref(),
            Some("2020-01-01 00:00:00+00")
        );
        assert_eq!(
            scalar(&tokyo, "SELECT v FROM t").await.as_deref(),
            Some("from a")
        );
        assert_eq!(
            scalar(&utc, "SELECT v FROM t").await.as_deref(),
            Some("from b")
        );
        assert_eq!(
            scalar(&tokyo, "SHOW TimeZone").await.as_deref(),
            Some("Asia/Tokyo")
        );
    }
    let servers: usize = proxy
        .app
        .pool
        .pooled
        .all()
        .iter()
        .map(|p| p.servers().len())
        .sum();
    assert_eq!(servers, 1, "both ran on the pool's one connection");
    assert!(
        proxy.hits() > 0,
        "the reads were cached, each under its client's settings"
    );
    // RESET goes back to the server's default for this client only.
    tokyo.batch_execute("RESET TimeZone").await.unwrap();
    let default = scalar(&direct, "SHOW TimeZone").await;
    assert_eq!(scalar(&tokyo, "SHOW TimeZone").await, default);
    assert_eq!(scalar(&utc, "SHOW TimeZone").await.as_deref(), Some("UTC"));
}

#[tokio::test]
async fn a_reset_startup_parameter_goes_back_to_the_clients_value() {
    let pg = pg();
    let db = pg.create_db("tx_reset");
    let proxy = Proxy::start(config(pg, 1)).await;
    let connect = || async {
        let mut config: tokio_postgres::Config = proxy.dsn("postgres", &db).parse().unwrap();
        config.options("-c DateStyle=Postgres,MDY");
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
    let client = connect().await;
    // Another client of the pool's one connection, with the server's
    // default.
    let other = proxy.connect(&db).await;
    let style = "SHOW DateStyle";
    assert_eq!(
        scalar(&client, style).await.as_deref(),
        Some("Postgres, MDY")
    );
    for reset in [
        "RESET DateStyle",
        "SET DateStyle TO DEFAULT",
        "RESET ALL",
        "DISCARD ALL",
    ] {
        client
            .batch_execute("SET DateStyle = 'German'")
            .await
            .unwrap();
        assert_eq!(scalar(&other, style).await.as_deref(), Some("ISO, MDY"));
        assert_eq!(scalar(&client, style).await.as_deref(), Some("German, DMY"));
        client.batch_execute(reset).await.unwrap();
        // The same connection at once, and after another client had it.
        assert_eq!(
            scalar(&client, style).await.as_deref(),
            Some("Postgres, MDY"),
            "after {reset}"
        );
        assert_eq!(scalar(&other, style).await.as_deref(), Some("ISO, MDY"));
        assert_eq!(
            scalar(&client, style).await.as_deref(),
            Some("Postgres, MDY"),
            "after {reset} and another client"
        );
    }
    // A pinned client keeps its connection, and its startup value too.
    let pinned = connect().await;
    drop(other);
    pinned
        .batch_execute("CREATE TEMP TABLE scratch(a int); SET DateStyle = 'SQL'")
        .await
        .unwrap();
    pinned.batch_execute("RESET DateStyle").await.unwrap();
    assert_eq!(
        scalar(&pinned, style).await.as_deref(),
        Some("Postgres, MDY")
    );
}

/// A new database with a table `items` holding (1, 'one').
async fn items_db(pg: &Pg, name: &str) -> String {
    let db = pg.create_db(name);
    pg.direct(&db)
        .await
        .batch_execute(
            "CREATE TABLE items(id int PRIMARY KEY, name text); \
             INSERT INTO items VALUES (1, 'one')",
        )
        .await
        .unwrap();
    db
}

#[tokio::test]
async fn cache_hits_take_no_server_connection() {
    let pg = pg();
    let db = items_db(pg, "tx_hits").await;
    let mut config = config(pg, 2);
    // The sampler checks a drawn hit on a server connection of its own
    // (1 hit in 1,000 by default): that check is not the hit's.
    config.cache.verify_sample_rate = 0.0;
    let proxy = Proxy::start(config).await;
    let warm = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    let read = "SELECT name FROM items WHERE id = 1";
    eventually(WAIT, "the read to be cached", || async {
        let before = proxy.hits();
        scalar(&warm, read).await;
        (proxy.hits() > before).then_some(())
    })
    .await;
    let client = proxy.connect(&db).await;
    scalar(&client, read).await; // its settings are read once
    let (taken, hits) = (checkouts(&proxy), proxy.hits());
    for _ in 0..20 {
        assert_eq!(scalar(&client, read).await.as_deref(), Some("one"));
    }
    assert_eq!(proxy.hits(), hits + 20);
    assert_eq!(checkouts(&proxy), taken, "no hit took a server connection");
}

#[tokio::test]
async fn a_client_that_waits_too_long_gets_57014_and_goes_on() {
    let pg = pg();
    let db = pg.create_db("tx_wait");
    let mut config = config(pg, 1);
    config.pool.query_wait_timeout_secs = 1;
    let proxy = Proxy::start(config).await;
    let holder = proxy.connect(&db).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = proxy.connect(&db).await;
    assert_eq!(sqlstate_of(&waiter, "SELECT 1").await, "57014");
    assert_eq!(proxy.app.metrics.pooled.wait_timeouts.get(), 1);
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(scalar(&waiter, "SELECT 2").await.as_deref(), Some("2"));
}

#[tokio::test]
async fn features_that_live_in_one_backend_pin_their_client() {
    let pg = pg();
    let db = pg.create_db("tx_pins");
    let proxy = Proxy::start(config(pg, 3)).await;
    let temp = proxy.connect(&db).await;
    let locker = proxy.connect(&db).await;
    let other = proxy.connect(&db).await;
    temp.batch_execute("CREATE TEMP TABLE scratch(a int); INSERT INTO scratch VALUES (1)")
        .await
        .unwrap();
    let pid = scalar(&temp, "SELECT pg_backend_pid()").await;
    // Another client holds the pool's other connection meanwhile.
    other.batch_execute("BEGIN").await.unwrap();
    for _ in 0..3 {
        temp.batch_execute("INSERT INTO scratch VALUES (2)")
            .await
            .unwrap();
        assert_eq!(scalar(&temp, "SELECT pg_backend_pid()").await, pid);
    }
    assert_eq!(
        scalar(&temp, "SELECT count(*) FROM scratch")
            .await
            .as_deref(),
        Some("4")
    );
    other.batch_execute("COMMIT").await.unwrap();
    // A session-level advisory lock is released on the backend that took it.
    assert_eq!(
        scalar(&locker, "SELECT pg_advisory_lock(7)::text")
            .await
            .as_deref(),
        Some("")
    );
    other.batch_execute("SELECT 1").await.unwrap();
    assert_eq!(
        scalar(&locker, "SELECT pg_advisory_unlock(7)::text")
            .await
            .as_deref(),
        Some("true")
    );
    let pins = &proxy.app.metrics.pooled.pins;
    assert_eq!(pins.with_label_values(&["temp_objects"]).get(), 1);
    assert_eq!(pins.with_label_values(&["advisory_lock"]).get(), 1);
}

#[tokio::test]
async fn cancel_reaches_the_connection_in_use() {
    let pg = pg();
    let db = pg.create_db("tx_cancel");
    let proxy = Proxy::start(config(pg, 2)).await;
    let client = proxy.connect(&db).await;
    let token = client.cancel_token();
    let sleeping = tokio::spawn(async move {
        let e = client
            .batch_execute("SELECT pg_sleep(30)")
            .await
            .unwrap_err();
        e.code().map(|c| c.code().to_owned())
    });
    // The cancel goes out once the sleep holds a connection.
    eventually(WAIT, "the query to be running", || async {
        (proxy.app.metrics.pooled.active.get() > 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let code = tokio::time::timeout(WAIT, sleeping).await.unwrap().unwrap();
    assert_eq!(code.as_deref(), Some("57014"));
}

#[tokio::test]
async fn a_client_killed_mid_transaction_frees_its_connection() {
    let pg = pg();
    let db = pg.create_db("tx_killed");
    let direct = pg.direct(&db).await;
    direct
        .batch_execute("CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0)")
        .await
        .unwrap();
    let proxy = Proxy::start(config(pg, 1)).await;
    let (client, connection) =
        tokio_postgres::connect(&proxy.dsn("postgres", &db), tokio_postgres::NoTls)
            .await
            .unwrap();
    let task = tokio::spawn(connection);
    client
        .batch_execute("BEGIN; UPDATE t SET v = 1 WHERE id = 1")
        .await
        .unwrap();
    task.abort(); // the socket closes without a word
    let next = proxy.connect(&db).await;
    next.batch_execute("UPDATE t SET v = 2 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(
        scalar(&direct, "SELECT v FROM t").await.as_deref(),
        Some("2")
    );
    // pgcache's own connections (its heartbeats commit in this database)
    // are not the killed client's.
    assert_eq!(
        scalar(
            &next,
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'transactionid' AND a.datname = current_database() \
             AND a.application_name <> 'pgcache'"
        )
        .await
        .as_deref(),
        Some("0")
    );
}

#[tokio::test]
async fn terminated_pool_connections_are_replaced() {
    let pg = pg();
    let db = pg.create_db("tx_terminated");
    let proxy = Proxy::start(config(pg, 2)).await;
    let client = proxy.connect(&db).await;
    client.batch_execute("SELECT 1").await.unwrap();
    let idle_pids = || -> Vec<u32> {
        proxy
            .app
            .pool
            .pooled
            .all()
            .iter()
            .flat_map(|p| p.servers())
            .filter(|s| !s.active)
            .map(|s| s.pid)
            .collect()
    };
    let pids = idle_pids();
    assert!(!pids.is_empty(), "an idle pooled connection");
    let direct = pg.direct(&db).await;
    let listed = pids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    direct
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({listed})"
        ))
        .await
        .unwrap();
    eventually(WAIT, "the backends to be gone", || async {
        let left = scalar(
            &direct,
            &format!("SELECT count(*) FROM pg_stat_activity WHERE pid IN ({listed})"),
        )
        .await;
        (left.as_deref() == Some("0")).then_some(())
    })
    .await;
    assert_eq!(scalar(&client, "SELECT 2").await.as_deref(), Some("2"));
    let now = idle_pids();
    assert!(!now.is_empty(), "a new connection served the client");
    assert!(
        now.iter().all(|pid| !pids.contains(pid)),
        "{now:?} are new, not {pids:?}"
    );
}

#[tokio::test]
async fn a_client_that_learned_its_backend_pid_keeps_that_backend() {
    let pg = pg();
    let db = pg.create_db("tx_backend_pid");
    let proxy = Proxy::start(config(pg, 2)).await;
    let (client, connection) =
        tokio_postgres::connect(&proxy.dsn("postgres", &db), tokio_postgres::NoTls)
            .await
            .unwrap();
    let connection = tokio::spawn(connection);
    let pid = scalar(&client, "SELECT pg_backend_pid()").await.unwrap();
    let other = proxy.connect(&db).await;
    other.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT pg_backend_pid()").await.as_deref(),
        Some(pid.as_str()),
        "the same backend while another client holds the other connection"
    );
    other.batch_execute("COMMIT").await.unwrap();
    let pins = &proxy.app.metrics.pooled.pins;
    assert_eq!(pins.with_label_values(&["backend_pid"]).get(), 1);
    // As directly, terminating that backend ends the client's session
    // (node-postgres's test of its issue 130 does this).
    other
        .batch_execute(&format!("SELECT pg_terminate_backend({pid})"))
        .await
        .unwrap();
    let ended = tokio::time::timeout(WAIT, connection)
        .await
        .expect("the session ends")
        .unwrap();
    let error = ended.expect_err("the session ends with an error");
    assert_eq!(error.code().map(|c| c.code()), Some("57P01"), "{error}");
}

#[tokio::test]
async fn the_admin_console_shows_pools_clients_and_servers() {
    let pg = pg();
    let db = pg.create_db("tx_show");
    let mut config = config(pg, 1);
    config.admin.password = "admin-secret".to_owned();
    let proxy = Proxy::start(config).await;
    let holder = proxy.connect(&db).await;
    let idle = proxy.connect(&db).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = proxy.connect(&db).await;
    let waiting = tokio::spawn(async move { waiter.batch_execute("SELECT 1").await });
    let admin = connect_dsn(&format!(
        "host=127.0.0.1 port={} user=pgcache password=admin-secret dbname=pgcache",
        proxy.addr.port()
    ))
    .await
    .unwrap();
    let show = |sql: &'static str| {
        let admin = &admin;
        async move {
            admin
                .simple_query(sql)
                .await
                .unwrap()
                .into_iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                        (0..r.len())
                            .map(|i| r.get(i).unwrap_or_default().to_owned())
                            .collect::<Vec<_>>(),
                    ),
                    _ => None,
                })
                .collect::<Vec<_>>()
        }
    };
    let pool = eventually(WAIT, "a waiting client", || async {
        let rows = show("SHOW POOLS").await;
        rows.into_iter().find(|r| r[0] == db && r[3] == "1")
    })
    .await;
    // database, user, cl_active, cl_waiting, cl_idle, sv_active, sv_idle, sv_open
    assert_eq!(&pool[2..8], ["1", "1", "1", "1", "0", "1"], "{pool:?}");
    assert_eq!(pool[12], "transaction");
    // pool_mode, server, role, lag_ms
    assert_eq!((pool[14].as_str(), pool[15].as_str()), ("primary", "0"));
    let clients = show("SHOW CLIENTS").await;
    let states: Vec<&str> = clients
        .iter()
        .filter(|r| r[2] == db)
        .map(|r| r[3].as_str())
        .collect();
    assert_eq!(states, ["active", "idle", "waiting"]);
    let holder_id = &clients
        .iter()
        .find(|r| r[2] == db && r[3] == "active")
        .unwrap()[10];
    let (_, json) = proxy.http_get("/stats.json").await;
    let stats: serde_json::Value = serde_json::from_str(&json).unwrap();
    let pool_json = &stats["pool"];
    assert_eq!(pool_json["mode"], "transaction");
    assert_eq!(pool_json["clients"]["waiting"], 1, "{pool_json}");
    assert_eq!(pool_json["servers"]["active"], 1, "{pool_json}");
    let servers = show("SHOW SERVERS").await;
    let server = servers.iter().find(|r| r[2] == db).unwrap();
    assert_eq!((server[3].as_str(), &server[9]), ("active", holder_id));
    assert_eq!(server[11], "primary", "its role: {server:?}");
    holder.batch_execute("COMMIT").await.unwrap();
    waiting.await.unwrap().unwrap();
    drop(idle);
}

#[tokio::test]
async fn connections_older_than_a_role_setting_are_not_reused() {
    let pg = pg();
    let db = pg.create_db("tx_role_setting");
    let role = format!("tx_role_{}", rand_suffix());
    let direct = pg.direct(&db).await;
    direct
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .unwrap();
    let proxy = Proxy::start(config(pg, 2)).await;
    let dsn = proxy.dsn(&role, &db);
    let first = connect_dsn(&dsn).await.unwrap();
    let before = scalar(&first, "SHOW work_mem").await;
    direct
        .batch_execute(&format!("ALTER ROLE {role} SET work_mem = '7MB'"))
        .await
        .unwrap();
    // The old connection is held: the next client needs a new one, which
    // logs in under the new setting.
    first.batch_execute("BEGIN").await.unwrap();
    let second = connect_dsn(&dsn).await.unwrap();
    assert_eq!(
        scalar(&second, "SHOW work_mem").await.as_deref(),
        Some("7MB")
    );
    assert_eq!(
        scalar(&first, "SHOW work_mem").await,
        before,
        "its transaction's connection"
    );
    first.batch_execute("COMMIT").await.unwrap();
    let stale = proxy.app.metrics.pooled.closed_stale.get();
    assert!(
        stale >= 1,
        "the older connection was closed, not given back"
    );
    for client in [&first, &second] {
        assert_eq!(
            scalar(client, "SHOW work_mem").await.as_deref(),
            Some("7MB")
        );
    }
    direct
        .batch_execute(&format!("ALTER ROLE {role} RESET work_mem"))
        .await
        .unwrap();
}

#[tokio::test]
async fn sampled_hits_are_checked_on_a_pool_connection_off_the_clients_path() {
    let pg = pg();
    let db = items_db(pg, "tx_sampler").await;
    let mut config = config(pg, 2);
    config.cache.verify_sample_rate = 1.0;
    config.cache.verify_max_per_sec = 1000;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    let read = "SELECT name FROM items WHERE id = $1";
    eventually(WAIT, "the read to be cached", || async {
        let before = proxy.hits();
        client.query_one(read, &[&1i32]).await.unwrap();
        (proxy.hits() > before).then_some(())
    })
    .await;
    let statement = client.prepare(read).await.unwrap();
    let hits = proxy.hits();
    // Twenty reads pipelined on one connection: a check sent on the
    // client's own connection would make the reads behind it bypass the
    // cache (`pipelined`).
    let reads = (0..20).map(|_| client.query_one(&statement, &[&1i32]));
    for row in futures_util::future::join_all(reads).await {
        assert_eq!(row.unwrap().get::<_, &str>(0), "one");
    }
    // Checked off its path, every read was a hit.
    assert_eq!(proxy.hits(), hits + 20);
    let verify = &proxy.app.metrics.verify;
    eventually(WAIT, "the checks to be judged", || async {
        (verify.matched.get() >= 20).then_some(())
    })
    .await;
    assert_eq!(verify.mismatch.get(), 0);
}

#[tokio::test]
async fn listen_hold_cursors_and_sql_prepare_pin_their_client() {
    use futures_util::StreamExt;
    let pg = pg();
    let db = pg.create_db("tx_more_pins");
    let proxy = Proxy::start(config(pg, 3)).await;
    let (listener, mut connection) =
        tokio_postgres::connect(&proxy.dsn("postgres", &db), tokio_postgres::NoTls)
            .await
            .unwrap();
    let (tx, mut notifications) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = tx.send(n.payload().to_owned());
            }
        }
    });
    listener.batch_execute("LISTEN jobs").await.unwrap();
    let cursor = proxy.connect(&db).await;
    cursor
        .batch_execute("DECLARE c CURSOR WITH HOLD FOR SELECT generate_series(1, 3)")
        .await
        .unwrap();
    let prepared = proxy.connect(&db).await;
    prepared
        .batch_execute("PREPARE q AS SELECT 42")
        .await
        .unwrap();
    // Three pinned clients now hold the pool's three connections.
    pg.direct(&db)
        .await
        .batch_execute("NOTIFY jobs, 'first'")
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, notifications.recv())
        .await
        .unwrap();
    assert_eq!(got.as_deref(), Some("first"));
    for want in ["1", "2", "3"] {
        assert_eq!(
            scalar(&cursor, "FETCH 1 FROM c").await.as_deref(),
            Some(want)
        );
    }
    assert_eq!(scalar(&prepared, "EXECUTE q").await.as_deref(), Some("42"));
    let pins = &proxy.app.metrics.pooled.pins;
    for reason in ["listen", "hold_cursor", "sql_prepare"] {
        assert_eq!(pins.with_label_values(&[reason]).get(), 1, "{reason}");
    }
    assert_eq!(
        proxy.app.metrics.pooled.idle.get(),
        0,
        "each pinned client keeps its connection"
    );
}

#[tokio::test]
async fn clients_outlive_a_server_restart() {
    let pg = Pg::dedicated();
    let db = pg.create_db("tx_restart");
    let mut config = config(&pg, 2);
    // No replication stream: a fast shutdown would wait for it
    // (wal_sender_timeout); the pool is what is under test.
    config.replication.enabled = false;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    // (Not pg_backend_pid(), which would pin the client to a backend the
    // restart ends.)
    let started = "SELECT pg_postmaster_start_time()::text";
    let before = scalar(&client, started).await.unwrap();
    pg.stop();
    pg.restart();
    // The client held no connection across the restart: its next
    // statement takes a new one.
    let after = eventually(WAIT, "a statement after the restart", || async {
        let answer = client.simple_query(started).await;
        answer.ok()?.into_iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
    })
    .await;
    assert_ne!(before, after);
}

/// A migration that makes statements prepared before it stale on the
/// server: directly, a connection that prepares the statement afresh never
/// notices; through a transaction pool the server statement is shared by
/// text, so it must be retired.
struct Migration {
    setup: &'static str,
    statement: &'static str,
    param: &'static str,
    ddl: &'static str,
    /// The first column's type after the DDL, by name.
    type_after: &'static str,
    value: &'static str,
    /// A write after which the statement's next run is no hit.
    write: Option<&'static str>,
}

const MIGRATIONS: [Migration; 2] = [
    // 0A000 cached plan must not change result type
    Migration {
        setup: "CREATE TABLE dp(k int PRIMARY KEY, c int); INSERT INTO dp VALUES (1, 10)",
        statement: "select c from dp where k = $1",
        param: "1",
        ddl: "ALTER TABLE dp ALTER COLUMN c TYPE text",
        type_after: "text",
        value: "10",
        write: Some("UPDATE dp SET c = c"),
    },
    // XX000 cache lookup failed for type N
    Migration {
        setup: "CREATE TYPE mood AS ENUM ('a', 'b')",
        statement: "select $1::mood",
        param: "a",
        ddl: "DROP TYPE mood; CREATE TYPE mood AS ENUM ('a', 'b')",
        type_after: "mood",
        value: "a",
        write: None,
    },
];

/// Where the migration's DDL runs.
#[derive(Clone, Copy, Debug)]
enum Via {
    Pgcache,
    Direct,
}

/// What one run of a prepared statement answered.
#[derive(Debug)]
enum Ran {
    Rows { type_oid: u32, value: String },
    Error(String),
}

/// Runs `statement` (parsing it as `name` first if `parse`) with a Bind
/// first in its batch, as drivers do.
async fn run_prepared(
    s: &mut tokio::net::TcpStream,
    name: &str,
    parse: Option<&str>,
    param: &str,
) -> Ran {
    use tokio::io::AsyncWriteExt;
    let mut batch = Vec::new();
    if let Some(sql) = parse {
        batch.extend(wire::parse(name, sql));
    }
    batch.extend(wire::bind_text(name, param));
    batch.extend(wire::describe_portal());
    batch.extend(wire::execute());
    batch.extend(wire::sync());
    s.write_all(&batch).await.unwrap();
    let answer = wire::read_until_ready(s).await;
    if let Some((_, body)) = answer.iter().find(|(t, _)| *t == b'E') {
        return Ran::Error(wire::sqlstate_of(body).unwrap_or_default());
    }
    let (_, desc) = answer
        .iter()
        .find(|(t, _)| *t == b'T')
        .expect("a RowDescription");
    let name_end = 2 + desc[2..].iter().position(|b| *b == 0).unwrap() + 1;
    let oid = &desc[name_end + 6..name_end + 10];
    let (_, row) = answer.iter().find(|(t, _)| *t == b'D').expect("a row");
    let len = u32::from_be_bytes(row[2..6].try_into().unwrap()) as usize;
    Ran::Rows {
        type_oid: u32::from_be_bytes(oid.try_into().unwrap()),
        value: String::from_utf8_lossy(&row[6..6 + len]).into_owned(),
    }
}

async fn simple(s: &mut tokio::net::TcpStream, sql: &str) {
    use tokio::io::AsyncWriteExt;
    s.write_all(&wire::query(sql)).await.unwrap();
    let answer = wire::read_until_ready(s).await;
    assert!(!answer.iter().any(|(t, _)| *t == b'E'), "{sql}: {answer:?}");
}

/// The client that prepared the statement before the migration: it gets
/// the stale statement's error at most once, as it would directly, and the
/// new rows before and after it. With caching on, a hit may answer it
/// before its statement has met the server: then a write (where the
/// migration has one) makes its runs misses, until one has met it.
async fn the_old_client(
    proxy: &Proxy,
    s: &mut tokio::net::TcpStream,
    direct: &tokio_postgres::Client,
    m: &Migration,
    want: &(u32, String),
    who: &str,
) {
    let mut errors = Vec::new();
    let mut run = async |s: &mut tokio::net::TcpStream, what: &str| {
        let hits = proxy.hits();
        match run_prepared(s, "a", None, m.param).await {
            Ran::Rows { type_oid, value } => {
                assert_eq!(&(type_oid, value), want, "{who}: the old client, {what}")
            }
            Ran::Error(code) => {
                assert!(
                    errors.is_empty() && (code == "0A000" || code == "XX000"),
                    "{who}: the old client, {what}: {code} after {errors:?}"
                );
                errors.push(code);
            }
        }
        proxy.hits() > hits
    };
    let mut hit = run(s, "first").await;
    if let Some(write) = m.write.filter(|_| hit) {
        direct.batch_execute(write).await.unwrap();
        for _ in 0..100 {
            hit = run(s, "after a write").await;
            if !hit {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(!hit, "{who}: the write was not seen");
    }
    for _ in 0..2 {
        run(s, "from then on").await;
    }
    match run_prepared(s, "a", None, m.param).await {
        Ran::Rows { type_oid, value } => {
            assert_eq!(&(type_oid, value), want, "{who}: the old client, at last")
        }
        Ran::Error(code) => panic!("{who}: the old client, at last: {code} after {errors:?}"),
    }
}

/// Through a transaction pool of one connection: a statement prepared
/// before each migration, the migration, then clients that prepare it
/// afresh (they must never fail), one inside a transaction block (at most
/// once), and the client that prepared it before (at most once). Each
/// migration runs twice: the fresh clients first, then the transaction
/// first, since whichever meets a stale statement first retires it.
async fn prepared_statements_survive_migrations(via: Via, trigger: bool, caching: bool) {
    let pg = pg();
    let label = format!("{via:?}_{trigger}_{caching}").to_lowercase();
    for (i, m) in MIGRATIONS.iter().enumerate() {
        for fresh_first in [true, false] {
            let db = pg.create_db(&format!("tx_ddl_{label}_{i}_{fresh_first}"));
            pg.psql_db(&db, m.setup);
            let mut config = config(pg, 1);
            config.replication.ddl_event_trigger = trigger;
            config.cache.enabled = caching;
            let proxy = Proxy::start(config).await;
            let (mut a, _) = wire::raw_login(proxy.addr, &db).await;
            let before = run_prepared(&mut a, "a", Some(m.statement), m.param).await;
            assert!(matches!(before, Ran::Rows { .. }), "{before:?}");
            if caching {
                // Its event trigger is installed by then.
                proxy.wait_streaming(&db).await;
            }
            match via {
                Via::Pgcache => {
                    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
                    client.batch_execute(m.ddl).await.unwrap();
                }
                Via::Direct => pg.psql_db(&db, m.ddl).truncate(0),
            }
            let direct = pg.direct(&db).await;
            let oid = scalar(&direct, &format!("SELECT '{}'::regtype::oid", m.type_after))
                .await
                .unwrap();
            let want = (oid.parse::<u32>().unwrap(), m.value.to_owned());
            let who = format!("{label}, migration {i}, fresh first: {fresh_first}");
            // DDL pgcache saw retires the statement before anyone meets it:
            // made through it, or announced in the stream.
            let known = match via {
                Via::Pgcache => true,
                Via::Direct if trigger && caching => {
                    let state = proxy.app.cache.db(&db);
                    eventually(WAIT, "the stream to announce the DDL", || async {
                        (state
                            .versions
                            .schema
                            .load(std::sync::atomic::Ordering::Acquire)
                            > 0)
                        .then_some(())
                    })
                    .await;
                    true
                }
                Via::Direct => false,
            };
            let most = if known { 0 } else { 1 };
            if fresh_first {
                fresh_clients_never_fail(&proxy, &db, m, &want, &who).await;
                in_a_transaction(&proxy, &db, m, &want, most, &who).await;
            } else {
                in_a_transaction(&proxy, &db, m, &want, most, &who).await;
                fresh_clients_never_fail(&proxy, &db, m, &want, &who).await;
            }
            the_old_client(&proxy, &mut a, &direct, m, &want, &who).await;
        }
    }
}

/// Clients on new connections prepare the statement afresh: directly they
/// would never see an error, so through pgcache neither.
async fn fresh_clients_never_fail(
    proxy: &Proxy,
    db: &str,
    m: &Migration,
    want: &(u32, String),
    who: &str,
) {
    for c in 0..3 {
        let (mut s, _) = wire::raw_login(proxy.addr, db).await;
        match run_prepared(&mut s, "c", Some(m.statement), m.param).await {
            Ran::Rows { type_oid, value } => {
                assert_eq!(&(type_oid, value), want, "{who}: new client {c}")
            }
            Ran::Error(code) => panic!("{who}: new client {c} got {code}"),
        }
        // And again on the same connection.
        let again = run_prepared(&mut s, "c", None, m.param).await;
        assert!(matches!(again, Ran::Rows { .. }), "{who}: {again:?}");
    }
}

/// Inside a transaction block a stale statement cannot be retried unseen:
/// the error at most `most` times (then the transaction is aborted, as
/// directly).
async fn in_a_transaction(
    proxy: &Proxy,
    db: &str,
    m: &Migration,
    want: &(u32, String),
    most: usize,
    who: &str,
) {
    let (mut b, _) = wire::raw_login(proxy.addr, db).await;
    let mut errors = Vec::new();
    let got = loop {
        simple(&mut b, "BEGIN").await;
        let parse = Some(m.statement).filter(|_| errors.is_empty());
        let ran = run_prepared(&mut b, "b", parse, m.param).await;
        simple(&mut b, "ROLLBACK").await;
        match ran {
            Ran::Rows { type_oid, value } => break (type_oid, value),
            Ran::Error(code) => {
                assert!(
                    errors.len() < most && (code == "0A000" || code == "XX000"),
                    "{who}: {code} in a transaction after {errors:?}"
                );
                errors.push(code);
            }
        }
    };
    assert_eq!(&got, want, "{who}: in a transaction");
}

#[tokio::test]
async fn prepared_statements_survive_ddl_made_through_pgcache() {
    prepared_statements_survive_migrations(Via::Pgcache, true, true).await;
}

#[tokio::test]
async fn prepared_statements_survive_ddl_made_directly() {
    prepared_statements_survive_migrations(Via::Direct, true, true).await;
}

#[tokio::test]
async fn prepared_statements_survive_ddl_through_pgcache_without_the_event_trigger() {
    prepared_statements_survive_migrations(Via::Pgcache, false, true).await;
}

#[tokio::test]
async fn prepared_statements_survive_ddl_made_directly_without_the_event_trigger() {
    prepared_statements_survive_migrations(Via::Direct, false, true).await;
}

#[tokio::test]
async fn prepared_statements_survive_ddl_with_caching_off() {
    prepared_statements_survive_migrations(Via::Pgcache, true, false).await;
    prepared_statements_survive_migrations(Via::Direct, true, false).await;
}

/// The `client_encoding` a client asking for `asked` is told at login.
async fn reported_encoding(addr: std::net::SocketAddr, db: &str, asked: &str) -> String {
    reported(addr, db, "client_encoding", asked)
        .await
        .expect("logged in")
}

/// What a login with startup parameter `name=asked` is told of `name`;
/// `Err`: the login's error, as its SQLSTATE.
async fn reported(
    addr: std::net::SocketAddr,
    db: &str,
    name: &str,
    asked: &str,
) -> Result<String, String> {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&pgcache::protocol::startup::encode_startup(&[
        ("user", "postgres"),
        ("database", db),
        (name, asked),
    ]))
    .await
    .unwrap();
    let login = wire::read_until_ready(&mut s).await;
    if let Some((_, error)) = login.iter().find(|(tag, _)| *tag == b'E') {
        return Err(wire::sqlstate_of(error).unwrap_or_default());
    }
    assert_eq!(login.last().map(|m| m.0), Some(b'Z'), "{asked}: logged in");
    Ok(login
        .iter()
        .filter(|(tag, _)| *tag == b'S')
        .find_map(|(_, body)| {
            let mut parts = body.split(|b| *b == 0);
            (parts.next() == Some(name.as_bytes()))
                .then(|| String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned())
        })
        .unwrap_or_else(|| panic!("{name} is reported")))
}

/// Every startup value a pooled client is told is the one PostgreSQL
/// reports (`ISO, MDY` for `iso, mdy`), learnt once per pool and value;
/// a value PostgreSQL refuses fails the login, as directly.
#[tokio::test]
async fn a_pooled_client_is_told_its_startup_values_as_postgresql_reports_them() {
    let pg = pg();
    let db = pg.create_db("tx_reported");
    let direct: std::net::SocketAddr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let proxy = Proxy::start(config(pg, 2)).await;
    // The pool's first login, relayed.
    reported_encoding(proxy.addr, &db, "UTF8").await;
    let cases = [
        ("DateStyle", "iso, mdy"),
        ("DateStyle", "german"),
        ("DateStyle", "sql,dmy"),
        ("TimeZone", "europe/paris"),
        ("TimeZone", "utc"),
        ("IntervalStyle", "POSTGRES_verbose"),
        ("application_name", "caf\u{e9} app"),
    ];
    let before = checkouts(&proxy);
    for (name, asked) in cases {
        let want = reported(direct, &db, name, asked)
            .await
            .expect("direct login");
        for _ in 0..2 {
            let got = reported(proxy.addr, &db, name, asked).await;
            assert_eq!(got.as_deref(), Ok(want.as_str()), "{name}={asked}");
        }
    }
    assert!(
        checkouts(&proxy) - before <= cases.len() as u64,
        "a connection only the first time a value is met"
    );
    for (name, asked) in [("DateStyle", "bogus"), ("TimeZone", "nowhere/at_all")] {
        let want = reported(direct, &db, name, asked).await;
        assert!(want.is_err(), "PostgreSQL refuses {name}={asked}");
        assert_eq!(
            reported(proxy.addr, &db, name, asked).await,
            want,
            "{name}={asked}"
        );
    }
}

/// PostgreSQL reports the encoding's own name, however the client spelled
/// it; so does pgcache when it greets a pooled client itself.
#[tokio::test]
async fn a_pooled_client_is_told_its_encoding_as_postgresql_names_it() {
    let pg = pg();
    let db = pg.create_db("tx_encoding");
    let direct: std::net::SocketAddr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let proxy = Proxy::start(config(pg, 2)).await;
    for asked in ["utf8", "UTF-8", "unicode", "euc-jp", "Latin-1", "win-1252"] {
        let want = reported_encoding(direct, &db, asked).await;
        // The first login of a pool may be relayed; the next are greeted
        // by pgcache.
        for _ in 0..2 {
            let got = reported_encoding(proxy.addr, &db, asked).await;
            assert_eq!(got, want, "asked for {asked}");
        }
    }
    assert!(
        checkouts(&proxy) <= 1,
        "greeted without a server connection"
    );
    // pgcache's table of names against PostgreSQL's own.
    let client = pg.direct(&db).await;
    for (spelling, name) in pgcache::protocol::encoding::names() {
        let sql = format!("SELECT pg_encoding_to_char(pg_char_to_encoding('{spelling}'))");
        assert_eq!(
            scalar(&client, &sql).await.as_deref(),
            Some(*name),
            "{spelling}"
        );
    }
}

/// A client that keeps the notifications it gets, as (channel, payload).
async fn notified_client(
    proxy: &Proxy,
    db: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<(String, String)>,
) {
    connect_picking(&proxy.dsn("postgres", db), |message| match message {
        tokio_postgres::AsyncMessage::Notification(n) => {
            Some((n.channel().to_owned(), n.payload().to_owned()))
        }
        _ => None,
    })
    .await
}

/// The three shapes a statement's text travels in.
#[derive(Debug, Clone, Copy)]
enum Shape {
    Simple,
    Unnamed,
    Named,
}

async fn run_as(client: &tokio_postgres::Client, sql: &str, shape: Shape) {
    match shape {
        Shape::Simple => client.batch_execute(sql).await.map(drop),
        Shape::Unnamed => client.query_typed(sql, &[]).await.map(drop),
        Shape::Named => {
            let statement = client.prepare(sql).await.unwrap();
            client.query(&statement, &[]).await.map(drop)
        }
    }
    .unwrap_or_else(|e| panic!("{sql} as {shape:?}: {e}"));
}

#[tokio::test]
async fn what_pins_a_client_does_so_in_every_shape() {
    let pg = pg();
    let db = pg.create_db("tx_pin_shapes");
    let proxy = Proxy::start(config(pg, 2)).await;
    let pins = &proxy.app.metrics.pooled.pins;
    let table = [
        ("LISTEN jobs", "listen"),
        ("PREPARE q AS SELECT 1", "sql_prepare"),
        ("CREATE TEMP TABLE scratch(a int)", "temp_objects"),
        ("SELECT pg_advisory_lock(1)", "advisory_lock"),
        ("SELECT pg_backend_pid()", "backend_pid"),
    ];
    for (sql, reason) in table {
        for shape in [Shape::Simple, Shape::Unnamed, Shape::Named] {
            let before = pins.with_label_values(&[reason]).get();
            let client = proxy.connect(&db).await;
            run_as(&client, sql, shape).await;
            assert_eq!(
                pins.with_label_values(&[reason]).get(),
                before + 1,
                "{sql} as {shape:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_listen_as_a_named_statement_keeps_its_notifications_to_its_client() {
    let pg = pg();
    let db = pg.create_db("tx_named_listen");
    let proxy = Proxy::start(config(pg, 2)).await;
    let (listener, mut heard) = notified_client(&proxy, &db).await;
    run_as(&listener, "LISTEN pinned_ch", Shape::Named).await;
    let mut others = Vec::new();
    for _ in 0..4 {
        others.push(notified_client(&proxy, &db).await);
    }
    for (other, _) in &others {
        other.batch_execute("SELECT 1").await.unwrap();
    }
    others[0]
        .0
        .batch_execute("NOTIFY pinned_ch, 'hello'")
        .await
        .unwrap();
    let got = tokio::time::timeout(WAIT, heard.recv()).await.unwrap();
    assert_eq!(got, Some(("pinned_ch".to_owned(), "hello".to_owned())));
    for (other, _) in &others {
        other.batch_execute("SELECT 2").await.unwrap();
    }
    for (_, leaked) in &mut others {
        assert!(leaked.try_recv().is_err(), "another client got it");
    }
    assert_eq!(proxy.app.metrics.pooled.notifications_withheld.get(), 0);
}

#[tokio::test]
async fn a_connection_that_listens_for_nobody_never_notifies_the_next_client() {
    let pg = pg();
    let db = pg.create_db("tx_stray_listen");
    // A LISTEN no scan can see: run by a function.
    pg.direct(&db)
        .await
        .batch_execute(
            "CREATE FUNCTION sneak() RETURNS void LANGUAGE plpgsql AS \
             $$ BEGIN EXECUTE 'LISTEN stray'; END $$",
        )
        .await
        .unwrap();
    let proxy = Proxy::start(config(pg, 1)).await;
    let sneaky = proxy.connect(&db).await;
    sneaky.batch_execute("SELECT sneak()").await.unwrap();
    drop(sneaky);
    // The only connection, now listening, goes to the next client.
    let (next, mut heard) = notified_client(&proxy, &db).await;
    let listening = scalar(&next, "SELECT pg_listening_channels()").await;
    assert_eq!(listening.as_deref(), Some("stray"), "the same connection");
    // A notification reaches a backend between transactions: this one
    // comes while the client holds the connection. (One that comes while
    // the connection is idle in the pool makes it look broken: closed.)
    next.batch_execute("BEGIN").await.unwrap();
    pg.direct(&db)
        .await
        .batch_execute("NOTIFY stray, 'not yours'")
        .await
        .unwrap();
    next.batch_execute("COMMIT").await.unwrap();
    next.batch_execute("SELECT 1").await.unwrap();
    let metrics = &proxy.app.metrics.pooled;
    assert_eq!(metrics.notifications_withheld.get(), 1);
    assert!(heard.try_recv().is_err(), "the client never sees it");
    // That connection is closed, not given to anyone else.
    assert_eq!(metrics.closed_listening.get(), 1);
    assert_eq!(
        scalar(&next, "SELECT count(*) FROM pg_listening_channels()")
            .await
            .as_deref(),
        Some("0")
    );
}

/// One batch as asyncpg sends it by default: a named Parse, then Bind,
/// Execute and Sync; the first error's SQLSTATE, or the first column of
/// the first row.
async fn named_batch(
    s: &mut tokio::net::TcpStream,
    name: &str,
    sql: &str,
) -> Result<Option<String>, String> {
    use tokio::io::AsyncWriteExt;
    let batch = [
        wire::parse(name, sql),
        wire::bind(name),
        wire::execute(),
        wire::sync(),
    ]
    .concat();
    s.write_all(&batch).await.unwrap();
    let answer = wire::read_until_ready(s).await;
    if let Some((_, body)) = answer.iter().find(|(t, _)| *t == b'E') {
        return Err(wire::sqlstate_of(body).unwrap_or_default());
    }
    Ok(answer.iter().find(|(t, _)| *t == b'D').map(|(_, row)| {
        let len = u32::from_be_bytes(row[2..6].try_into().unwrap()) as usize;
        String::from_utf8_lossy(&row[6..6 + len]).into_owned()
    }))
}

#[tokio::test]
async fn sql_execute_and_deallocate_sent_as_named_statements_find_the_protocol_statement() {
    let pg = pg();
    let db = pg.create_db("tx_named_execute");
    let proxy = Proxy::start(config(pg, 2)).await;
    let (mut s, _) = wire::raw_login(proxy.addr, &db).await;
    // Another client holds a connection meanwhile, so that the next
    // batches may run on either.
    let other = proxy.connect(&db).await;
    assert_eq!(
        named_batch(&mut s, "_pg3_0", "select 41 + 1").await,
        Ok(Some("42".into()))
    );
    for round in 0..3 {
        if round == 1 {
            other.batch_execute("BEGIN").await.unwrap();
        }
        assert_eq!(
            named_batch(&mut s, &format!("run_{round}"), "EXECUTE _pg3_0").await,
            Ok(Some("42".into())),
            "round {round}"
        );
    }
    other.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        named_batch(&mut s, "free", "DEALLOCATE _pg3_0").await,
        Ok(None)
    );
    // Freed: the server refuses it, as it would directly.
    assert_eq!(
        named_batch(&mut s, "again", "EXECUTE _pg3_0").await,
        Err("26000".into())
    );
    assert_eq!(
        named_batch(&mut s, "_pg3_0", "select 7").await,
        Ok(Some("7".into()))
    );
}

/// The ParameterStatus messages of one simple query's answer.
async fn statuses_of(s: &mut tokio::net::TcpStream, sql: &str) -> Vec<String> {
    use tokio::io::AsyncWriteExt;
    s.write_all(&wire::query(sql)).await.unwrap();
    let answer = wire::read_until_ready(s).await;
    assert!(!answer.iter().any(|(t, _)| *t == b'E'), "{sql}: {answer:?}");
    answer
        .iter()
        .filter(|(tag, _)| *tag == b'S')
        .map(|(_, body)| {
            String::from_utf8_lossy(body)
                .replace('\0', " ")
                .trim()
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn a_connection_taking_a_clients_settings_tells_it_only_what_changed_for_it() {
    use tokio::io::AsyncWriteExt;
    let pg = pg();
    let db = pg.create_db("tx_told");
    // One connection: the two clients take it in turns.
    let proxy = Proxy::start(config(pg, 1)).await;
    let (mut a, _) = wire::raw_login(proxy.addr, &db).await;
    let (mut b, _) = wire::raw_login(proxy.addr, &db).await;
    // A's own SET is reported to it, as PostgreSQL reports it directly.
    let set = statuses_of(&mut a, "SET application_name = 'told'").await;
    assert_eq!(set, ["application_name told"]);
    // B takes the connection A left: pgcache puts B's settings back on it,
    // which the server reports; B's application_name never changed.
    assert_eq!(statuses_of(&mut b, "SELECT 1").await, Vec::<String>::new());
    // A again: its settings put back on the connection, nothing new to it.
    assert_eq!(statuses_of(&mut a, "SELECT 1").await, Vec::<String>::new());
    a.write_all(&wire::query("SHOW application_name"))
        .await
        .unwrap();
    let answer = wire::read_until_ready(&mut a).await;
    let (_, row) = answer.iter().find(|(t, _)| *t == b'D').expect("a row");
    assert_eq!(&row[6..], b"told", "A's setting is on the connection");
}
