//! Read replicas: real standbys of a throwaway primary (`pg_basebackup
//! -R`), checked at start-up, watched for health and lag, taken out of
//! rotation and put back.

mod common;

use std::time::Duration;

use common::*;
use pgcache::replica::Out;

const WAIT: Duration = Duration::from_secs(30);

/// pgcache in front of `primary` with these replicas.
fn config_with(primary: &Pg, replicas: &[&Pg]) -> pgcache::Config {
    let mut config = primary.proxy_config();
    config.upstream.replicas = replicas
        .iter()
        .map(|r| {
            pgcache::config::ReplicaConfig::Url(format!("postgres://postgres@127.0.0.1:{}", r.port))
        })
        .collect();
    config.replicas.healthy_polls = 2;
    config.admin.password = "admin-secret".to_owned();
    config
}

/// Waits until the first replica is in rotation (`true`) or out of it.
async fn until_in_rotation(proxy: &Proxy, wanted: bool) -> pgcache::replica::Health {
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(WAIT, &format!("replica in rotation: {wanted}"), || {
        let replica = std::sync::Arc::clone(&replica);
        async move { (replica.in_rotation() == wanted).then(|| replica.health()) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_a_standby_of_the_primary_is_refused_at_start() {
    let primary = Pg::dedicated();
    let stranger = Pg::dedicated();
    let err = pgcache::App::start(config_with(&primary, &[&stranger]))
        .await
        .err()
        .expect("an unrelated cluster is refused");
    let text = err.to_string();
    assert!(text.contains("another cluster"), "{text}");
    assert!(
        text.contains(&stranger.port.to_string()),
        "names the replica: {text}"
    );
    // The primary itself is the right cluster, but not in recovery.
    let err = pgcache::App::start(config_with(&primary, &[&primary]))
        .await
        .err()
        .expect("a server not in recovery is refused");
    assert!(err.to_string().contains("not in recovery"), "{err}");
}

/// `SHOW REPLICAS` on the admin console: one row per replica.
async fn show_replicas(proxy: &Proxy) -> Vec<Vec<String>> {
    show(proxy, "SHOW REPLICAS").await
}

/// The rows of an admin console command.
async fn show(proxy: &Proxy, command: &str) -> Vec<Vec<String>> {
    let admin = connect_dsn(&format!(
        "host=127.0.0.1 port={} user=pgcache password=admin-secret dbname=pgcache",
        proxy.addr.port()
    ))
    .await
    .expect("the admin console");
    admin
        .simple_query(command)
        .await
        .expect(command)
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or_default().to_owned())
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_joins_the_rotation_leaves_it_when_behind_and_comes_back() {
    let primary = Pg::dedicated();
    let standby = primary.standby();
    let mut config = config_with(&primary, &[&standby]);
    config.replicas.max_lag_bytes = 64 * 1024;
    let proxy = Proxy::start(config).await;
    let health = until_in_rotation(&proxy, true).await;
    assert_eq!(health.out, None);
    let rows = show_replicas(&proxy).await;
    assert_eq!(rows.len(), 1);
    // server, role, state, weight, replay_lsn, lag_bytes, lag_ms, ...
    assert_eq!(rows[0][0], format!("127.0.0.1:{}", standby.port));
    assert_eq!(
        (rows[0][1].as_str(), rows[0][2].as_str()),
        ("replica", "in rotation")
    );
    assert_ne!(rows[0][4], "0/0", "its replay position is read");
    let (_, body) = proxy.http_get("/metrics").await;
    let server = &proxy.app.replicas.servers[0].name;
    assert!(
        body.contains(&format!("pgcache_replica_up{{server=\"{server}\"}} 1")),
        "{body}"
    );
    let (_, json) = proxy.http_get("/stats.json").await;
    let stats: serde_json::Value = serde_json::from_str(&json).unwrap();
    let live = &stats["replicas"][0];
    assert_eq!(
        (live["server"].as_str(), live["state"].as_str()),
        (Some(server.as_str()), Some("in rotation")),
        "the live page's data: {stats}"
    );
    // The dashboard's replica panels (the rest need a database's traffic:
    // tests/metrics.rs).
    let (missing, _) = dashboard_metrics_missing(&body);
    let missing: Vec<_> = missing.iter().filter(|m| is_replica_metric(m)).collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses {missing:?}, which /metrics lacks"
    );
    // Replay paused: the primary moves on, the standby does not.
    standby.psql_admin("SELECT pg_wal_replay_pause()");
    primary.psql_admin(
        "CREATE TABLE filler AS SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 5000) g",
    );
    let health = until_in_rotation(&proxy, false).await;
    assert_eq!(health.out, Some(Out::Lagging));
    assert!(health.lag_bytes > 64 * 1024, "{health:?}");
    let rows = show_replicas(&proxy).await;
    assert!(rows[0][2].starts_with("out: behind"), "{rows:?}");
    assert!(rows[0][5].parse::<u64>().unwrap() > 64 * 1024, "{rows:?}");
    assert!(health.lag > Duration::ZERO, "{health:?}");
    let (_, body) = proxy.http_get("/metrics").await;
    assert!(
        body.contains(&format!("pgcache_replica_up{{server=\"{server}\"}} 0")),
        "{body}"
    );
    // Caught up again: back after its good polls.
    standby.psql_admin("SELECT pg_wal_replay_resume()");
    let health = until_in_rotation(&proxy, true).await;
    assert!(health.lag_bytes <= 64 * 1024, "{health:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_standby_leaves_the_rotation_and_a_promoted_one_does_not_come_back() {
    let primary = Pg::dedicated();
    let standby = primary.standby();
    let proxy = Proxy::start(config_with(&primary, &[&standby])).await;
    until_in_rotation(&proxy, true).await;
    standby.stop();
    let health = until_in_rotation(&proxy, false).await;
    assert!(
        matches!(health.out, Some(Out::Unreachable(_))),
        "{health:?}"
    );
    standby.restart();
    until_in_rotation(&proxy, true).await;
    // Promoted: a primary of its own, never a replica again.
    standby.promote();
    let health = until_in_rotation(&proxy, false).await;
    assert!(
        matches!(health.out, Some(Out::NotInRecovery | Out::Unreachable(_))),
        "{health:?}"
    );
    // Checked again on reconnect: out because it is no standby.
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(WAIT, "the promoted server judged not a standby", || {
        let replica = std::sync::Arc::clone(&replica);
        async move { (replica.health().out == Some(Out::NotInRecovery)).then_some(()) }
    })
    .await;
    assert!(!replica.in_rotation());
}

/// Pauses the standby's replay, and waits until it is paused (a pause is
/// a request that takes effect at the next record).
async fn pause_replay(standby: &Pg) {
    standby.psql_admin("SELECT pg_wal_replay_pause()");
    eventually(WAIT, "replay paused", || {
        let state = standby.psql_admin("SELECT pg_get_wal_replay_pause_state()");
        async move { (state.trim() == "paused").then_some(()) }
    })
    .await;
}

/// The users of the client sessions `server` has in `db` (pgcache's own
/// watcher connects to `postgres`, not to `db`).
fn sessions_on(server: &Pg, db: &str) -> Vec<String> {
    server
        .psql_admin(&format!(
            "SELECT usename FROM pg_stat_activity WHERE datname = '{db}' AND backend_type = 'client backend'"
        ))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_owned())
        .collect()
}

/// How many times the standby's `items` was scanned, as its statistics say.
fn scans(standby: &Pg, db: &str) -> u64 {
    standby
        .psql_db(
            db,
            "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) FROM pg_stat_user_tables \
             WHERE relname = 'items'",
        )
        .trim()
        .parse()
        .unwrap()
}

/// A primary with a database of `items`, its standby caught up, and
/// pgcache in front of both with the standby in rotation.
async fn routed_setup(name: &str) -> (Pg, Pg, String, Proxy) {
    routed_setup_with(name, |_| {}).await
}

/// [`routed_setup`] with the configuration changed by `adjust`.
async fn routed_setup_with(
    name: &str,
    adjust: impl FnOnce(&mut pgcache::Config),
) -> (Pg, Pg, String, Proxy) {
    let primary = Pg::dedicated();
    let db = primary.create_db(name);
    primary.psql_db(
        &db,
        "CREATE TABLE items (k int PRIMARY KEY, v text);
         INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 100) g",
    );
    let standby = primary.standby();
    let mut config = config_with(&primary, &[&standby]);
    adjust(&mut config);
    let proxy = Proxy::start(config).await;
    until_in_rotation(&proxy, true).await;
    // The database's stream up, and the standby past its first heartbeat:
    // answers read there from now on may be stored.
    drop(proxy.connect(&db).await);
    standby_caught_up(&primary, &standby).await;
    (primary, standby, db, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misses_are_read_on_the_standby_and_their_answers_cached() {
    let (_primary, standby, db, proxy) = routed_setup("routed").await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    let before = scans(&standby, &db);
    // A miss: answered by the standby, and stored.
    let sql = "SELECT v FROM items WHERE k = 7";
    assert_eq!(scalar(&client, sql).await.as_deref(), Some("v7"));
    assert_eq!(routed(), 1, "the miss went to the standby");
    eventually(WAIT, "the standby's statistics to show the read", || {
        let grew = scans(&standby, &db) > before;
        async move { grew.then_some(()) }
    })
    .await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, sql).await.as_deref(), Some("v7"));
    assert_eq!(proxy.hits(), hits + 1, "the standby's answer was stored");
    // The session's connection to the standby, in SHOW SERVERS and POOLS.
    let servers = show(&proxy, "SHOW SERVERS").await;
    let conn = servers
        .iter()
        .find(|r| r[4] == server)
        .unwrap_or_else(|| panic!("the standby's connection: {servers:?}"));
    // type, user, database, state, addr, ..., role, lag_ms
    assert_eq!((conn[2].as_str(), conn[3].as_str()), (db.as_str(), "idle"));
    assert_eq!(conn[11], "replica");
    assert!(conn[12].parse::<u64>().is_ok(), "{conn:?}");
    let pools = show(&proxy, "SHOW POOLS").await;
    let pool = pools
        .iter()
        .find(|r| r[13] == server)
        .unwrap_or_else(|| panic!("the standby's pool: {pools:?}"));
    // database, user, cl_*, sv_active, sv_idle, sv_open, ..., server, role
    assert_eq!(&pool[5..8], ["0", "1", "1"], "{pool:?}");
    assert_eq!(pool[14], "replica");
    assert_eq!(routed(), 1, "a hit goes nowhere");
    // A write goes to the primary (a standby would refuse it), and a read
    // after it, on another connection of the instance, sees it.
    let other = proxy.connect(&db).await;
    other
        .simple_query("UPDATE items SET v = 'new' WHERE k = 8")
        .await
        .expect("the write reaches the primary");
    let read = "SELECT v FROM items WHERE k = 8";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("new"));
    // Transactions are the primary's.
    let routed_before = routed();
    client
        .simple_query("BEGIN; SELECT v FROM items WHERE k = 9; COMMIT")
        .await
        .unwrap();
    assert_eq!(routed(), routed_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replay_paused_a_session_reads_its_own_write_from_the_primary() {
    let (_primary, standby, db, proxy) = routed_setup("ryw").await;
    let client = proxy.connect(&db).await;
    let to_primary = || proxy.app.replicas.to_primary.routed.get();
    pause_replay(&standby).await;
    client
        .simple_query("UPDATE items SET v = 'mine' WHERE k = 2")
        .await
        .unwrap();
    let before = to_primary();
    let read = "SELECT v FROM items WHERE k = 2";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("mine"));
    assert_eq!(to_primary(), before + 1, "the read went to the primary");
    // Another connection of the instance too.
    let other = proxy.connect(&db).await;
    assert_eq!(scalar(&other, read).await.as_deref(), Some("mine"));
    standby.psql_admin("SELECT pg_wal_replay_resume()");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_behind_a_direct_write_answers_but_its_answer_is_never_stored() {
    // Far behind is still in rotation: what is tested is the cache.
    let (primary, standby, db, proxy) = routed_setup_with("behind", |config| {
        config.replicas.max_lag_ms = 0;
        config.replicas.max_lag_bytes = 0;
    })
    .await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let refused = || proxy.app.metrics.replicas.of(&server).refused_fills.get();
    pause_replay(&standby).await;
    let direct = primary.direct(&db).await;
    direct
        .simple_query("UPDATE items SET v = 'changed' WHERE k = 1")
        .await
        .unwrap();
    // The stream has applied the write: from now on the cache must never
    // serve the old value.
    proxy.wait_stream(&db).await;
    let read = "SELECT v FROM items WHERE k = 1";
    let hits = proxy.hits();
    for _ in 0..20 {
        let v = scalar(&client, read).await;
        assert_eq!(
            v.as_deref(),
            Some("v1"),
            "the standby's answer, within max_lag"
        );
    }
    assert_eq!(proxy.hits(), hits, "none of them was served from the cache");
    assert!(
        refused() >= 20,
        "every answer was refused for the cache: {}",
        refused()
    );
    standby.psql_admin("SELECT pg_wal_replay_resume()");
    eventually(WAIT, "the new value", || {
        let client = &client;
        async move { (scalar(client, read).await.as_deref() == Some("changed")).then_some(()) }
    })
    .await;
    let hits = proxy.hits();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("changed"));
    assert_eq!(proxy.hits(), hits + 1, "the caught-up answer was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_go_on_without_an_error_while_the_standby_stops_and_return_to_it() {
    let (_primary, standby, db, proxy) = routed_setup("stopped").await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    // Distinct keys: every read misses and is routed while it can be.
    let mut k = 0;
    let mut read = || {
        k += 1;
        format!("SELECT v FROM items WHERE k = {}", k % 100 + 1)
    };
    for _ in 0..20 {
        assert!(scalar(&client, &read()).await.is_some());
    }
    assert!(routed() > 0);
    standby.stop();
    // Every read answers: what cannot go to the standby goes to the primary.
    for _ in 0..50 {
        let sql = read();
        let v = client.simple_query(&sql).await;
        assert!(v.is_ok(), "{sql}: {v:?}");
    }
    until_in_rotation(&proxy, false).await;
    standby.restart();
    until_in_rotation(&proxy, true).await;
    let before = routed();
    for _ in 0..20 {
        assert!(scalar(&client, &read()).await.is_some());
    }
    assert!(routed() > before, "the standby takes reads again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_past_max_lag_ms_is_drained_and_takes_no_reads_until_it_catches_up() {
    // Only the time limit: any number of bytes behind is allowed.
    let (primary, standby, db, proxy) = routed_setup_with("lagms", |config| {
        config.replicas.max_lag_ms = 300;
        config.replicas.max_lag_bytes = 0;
    })
    .await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    assert!(
        scalar(&client, "SELECT v FROM items WHERE k = 1")
            .await
            .is_some()
    );
    assert_eq!(routed(), 1, "in rotation, a miss goes to the standby");
    assert_eq!(proxy.app.replicas.servers[0].connections.all().len(), 1);
    assert_eq!(sessions_on(&standby, &db).len(), 1, "the session's");
    pause_replay(&standby).await;
    // A small write: a few hundred bytes behind, and more and more time.
    primary.psql_db(&db, "INSERT INTO items VALUES (1000, 'late')");
    let health = until_in_rotation(&proxy, false).await;
    assert_eq!(health.out, Some(Out::Lagging));
    assert!(health.lag >= Duration::from_millis(300), "{health:?}");
    assert!(health.lag_bytes < 64 * 1024, "{health:?}");
    // Drained: the idle session's connection to it is closed.
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(
        WAIT,
        "the session's connection to the standby closed",
        || {
            let open = replica.connections.all().len();
            let there = sessions_on(&standby, &db).len();
            async move { (open == 0 && there == 0).then_some(()) }
        },
    )
    .await;
    // Out of rotation: every miss goes to the primary, which has the row.
    let before = (routed(), scans(&standby, &db));
    for k in 2..12 {
        let sql = format!("SELECT v FROM items WHERE k = {k}");
        assert_eq!(scalar(&client, &sql).await, Some(format!("v{k}")));
    }
    assert_eq!(
        scalar(&client, "SELECT v FROM items WHERE k = 1000")
            .await
            .as_deref(),
        Some("late")
    );
    assert_eq!(
        (routed(), scans(&standby, &db)),
        before,
        "the standby took no read past its lag limit"
    );
    standby.psql_admin("SELECT pg_wal_replay_resume()");
    until_in_rotation(&proxy, true).await;
    assert!(
        scalar(&client, "SELECT v FROM items WHERE k = 50")
            .await
            .is_some()
    );
    assert_eq!(
        routed(),
        before.0 + 1,
        "back in rotation, it takes misses again"
    );
}

/// The keys whose balance read through pgcache differs from the one read
/// directly.
async fn stale_entries(
    client: &tokio_postgres::Client,
    direct: &tokio_postgres::Client,
    keys: i32,
) -> Vec<i32> {
    let mut stale = Vec::new();
    for aid in 1..=keys {
        let sql = format!("SELECT abalance FROM pgbench_accounts WHERE aid = {aid}");
        if scalar(client, &sql).await != scalar(direct, &sql).await {
            stale.push(aid);
        }
    }
    stale
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pgbench_writes_misses_go_to_the_standby_and_no_cached_entry_is_stale() {
    const KEYS: i32 = 500;
    let primary = Pg::dedicated();
    let db = primary.create_db("readwrite");
    let init = run_tool(
        &primary.bin("pgbench"),
        &[
            "-i",
            "-q",
            "-s",
            "1",
            "-h",
            "127.0.0.1",
            "-p",
            &primary.port.to_string(),
            "-U",
            "postgres",
            &db,
        ],
    )
    .await;
    assert!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
    let standby = primary.standby();
    let proxy = Proxy::start(config_with(&primary, &[&standby])).await;
    until_in_rotation(&proxy, true).await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    // Writes straight to the primary, on the keys the reads use.
    let script = scratch_dir("readwrite").join("write.sql");
    std::fs::write(
        &script,
        format!(
            "\\set aid random(1, {KEYS})\n\\set delta random(-5000, 5000)\n\
             BEGIN;\nUPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;\n\
             INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, :aid, :delta, now());\nEND;\n"
        ),
    )
    .unwrap();
    let bin = primary.bin("pgbench");
    let port = primary.port.to_string();
    let script = script.display().to_string();
    let db_name = db.clone();
    let writer = tokio::spawn(async move {
        let args = [
            "-n",
            "-c",
            "2",
            "-T",
            "4",
            "-f",
            &script,
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            &db_name,
        ];
        run_tool(&bin, &args).await
    });
    let (misses, hits) = (proxy.app.metrics.misses.get(), proxy.hits());
    let mut reads = 0u64;
    while !writer.is_finished() {
        let aid = rand::random::<u32>() % KEYS as u32 + 1;
        let sql = format!("SELECT abalance FROM pgbench_accounts WHERE aid = {aid}");
        let v = client.simple_query(&sql).await;
        assert!(v.is_ok(), "{sql}: {v:?}");
        reads += 1;
    }
    let out = writer.await.unwrap();
    assert!(
        out.status.success(),
        "pgbench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let misses = proxy.app.metrics.misses.get() - misses;
    let hits = proxy.hits() - hits;
    // Every write bumps the table: most reads miss.
    assert!(misses > 50, "{reads} reads: {misses} misses, {hits} hits");
    assert!(
        routed() * 2 >= misses,
        "at least half the misses reach the standby: {} of {misses}",
        routed()
    );
    // Every write applied: no entry the cache serves may be older. The
    // entries stored since the last write are served by the first pass;
    // the second is all hits.
    proxy.wait_stream(&db).await;
    let direct = primary.direct(&db).await;
    let stale = stale_entries(&client, &direct, KEYS).await;
    assert!(stale.is_empty(), "stale keys: {stale:?}");
    let hits = proxy.hits();
    let stale = stale_entries(&client, &direct, KEYS).await;
    assert!(stale.is_empty(), "stale keys: {stale:?}");
    assert_eq!(
        proxy.hits(),
        hits + KEYS as u64,
        "the second pass is served by the cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_misses_are_read_on_the_standby_and_statements_stay_on_the_primary() {
    let (_primary, standby, db, proxy) = routed_setup("extended").await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    let before = scans(&standby, &db);
    // A named statement, prepared on the primary, bound for each read.
    let stmt = client
        .prepare("SELECT v FROM items WHERE k = $1")
        .await
        .unwrap();
    for k in 1..=5i32 {
        let row = client.query_one(&stmt, &[&k]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{k}"));
    }
    assert_eq!(routed(), 5, "every miss went to the standby");
    let hits = proxy.hits();
    let row = client.query_one(&stmt, &[&3i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "v3");
    assert_eq!(proxy.hits(), hits + 1, "the standby's answer was stored");
    // Unnamed statements parsed in the batch itself.
    for k in 6..=8i32 {
        let rows = client
            .query_typed(
                "SELECT v FROM items WHERE k = $1",
                &[(&k, tokio_postgres::types::Type::INT4)],
            )
            .await
            .unwrap();
        assert_eq!(rows[0].get::<_, String>(0), format!("v{k}"));
    }
    assert_eq!(routed(), 8);
    eventually(WAIT, "the standby's statistics to show the reads", || {
        let grew = scans(&standby, &db) >= before + 8;
        async move { grew.then_some(()) }
    })
    .await;
    // In a transaction the primary answers: the statement is there too.
    client.batch_execute("BEGIN").await.unwrap();
    let row = client.query_one(&stmt, &[&9i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "v9");
    client.batch_execute("COMMIT").await.unwrap();
    assert_eq!(routed(), 8, "transactions are the primary's");
    // A write, then a read of it through the named statement.
    client
        .execute("UPDATE items SET v = 'w' WHERE k = 10", &[])
        .await
        .unwrap();
    let row = client.query_one(&stmt, &[&10i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "w", "read-your-writes");
    // A statement prepared again under another name, and one closed.
    let again = client
        .prepare("SELECT v FROM items WHERE k = $1")
        .await
        .unwrap();
    drop(stmt);
    let row = client.query_one(&again, &[&11i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "v11");
    assert_eq!(
        scalar(&client, "SELECT 'still fine'").await.as_deref(),
        Some("still fine")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reads_also_routes_uncacheable_reads_but_never_server_local_or_volatile_ones() {
    let (primary, _standby, db, proxy) = routed_setup_with("allreads", |config| {
        config.replicas.routing = pgcache::config::Routing::AllReads;
    })
    .await;
    primary.psql_db(
        &db,
        "CREATE SEQUENCE seq; CREATE UNLOGGED TABLE scratch AS SELECT 1 AS x",
    );
    // What pgcache knows of the catalog again after the DDL.
    proxy.learn_all(&db).await;
    let client = proxy.connect(&db).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    // Uncacheable, but a standby answers as the primary: routed, never stored.
    let stores = proxy.stores();
    for sql in [
        "SELECT v, 'now'::timestamptz IS NOT NULL FROM items WHERE k = 1",
        "SELECT /*+ nocache */ v FROM items WHERE k = 2",
        "SELECT v, now() > '2000-01-01' FROM items WHERE k = 3",
        "SELECT v || current_user FROM items WHERE k = 4",
    ] {
        let before = routed();
        assert!(scalar(&client, sql).await.is_some(), "{sql}");
        assert_eq!(routed(), before + 1, "{sql} went to the standby");
    }
    assert_eq!(proxy.stores(), stores, "nothing stored");
    // The server's own state, and volatile functions: the primary's.
    let before = routed();
    let pid = scalar(&client, "SELECT pg_backend_pid()").await;
    let direct_pid = scalar(&client, "SELECT /*+ nocache */ pg_backend_pid()").await;
    assert_eq!(pid, direct_pid, "the session's primary backend both times");
    assert!(
        scalar(&client, "SELECT random() < 2 FROM items WHERE k = 5")
            .await
            .is_some()
    );
    assert_eq!(
        scalar(&client, "SELECT pg_is_in_recovery()")
            .await
            .as_deref(),
        Some("f")
    );
    assert_eq!(
        scalar(&client, "SELECT nextval('seq')").await.as_deref(),
        Some("1")
    );
    assert_eq!(
        scalar(&client, "SELECT count(*) > 0 FROM pg_stat_activity")
            .await
            .as_deref(),
        Some("t")
    );
    // An unlogged table, which a standby cannot read.
    assert_eq!(
        scalar(&client, "SELECT x FROM scratch").await.as_deref(),
        Some("1")
    );
    assert_eq!(routed(), before, "none of them went to the standby");
    let retries = proxy.app.metrics.replicas.of(&server).retries.get();
    assert_eq!(retries, 0, "none was sent there and retried");
    // The same through the extended protocol: an uncacheable read a
    // standby answers alike is held to its Sync and routed.
    let stable = "SELECT v, now() > '2000-01-01' FROM items WHERE k = $1";
    for k in 6..=8i32 {
        let row = client.query_one(stable, &[&k]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{k}"));
    }
    assert_eq!(routed(), before + 3, "extended reads with now() routed");
    let before = routed();
    let row = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap();
    assert_eq!(
        Some(row.get::<_, i32>(0).to_string()),
        pid,
        "the session's primary backend"
    );
    let row = client
        .query_one("SELECT nextval('seq') FROM items WHERE k = $1", &[&1i32])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2);
    assert_eq!(routed(), before, "neither went to the standby");
    assert_eq!(proxy.stores(), stores, "nothing stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_mode_reads_take_a_connection_of_the_standbys_pool_and_give_it_back() {
    let (primary, standby, db, proxy) = routed_setup_with("txpool", |config| {
        config.pool.mode = pgcache::config::PoolMode::Transaction;
        config.pool.default_pool_size = 2;
        // Out of rotation once replay is paused (at the end).
        config.replicas.max_lag_ms = 2_000;
        config.replicas.max_lag_bytes = 0;
    })
    .await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    let before = scans(&standby, &db);
    let a = proxy.connect(&db).await;
    // Simple protocol: a miss read on the standby, then a hit.
    assert_eq!(
        scalar(&a, "SELECT v FROM items WHERE k = 1")
            .await
            .as_deref(),
        Some("v1")
    );
    assert_eq!(routed(), 1, "the miss went to the standby");
    let hits = proxy.hits();
    assert_eq!(
        scalar(&a, "SELECT v FROM items WHERE k = 1")
            .await
            .as_deref(),
        Some("v1")
    );
    assert_eq!(proxy.hits(), hits + 1, "the standby's answer was stored");
    // Extended protocol: the statement prepared on the pooled connection
    // once, and found there by the next reads of any client.
    let stmt = a.prepare("SELECT v FROM items WHERE k = $1").await.unwrap();
    for k in 2..=4i32 {
        let row = a.query_one(&stmt, &[&k]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), format!("v{k}"));
    }
    let b = proxy.connect(&db).await;
    let other = b.prepare("SELECT v FROM items WHERE k = $1").await.unwrap();
    let row = b.query_one(&other, &[&5i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "v5");
    assert_eq!(routed(), 5, "every miss went to the standby");
    eventually(WAIT, "the standby's statistics to show the reads", || {
        let grew = scans(&standby, &db) >= before + 5;
        async move { grew.then_some(()) }
    })
    .await;
    // Between reads the connection is the pool's: idle, held by no client,
    // with the one statement.
    let servers = show(&proxy, "SHOW SERVERS").await;
    let on_standby: Vec<_> = servers.iter().filter(|r| r[4] == server).collect();
    assert_eq!(
        on_standby.len(),
        1,
        "one connection served both: {servers:?}"
    );
    // type, user, database, state, addr, connect_time, request_time, id,
    // remote_pid, link, prepared_statements, role, lag_ms
    let conn = on_standby[0];
    assert_eq!(
        (conn[3].as_str(), conn[9].as_str(), conn[10].as_str()),
        ("idle", "", "1"),
        "{conn:?}"
    );
    assert_eq!(conn[11], "replica");
    let pools = show(&proxy, "SHOW POOLS").await;
    let pool = pools
        .iter()
        .find(|r| r[13] == server)
        .unwrap_or_else(|| panic!("the standby's pool: {pools:?}"));
    // sv_active, sv_idle, sv_open, checkouts
    assert_eq!(&pool[5..9], ["0", "1", "1", "5"], "{pool:?}");
    // Read-your-writes across the pool: b writes, a reads it at once.
    b.execute("UPDATE items SET v = 'b wrote' WHERE k = 6", &[])
        .await
        .unwrap();
    let row = a.query_one(&stmt, &[&6i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "b wrote");
    // Reads go to the standby again once the write's position is known
    // (a heartbeat after it came back through the stream) and a poll saw
    // the standby past it.
    let state = proxy.app.cache.db(&db);
    let replica = &proxy.app.replicas.servers[0];
    eventually(WAIT, "the standby known to have replayed b's write", || {
        let floor = state.floor(&state.versions.writes);
        let past = floor.is_some_and(|at| replica.replayed() >= at);
        async move { past.then_some(()) }
    })
    .await;
    // The client's settings go with its reads: its DateStyle, applied on
    // the standby's connection before the read.
    a.batch_execute("SET DateStyle = 'SQL, DMY'").await.unwrap();
    let routed_before = routed();
    let sql = "SELECT '2024-03-01'::date::text FROM items WHERE k = 7";
    assert_eq!(scalar(&a, sql).await.as_deref(), Some("01/03/2024"));
    assert_eq!(routed(), routed_before + 1, "read on the standby");
    assert_eq!(scalar(&b, sql).await.as_deref(), Some("2024-03-01"));
    // A session pinned to its connection (a temporary table) reads on the
    // primary.
    a.batch_execute("CREATE TEMP TABLE mine (x int)")
        .await
        .unwrap();
    let routed_before = routed();
    assert_eq!(
        scalar(&a, "SELECT v FROM items WHERE k = 8")
            .await
            .as_deref(),
        Some("v8")
    );
    assert_eq!(
        routed(),
        routed_before,
        "a pinned session reads on the primary"
    );
    drop(a);
    // More clients reading at once than the standby's pool has
    // connections: what finds it full reads on the primary, without an
    // error, and the pool never grows past its size.
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(proxy.connect(&db).await);
    }
    let reads = clients.iter().enumerate().map(|(i, c)| async move {
        for k in 0..15 {
            let key = 10 + i * 15 + k;
            let sql = format!("SELECT v FROM items WHERE k = {key}");
            let v = scalar(c, &sql).await;
            assert_eq!(v, Some(format!("v{key}")), "{sql}");
        }
    });
    futures_util::future::join_all(reads).await;
    let open: usize = replica.pools.all().iter().map(|p| p.row().open).sum();
    assert!((1..=2).contains(&open), "{open} connections to the standby");
    // Drained: out of rotation, the pool's idle connections are closed.
    assert_eq!(sessions_on(&standby, &db).len(), open);
    pause_replay(&standby).await;
    primary.psql_db(&db, "INSERT INTO items VALUES (1000, 'late')");
    eventually(WAIT, "the standby's pool drained", || {
        let out = !replica.in_rotation();
        let open: usize = replica.pools.all().iter().map(|p| p.row().open).sum();
        let there = sessions_on(&standby, &db).len();
        async move { (out && open == 0 && there == 0).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_read_your_writes_another_instances_write_keeps_reads_off_a_standby_behind_it() {
    let redis = Redis::dedicated();
    let (_primary, standby, db, a) = routed_setup_with("rywshared", |config| {
        config.redis.url = redis.url();
        config.cache.shared.consistency = pgcache::config::Consistency::ReadYourWrites;
    })
    .await;
    let b = Proxy::start((*a.app.config()).clone()).await;
    until_in_rotation(&b, true).await;
    let (ca, cb) = (a.connect(&db).await, b.connect(&db).await);
    a.shared_ready(&db).await;
    b.shared_ready(&db).await;
    let server = b.app.replicas.servers[0].name.clone();
    let routed_by_b = || b.app.metrics.replicas.of(&server).routed.get();
    // B's misses go to the standby.
    assert_eq!(
        scalar(&cb, "SELECT v FROM items WHERE k = 3")
            .await
            .as_deref(),
        Some("v3")
    );
    assert_eq!(routed_by_b(), 1);
    // A write through A while the standby replays nothing: B's read right
    // after it is the primary's, with the new value.
    pause_replay(&standby).await;
    ca.execute("UPDATE items SET v = 'a wrote' WHERE k = 4", &[])
        .await
        .unwrap();
    assert_eq!(
        scalar(&cb, "SELECT v FROM items WHERE k = 4")
            .await
            .as_deref(),
        Some("a wrote")
    );
    assert_eq!(routed_by_b(), 1, "not read on the standby");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_hit_a_session_never_reads_from_a_standby_behind_what_the_hit_showed() {
    let redis = Redis::dedicated();
    let (primary, standby, db, y) = routed_setup_with("monotonic", |config| {
        config.redis.url = redis.url();
    })
    .await;
    // X shares Redis with Y and reads only the primary.
    let mut config = (*y.app.config()).clone();
    config.upstream.replicas.clear();
    let x = Proxy::start(config).await;
    let (cx, cy) = (x.connect(&db).await, y.connect(&db).await);
    x.shared_ready(&db).await;
    y.shared_ready(&db).await;
    let server = y.app.replicas.servers[0].name.clone();
    let routed = || y.app.metrics.replicas.of(&server).routed.get();
    // The standby stops replaying; a direct write on the primary.
    pause_replay(&standby).await;
    primary.psql_db(&db, "UPDATE items SET v = 'new' WHERE k = 20");
    // X reads the new row and stores it in Redis; Y's session is served
    // it from there (a miss meanwhile may read the standby's old row).
    let read = "SELECT v FROM items WHERE k = 20";
    eventually(WAIT, "X to read and store the new row", || {
        let cx = &cx;
        async move { (scalar(cx, read).await.as_deref() == Some("new")).then_some(()) }
    })
    .await;
    eventually(WAIT, "a hit on Y showing the new row", || {
        let (cy, y) = (&cy, &y);
        async move {
            let hits = y.hits();
            let v = scalar(cy, read).await;
            (v.as_deref() == Some("new") && y.hits() > hits).then_some(())
        }
    })
    .await;
    // Another read of the same row after the hit: never the standby's
    // older one.
    let before = routed();
    for other in [
        "SELECT v FROM items WHERE k = 20 AND k > 0",
        "SELECT v FROM items WHERE k >= 20 AND k <= 20",
    ] {
        assert_eq!(scalar(&cy, other).await.as_deref(), Some("new"), "{other}");
    }
    assert_eq!(routed(), before, "read on the primary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_terminate_mode_a_password_users_reads_go_to_the_standby_as_that_user() {
    let primary = Pg::dedicated();
    let db = primary.create_db("terminate");
    primary.psql_db(
        &db,
        &format!(
            "CREATE TABLE items (k int PRIMARY KEY, v text);
             INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 100) g;
             GRANT SELECT ON items TO {SCRAM_USER}"
        ),
    );
    let standby = primary.standby();
    let mut config = config_with(&primary, &[&standby]);
    config.auth.mode = pgcache::config::AuthMode::Terminate;
    config
        .auth
        .users
        .insert(SCRAM_USER.into(), SCRAM_PASSWORD.into());
    let proxy = Proxy::start(config).await;
    until_in_rotation(&proxy, true).await;
    let dsn = format!("{} password={SCRAM_PASSWORD}", proxy.dsn(SCRAM_USER, &db));
    let client = connect_dsn(&dsn).await.expect("a password login");
    proxy.wait_streaming(&db).await;
    standby_caught_up(&primary, &standby).await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    for k in 1..=3 {
        let sql = format!("SELECT v FROM items WHERE k = {k}");
        assert_eq!(scalar(&client, &sql).await, Some(format!("v{k}")));
    }
    assert_eq!(routed(), 3, "the misses went to the standby");
    // The standby's session is the client's user, logged in with the
    // password pgcache checked.
    assert_eq!(sessions_on(&standby, &db), [SCRAM_USER]);
}

/// Transactions the standby committed in database `db`, read-only ones
/// included (a session's are counted once it ends, or later).
fn standby_transactions(standby: &Pg, db: &str) -> i64 {
    standby
        .psql_db(
            db,
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )
        .trim()
        .parse()
        .unwrap()
}

/// A read routed to the standby costs it one transaction once its position
/// is known (from the monitor's polls, or the probe of an earlier read on
/// the same connection): no probe goes before each read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_read_costs_the_standby_one_transaction_once_its_position_is_known() {
    let (_primary, standby, db, proxy) = routed_setup("routed_cost").await;
    let server = proxy.app.replicas.servers[0].name.clone();
    let routed = || proxy.app.metrics.replicas.of(&server).routed.get();
    let before = standby_transactions(&standby, &db);
    let client = proxy.connect(&db).await;
    for k in 1..=50 {
        let sql = format!("SELECT v FROM items WHERE k = {k}");
        assert_eq!(scalar(&client, &sql).await, Some(format!("v{k}")));
    }
    assert_eq!(routed(), 50, "every miss went to the standby");
    // The session's connection there ends, and its statistics with it.
    drop(client);
    eventually(WAIT, "the session on the standby to end", || {
        let gone = sessions_on(&standby, &db).is_empty();
        async move { gone.then_some(()) }
    })
    .await;
    let transactions = standby_transactions(&standby, &db) - before;
    // 50 reads, the client's settings applied once, the reading of
    // `before`, and a probe or two while the position was not known yet.
    assert!(
        (50..=56).contains(&transactions),
        "{transactions} standby transactions for 50 routed reads"
    );
}
