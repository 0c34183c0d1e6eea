//! What pgcache knows of the catalog, learnt name by name: a first read
//! is forwarded while its names are looked up, and DDL made directly on
//! PostgreSQL never lets an entry outlive what it was computed from.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pgcache::classify::BypassReason;
use tokio_postgres::Client;

/// Reads `sql` until one read is a hit; returns the value.
async fn eventually_hit(proxy: &Proxy, client: &Client, sql: &str) -> Option<String> {
    eventually(
        Duration::from_secs(10),
        &format!("{sql} to hit"),
        || async {
            let hits = proxy.hits();
            let value = scalar(client, sql).await;
            (proxy.hits() > hits).then_some(value)
        },
    )
    .await
}

/// Waits until three reads of `sql` in a row return `want` and none is a
/// hit: DDL made directly stops caching within the stream's lag (the stream
/// names what a command altered once its transaction is visible).
async fn stops_hitting(proxy: &Proxy, client: &Client, sql: &str, want: &str) {
    eventually(
        Duration::from_secs(10),
        &format!("{sql} to stop hitting"),
        || async {
            let hits = proxy.hits();
            for _ in 0..3 {
                assert_eq!(scalar(client, sql).await.as_deref(), Some(want), "{sql}");
            }
            (proxy.hits() == hits).then_some(())
        },
    )
    .await;
    never_hits(proxy, client, sql, want).await;
}

/// Reads `sql` three times, expecting `want` each time and no hit.
async fn never_hits(proxy: &Proxy, client: &Client, sql: &str, want: &str) {
    let hits = proxy.hits();
    for _ in 0..3 {
        assert_eq!(scalar(client, sql).await.as_deref(), Some(want), "{sql}");
    }
    assert_eq!(proxy.hits(), hits, "{sql} must not be served from cache");
}

#[tokio::test]
async fn a_first_read_is_forwarded_while_its_names_are_looked_up_then_cached() {
    let db = pg().create_db("cat_first");
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 7)",
    );
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    proxy.wait_stream(&db).await;
    let pending = proxy.app.metrics.bypasses(BypassReason::CatalogPending);
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("7"));
    assert_eq!(
        proxy.app.metrics.bypasses(BypassReason::CatalogPending),
        pending + 1,
        "the first read does not wait for the lookup: it is a counted bypass"
    );
    assert_eq!(proxy.stores(), 0);
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("7")
    );
    // DDL never waits for, nor causes, a lookup.
    let fetches = proxy.app.cache.db(&db).catalog.fetches();
    client
        .batch_execute("CREATE TABLE other(a int); DROP TABLE other")
        .await
        .unwrap();
    assert_eq!(proxy.app.cache.db(&db).catalog.fetches(), fetches);
}

#[tokio::test]
async fn without_a_connection_of_its_own_a_session_looks_names_up_itself() {
    let db = pg().create_db("cat_own");
    pg().psql_db(
        &db,
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 7)",
    );
    let mut config = pg().proxy_config();
    // pgcache's own connections log in as a user that does not exist;
    // clients still log in as themselves.
    config.upstream.url = config.upstream.url.replace("postgres@", "no_such_user@");
    config.replication.enabled = false;
    let proxy = Proxy::start(config).await;
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    let read = "SELECT v FROM t WHERE id = 1";
    let state = proxy.app.cache.db(&db);
    eventually(
        Duration::from_secs(10),
        "the fetcher to give up",
        || async {
            scalar(&client, read).await;
            state.catalog.fetcher_down().then_some(())
        },
    )
    .await;
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("7")
    );
}

#[tokio::test]
async fn a_table_created_directly_becomes_cacheable_within_the_stream_lag() {
    let (_db, proxy, client, direct) = setup_streaming("cat_created", "SELECT 1").await;
    let read = "SELECT v FROM fresh WHERE id = 1";
    assert!(
        client.simple_query(read).await.is_err(),
        "no such table yet"
    );
    direct
        .batch_execute(
            "CREATE TABLE fresh(id int PRIMARY KEY, v int); INSERT INTO fresh VALUES (1, 5)",
        )
        .await
        .unwrap();
    let created = Instant::now();
    let stores = proxy.stores();
    eventually(
        Duration::from_secs(10),
        "the new table to be stored",
        || async {
            let _ = client.simple_query(read).await;
            (proxy.stores() > stores).then_some(())
        },
    )
    .await;
    eprintln!(
        "a table created directly was cacheable after {:?}",
        created.elapsed()
    );
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("5")
    );
    direct
        .batch_execute("UPDATE fresh SET v = 6")
        .await
        .unwrap();
    eventually_reads(&client, read, "6").await;
}

/// A table joins pgcache's publication when a statement through pgcache
/// first finds it missing, not when DDL makes it: DDL of tables nobody
/// reads or writes through pgcache changes no publication.
#[tokio::test]
async fn a_new_table_joins_the_publication_when_first_read_not_when_made() {
    let (db, proxy, client, direct) = setup_streaming("cat_lazy", "SELECT 1").await;
    client
        .batch_execute("CREATE TABLE made(id int PRIMARY KEY, v int); CREATE INDEX ON made(v)")
        .await
        .unwrap();
    direct
        .batch_execute(
            "INSERT INTO made VALUES (1, 5); CREATE TABLE made_directly(id int PRIMARY KEY)",
        )
        .await
        .unwrap();
    // A heartbeat back follows the DDL before it, and what was done after it.
    proxy.wait_stream(&db).await;
    let published = "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables WHERE pubname = 'pgcache'";
    assert_eq!(scalar(&direct, published).await, None, "nothing read yet");
    let read = "SELECT v FROM made WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("5")
    );
    assert_eq!(scalar(&direct, published).await.as_deref(), Some("made"));
    // Its writes made directly reach the cache through the stream.
    direct.batch_execute("UPDATE made SET v = 6").await.unwrap();
    eventually_reads(&client, read, "6").await;
}

#[tokio::test]
async fn a_table_replaced_renamed_or_moved_directly_never_serves_an_old_entry() {
    let (_db, proxy, client, direct) = setup_streaming(
        "cat_replaced",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE TABLE base(id int PRIMARY KEY, v int); INSERT INTO base VALUES (1, 2)",
    )
    .await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("1")
    );

    // Dropped and recreated as a view: never served from the table's entry,
    // and a view is not cached without a TTL.
    direct
        .batch_execute("DROP TABLE t; CREATE VIEW t AS SELECT id, v FROM base")
        .await
        .unwrap();
    eventually_reads(&client, read, "2").await;
    stops_hitting(&proxy, &client, read, "2").await;
    direct.batch_execute("UPDATE base SET v = 3").await.unwrap();
    never_hits(&proxy, &client, read, "3").await;

    // Back to a table: cached again, and its writes seen.
    direct
        .batch_execute(
            "DROP VIEW t; CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 4)",
        )
        .await
        .unwrap();
    eventually_reads(&client, read, "4").await;
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("4")
    );

    // Renamed: the old name fails, the new one is read and cached.
    direct
        .batch_execute("ALTER TABLE t RENAME TO t2")
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "the old name to fail", || async {
        client.simple_query(read).await.is_err().then_some(())
    })
    .await;
    let renamed = "SELECT v FROM t2 WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, renamed).await.as_deref(),
        Some("4")
    );

    // Moved to another schema: read by its new qualified name, its writes
    // still invalidate.
    direct
        .batch_execute("CREATE SCHEMA elsewhere; ALTER TABLE t2 SET SCHEMA elsewhere")
        .await
        .unwrap();
    let moved = "SELECT v FROM elsewhere.t2 WHERE id = 1";
    eventually_reads(&client, moved, "4").await;
    assert_eq!(
        eventually_hit(&proxy, &client, moved).await.as_deref(),
        Some("4")
    );
    direct
        .batch_execute("UPDATE elsewhere.t2 SET v = 5")
        .await
        .unwrap();
    eventually_reads(&client, moved, "5").await;
}

#[tokio::test]
async fn a_function_made_volatile_directly_stops_its_reads_being_cached() {
    let (_db, proxy, client, direct) = setup_streaming(
        "cat_volatile",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 10);
         CREATE FUNCTION twice(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1 * 2'",
    )
    .await;
    let read = "SELECT twice(v) FROM t WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("20")
    );
    direct
        .batch_execute(
            "CREATE OR REPLACE FUNCTION twice(int) RETURNS int LANGUAGE sql VOLATILE AS 'SELECT $1 * 3'",
        )
        .await
        .unwrap();
    eventually_reads(&client, read, "30").await;
    stops_hitting(&proxy, &client, read, "30").await;
}

#[tokio::test]
async fn a_temporary_table_that_shadows_a_cached_one_is_read_not_the_entry() {
    let (db, proxy, client, _direct) = setup_streaming(
        "cat_temp",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1)",
    )
    .await;
    let read = "SELECT v FROM t WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("1")
    );
    client
        .batch_execute("CREATE TEMP TABLE t(id int, v int); INSERT INTO t VALUES (1, 99)")
        .await
        .unwrap();
    never_hits(&proxy, &client, read, "99").await;
    // Other sessions read the permanent table. pgcache keeps one set of
    // facts per name for every session, so while any session has a
    // temporary relation of that name, nobody's reads of it are cached.
    let other = proxy.connect(&db).await;
    never_hits(&proxy, &other, read, "1").await;
    client.batch_execute("DROP TABLE pg_temp.t").await.unwrap();
    never_hits(&proxy, &client, read, "1").await;
    assert_eq!(
        eventually_hit(&proxy, &other, read).await.as_deref(),
        Some("1")
    );
}

#[tokio::test]
async fn row_level_security_added_or_changed_directly_is_obeyed() {
    let role = format!("cat_rls_{}", rand_suffix());
    let (db, proxy, _client, direct) = setup_streaming(
        "cat_rls",
        &format!(
            "CREATE ROLE {role} LOGIN;
             CREATE TABLE docs(id int PRIMARY KEY, tenant int, body text);
             INSERT INTO docs VALUES (1, 1, 'one'), (2, 2, 'two');
             GRANT SELECT ON docs TO {role};
             CREATE FUNCTION tenant_now() RETURNS int LANGUAGE sql VOLATILE AS 'SELECT 1'"
        ),
    )
    .await;
    let login = |tenant: u32| {
        let dsn = format!("{} options='-c app.tenant={tenant}'", proxy.dsn(&role, &db));
        async move { connect_dsn(&dsn).await.unwrap() }
    };
    let (one, two) = (login(1).await, login(2).await);
    let read = "SELECT string_agg(body, ',' ORDER BY id) FROM docs";
    assert_eq!(
        eventually_hit(&proxy, &one, read).await.as_deref(),
        Some("one,two")
    );

    // A policy added directly: each tenant sees its own rows, cached apart.
    direct
        .batch_execute(
            "ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
             CREATE POLICY by_tenant ON docs USING (tenant = current_setting('app.tenant')::int)",
        )
        .await
        .unwrap();
    eventually_reads(&one, read, "one").await;
    eventually_reads(&two, read, "two").await;
    assert_eq!(
        eventually_hit(&proxy, &one, read).await.as_deref(),
        Some("one")
    );
    assert_eq!(
        eventually_hit(&proxy, &two, read).await.as_deref(),
        Some("two")
    );

    // Changed directly to call a volatile function: never cached.
    direct
        .batch_execute("ALTER POLICY by_tenant ON docs USING (tenant = tenant_now() + 1)")
        .await
        .unwrap();
    eventually_reads(&one, read, "two").await;
    stops_hitting(&proxy, &one, read, "two").await;
    never_hits(&proxy, &two, read, "two").await;
}

#[tokio::test]
async fn a_table_that_loses_its_replica_identity_can_be_updated_at_once() {
    let (_db, _proxy, client, direct) = setup_streaming(
        "cat_identity",
        "CREATE TABLE t(id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE TABLE u(id int PRIMARY KEY, v int); INSERT INTO u VALUES (1, 1)",
    )
    .await;
    let published = "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'pgcache' AND tablename IN ('t', 'u')";
    assert_eq!(scalar(&direct, published).await.as_deref(), Some("2"));
    // PostgreSQL refuses UPDATE on a published table without a replica
    // identity: the publication must let go of it within the DDL itself.
    direct
        .batch_execute("ALTER TABLE t DROP CONSTRAINT t_pkey; UPDATE t SET v = 2")
        .await
        .expect("directly");
    client
        .batch_execute("ALTER TABLE u REPLICA IDENTITY NOTHING")
        .await
        .unwrap();
    client
        .batch_execute("UPDATE u SET v = 2")
        .await
        .expect("through pgcache");
    assert_eq!(scalar(&direct, published).await.as_deref(), Some("0"));
}

/// A table whose identity index is dropped (DDL that does not name the
/// table) leaves the publication within the DDL too, and the stream lists
/// it as having no replica identity.
#[tokio::test]
async fn a_table_whose_identity_index_is_dropped_leaves_the_publication() {
    let (db, proxy, _client, direct) = setup_streaming(
        "cat_identity_index",
        "CREATE TABLE t(id int NOT NULL, v int); CREATE UNIQUE INDEX t_id ON t(id);
         ALTER TABLE t REPLICA IDENTITY USING INDEX t_id; INSERT INTO t VALUES (1, 1)",
    )
    .await;
    let published =
        "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'pgcache' AND tablename = 't'";
    eventually_reads(&direct, published, "1").await;
    direct
        .batch_execute("DROP INDEX t_id; UPDATE t SET v = 2")
        .await
        .expect("an UPDATE right after the DDL");
    assert_eq!(scalar(&direct, published).await.as_deref(), Some("0"));
    let state = proxy.app.cache.db(&db);
    eventually(
        Duration::from_secs(10),
        "t to be listed without a replica identity",
        || async { state.stream.is_unpublished("t").then_some(()) },
    )
    .await;
}

/// A table made without a replica identity is left out of the publication
/// when first read. Given one through pgcache (DDL its own session handles,
/// with no round after it in the stream), its next reads bring it into the
/// publication, and it is cached from then on.
#[tokio::test]
async fn a_table_given_an_identity_through_pgcache_is_cached_from_then_on() {
    let (db, proxy, client, _direct) = setup_streaming("cat_identity_later", "SELECT 1").await;
    client
        .batch_execute("CREATE TABLE late(id int, v int); INSERT INTO late VALUES (1, 1)")
        .await
        .unwrap();
    let read = "SELECT v FROM late WHERE id = 1";
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(10), "late to be left out", || async {
        scalar(&client, read).await;
        state.stream.is_unpublished("late").then_some(())
    })
    .await;
    client
        .batch_execute("ALTER TABLE late ADD PRIMARY KEY (id)")
        .await
        .unwrap();
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("1")
    );
    assert!(!state.stream.is_unpublished("late"));
}

/// pgcache's own DDL is handled where it is made: a table joining its
/// publication (when a read first names it) takes no round after it in the
/// stream of the instance that added it.
#[tokio::test]
async fn a_table_joining_the_publication_takes_no_round() {
    let (db, proxy, client, direct) = setup_streaming("cat_join_round", "SELECT 1").await;
    direct
        .batch_execute(
            "CREATE TABLE joined(id int PRIMARY KEY, v int); INSERT INTO joined VALUES (1, 7)",
        )
        .await
        .unwrap();
    proxy.wait_stream(&db).await;
    let state = proxy.app.cache.db(&db);
    let (_, rounds) = state.stream.ddl();
    let read = "SELECT v FROM joined WHERE id = 1";
    assert_eq!(
        eventually_hit(&proxy, &client, read).await.as_deref(),
        Some("7")
    );
    let published = scalar(
        &direct,
        "SELECT count(*) FROM pg_publication_tables WHERE tablename = 'joined'",
    )
    .await;
    assert_eq!(published.as_deref(), Some("1"));
    proxy.wait_stream(&db).await;
    assert_eq!(
        state.stream.ddl().1,
        rounds,
        "no round after its own ALTER PUBLICATION"
    );
}
