//! Invalidation from logical replication: writes made directly on
//! PostgreSQL, never through pgcache, stop being served from the cache.

mod common;

use std::time::Duration;

use common::*;
use tokio_postgres::{Client, SimpleQueryMessage};

/// Reads `sql` twice and checks the second read was a hit.
async fn cached(proxy: &Proxy, client: &Client, sql: &str) -> Option<String> {
    let first = scalar(client, sql).await;
    let hits = proxy.hits();
    let second = scalar(client, sql).await;
    assert_eq!(first, second);
    assert_eq!(proxy.hits(), hits + 1, "{sql} was not served from cache");
    second
}

#[tokio::test]
async fn direct_writes_of_every_kind_invalidate() {
    let (_db, proxy, client, direct) = setup_streaming(
        "directwrites",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0)",
    )
    .await;
    let read = "SELECT sum(v)::text || '/' || count(*) FROM t";
    assert_eq!(cached(&proxy, &client, read).await.as_deref(), Some("0/1"));
    direct.batch_execute("UPDATE t SET v = 5").await.unwrap();
    eventually_reads(&client, read, "5/1").await;
    assert_eq!(cached(&proxy, &client, read).await.as_deref(), Some("5/1"));
    direct
        .batch_execute("INSERT INTO t VALUES (2, 1)")
        .await
        .unwrap();
    eventually_reads(&client, read, "6/2").await;
    cached(&proxy, &client, read).await;
    direct
        .batch_execute("DELETE FROM t WHERE id = 1")
        .await
        .unwrap();
    eventually_reads(&client, read, "1/1").await;
    cached(&proxy, &client, read).await;
    let sink = direct.copy_in("COPY t FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    futures_util::SinkExt::send(&mut sink, bytes::Bytes::from_static(b"10\t10\n"))
        .await
        .unwrap();
    sink.finish().await.unwrap();
    eventually_reads(&client, read, "11/2").await;
    cached(&proxy, &client, read).await;
    direct.batch_execute("TRUNCATE t").await.unwrap();
    eventually_reads(&client, "SELECT count(*) FROM t", "0").await;
}

#[tokio::test]
async fn a_rolled_back_transaction_leaves_the_cache_alone() {
    let (_db, proxy, client, direct) = setup_streaming(
        "rollback",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1); CREATE TABLE other(id int PRIMARY KEY)",
    )
    .await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(cached(&proxy, &client, read).await.as_deref(), Some("1"));
    direct
        .batch_execute("BEGIN; UPDATE t SET v = 2; ROLLBACK")
        .await
        .unwrap();
    // A later committed change proves the stream has passed the rollback.
    direct
        .batch_execute("INSERT INTO other VALUES (1)")
        .await
        .unwrap();
    eventually_reads(&client, "SELECT count(*) FROM other", "1").await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("1"));
    assert_eq!(
        proxy.hits(),
        hits + 1,
        "the rolled-back update must not invalidate"
    );
}

#[tokio::test]
async fn a_direct_write_to_a_partition_invalidates_the_parent() {
    let (_db, proxy, client, direct) = setup_streaming(
        "partitions",
        "CREATE TABLE m(id int PRIMARY KEY, v int) PARTITION BY RANGE (id);
         CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (100);
         CREATE TABLE m2 PARTITION OF m FOR VALUES FROM (100) TO (200);
         INSERT INTO m VALUES (1, 1), (150, 1);",
    )
    .await;
    assert_eq!(
        cached(&proxy, &client, "SELECT sum(v) FROM m")
            .await
            .as_deref(),
        Some("2")
    );
    assert_eq!(
        cached(&proxy, &client, "SELECT sum(v) FROM m2")
            .await
            .as_deref(),
        Some("1")
    );
    direct.batch_execute("UPDATE m1 SET v = 10").await.unwrap();
    eventually_reads(&client, "SELECT sum(v) FROM m", "11").await;
    direct
        .batch_execute("UPDATE m SET v = 7 WHERE id = 150")
        .await
        .unwrap();
    eventually_reads(&client, "SELECT sum(v) FROM m2", "7").await;
}

#[tokio::test]
async fn a_table_without_a_primary_key_is_never_published_and_its_writes_work() {
    let (db, proxy, client, direct) = setup_streaming(
        "nopk",
        "CREATE TABLE log(msg text); INSERT INTO log VALUES ('a'); CREATE TABLE t(id int PRIMARY KEY)",
    )
    .await;
    // Created after the stream started, outside pgcache: also never published.
    direct
        .batch_execute("CREATE TABLE later(msg text); INSERT INTO later VALUES ('x')")
        .await
        .unwrap();
    // Give the DDL time to reach the stream: a committed change after it.
    direct
        .batch_execute("INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    eventually_reads(&client, "SELECT count(*) FROM t", "1").await;
    for table in ["log", "later"] {
        direct
            .batch_execute(&format!("UPDATE {table} SET msg = 'b'"))
            .await
            .unwrap();
        direct
            .batch_execute(&format!("DELETE FROM {table}"))
            .await
            .unwrap();
        client
            .batch_execute(&format!(
                "INSERT INTO {table} VALUES ('c'); UPDATE {table} SET msg = 'd'"
            ))
            .await
            .unwrap();
        let hits = proxy.hits();
        assert_eq!(
            scalar(&client, &format!("SELECT msg FROM {table}"))
                .await
                .as_deref(),
            Some("d")
        );
        assert_eq!(
            scalar(&client, &format!("SELECT msg FROM {table}"))
                .await
                .as_deref(),
            Some("d")
        );
        assert_eq!(
            proxy.hits(),
            hits,
            "{table} has no replica identity: never cached"
        );
    }
    let published = pg().psql_db(&db, "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = 'pgcache'");
    assert_eq!(published.trim(), "t");
}

#[tokio::test]
async fn ddl_made_outside_pgcache_invalidates() {
    let (_db, proxy, client, direct) = setup_streaming(
        "ddl",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    assert_eq!(
        cached(&proxy, &client, "SELECT * FROM t").await.as_deref(),
        Some("1")
    );
    direct
        .batch_execute("ALTER TABLE t RENAME COLUMN id TO key")
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "the rename to be seen", || async {
        let rows = client.simple_query("SELECT * FROM t").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                SimpleQueryMessage::RowDescription(cols) => Some(cols[0].name() == "key"),
                _ => None,
            })
            .unwrap_or(false)
            .then_some(())
    })
    .await;
}

/// DDL that reaches the stream together (here: committed while the
/// walsender was stopped) is named in one round of queries, and each
/// statement's effect is still seen.
#[tokio::test]
async fn ddl_that_arrives_together_is_handled_in_few_rounds() {
    const TABLES: usize = 10;
    let (db, proxy, client, direct) = setup_streaming(
        "ddlburst",
        "CREATE TABLE a(id int PRIMARY KEY); INSERT INTO a VALUES (1)",
    )
    .await;
    assert_eq!(
        cached(&proxy, &client, "SELECT * FROM a").await.as_deref(),
        Some("1")
    );
    let state = proxy.app.cache.db(&db);
    let (transactions, rounds) = state.stream.ddl();
    let stopped = stop_walsender(&direct, &db).await;
    for i in 0..TABLES {
        direct
            .batch_execute(&format!("CREATE TABLE burst_{i}(id int PRIMARY KEY)"))
            .await
            .unwrap();
    }
    direct
        .batch_execute("ALTER TABLE a ADD COLUMN v int DEFAULT 7")
        .await
        .unwrap();
    drop(stopped);
    eventually_reads(&client, "SELECT v FROM a", "7").await;
    // A heartbeat back follows the DDL before it.
    proxy.wait_stream(&db).await;
    let (now_transactions, now_rounds) = state.stream.ddl();
    let handled = now_transactions - transactions;
    assert!(
        handled > TABLES as u64,
        "{handled} DDL transactions handled"
    );
    let took = now_rounds - rounds;
    assert!(
        took * 2 <= handled,
        "{handled} DDL transactions that arrived together took {took} rounds"
    );
    let shown = proxy
        .database_metric("pgcache_replication_ddl_rounds", &db)
        .await as u64;
    assert!(
        shown >= now_rounds,
        "{shown} rounds shown, {now_rounds} counted"
    );
}

#[tokio::test]
async fn a_killed_walsender_reconnects_and_flushes_the_cache() {
    let (db, proxy, client, direct) = setup_streaming(
        "walsender",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(cached(&proxy, &client, read).await.as_deref(), Some("1"));
    let state = proxy.app.cache.db(&db);
    let starts = state.stream.starts();
    let killed: i64 = direct
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1);
    eventually(Duration::from_secs(20), "the stream to come back", || {
        let again = state.stream.starts() > starts && state.stream.is_streaming();
        async move { again.then_some(()) }
    })
    .await;
    proxy.learn_all(&db).await;
    // Whatever was cached before may have missed changes: not served again.
    let hits = proxy.hits();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("1"));
    assert_eq!(proxy.hits(), hits, "the reconnect must flush");
    assert_eq!(cached(&proxy, &client, read).await.as_deref(), Some("1"));
    direct.batch_execute("UPDATE t SET v = 2").await.unwrap();
    eventually_reads(&client, read, "2").await;
}

// Multi-threaded: Pg::stop blocks a thread, and the in-process pgcache must
// keep answering its walsender meanwhile or PostgreSQL waits to shut down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_breaks_sessions_then_caching_recovers() {
    let pg = Pg::dedicated();
    pg.psql_admin("CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)");
    let mut config = pg.proxy_config();
    config.upstream.connect_timeout_ms = 1000;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect("postgres").await;
    assert_eq!(
        cached(&proxy, &client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    pg.stop();
    assert!(
        client.simple_query("SELECT v FROM t").await.is_err(),
        "the session's backend is gone"
    );
    pg.restart();
    let client = eventually(Duration::from_secs(30), "a new session", || async {
        connect_dsn(&proxy.dsn("postgres", "postgres")).await.ok()
    })
    .await;
    proxy.wait_streaming("postgres").await;
    pg.psql_admin("UPDATE t SET v = 3");
    eventually_reads(&client, "SELECT v FROM t", "3").await;
    assert_eq!(
        cached(&proxy, &client, "SELECT v FROM t").await.as_deref(),
        Some("3")
    );
}

#[tokio::test]
async fn without_logical_wal_pgcache_refuses_to_start_and_says_how_to_fix_it() {
    let pg = Pg::dedicated_with("-c wal_level=replica");
    let err = match pgcache::App::start(pg.proxy_config()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("started without logical replication"),
    };
    assert!(
        err.contains("wal_level") && err.contains("logical"),
        "{err}"
    );
    assert!(err.contains("replication.required = false"), "{err}");
    // Not required: starts with replication off, and still caches (TTL-only).
    let mut config = pg.proxy_config();
    config.replication.required = false;
    let proxy = Proxy::start(config).await;
    assert!(!proxy.app.cache.replication_on());
    pg.psql_admin("CREATE TABLE t(id int PRIMARY KEY); INSERT INTO t VALUES (1)");
    let client = proxy.connect("postgres").await;
    assert_eq!(
        cached(&proxy, &client, "SELECT id FROM t").await.as_deref(),
        Some("1")
    );
}

#[tokio::test]
async fn while_the_stream_is_down_the_database_is_served_from_postgres() {
    let db = pg().create_db("down");
    let role = format!("repl_{}", rand_suffix());
    pg().psql_db(
        &db,
        &format!(
            "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
             CREATE ROLE {role} LOGIN REPLICATION;
             CREATE PUBLICATION pgcache FOR ALL TABLES;"
        ),
    );
    // pgcache replicates as its own role; the test can then refuse it.
    let mut config = pg().proxy_config();
    config.upstream.url = format!("postgres://{role}@127.0.0.1:{}", pg().port);
    config.replication.manage_publication = false;
    config.replication.ddl_event_trigger = false;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    let direct = pg().direct(&db).await;
    assert_eq!(
        cached(&proxy, &client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );

    direct
        .batch_execute(&format!(
            "ALTER ROLE {role} NOLOGIN;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
        ))
        .await
        .unwrap();
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(10), "the stream to go down", || {
        let down = !state.stream.is_streaming();
        async move { down.then_some(()) }
    })
    .await;
    // Down: no cached result is served, so a direct write is seen at once.
    direct.batch_execute("UPDATE t SET v = 2").await.unwrap();
    let hits = proxy.hits();
    for _ in 0..3 {
        assert_eq!(
            scalar(&client, "SELECT v FROM t").await.as_deref(),
            Some("2")
        );
    }
    assert_eq!(
        proxy.hits(),
        hits,
        "nothing served from cache while the stream is down"
    );

    direct
        .batch_execute(&format!("ALTER ROLE {role} LOGIN"))
        .await
        .unwrap();
    proxy.wait_streaming(&db).await;
    assert_eq!(
        cached(&proxy, &client, "SELECT v FROM t").await.as_deref(),
        Some("2")
    );
}

/// The number of columns `SELECT * FROM t` shows.
async fn columns(client: &Client) -> usize {
    rows(client, "SELECT * FROM t WHERE id = 1").await[0].len()
}

async fn columns_become(client: &Client, want: usize) {
    eventually(Duration::from_secs(10), "the new column", || async {
        (columns(client).await == want).then_some(())
    })
    .await;
}

/// DDL a client sends through pgcache is handled by its session, which
/// forgets what the statement names once it is visible: the stream of the
/// same instance takes no round for it. DDL inside a function a statement
/// calls, DDL made directly and DDL another instance's client sent each
/// take a round where they were not sent, and each is seen.
async fn ddl_sent_through_an_instance_takes_no_round_there(mode: pgcache::config::PoolMode) {
    let db = pg().create_db(&format!("ddlown_{mode:?}").to_lowercase());
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE FUNCTION migrate() RETURNS void LANGUAGE plpgsql
           AS $$ BEGIN ALTER TABLE t ADD COLUMN y int DEFAULT 8; END $$",
    );
    let mut config = pg().proxy_config();
    config.pool.mode = mode;
    let a = Proxy::start(config).await;
    let ca = a.connect(&db).await;
    let b = Proxy::start(pg().proxy_config()).await;
    let cb = b.connect(&db).await;
    let direct = pg().direct(&db).await;
    a.wait_stream(&db).await;
    for (proxy, client) in [(&a, &ca), (&b, &cb)] {
        columns(client).await;
        let hits = proxy.hits();
        assert_eq!(columns(client).await, 2);
        assert_eq!(proxy.hits(), hits + 1, "served from the cache");
    }
    let (sa, sb) = (a.app.cache.db(&db), b.app.cache.db(&db));
    let ((a_transactions, a_rounds), (_, b_rounds)) = (sa.stream.ddl(), sb.stream.ddl());

    for ddl in [
        "ALTER TABLE t ADD COLUMN w int DEFAULT 5",
        "CREATE TABLE made(id int PRIMARY KEY)",
        "DROP TABLE made",
    ] {
        ca.batch_execute(ddl).await.unwrap();
    }
    assert_eq!(columns(&ca).await, 3, "the sender's own session forgot t");
    columns_become(&cb, 3).await;
    a.wait_stream(&db).await;
    b.wait_stream(&db).await;
    let (transactions, rounds) = sa.stream.ddl();
    assert!(
        transactions >= a_transactions + 3,
        "{} DDL transactions seen",
        transactions - a_transactions
    );
    assert_eq!(rounds, a_rounds, "no round for DDL its own session sent");
    assert!(sb.stream.ddl().1 > b_rounds, "the other instance names it");

    // DDL the client's statement did not spell out.
    ca.batch_execute("SELECT migrate()").await.unwrap();
    columns_become(&ca, 4).await;
    a.wait_stream(&db).await;
    let (_, after_function) = sa.stream.ddl();
    assert!(
        after_function > rounds,
        "DDL inside a function takes a round"
    );

    direct
        .batch_execute("ALTER TABLE t ADD COLUMN x int DEFAULT 6")
        .await
        .unwrap();
    columns_become(&ca, 5).await;
    a.wait_stream(&db).await;
    assert!(
        sa.stream.ddl().1 > after_function,
        "DDL made directly takes a round"
    );
}

#[tokio::test]
async fn ddl_sent_through_pgcache_takes_no_round_there() {
    ddl_sent_through_an_instance_takes_no_round_there(pgcache::config::PoolMode::Session).await;
}

#[tokio::test]
async fn ddl_sent_through_a_transaction_pool_takes_no_round_there() {
    ddl_sent_through_an_instance_takes_no_round_there(pgcache::config::PoolMode::Transaction).await;
}

/// A logical slot of `direct`'s session, named after its database (slots
/// are the cluster's: tests running at once each need their own), which
/// [`ddl_messages`] reads.
async fn probe_slot(direct: &Client, db: &str) -> String {
    let slot = format!("probe_{db}");
    direct
        .batch_execute(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding', true)"
        ))
        .await
        .unwrap();
    slot
}

/// The DDL messages of `slot`'s database since the last call, as the probe
/// slot decodes them.
async fn ddl_messages(direct: &Client, slot: &str) -> Vec<String> {
    rows(
        direct,
        &format!(
            "SELECT data FROM pg_logical_slot_get_changes('{slot}', NULL, NULL)
             WHERE data LIKE 'message:%pgcache_ddl%'"
        ),
    )
    .await
    .into_iter()
    .filter_map(|row| Some(row[0].clone()?.split_once("content:")?.1.to_owned()))
    .collect()
}

/// Listing what a command created or altered is most of the trigger's
/// cost, and only instances that did not send the DDL need it: for DDL a
/// session sent while no other instance streams the database, the trigger
/// leaves it out; once another streams, it lists it again, and once that
/// one has gone, the first one's next check leaves it out again.
#[tokio::test]
async fn the_trigger_lists_objects_only_while_another_instance_streams() {
    let (db, a, ca, direct) =
        setup_streaming("ddllist", "CREATE TABLE t(id int PRIMARY KEY)").await;
    let probe = probe_slot(&direct, &db).await;
    let origin = a.app.upstream.origin.value();
    ca.batch_execute("CREATE TABLE alone(id int)")
        .await
        .unwrap();
    let alone = ddl_messages(&direct, &probe).await;
    assert_eq!(alone, [format!("CREATE TABLE ~ !{origin}\n")], "left out");

    let mut config = pg().proxy_config();
    config.replication.idle_release_secs = 1;
    let b = Proxy::start(config).await;
    let cb = b.connect(&db).await;
    // B rewrote the trigger once its slot was made, before its stream
    // was up.
    b.wait_stream(&db).await;
    a.wait_stream(&db).await;
    assert_eq!(
        ddl_messages(&direct, &probe).await,
        Vec::<String>::new(),
        "installing the trigger is not announced"
    );
    ca.batch_execute("CREATE TABLE shared(id int)")
        .await
        .unwrap();
    let listed = ddl_messages(&direct, &probe).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(
        listed[0].starts_with(&format!("CREATE TABLE !{origin}\n@1259,")),
        "{listed:?}"
    );

    // B lets go of the database a second after its last client, and its
    // slot goes with its stream. A checks every 30 seconds.
    drop(cb);
    let body = "SELECT prosrc FROM pg_proc WHERE proname = 'announce_ddl'";
    eventually(
        Duration::from_secs(60),
        "A to find itself alone",
        || async {
            let alone = scalar(&direct, body)
                .await
                .is_some_and(|b| b.contains("origin IS NOT NULL AND true"));
            alone.then_some(())
        },
    )
    .await;
    ca.batch_execute("CREATE TABLE alone_again(id int)")
        .await
        .unwrap();
    assert_eq!(
        ddl_messages(&direct, &probe).await,
        [format!("CREATE TABLE ~ !{origin}\n")],
        "left out again, and rewriting the trigger was not announced"
    );
    drop(b);
}

/// The trigger names the instance for DDL its session analysed: the
/// client's statement itself, whatever comments come before it or
/// semicolons its body holds; not DDL run below it, by a function, a DO
/// block or another event trigger, even of the same verb.
#[tokio::test]
async fn the_trigger_names_the_origin_for_the_statements_a_session_sent() {
    let (db, a, ca, direct) =
        setup_streaming("ddlorigin", "CREATE TABLE t(id int PRIMARY KEY)").await;
    direct
        .batch_execute(
            "CREATE FUNCTION audit() RETURNS event_trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NOT EXISTS (SELECT FROM pg_class WHERE relname = 'audit_log') THEN
                 CREATE TABLE audit_log(id int);
               END IF;
             END $$;
             CREATE EVENT TRIGGER audit ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
               EXECUTE FUNCTION audit()",
        )
        .await
        .unwrap();
    let probe = probe_slot(&direct, &db).await;
    let origin = a.app.upstream.origin.value();
    ca.batch_execute(
        "/* made by a migration; */ -- step 1;
         CREATE FUNCTION grow(n int) RETURNS int LANGUAGE plpgsql AS $$
           BEGIN n := n + 1; RETURN n; END $$",
    )
    .await
    .unwrap();
    ca.batch_execute("DO $$ BEGIN CREATE INDEX ON t(id); END $$")
        .await
        .unwrap();
    ca.batch_execute("CREATE TABLE audited(id int)")
        .await
        .unwrap();
    let messages = ddl_messages(&direct, &probe).await;
    assert_eq!(messages.len(), 4, "{messages:?}");
    assert_eq!(messages[0], format!("CREATE FUNCTION ~ !{origin}\n"));
    // Below a DO block and below the user's event trigger: listed, for
    // every instance's round.
    assert!(
        messages[1].starts_with("CREATE INDEX\n@1259,"),
        "{messages:?}"
    );
    assert!(
        messages[2].starts_with("CREATE TABLE\n@1259,"),
        "{messages:?}"
    );
    assert_eq!(messages[3], format!("CREATE TABLE ~ !{origin}\n"));
}

/// Temporary objects made directly are their session's alone: their DDL
/// is not announced, and what the cache holds stays. A table dropped at
/// commit used to be gone before its round could name it, which counted
/// as a change of anything.
#[tokio::test]
async fn temporary_objects_made_directly_leave_the_cache_alone() {
    let (db, a, ca, direct) = setup_streaming(
        "ddltemp",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    let probe = probe_slot(&direct, &db).await;
    a.wait_stream(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    eventually(Duration::from_secs(10), "the read to hit", || async {
        let hits = a.hits();
        rows(&ca, read).await;
        (a.hits() > hits).then_some(())
    })
    .await;
    let state = a.app.cache.db(&db);
    let (_, rounds) = state.stream.ddl();
    direct
        .batch_execute(
            "BEGIN;
             CREATE TEMP TABLE scratch(id int PRIMARY KEY) ON COMMIT DROP;
             INSERT INTO scratch VALUES (1);
             COMMIT;
             CREATE TEMP TABLE kept(id int);
             DROP TABLE kept",
        )
        .await
        .unwrap();
    a.wait_stream(&db).await;
    let hits = a.hits();
    rows(&ca, read).await;
    assert_eq!(a.hits(), hits + 1, "still served from the cache");
    assert_eq!(state.stream.ddl().1, rounds, "no round");
    // A permanent table, for contrast: announced, listed, one round.
    direct
        .batch_execute("CREATE TABLE other(id int)")
        .await
        .unwrap();
    a.wait_stream(&db).await;
    let messages = ddl_messages(&direct, &probe).await;
    assert_eq!(
        messages.len(),
        1,
        "only the permanent table's: {messages:?}"
    );
    assert!(
        messages[0].starts_with("CREATE TABLE\n@1259,"),
        "{messages:?}"
    );
    assert_eq!(
        state.stream.ddl().1,
        rounds + 1,
        "one round, for that table"
    );
}

/// Behind a pooler that refuses the startup option `pgcache.origin`,
/// pgcache finds out at start-up and its clients' connections go without
/// it: they work, and their DDL takes a round like DDL made elsewhere.
#[tokio::test]
async fn behind_an_upstream_that_refuses_the_origin_setting_clients_work_without_it() {
    use pgcache::config::PoolMode;
    let db = pg().create_db("ddlrefused");
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    );
    let port = refusing_relay(pg().port, b"pgcache.origin").await;
    for (mode, column) in [(PoolMode::Session, "s"), (PoolMode::Transaction, "x")] {
        let mut config = pg().proxy_config();
        config.upstream.url = format!("postgres://postgres@127.0.0.1:{port}");
        config.pool.mode = mode;
        let proxy = Proxy::start(config).await;
        assert_eq!(proxy.app.upstream.origin.options(), None, "{mode:?}");
        let client = proxy.connect(&db).await;
        let read = "SELECT v FROM t WHERE id = 1";
        assert_eq!(
            scalar(&client, read).await.as_deref(),
            Some("1"),
            "{mode:?}"
        );
        let state = proxy.app.cache.db(&db);
        let (_, rounds) = state.stream.ddl();
        client
            .batch_execute(&format!("ALTER TABLE t ADD COLUMN {column} int"))
            .await
            .unwrap();
        proxy.wait_stream(&db).await;
        assert!(
            state.stream.ddl().1 > rounds,
            "{mode:?}: DDL from a connection without the setting takes a round"
        );
    }
}

/// pgcache adds tables to its publication as they are first read. A
/// migration that holds one of them, and then wants another that pgcache
/// has just added, must not meet a deadlock: pgcache gives up waiting
/// first, adds the table later, and nothing it ran writes an ERROR into
/// the server's log.
#[tokio::test]
async fn publication_changes_never_fail_a_concurrent_migration() {
    let pg = Pg::dedicated();
    let db = pg.create_db("pub_migration");
    let proxy = Proxy::start(pg.proxy_config()).await;
    let client = proxy.connect(&db).await;
    let direct = pg.direct(&db).await;
    // Made after the stream started: they join the publication when read.
    direct
        .batch_execute(
            "CREATE TABLE a_first(id int PRIMARY KEY, v int CONSTRAINT positive CHECK (v > 0)); \
             CREATE TABLE m_later(id int PRIMARY KEY); \
             INSERT INTO a_first VALUES (1, 1); INSERT INTO m_later VALUES (1)",
        )
        .await
        .unwrap();
    let published = |table: &'static str| {
        let direct = &direct;
        async move {
            let row = direct
                .query_one(
                    "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'pgcache' AND tablename = $1",
                    &[&table],
                )
                .await
                .unwrap();
            row.get::<_, i64>(0) == 1
        }
    };
    // The migration holds m_later, and will want a_first. Its deadlock
    // check comes before pgcache's own would (1 s).
    let migration = pg.direct(&db).await;
    migration
        .batch_execute("BEGIN; SET LOCAL deadlock_timeout = '500ms'; LOCK TABLE m_later IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let reader = tokio::spawn(async move {
        scalar(
            &client,
            "SELECT a_first.v FROM m_later JOIN a_first USING (id)",
        )
        .await
    });
    // pgcache tries both: it has added a_first, or it waits for m_later.
    eventually(
        Duration::from_secs(20),
        "pgcache to change the publication",
        || async {
            let waiting = direct
                .query_one(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid) \
                 WHERE l.relation = 'm_later'::regclass AND NOT l.granted \
                 AND s.query LIKE '%ALTER PUBLICATION%'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0);
            (waiting > 0 || published("a_first").await).then_some(())
        },
    )
    .await;
    migration
        .batch_execute("ALTER TABLE a_first DROP CONSTRAINT positive")
        .await
        .expect("the migration is never the victim of pgcache's publication change");
    migration.batch_execute("COMMIT").await.unwrap();
    assert_eq!(reader.await.unwrap().as_deref(), Some("1"));
    // m_later joins later, off the client's path.
    eventually(
        Duration::from_secs(20),
        "m_later to join the publication",
        || async { (published("a_first").await && published("m_later").await).then_some(()) },
    )
    .await;
    let log = std::fs::read_to_string(pg.dir.join("log")).unwrap();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR:")).collect();
    assert!(errors.is_empty(), "errors in the server's log: {errors:?}");
}
