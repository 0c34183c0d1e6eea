//! The local cache tier: what is served from memory, what never is, and
//! that no read ever returns a result older than a write acknowledged
//! through pgcache.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use tokio_postgres::Client;

async fn setup(name: &str, sql: &str) -> (String, Proxy, Client) {
    let db = pg().create_db(name);
    if !sql.is_empty() {
        pg().psql_db(&db, sql);
    }
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    (db, proxy, client)
}

#[tokio::test]
async fn second_identical_select_is_served_from_cache_even_while_the_table_is_locked() {
    let (db, proxy, client) = setup(
        "hit",
        "CREATE TABLE t(id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'one')",
    )
    .await;
    assert_eq!(
        scalar(&client, "SELECT v FROM t WHERE id = 1")
            .await
            .as_deref(),
        Some("one")
    );
    assert_eq!(proxy.hits(), 0);
    assert_eq!(proxy.stores(), 1);

    let locker = lock_table(&db, "t").await;
    let cached = tokio::time::timeout(
        Duration::from_secs(5),
        scalar(&client, "SELECT v FROM t WHERE id = 1"),
    )
    .await
    .expect("a cached read does not wait for the lock");
    assert_eq!(cached.as_deref(), Some("one"));
    assert_eq!(proxy.hits(), 1);
    // A read pgcache has not cached goes to PostgreSQL and waits for the lock.
    let forwarded = tokio::time::timeout(
        Duration::from_millis(300),
        scalar(&client, "SELECT v FROM t WHERE id = 2"),
    )
    .await;
    assert!(
        forwarded.is_err(),
        "an uncached read must reach PostgreSQL and block"
    );
    drop(locker);
}

#[tokio::test]
async fn writes_through_pgcache_are_seen_by_every_later_read() {
    let (db, proxy, client) = setup(
        "ryw",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 10)",
    )
    .await;
    let other = proxy.connect(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("10"));
    assert_eq!(scalar(&other, read).await.as_deref(), Some("10"));
    assert_eq!(proxy.hits(), 1);
    let writes = [
        "UPDATE t SET v = 11 WHERE id = 1",
        "INSERT INTO t VALUES (2, 0) ON CONFLICT DO NOTHING; UPDATE t SET v = 12 WHERE id = 1",
        "WITH w AS (UPDATE t SET v = 13 WHERE id = 1 RETURNING v) SELECT * FROM w",
        "DELETE FROM t WHERE id = 1; INSERT INTO t VALUES (1, 14)",
        "MERGE INTO t USING (VALUES (1)) s(id) ON t.id = s.id WHEN MATCHED THEN UPDATE SET v = 15",
        "TRUNCATE t; INSERT INTO t VALUES (1, 16)",
    ];
    for (i, write) in writes.iter().enumerate() {
        client.batch_execute(write).await.unwrap();
        let want = (11 + i).to_string();
        assert_eq!(
            scalar(&other, read).await.as_deref(),
            Some(want.as_str()),
            "after {write}"
        );
        assert_eq!(
            scalar(&client, read).await.as_deref(),
            Some(want.as_str()),
            "after {write}"
        );
    }
    // COPY FROM STDIN is a write too.
    assert_eq!(
        scalar(&other, "SELECT count(*) FROM t").await.as_deref(),
        Some("1")
    );
    let sink = client.copy_in("COPY t FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    futures_util::SinkExt::send(&mut sink, bytes::Bytes::from_static(b"3\t30\n"))
        .await
        .unwrap();
    sink.finish().await.unwrap();
    assert_eq!(
        scalar(&other, "SELECT count(*) FROM t").await.as_deref(),
        Some("2")
    );
}

#[tokio::test]
async fn a_function_that_writes_invalidates_what_it_wrote() {
    let (db, proxy, client) = setup(
        "funcwrite",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0);
         CREATE FUNCTION bump() RETURNS int LANGUAGE sql VOLATILE AS 'UPDATE t SET v = v + 1 RETURNING v';
         CREATE PROCEDURE bump_proc() LANGUAGE sql AS 'UPDATE t SET v = v + 1';",
    )
    .await;
    let other = proxy.connect(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(scalar(&other, read).await.as_deref(), Some("0"));
    assert_eq!(scalar(&client, "SELECT bump()").await.as_deref(), Some("1"));
    assert_eq!(
        scalar(&other, read).await.as_deref(),
        Some("1"),
        "SELECT of a writing function"
    );
    client.batch_execute("CALL bump_proc()").await.unwrap();
    assert_eq!(scalar(&other, read).await.as_deref(), Some("2"), "CALL");
    client
        .batch_execute("DO $$ BEGIN UPDATE t SET v = v + 1; END $$")
        .await
        .unwrap();
    assert_eq!(scalar(&other, read).await.as_deref(), Some("3"), "DO");
    // Through the extended protocol too.
    let row = client.query_one("SELECT bump()", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 4);
    assert_eq!(
        scalar(&other, read).await.as_deref(),
        Some("4"),
        "extended SELECT bump()"
    );
}

#[tokio::test]
async fn trigger_and_cascade_writes_to_other_tables_invalidate_them() {
    let (db, proxy, client) = setup(
        "trigger",
        "CREATE TABLE a(id int PRIMARY KEY); CREATE TABLE audit(n int);
         INSERT INTO audit VALUES (0);
         CREATE FUNCTION log_a() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN UPDATE audit SET n = n + 1; RETURN NEW; END $$;
         CREATE TRIGGER a_log AFTER INSERT ON a FOR EACH ROW EXECUTE FUNCTION log_a();
         CREATE TABLE parent(id int PRIMARY KEY);
         CREATE TABLE child(id int PRIMARY KEY, pid int REFERENCES parent ON DELETE CASCADE);
         INSERT INTO parent VALUES (1); INSERT INTO child VALUES (1, 1);",
    )
    .await;
    let other = proxy.connect(&db).await;
    assert_eq!(
        scalar(&other, "SELECT n FROM audit").await.as_deref(),
        Some("0")
    );
    client
        .batch_execute("INSERT INTO a VALUES (1)")
        .await
        .unwrap();
    assert_eq!(
        scalar(&other, "SELECT n FROM audit").await.as_deref(),
        Some("1")
    );
    assert_eq!(
        scalar(&other, "SELECT count(*) FROM child")
            .await
            .as_deref(),
        Some("1")
    );
    client
        .batch_execute("DELETE FROM parent WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(
        scalar(&other, "SELECT count(*) FROM child")
            .await
            .as_deref(),
        Some("0")
    );
}

#[tokio::test]
async fn partition_writes_invalidate_the_parent_and_the_other_way_round() {
    let (db, proxy, client) = setup(
        "partition",
        "CREATE TABLE m(id int PRIMARY KEY, v int) PARTITION BY RANGE (id);
         CREATE TABLE m_low PARTITION OF m FOR VALUES FROM (0) TO (100);
         CREATE TABLE m_high PARTITION OF m FOR VALUES FROM (100) TO (200);
         INSERT INTO m VALUES (1, 1), (150, 1);",
    )
    .await;
    let other = proxy.connect(&db).await;
    assert_eq!(
        scalar(&other, "SELECT sum(v) FROM m").await.as_deref(),
        Some("2")
    );
    assert_eq!(
        scalar(&other, "SELECT sum(v) FROM m_high").await.as_deref(),
        Some("1")
    );
    client
        .batch_execute("UPDATE m_low SET v = 10")
        .await
        .unwrap();
    assert_eq!(
        scalar(&other, "SELECT sum(v) FROM m").await.as_deref(),
        Some("11")
    );
    client
        .batch_execute("UPDATE m SET v = 5 WHERE id = 150")
        .await
        .unwrap();
    assert_eq!(
        scalar(&other, "SELECT sum(v) FROM m_high").await.as_deref(),
        Some("5")
    );
    assert!(proxy.hits() == 0, "every read above followed a write");
}

#[tokio::test]
async fn never_cached_statements_always_reach_postgres() {
    let (db, proxy, client) = setup(
        "never",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE VIEW tv AS SELECT * FROM t;
         CREATE SEQUENCE s;
         CREATE FUNCTION stable_f() RETURNS int LANGUAGE sql STABLE AS 'SELECT 1';",
    )
    .await;
    let cases = [
        "SELECT now()::text",
        "SELECT random()",
        "SELECT nextval('s')",
        "SELECT v, stable_f() FROM t",
        "SELECT current_user",
        "SELECT 'now'::timestamptz",
        "SELECT * FROM t FOR UPDATE",
        "SELECT * FROM t FOR SHARE",
        "SELECT * FROM tv",
        "SELECT relname FROM pg_class WHERE relname = 't'",
        "SELECT count(*) FROM information_schema.tables",
        "SELECT 1; SELECT 2",
    ];
    for sql in cases {
        let before = (proxy.hits(), proxy.stores());
        rows(&client, sql).await;
        rows(&client, sql).await;
        assert_eq!(
            (proxy.hits(), proxy.stores()),
            before,
            "{sql} must not be cached"
        );
    }
    // SELECT INTO and data-modifying CTEs are writes, not reads.
    client
        .batch_execute("SELECT * INTO t_copy FROM t")
        .await
        .unwrap();
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM t_copy")
            .await
            .as_deref(),
        Some("1")
    );
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM t").await.as_deref(),
        Some("1")
    );
    let moved = rows(
        &client,
        "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
    )
    .await;
    assert_eq!(moved.len(), 1);
    let other = proxy.connect(&db).await;
    assert_eq!(
        scalar(&other, "SELECT count(*) FROM t").await.as_deref(),
        Some("0")
    );
}

#[tokio::test]
async fn temp_tables_disable_the_cache_for_their_session() {
    let (db, proxy, client) = setup(
        "temp",
        "CREATE TABLE t(v int PRIMARY KEY); INSERT INTO t VALUES (1)",
    )
    .await;
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    // A temp table of the same name shadows public.t in this session only.
    client
        .batch_execute("CREATE TEMP TABLE t(v int); INSERT INTO t VALUES (2)")
        .await
        .unwrap();
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("2")
    );
    let other = proxy.connect(&db).await;
    assert_eq!(
        scalar(&other, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
}

#[tokio::test]
async fn reads_after_a_write_in_a_transaction_see_that_write_and_aborted_reads_are_not_stored() {
    let (db, proxy, client) = setup(
        "txn",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    let other = proxy.connect(&db).await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(scalar(&other, read).await.as_deref(), Some("1"));
    client
        .batch_execute("BEGIN; UPDATE t SET v = 2 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(
        scalar(&client, read).await.as_deref(),
        Some("2"),
        "own uncommitted write"
    );
    assert_eq!(
        scalar(&other, read).await.as_deref(),
        Some("1"),
        "not visible elsewhere yet"
    );
    client.batch_execute("COMMIT").await.unwrap();
    assert_eq!(scalar(&other, read).await.as_deref(), Some("2"));

    // A read inside a transaction that rolls back is never stored.
    let stores = proxy.stores();
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT v + 100 FROM t WHERE id = 1")
            .await
            .as_deref(),
        Some("102")
    );
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(proxy.stores(), stores);
    // The same read in a committed transaction is stored at COMMIT.
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT v + 100 FROM t WHERE id = 1")
            .await
            .as_deref(),
        Some("102")
    );
    assert_eq!(proxy.stores(), stores, "not before COMMIT");
    client.batch_execute("COMMIT").await.unwrap();
    assert_eq!(proxy.stores(), stores + 1);
}

#[tokio::test]
async fn repeatable_read_and_serializable_transactions_bypass_the_cache() {
    let (db, proxy, client) = setup(
        "rr",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    for begin in [
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
        "BEGIN; SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
    ] {
        let hits = proxy.hits();
        client.batch_execute(begin).await.unwrap();
        assert_eq!(
            scalar(&client, "SELECT v FROM t").await.as_deref(),
            Some("1")
        );
        // The snapshot is fixed: a write committed elsewhere stays invisible.
        pg().psql_db(&db, "UPDATE t SET v = v + 1");
        assert_eq!(
            scalar(&client, "SELECT v FROM t").await.as_deref(),
            Some("1"),
            "{begin}"
        );
        client.batch_execute("COMMIT").await.unwrap();
        assert_eq!(proxy.hits(), hits, "{begin}");
        pg().psql_db(&db, "UPDATE t SET v = 1");
        client.batch_execute("UPDATE t SET v = 1").await.unwrap();
    }
    // A read-committed transaction may use the cache before it writes.
    proxy.wait_stream(&db).await;
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    let hits = proxy.hits();
    client.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    client.batch_execute("COMMIT").await.unwrap();
    assert_eq!(proxy.hits(), hits + 1);
}

#[tokio::test]
async fn a_transaction_takes_the_isolation_it_names_over_the_sessions_default() {
    let (db, proxy, client) = setup(
        "named_isolation",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    proxy.wait_stream(&db).await;
    let set = "SET default_transaction_isolation = 'repeatable read'";
    client.batch_execute(set).await.unwrap();
    let read = || async { scalar(&client, "SELECT v FROM t").await };
    read().await;
    assert_eq!(read().await.as_deref(), Some("1"));
    // At the default, a snapshot: PostgreSQL answers. READ COMMITTED
    // named: each statement reads what is committed, as a cached answer is.
    for (begin, served) in [("BEGIN", 0), ("BEGIN ISOLATION LEVEL READ COMMITTED", 1)] {
        let hits = proxy.hits();
        client.batch_execute(begin).await.unwrap();
        assert_eq!(read().await.as_deref(), Some("1"), "{begin}");
        client.batch_execute("COMMIT").await.unwrap();
        assert_eq!(proxy.hits(), hits + served, "{begin}");
    }
}

#[tokio::test]
async fn extended_protocol_hits_with_binary_results_nulls_and_new_parameters() {
    let (_db, proxy, client) = setup(
        "extended",
        "CREATE TABLE t(id int PRIMARY KEY, name text, data bytea, score float8);
         INSERT INTO t VALUES (1, 'a', '\\x0102', 1.5), (2, NULL, NULL, NULL);",
    )
    .await;
    let stmt = client
        .prepare("SELECT id, name, data, score FROM t WHERE id = $1")
        .await
        .unwrap();
    for _ in 0..3 {
        let r = client.query_one(&stmt, &[&1i32]).await.unwrap();
        assert_eq!(r.get::<_, Option<&str>>(1), Some("a"));
        assert_eq!(r.get::<_, Option<Vec<u8>>>(2), Some(vec![1, 2]));
        assert_eq!(r.get::<_, Option<f64>>(3), Some(1.5));
        let r = client.query_one(&stmt, &[&2i32]).await.unwrap();
        assert_eq!(r.get::<_, Option<&str>>(1), None);
        assert_eq!(r.get::<_, Option<Vec<u8>>>(2), None);
    }
    assert_eq!(
        proxy.hits(),
        4,
        "two parameter values, each stored once and hit twice"
    );
    assert!(client.query_opt(&stmt, &[&3i32]).await.unwrap().is_none());
    // Statements parsed anew for each query (as psycopg and pgbench -M
    // extended do). tokio-postgres closes each in the background, which can
    // race with the next query (then forwarded): most, not all, hit.
    let hits = proxy.hits();
    for _ in 0..6 {
        let r = client
            .query_one("SELECT name FROM t WHERE id = 1", &[])
            .await
            .unwrap();
        assert_eq!(r.get::<_, &str>(0), "a");
    }
    assert!(
        proxy.hits() >= hits + 2,
        "hits {} -> {}",
        hits,
        proxy.hits()
    );
    // And the backend's statement state stays right: a write after hits works.
    client
        .execute("UPDATE t SET name = 'b' WHERE id = 1", &[])
        .await
        .unwrap();
    let r = client.query_one(&stmt, &[&1i32]).await.unwrap();
    assert_eq!(r.get::<_, Option<&str>>(1), Some("b"));
}

/// What libpq and pgbench -M prepared send for each run of a prepared
/// statement, Bind [Describe] Execute Sync, arrives whole in one read:
/// once the statement's plan is known, pgcache decides on it in one step.
/// Each shape keeps its own entry, found the same whether the batch that
/// stored it went that way or frame by frame, and two batches in one write
/// are both answered, in order.
#[tokio::test]
async fn whole_prepared_batches_find_the_entries_their_frames_made() {
    use common::wire::*;
    use tokio::io::AsyncWriteExt;
    let (db, proxy, _client) = setup(
        "whole_batches",
        "CREATE TABLE t(id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'one');",
    )
    .await;
    let (mut s, _) = raw_login(proxy.addr, &db).await;
    s.write_all(&[parse("s1", "SELECT v FROM t WHERE id = 1"), sync()].concat())
        .await
        .unwrap();
    assert_eq!(tags(&read_until_ready(&mut s).await), "1Z");
    let by_portal = [bind("s1"), describe_portal(), execute(), sync()].concat();
    let by_statement = [bind("s1"), describe_statement("s1"), execute(), sync()].concat();
    // The first run of the first shape plans the statement (frame by frame);
    // every later one finds the plan.
    for (batch, answer) in [(&by_portal, "2TDCZ"), (&by_statement, "2tTDCZ")] {
        let hits = proxy.hits();
        for run in 0..3 {
            s.write_all(batch).await.unwrap();
            let reply = read_until_ready(&mut s).await;
            assert_eq!(tags(&reply), answer, "run {run}");
            let row = reply.iter().find(|(t, _)| *t == b'D').unwrap();
            assert!(row.1.ends_with(b"one"), "run {run}: {row:?}");
        }
        assert_eq!(proxy.hits() - hits, 2, "{answer}: stored once, hit twice");
    }
    s.write_all(&[by_portal.clone(), by_portal].concat())
        .await
        .unwrap();
    for _ in 0..2 {
        assert_eq!(tags(&read_until_ready(&mut s).await), "2TDCZ");
    }
    // The writes that follow are seen: the entry's table was bumped.
    s.write_all(&query("UPDATE t SET v = 'uno' WHERE id = 1"))
        .await
        .unwrap();
    read_until_ready(&mut s).await;
    s.write_all(&[bind("s1"), describe_portal(), execute(), sync()].concat())
        .await
        .unwrap();
    let reply = read_until_ready(&mut s).await;
    let row = reply.iter().find(|(t, _)| *t == b'D').unwrap();
    assert!(row.1.ends_with(b"uno"), "{row:?}");
}

#[tokio::test]
async fn results_over_the_entry_limit_are_streamed_not_stored() {
    let db = pg().create_db("large");
    pg().psql_db(&db, "CREATE TABLE big AS SELECT g AS id, repeat('x', 100) AS pad FROM generate_series(1, 20000) g; ALTER TABLE big ADD PRIMARY KEY (id)");
    let mut config = pg().proxy_config();
    config.cache.max_entry_bytes = 64 * 1024;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    for _ in 0..2 {
        let all = rows(&client, "SELECT id, pad FROM big ORDER BY id").await;
        assert_eq!(all.len(), 20000);
        assert_eq!(all[19999][0].as_deref(), Some("20000"));
    }
    assert_eq!(proxy.stores(), 0);
    assert_eq!(proxy.hits(), 0);
    let few = rows(&client, "SELECT id FROM big WHERE id < 10 ORDER BY id").await;
    assert_eq!(few.len(), 9);
    assert_eq!(proxy.stores(), 1);
}

#[tokio::test]
async fn row_level_security_gives_each_role_its_own_rows() {
    let db = pg().create_db("rls");
    pg().psql_db(
        &db,
        "CREATE TABLE docs(id serial PRIMARY KEY, owner text, body text);
         INSERT INTO docs(owner, body) VALUES ('alice', 'a1'), ('bob', 'b1'), ('bob', 'b2');
         ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own ON docs USING (owner = current_user);
         DO $$ BEGIN CREATE ROLE alice LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
         DO $$ BEGIN CREATE ROLE bob LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
         GRANT SELECT ON docs TO alice, bob;
         CREATE TABLE tenant_rows(tenant int PRIMARY KEY, v text);
         INSERT INTO tenant_rows VALUES (1, 'one'), (2, 'two');
         ALTER TABLE tenant_rows ENABLE ROW LEVEL SECURITY;
         CREATE POLICY by_tenant ON tenant_rows USING (tenant = current_setting('app.tenant')::int);
         GRANT SELECT ON tenant_rows TO alice;",
    );
    let proxy = Proxy::start(pg().proxy_config()).await;
    let alice = connect_dsn(&proxy.dsn("alice", &db)).await.unwrap();
    let bob = connect_dsn(&proxy.dsn("bob", &db)).await.unwrap();
    proxy.wait_streaming(&db).await;
    for _ in 0..2 {
        assert_eq!(
            rows(&alice, "SELECT body FROM docs ORDER BY body")
                .await
                .len(),
            1
        );
        assert_eq!(
            rows(&bob, "SELECT body FROM docs ORDER BY body")
                .await
                .len(),
            2
        );
    }
    assert!(proxy.hits() >= 2, "each role hits its own entry");
    // SET ROLE changes the rows too.
    let admin = proxy.connect(&db).await;
    admin.batch_execute("SET ROLE bob").await.unwrap();
    assert_eq!(
        rows(&admin, "SELECT body FROM docs ORDER BY body")
            .await
            .len(),
        2
    );
    admin.batch_execute("SET ROLE alice").await.unwrap();
    assert_eq!(
        rows(&admin, "SELECT body FROM docs ORDER BY body")
            .await
            .len(),
        1
    );
    // A policy keyed on a custom setting: the setting is part of the key.
    for (tenant, want) in [("1", "one"), ("2", "two"), ("1", "one")] {
        alice
            .batch_execute(&format!("SET app.tenant = '{tenant}'"))
            .await
            .unwrap();
        assert_eq!(
            scalar(&alice, "SELECT v FROM tenant_rows").await.as_deref(),
            Some(want),
            "tenant {tenant}"
        );
    }
}

#[tokio::test]
async fn the_same_text_under_two_search_paths_reads_two_tables() {
    let (db, proxy, client) = setup(
        "searchpath",
        "CREATE SCHEMA s1; CREATE SCHEMA s2;
         CREATE TABLE s1.t(v text PRIMARY KEY); CREATE TABLE s2.t(v text PRIMARY KEY);
         INSERT INTO s1.t VALUES ('from s1'); INSERT INTO s2.t VALUES ('from s2');",
    )
    .await;
    let other = proxy.connect(&db).await;
    client.batch_execute("SET search_path = s1").await.unwrap();
    other.batch_execute("SET search_path = s2").await.unwrap();
    for _ in 0..2 {
        assert_eq!(
            scalar(&client, "SELECT v FROM t").await.as_deref(),
            Some("from s1")
        );
        assert_eq!(
            scalar(&other, "SELECT v FROM t").await.as_deref(),
            Some("from s2")
        );
    }
    assert_eq!(proxy.hits(), 2);
    client.batch_execute("SET search_path = s2").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("from s2")
    );
}

#[tokio::test]
async fn set_time_zone_changes_timestamptz_output() {
    let (_db, _proxy, client) = setup(
        "tz",
        "CREATE TABLE e(at timestamptz PRIMARY KEY); INSERT INTO e VALUES ('2024-01-01 00:00:00+00')",
    )
    .await;
    client.batch_execute("SET TIME ZONE 'UTC'").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT at FROM e").await.as_deref(),
        Some("2024-01-01 00:00:00+00")
    );
    client
        .batch_execute("SET TIME ZONE 'Asia/Tokyo'")
        .await
        .unwrap();
    assert_eq!(
        scalar(&client, "SELECT at FROM e").await.as_deref(),
        Some("2024-01-01 09:00:00+09")
    );
    client.batch_execute("SET TIME ZONE 'UTC'").await.unwrap();
    assert_eq!(
        scalar(&client, "SELECT at FROM e").await.as_deref(),
        Some("2024-01-01 00:00:00+00")
    );
    // Other output settings too.
    client
        .batch_execute("SET extra_float_digits = 0")
        .await
        .unwrap();
    let short = scalar(&client, "SELECT 0.1::float8 + 0.2::float8").await;
    client
        .batch_execute("SET extra_float_digits = 3")
        .await
        .unwrap();
    let long = scalar(&client, "SELECT 0.1::float8 + 0.2::float8").await;
    assert_ne!(short, long);
}

/// Concurrent writers and readers through pgcache: a read that starts after
/// a write was acknowledged must never return an older value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_read_returns_a_value_older_than_an_acknowledged_write() {
    let (db, proxy, client) = setup(
        "stale",
        "CREATE TABLE c(id int PRIMARY KEY, v bigint); INSERT INTO c VALUES (1, 0)",
    )
    .await;
    drop(client);
    let acked = Arc::new(AtomicI64::new(0));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let client = proxy.connect(&db).await;
        let acked = Arc::clone(&acked);
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let v: i64 = scalar(&client, "UPDATE c SET v = v + 1 WHERE id = 1 RETURNING v")
                    .await
                    .unwrap()
                    .parse()
                    .unwrap();
                acked.fetch_max(v, Ordering::SeqCst);
                n += 1;
            }
            n
        }));
    }
    let mut readers = Vec::new();
    for i in 0..4 {
        let client = proxy.connect(&db).await;
        let acked = Arc::clone(&acked);
        readers.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let floor = acked.load(Ordering::SeqCst);
                let v: i64 = if i % 2 == 0 {
                    scalar(&client, "SELECT v FROM c WHERE id = 1")
                        .await
                        .unwrap()
                        .parse()
                        .unwrap()
                } else {
                    client
                        .query_one("SELECT v FROM c WHERE id = $1", &[&1i32])
                        .await
                        .unwrap()
                        .get(0)
                };
                assert!(v >= floor, "read {v} after write {floor} was acknowledged");
                n += 1;
            }
            n
        }));
    }
    let writes: i32 = futures_util::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    let reads: i32 = futures_util::future::join_all(readers)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .sum();
    assert!(writes > 10 && reads > 10, "writes {writes}, reads {reads}");
    // The check had cached reads to catch: some reads were hits.
    assert!(proxy.hits() > 0, "no read was served from cache");
}

/// tokio-postgres sends `Bind, Execute, Sync` before COPY data and another
/// Sync after CopyDone; PostgreSQL answers only the second. pgcache must not
/// wait for an answer to the first, or the session would never look idle.
#[tokio::test]
async fn after_an_extended_copy_the_session_is_idle_and_hits_again() {
    let (_db, proxy, client) = setup(
        "copysync",
        "CREATE TABLE t(v int); CREATE TABLE u(v int PRIMARY KEY); INSERT INTO u VALUES (7)",
    )
    .await;
    // Prepared once: dropping a statement makes tokio-postgres send Close in
    // the background, which would race with the reads below.
    let copy = client.prepare("COPY t FROM STDIN").await.unwrap();
    for round in 0..2 {
        let sink = client.copy_in(&copy).await.unwrap();
        futures_util::pin_mut!(sink);
        futures_util::SinkExt::send(&mut sink, bytes::Bytes::from_static(b"1\n2\n"))
            .await
            .unwrap();
        assert_eq!(sink.finish().await.unwrap(), 2);
        let hits = proxy.hits();
        assert_eq!(
            scalar(&client, "SELECT v FROM u").await.as_deref(),
            Some("7")
        );
        assert_eq!(
            scalar(&client, "SELECT v FROM u").await.as_deref(),
            Some("7")
        );
        assert!(proxy.hits() > hits, "round {round}: no hit after COPY");
    }
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM t").await.as_deref(),
        Some("4")
    );
}

#[tokio::test]
async fn a_table_created_outside_pgcache_becomes_cacheable() {
    let (db, proxy, client) = setup("newtable", "CREATE TABLE t(v int PRIMARY KEY)").await;
    assert_eq!(
        scalar(&client, "SELECT count(*) FROM t").await.as_deref(),
        Some("0")
    );
    pg().psql_db(
        &db,
        "CREATE TABLE fresh(v int PRIMARY KEY); INSERT INTO fresh VALUES (5)",
    );
    // Unknown at first (not cached), then the snapshot is reloaded.
    let hits = eventually(Duration::from_secs(10), "a hit on the new table", || {
        let client = &client;
        let proxy = &proxy;
        async move {
            let before = proxy.hits();
            assert_eq!(
                scalar(client, "SELECT v FROM fresh").await.as_deref(),
                Some("5")
            );
            (proxy.hits() > before).then_some(proxy.hits())
        }
    })
    .await;
    assert!(hits > 0);
}

#[tokio::test]
async fn entries_expire_after_the_default_ttl() {
    let db = pg().create_db("ttl");
    pg().psql_db(
        &db,
        "CREATE TABLE t(v int PRIMARY KEY); INSERT INTO t VALUES (1)",
    );
    let mut config = pg().proxy_config();
    config.cache.default_ttl_secs = 1;
    // Replication would see the direct write below: test the TTL alone.
    config.replication.enabled = false;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    assert_eq!(
        scalar(&client, "SELECT v FROM t").await.as_deref(),
        Some("1")
    );
    assert_eq!(proxy.hits(), 1);
    // Without replication a write made directly on PostgreSQL is invisible
    // to pgcache: the TTL is what bounds it.
    pg().psql_db(&db, "UPDATE t SET v = 2");
    let started = Instant::now();
    eventually(Duration::from_secs(10), "the entry to expire", || {
        let client = &client;
        async move { (scalar(client, "SELECT v FROM t").await.as_deref() == Some("2")).then_some(()) }
    })
    .await;
    assert!(started.elapsed() < Duration::from_secs(5));
}
