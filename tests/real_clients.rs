//! libpq-based clients (psql, pgbench) through pgcache, and failures of the
//! backend itself.

mod common;

use std::time::Duration;

use common::*;
use tokio_postgres::error::SqlState;

fn port_arg(proxy: &Proxy) -> String {
    proxy.addr.port().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_script_with_copy_large_objects_and_errors() {
    let db = pg().create_db("psql");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("in.csv");
    let rows: String = (1..=1000).map(|i| format!("{i},name {i}\n")).collect();
    std::fs::write(&csv, &rows).unwrap();
    let blob = dir.path().join("blob.bin");
    let blob_data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&blob, &blob_data).unwrap();
    let exported = dir.path().join("out.bin");
    let out_csv = dir.path().join("out.csv");
    let script = dir.path().join("script.sql");
    std::fs::write(
        &script,
        format!(
            "\\set ON_ERROR_STOP 1
CREATE TABLE people(id int PRIMARY KEY, name text);
\\copy people FROM '{csv}' WITH (FORMAT csv)
SELECT count(*) AS n, sum(id) AS s FROM people \\gset
\\echo rows=:n sum=:s
\\copy (SELECT * FROM people ORDER BY id) TO '{out_csv}' WITH (FORMAT csv)
-- Large objects go through libpq's fast-path FunctionCall messages.
\\lo_import '{blob}'
SELECT :LASTOID AS oid \\gset
\\lo_export :oid '{exported}'
BEGIN;
SELECT 1/0;
ROLLBACK;
",
            csv = csv.display(),
            out_csv = out_csv.display(),
            blob = blob.display(),
            exported = exported.display(),
        ),
    )
    .unwrap();
    let out = run_tool(
        &pg().bin("psql"),
        &[
            "-X",
            "-h",
            "127.0.0.1",
            "-p",
            &port_arg(&proxy),
            "-U",
            "postgres",
            "-d",
            &db,
            "-f",
            script.to_str().unwrap(),
        ],
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // ON_ERROR_STOP makes the division by zero the script's last statement.
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(stderr.contains("division by zero"), "{stderr}");
    assert!(stdout.contains("rows=1000 sum=500500"), "{stdout}");
    assert_eq!(std::fs::read_to_string(&out_csv).unwrap(), rows);
    assert_eq!(std::fs::read(&exported).unwrap(), blob_data);
}

#[tokio::test]
async fn psql_sslmode_prefer_falls_back_and_require_is_refused_clearly() {
    let proxy = Proxy::start(pg().proxy_config()).await;
    let port = port_arg(&proxy);
    let prefer = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=prefer");
    let out = run_tool(
        &pg().bin("psql"),
        &["-X", "-A", "-t", "-d", &prefer, "-c", "SELECT 'plain'"],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "plain");
    let require =
        format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=require");
    let out = run_tool(&pg().bin("psql"), &["-X", "-d", &require, "-c", "SELECT 1"]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not support SSL"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_init_then_every_protocol_mode_with_zero_failures() {
    let db = pg().create_db("pgbench");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let port = port_arg(&proxy);
    let base = ["-h", "127.0.0.1", "-p", port.as_str(), "-U", "postgres"];
    let mut init = base.to_vec();
    init.extend(["-i", "-s", "1", "-q", db.as_str()]);
    let out = run_tool(&pg().bin("pgbench"), &init).await;
    assert!(
        out.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for mode in ["simple", "extended", "prepared"] {
        let mut args = base.to_vec();
        // The default TPC-B-like script: reads and writes in transactions.
        args.extend(["-M", mode, "-c", "8", "-j", "2", "-t", "200", db.as_str()]);
        let out = run_tool(&pg().bin("pgbench"), &args).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "pgbench -M {mode}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("number of transactions actually processed: 1600/1600"),
            "{mode}: {stdout}"
        );
        assert!(
            stdout.contains("number of failed transactions: 0 (0.000%)"),
            "{mode}: {stdout}"
        );
    }
    let direct = pg().direct(&db).await;
    let history: i64 = direct
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .await
        .unwrap()
        .get(0);
    // pgbench truncates the history before each run: the last run's rows remain.
    assert_eq!(history, 1600, "every transaction wrote its history row");
}

// Multi-threaded: Pg::stop blocks a thread, and the in-process pgcache must
// keep answering its walsender meanwhile or PostgreSQL waits to shut down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_gives_errors_then_everything_recovers() {
    let pg = Pg::dedicated();
    let mut config = pg.proxy_config();
    config.upstream.connect_timeout_ms = 1000;
    let proxy = Proxy::start(config).await;
    let client = proxy.connect("postgres").await;
    client.query_one("SELECT 1", &[]).await.unwrap();

    pg.stop();
    // The session's backend is gone: its next use fails with a clear error.
    let err = client.query_one("SELECT 1", &[]).await.unwrap_err();
    assert!(
        client.is_closed() || err.code().is_some(),
        "expected a closed connection or a database error, got {err}"
    );
    // New clients get 08006 while PostgreSQL is down.
    let err = connect_dsn(&proxy.dsn("postgres", "postgres"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::CONNECTION_FAILURE), "{err}");

    pg.restart();
    let client = eventually(
        Duration::from_secs(30),
        "a connection after restart",
        || async { connect_dsn(&proxy.dsn("postgres", "postgres")).await.ok() },
    )
    .await;
    let row = client.query_one("SELECT 'back'", &[]).await.unwrap();
    assert_eq!(row.get::<_, &str>(0), "back");
}

#[test]
fn redis_harness_starts_a_private_server() {
    let redis = redis();
    assert!(redis_ping(redis.port));
    assert_ne!(redis.port, 6379, "a private server, not the machine's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_prepared_hot_keys_hit_the_cache_with_zero_failures() {
    let db = pg().create_db("pgbenchcache");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let port = port_arg(&proxy);
    let base = ["-h", "127.0.0.1", "-p", port.as_str(), "-U", "postgres"];
    let mut init = base.to_vec();
    init.extend(["-i", "-s", "1", "-q", db.as_str()]);
    assert!(run_tool(&pg().bin("pgbench"), &init).await.status.success());
    // The tables pgbench created reach the publication through the stream:
    // wait until a read of pgbench_accounts is really served from cache.
    // Alone this takes about a second; under a full parallel test run it
    // has taken over 20 s.
    let client = proxy.connect(&db).await;
    eventually(
        Duration::from_secs(60),
        "pgbench_accounts to be cacheable",
        || {
            let client = &client;
            let proxy = &proxy;
            async move {
                let sql = "SELECT abalance FROM pgbench_accounts WHERE aid = 1";
                client.simple_query(sql).await.unwrap();
                let hits = proxy.hits();
                client.simple_query(sql).await.unwrap();
                (proxy.hits() > hits).then_some(())
            }
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("hot.sql");
    std::fs::write(
        &script,
        "\\set aid random(1, 20)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n",
    )
    .unwrap();
    for mode in ["simple", "extended", "prepared"] {
        let hits = proxy.hits();
        let mut args = base.to_vec();
        args.extend([
            "-n",
            "-M",
            mode,
            "-c",
            "4",
            "-j",
            "2",
            "-t",
            "500",
            "-f",
            script.to_str().unwrap(),
            db.as_str(),
        ]);
        let out = run_tool(&pg().bin("pgbench"), &args).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{mode}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("number of failed transactions: 0 (0.000%)"),
            "{mode}: {stdout}"
        );
        // 2,000 reads of 20 keys: all but the first read of each key may hit.
        assert!(
            proxy.hits() - hits > 1500,
            "{mode}: only {} hits",
            proxy.hits() - hits
        );
    }
}
