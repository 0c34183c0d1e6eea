//! Reads by key stay cached while other rows of their table change: per-row
//! invalidation from the replication stream and from writes through
//! pgcache, against real PostgreSQL. Every other read of a table, and every
//! change pgcache cannot key by row, stays table-wide.

mod common;

use std::time::Duration;

use common::*;
use tokio_postgres::Client;

const WAIT: Duration = Duration::from_secs(20);

/// A database with `sql` run in it, pgcache streaming it, a client through
/// pgcache and one straight to PostgreSQL.
async fn setup(name: &str, sql: &str) -> (String, Proxy, Client, Client) {
    let (db, proxy, client, direct) = setup_streaming(name, sql).await;
    (db, proxy, client, direct)
}

/// `sql` through `client` gives `want`, and the read after is a hit.
async fn cached(proxy: &Proxy, client: &Client, sql: &str, want: &str) {
    cached_as(proxy, client, sql, Some(want)).await;
}

/// [`cached`], for a read that may find no row (`None`).
async fn cached_as(proxy: &Proxy, client: &Client, sql: &str, want: Option<&str>) {
    eventually(
        WAIT,
        &format!("{sql} to be cached with {want:?}"),
        || async {
            let first = scalar(client, sql).await;
            assert_eq!(first.as_deref(), want, "{sql}");
            let hits = proxy.hits();
            let second = scalar(client, sql).await;
            assert_eq!(second.as_deref(), want, "{sql}");
            (proxy.hits() == hits + 1).then_some(())
        },
    )
    .await;
}

/// The next read of `sql` is a hit with `want`.
async fn still_hit(proxy: &Proxy, client: &Client, sql: &str, want: &str) {
    let hits = proxy.hits();
    assert_eq!(scalar(client, sql).await.as_deref(), Some(want), "{sql}");
    assert_eq!(
        proxy.hits(),
        hits + 1,
        "{sql} was not served from the cache"
    );
}

/// Waits until the stream has applied everything committed so far.
async fn streamed(proxy: &Proxy, db: &str) {
    proxy.wait_stream(db).await;
}

#[tokio::test]
async fn a_read_by_key_survives_writes_to_other_rows() {
    let (db, proxy, client, direct) = setup(
        "keyed_basic",
        "CREATE TABLE acc(id int PRIMARY KEY, v int); INSERT INTO acc SELECT g, g FROM generate_series(1, 100) g",
    )
    .await;
    let one = "SELECT v FROM acc WHERE id = 1";
    let two = "SELECT v FROM acc WHERE id = 2";
    cached(&proxy, &client, one, "1").await;
    cached(&proxy, &client, two, "2").await;
    let rows_moved = proxy.app.metrics.invalidations.rows.get();
    // Another row, directly and through pgcache.
    direct
        .batch_execute("UPDATE acc SET v = -50 WHERE id = 50")
        .await
        .unwrap();
    client
        .batch_execute("UPDATE acc SET v = -60 WHERE id = 60")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    still_hit(&proxy, &client, one, "1").await;
    still_hit(&proxy, &client, two, "2").await;
    assert!(
        proxy.app.metrics.invalidations.rows.get() >= rows_moved + 2,
        "both writes counted as row invalidations"
    );
    // The row itself: through pgcache, the next read sees it at once.
    client
        .batch_execute("UPDATE acc SET v = 11 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(scalar(&client, one).await.as_deref(), Some("11"));
    still_hit(&proxy, &client, two, "2").await;
    // Directly: once the stream brings it.
    direct
        .batch_execute("UPDATE acc SET v = 22 WHERE id = 2")
        .await
        .unwrap();
    eventually_reads(&client, two, "22").await;
    // A range read is table-wide: any write ends it.
    let range = "SELECT sum(v) FROM acc WHERE id BETWEEN 1 AND 3";
    cached(&proxy, &client, range, "36").await;
    direct
        .batch_execute("UPDATE acc SET v = 0 WHERE id = 99")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, range).await.as_deref(), Some("36"));
    assert_eq!(
        proxy.hits(),
        hits,
        "a range read is invalidated by any write"
    );
}

/// Reads and writes with parameters (tokio-postgres binds them in binary),
/// a composite key, and IN lists.
#[tokio::test]
async fn parameters_composite_keys_and_in_lists_are_keyed() {
    let (db, proxy, client, direct) = setup(
        "keyed_params",
        "CREATE TABLE ck(a int, b text, v int, PRIMARY KEY (a, b)); \
         INSERT INTO ck SELECT g % 10, 'k' || g, g FROM generate_series(1, 100) g",
    )
    .await;
    let read = "SELECT v FROM ck WHERE a = $1 AND b = $2";
    let value = |row: tokio_postgres::Row| row.get::<_, i32>(0);
    let by_param = |a: i32, b: &'static str| {
        let client = &client;
        async move { value(client.query_one(read, &[&a, &b]).await.unwrap()) }
    };
    // Warm, then a hit.
    assert_eq!(by_param(3, "k13").await, 13);
    let hits = proxy.hits();
    assert_eq!(by_param(3, "k13").await, 13);
    assert_eq!(proxy.hits(), hits + 1);
    // Another row with the same a, written with parameters through pgcache.
    client
        .execute(
            "UPDATE ck SET v = $1 WHERE a = $2 AND b = $3",
            &[&-23i32, &3i32, &"k23"],
        )
        .await
        .unwrap();
    let hits = proxy.hits();
    assert_eq!(by_param(3, "k13").await, 13);
    assert_eq!(proxy.hits(), hits + 1, "another row: still a hit");
    assert_eq!(by_param(3, "k23").await, -23, "its own row: fresh at once");
    // Half a key is not a key: table-wide.
    let half = "SELECT sum(v) FROM ck WHERE a = 3";
    cached(&proxy, &client, half, "434").await;
    direct
        .batch_execute("UPDATE ck SET v = 0 WHERE a = 7 AND b = 'k7'")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, half).await.as_deref(), Some("434"));
    assert_eq!(proxy.hits(), hits, "a partial key reads the whole table");
    // IN lists, on a one-column key.
    direct
        .batch_execute("CREATE TABLE one(id bigint PRIMARY KEY, v int); INSERT INTO one SELECT g, g FROM generate_series(1, 50) g")
        .await
        .unwrap();
    let list = "SELECT sum(v) FROM one WHERE id IN (1, 2, 3)";
    cached(&proxy, &client, list, "6").await;
    direct
        .batch_execute("UPDATE one SET v = 0 WHERE id = 40")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    still_hit(&proxy, &client, list, "6").await;
    direct
        .batch_execute("UPDATE one SET v = 10 WHERE id = 2")
        .await
        .unwrap();
    eventually_reads(&client, list, "14").await;
}

/// An UPDATE that moves a row's key invalidates both keys: through
/// pgcache (which cannot tell the new key from the text: the whole table's
/// keyed reads) and directly (the stream gives the old key and the new).
#[tokio::test]
async fn a_key_changed_by_update_leaves_neither_key_stale() {
    let (db, proxy, client, direct) = setup(
        "keyed_move",
        "CREATE TABLE mv(k int PRIMARY KEY, v int); INSERT INTO mv SELECT g, g FROM generate_series(1, 20) g",
    )
    .await;
    let at = |k: i32| format!("SELECT v FROM mv WHERE k = {k}");
    cached(&proxy, &client, &at(5), "5").await;
    cached_as(&proxy, &client, &at(500), None).await;
    cached_as(&proxy, &client, &at(600), None).await;
    client
        .batch_execute("UPDATE mv SET k = 500 WHERE k = 5")
        .await
        .unwrap();
    assert_eq!(scalar(&client, &at(5)).await, None, "the old key is gone");
    assert_eq!(
        scalar(&client, &at(500)).await.as_deref(),
        Some("5"),
        "the new key has it"
    );
    cached(&proxy, &client, &at(6), "6").await;
    direct
        .batch_execute("UPDATE mv SET k = 600 WHERE k = 6")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    assert_eq!(scalar(&client, &at(6)).await, None);
    assert_eq!(scalar(&client, &at(600)).await.as_deref(), Some("6"));
}

/// Writes that change other rows than the ones they name (a cascading
/// foreign key, a trigger): pgcache's own write takes the whole database as
/// changed; the stream keys each row they changed.
#[tokio::test]
async fn cascades_and_triggers_leave_no_row_stale() {
    let (db, proxy, client, direct) = setup(
        "keyed_cascade",
        "CREATE TABLE parent(id int PRIMARY KEY); \
         CREATE TABLE child(id int PRIMARY KEY, parent int REFERENCES parent ON DELETE CASCADE, v int); \
         INSERT INTO parent SELECT g FROM generate_series(1, 5) g; \
         INSERT INTO child SELECT g, g % 5 + 1, g FROM generate_series(1, 20) g; \
         CREATE TABLE audit(id int PRIMARY KEY, n int); INSERT INTO audit VALUES (1, 0), (2, 0); \
         CREATE FUNCTION count_it() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN UPDATE audit SET n = n + 1 WHERE id = 1; RETURN NEW; END $$; \
         CREATE TRIGGER counted AFTER UPDATE ON child FOR EACH ROW EXECUTE FUNCTION count_it()",
    )
    .await;
    let child = "SELECT v FROM child WHERE id = 4"; // parent 5
    let counted = "SELECT n FROM audit WHERE id = 1";
    let other = "SELECT n FROM audit WHERE id = 2";
    cached(&proxy, &client, child, "4").await;
    cached(&proxy, &client, counted, "0").await;
    cached(&proxy, &client, other, "0").await;
    // Through pgcache: a delete of the parent cascades to child 4.
    client
        .batch_execute("DELETE FROM parent WHERE id = 5")
        .await
        .unwrap();
    assert_eq!(scalar(&client, child).await, None, "the cascade's row");
    // A trigger writes another table's row.
    client
        .batch_execute("UPDATE child SET v = 0 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(scalar(&client, counted).await.as_deref(), Some("1"));
    // Directly: the stream keys the rows they changed.
    cached(&proxy, &client, counted, "1").await;
    cached(&proxy, &client, other, "0").await;
    direct
        .batch_execute("UPDATE child SET v = 0 WHERE id = 2")
        .await
        .unwrap();
    eventually_reads(&client, counted, "2").await;
    streamed(&proxy, &db).await;
    still_hit(&proxy, &client, other, "0").await;
}

/// A partitioned table is read and written whole (its partitions' rows
/// arrive under its root), TRUNCATE ends every read of a table, and a
/// table without a primary key is table-wide, as before.
#[tokio::test]
async fn partitions_truncate_and_tables_without_a_key_are_table_wide() {
    let (db, proxy, client, direct) = setup(
        "keyed_wide",
        "CREATE TABLE parts(id int PRIMARY KEY, v int) PARTITION BY RANGE (id); \
         CREATE TABLE parts_a PARTITION OF parts FOR VALUES FROM (0) TO (50); \
         CREATE TABLE parts_b PARTITION OF parts FOR VALUES FROM (50) TO (100); \
         INSERT INTO parts SELECT g, g FROM generate_series(1, 99) g; \
         CREATE TABLE tr(id int PRIMARY KEY, v int); INSERT INTO tr VALUES (1, 1), (2, 2); \
         CREATE TABLE nokey(id int, v int); ALTER TABLE nokey REPLICA IDENTITY FULL; \
         INSERT INTO nokey VALUES (1, 1), (2, 2)",
    )
    .await;
    let part = "SELECT v FROM parts WHERE id = 10";
    cached(&proxy, &client, part, "10").await;
    direct
        .batch_execute("UPDATE parts SET v = 0 WHERE id = 70")
        .await
        .unwrap();
    eventually(WAIT, "the partition's change to end the read", || async {
        let hits = proxy.hits();
        assert_eq!(scalar(&client, part).await.as_deref(), Some("10"));
        (proxy.hits() == hits).then_some(())
    })
    .await;
    direct
        .batch_execute("UPDATE parts SET v = -10 WHERE id = 10")
        .await
        .unwrap();
    eventually_reads(&client, part, "-10").await;
    let one = "SELECT v FROM tr WHERE id = 1";
    cached(&proxy, &client, one, "1").await;
    direct.batch_execute("TRUNCATE tr").await.unwrap();
    eventually(WAIT, "TRUNCATE to end the read", || async {
        (scalar(&client, one).await.is_none()).then_some(())
    })
    .await;
    let full = "SELECT v FROM nokey WHERE id = 1";
    cached(&proxy, &client, full, "1").await;
    direct
        .batch_execute("UPDATE nokey SET v = 0 WHERE id = 2")
        .await
        .unwrap();
    streamed(&proxy, &db).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, full).await.as_deref(), Some("1"));
    assert_eq!(proxy.hits(), hits, "REPLICA IDENTITY FULL: table-wide");
}

/// A table whose replica identity changes (made directly, the facts older):
/// no read keyed under the old identity is served stale.
#[tokio::test]
async fn a_replica_identity_that_changes_leaves_no_read_stale() {
    let (db, proxy, client, direct) = setup(
        "keyed_identity",
        "CREATE TABLE ri(id int PRIMARY KEY, code text NOT NULL UNIQUE, v int); \
         INSERT INTO ri SELECT g, 'c' || g, g FROM generate_series(1, 10) g",
    )
    .await;
    let by_id = "SELECT v FROM ri WHERE id = 3";
    let by_code = "SELECT v FROM ri WHERE code = 'c4'";
    cached(&proxy, &client, by_id, "3").await;
    cached(&proxy, &client, by_code, "4").await;
    direct
        .batch_execute("ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_code_key")
        .await
        .unwrap();
    direct
        .batch_execute("UPDATE ri SET v = 30 WHERE id = 3")
        .await
        .unwrap();
    eventually_reads(&client, by_id, "30").await;
    // Keyed by code now.
    cached(&proxy, &client, by_code, "4").await;
    direct
        .batch_execute("UPDATE ri SET v = 40 WHERE code = 'c4'")
        .await
        .unwrap();
    eventually_reads(&client, by_code, "40").await;
    streamed(&proxy, &db).await;
    assert_eq!(scalar(&client, by_id).await.as_deref(), Some("30"));
}

/// Two instances sharing Redis: each keys the table's reads by row; a
/// write by key through one leaves the other's reads of other rows cached
/// and its read of that row fresh, and a read stored by one is served by
/// the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis_agree_on_rows() {
    let db = pg().create_db("keyed_pair");
    pg().psql_db(
        &db,
        "CREATE TABLE acc(id int PRIMARY KEY, v int); INSERT INTO acc SELECT g, g FROM generate_series(1, 100) g",
    );
    let config = || {
        let mut config = pg().proxy_config();
        config.redis.url = redis().url();
        config.cache.shared.timeout_ms = 1000;
        config.cache.shared.consistency = pgcache::config::Consistency::ReadYourWrites;
        config
    };
    let a = Proxy::start(config()).await;
    let b = Proxy::start(config()).await;
    let ca = a.connect(&db).await;
    let cb = b.connect(&db).await;
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    let row = |id: i32| format!("SELECT v FROM acc WHERE id = {id}");
    // Each begins keying the table (its first read reads the table whole):
    // what was stored by row before is void everywhere.
    cached(&a, &ca, &row(1), "1").await;
    cached(&b, &cb, &row(2), "2").await;
    let wide = |p: &Proxy| {
        p.app
            .cache
            .db(&db)
            .versions
            .family("acc#all")
            .version
            .shared()
    };
    eventually(WAIT, "A to hear of B's keying", || {
        let (wa, wb) = (wide(&a), wide(&b));
        async move { (wa == wb).then_some(()) }
    })
    .await;
    cached(&a, &ca, &row(1), "1").await;
    // A read A stores by row, B serves from Redis.
    let shared_hits = b.app.metrics.shared.hit.get();
    eventually(WAIT, "B to serve A's row from Redis", || async {
        assert_eq!(scalar(&ca, &row(3)).await.as_deref(), Some("3"));
        assert_eq!(scalar(&cb, &row(3)).await.as_deref(), Some("3"));
        (b.app.metrics.shared.hit.get() > shared_hits).then_some(())
    })
    .await;
    // A write of another row through B: A's reads stay cached.
    cb.batch_execute("UPDATE acc SET v = -50 WHERE id = 50")
        .await
        .unwrap();
    still_hit(&a, &ca, &row(1), "1").await;
    // A write of row 1 through B: under read_your_writes, A's next read of
    // it is fresh at once.
    cb.batch_execute("UPDATE acc SET v = 10 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(scalar(&ca, &row(1)).await.as_deref(), Some("10"));
    still_hit(&b, &cb, &row(2), "2").await;
}

/// Adaptive admission: a read whose answers every write retires before
/// they are read again stops being stored for a while, and its answers
/// stay right; after the pause it is stored again. A read by key of the
/// same table, served between writes, stays admitted.
#[tokio::test]
async fn reads_retired_unread_stop_being_stored_for_a_while() {
    let db = pg().create_db("keyed_admission");
    pg().psql_db(
        &db,
        "CREATE TABLE acc(id int PRIMARY KEY, v int); INSERT INTO acc SELECT g, g FROM generate_series(1, 100) g",
    );
    let mut config = pg().proxy_config();
    config.cache.adaptive_admission = true;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect(&db).await;
    let direct = pg().direct(&db).await;
    streamed(&proxy, &db).await;
    let hot = "SELECT v FROM acc WHERE id = 1";
    cached(&proxy, &client, hot, "1").await;
    let not_admitted = || {
        proxy
            .app
            .metrics
            .bypasses(pgcache::classify::BypassReason::NotAdmitted)
    };
    let range = |k: i32| format!("SELECT sum(v) FROM acc WHERE id BETWEEN {k} AND {k} + 5");
    // Ranges read in turn, each retired by a write before it comes round
    // again: the shape is judged every 64 stores.
    let mut reads = 0;
    let mut stores = proxy.stores();
    for k in (2..42).cycle() {
        reads += 1;
        assert!(reads <= 200, "never suspended after {reads} reads");
        stores = proxy.stores();
        let want = scalar(&direct, &range(k)).await;
        assert_eq!(scalar(&client, &range(k)).await, want, "{}", range(k));
        if not_admitted() > 0 {
            break;
        }
        // Another row, through pgcache: the range reads are retired at
        // once, the read by key is not.
        client
            .batch_execute(&format!("UPDATE acc SET v = {reads} WHERE id = 100"))
            .await
            .unwrap();
        still_hit(&proxy, &client, hot, "1").await;
    }
    assert_eq!(proxy.stores(), stores, "not stored once suspended");
    let shape = proxy
        .app
        .cache
        .stats
        .top(10)
        .into_iter()
        .find(|q| q.text.starts_with("SELECT sum(v) FROM acc"))
        .expect("the range read's statistics");
    assert!(shape.suspensions >= 1, "{shape:?}");
    let advice = pgcache::cache::advice::advise(&shape, pgcache::config::CacheMode::Auto);
    assert_eq!(advice.action, "leave", "{advice:?}");
    // Paused: sent straight to PostgreSQL, right, and not stored.
    direct
        .batch_execute("UPDATE acc SET v = -3 WHERE id = 3")
        .await
        .unwrap();
    assert_eq!(
        scalar(&client, &range(3)).await,
        scalar(&direct, &range(3)).await
    );
    assert_eq!(proxy.stores(), stores, "nothing stored while paused");
    // After the pause it is stored again.
    eventually(WAIT, "the range read to be stored again", || async {
        assert_eq!(
            scalar(&client, &range(4)).await,
            scalar(&direct, &range(4)).await
        );
        (proxy.stores() > stores).then_some(())
    })
    .await;
}
