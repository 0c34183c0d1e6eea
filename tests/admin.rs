//! The admin console, driven with a real psql.

mod common;

use std::time::Duration;

use common::*;

const PASSWORD: &str = "admin-secret";

fn config() -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.admin.password = PASSWORD.to_owned();
    config
}

/// Runs admin commands through psql (unaligned, tuples only, `|` between
/// columns); returns (success, stdout, stderr).
async fn psql_admin(
    proxy: &Proxy,
    user: &str,
    password: &str,
    commands: &[&str],
) -> (bool, String, String) {
    let url = format!(
        "postgresql://{user}:{password}@127.0.0.1:{}/pgcache",
        proxy.addr.port()
    );
    let mut args = vec!["-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", url.as_str()];
    for c in commands {
        args.push("-c");
        args.push(c);
    }
    let out = run_tool(&pg().bin("psql"), &args).await;
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value of `key` in two-column output.
fn value<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('|'))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_refused() {
    let proxy = Proxy::start(config()).await;
    for (user, password) in [
        ("pgcache", "wrong"),
        ("postgres", PASSWORD),
        ("nobody", "x"),
    ] {
        let (ok, _, err) = psql_admin(&proxy, user, password, &["SHOW VERSION"]).await;
        assert!(!ok, "{user}/{password} logged in");
        assert!(err.contains("password authentication failed"), "{err}");
    }
    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW VERSION"]).await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), format!("pgcache {}", env!("CARGO_PKG_VERSION")));
}

/// SHOW TABLES says which tables' reads by key are invalidated per row, and
/// counts row and whole-table invalidations apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_tables_tells_row_invalidations_from_table_ones() {
    let db = pg().create_db("admin_rows");
    pg().psql_db(
        &db,
        "CREATE TABLE acc(id int PRIMARY KEY, v int); INSERT INTO acc VALUES (1, 10), (2, 20); \
         CREATE TABLE pair(a int, b text, v int, PRIMARY KEY (a, b))",
    );
    let proxy = Proxy::start(config()).await;
    let client = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    let read = "SELECT v FROM acc WHERE id = 1";
    eventually_reads(&client, read, "10").await;
    scalar(&client, "SELECT v FROM pair WHERE a = 1 AND b = 'x'").await;
    for sql in [
        "UPDATE acc SET v = 21 WHERE id = 2",
        "UPDATE acc SET v = 22 WHERE id = 2",
        "TRUNCATE pair",
    ] {
        client.batch_execute(sql).await.unwrap();
    }
    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW TABLES"]).await;
    assert!(ok, "{err}");
    let cols = |table: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.starts_with(&format!("{db}|{table}|")))
            .unwrap_or_else(|| panic!("{table} is listed: {out}"))
            .split('|')
            .map(str::to_owned)
            .collect()
    };
    let acc = cols("acc");
    // Each write counts once from pgcache and once more when the stream
    // brings it.
    assert!(acc[8].parse::<u64>().unwrap() >= 2, "{acc:?}");
    assert_eq!(&acc[9..], ["0", "key (id)"], "{acc:?}");
    let pair = cols("pair");
    assert_eq!(pair[8], "0", "{pair:?}");
    assert!(pair[9].parse::<u64>().unwrap() >= 1, "{pair:?}");
    assert_eq!(pair[10], "key (a, b)", "{pair:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_commands_report_what_the_cache_did() {
    let db = pg().create_db("admin_show");
    pg().psql_db(
        &db,
        "CREATE TABLE items(id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10), (2, 20); \
         CREATE TABLE no_key(v int)",
    );
    let proxy = Proxy::start(config()).await;
    let client = proxy.connect(&db).await;
    for id in [1, 1, 1, 2] {
        scalar(&client, &format!("SELECT v FROM items WHERE id = {id}")).await;
    }
    client
        .batch_execute("UPDATE items SET v = 11 WHERE id = 1")
        .await
        .unwrap();

    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW STATS"]).await;
    assert!(ok, "{err}");
    assert_eq!(value(&out, "lookups_hit"), Some("2"), "{out}");
    assert_eq!(value(&out, "lookups_miss"), Some("2"), "{out}");
    assert_eq!(value(&out, "hit_ratio"), Some("0.500"), "{out}");
    assert_eq!(value(&out, "local_hits"), Some("2"), "{out}");
    // Why the rest went to PostgreSQL: the UPDATE is not a SELECT.
    let bypassed = proxy
        .app
        .metrics
        .bypasses(pgcache::classify::BypassReason::NotSelect);
    assert!(bypassed > 0);
    assert_eq!(
        value(&out, "bypass.not_select"),
        Some(bypassed.to_string().as_str()),
        "{out}"
    );
    assert!(
        value(&out, "mean_hit_ms").is_some_and(|v| v.parse::<f64>().is_ok()),
        "{out}"
    );

    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW QUERIES 5"]).await;
    assert!(ok, "{err}");
    let select = out
        .lines()
        .find(|l| l.ends_with("SELECT v FROM items WHERE id = ?"))
        .unwrap_or_else(|| panic!("the normalised statement is listed: {out}"));
    let cols: Vec<&str> = select.split('|').collect();
    assert_eq!(&cols[1..5], ["4", "2", "2", "0.500"], "{select}");
    assert!(!cols[8].is_empty(), "the UPDATE invalidated it: {select}");

    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW TABLES"]).await;
    assert!(ok, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with(&format!("{db}|items|")))
        .unwrap_or_else(|| panic!("items is listed: {out}"));
    let cols: Vec<&str> = row.split('|').collect();
    assert!(cols[4].parse::<u64>().unwrap() >= 1, "invalidations: {row}");
    assert_eq!(cols[7], "published", "{row}");
    // Never named by a statement, yet listed: the stream left it out.
    let row = out
        .lines()
        .find(|l| l.starts_with(&format!("{db}|public.no_key|")))
        .unwrap_or_else(|| panic!("no_key is listed: {out}"));
    assert!(row.ends_with("|no replica identity"), "{row}");

    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW REPLICATION"]).await;
    assert!(ok, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with(&format!("{db}|")))
        .unwrap_or_else(|| panic!("{db} is listed: {out}"));
    assert!(row.contains("|streaming|"), "{row}");

    let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SHOW CONFIG"]).await;
    assert!(ok, "{err}");
    assert_eq!(value(&out, "admin.password"), Some("***"), "{out}");
    assert_eq!(value(&out, "cache.mode"), Some("auto"), "{out}");
    assert!(!out.contains(PASSWORD));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidate_commands_make_the_next_read_a_miss() {
    let db = pg().create_db("admin_inval");
    pg().psql_db(
        &db,
        "CREATE TABLE items(id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10)",
    );
    let proxy = Proxy::start(config()).await;
    let client = proxy.connect(&db).await;
    let sql = "SELECT v FROM items WHERE id = 1";
    let read_is_hit = || {
        let before = proxy.hits();
        let (client, proxy) = (&client, &proxy);
        async move {
            assert_eq!(scalar(client, sql).await.as_deref(), Some("10"));
            proxy.hits() > before
        }
    };
    read_is_hit().await;
    assert!(read_is_hit().await);
    for command in [
        "INVALIDATE TABLE items",
        "INVALIDATE TABLE public.items",
        "INVALIDATE ALL",
    ] {
        let (ok, out, err) = psql_admin(&proxy, "pgcache", PASSWORD, &[command]).await;
        assert!(ok, "{command}: {err}");
        assert_eq!(out.trim(), "INVALIDATE");
        // INVALIDATE ALL also forgets what pgcache knows of the catalog.
        proxy.learn_all(&db).await;
        assert!(!read_is_hit().await, "{command}: the next read is a miss");
        assert!(read_is_hit().await, "{command}: and the one after a hit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_the_policy_and_a_bad_file_changes_nothing() {
    let db = pg().create_db("admin_reload");
    pg().psql_db(
        &db,
        "CREATE TABLE items(id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10)",
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pgcache.toml");
    let base = config();
    let write = |extra: &str| {
        std::fs::write(
            &file,
            format!(
                "[upstream]\nurl = \"{}\"\n[server]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
                 [admin]\npassword = \"{PASSWORD}\"\n{extra}",
                base.upstream.url
            ),
        )
        .unwrap()
    };
    write("");
    let loaded = pgcache::Config::load(Some(&file), &Default::default()).unwrap();
    let proxy = Proxy::start(loaded).await;
    proxy
        .app
        .set_config_source(Some(file.clone()), Default::default());
    let client = proxy.connect(&db).await;
    let hits_of_two = |sql: &'static str| {
        let (client, proxy) = (&client, &proxy);
        async move {
            let before = proxy.hits();
            scalar(client, sql).await;
            scalar(client, sql).await;
            proxy.hits() - before
        }
    };
    assert_eq!(hits_of_two("SELECT v FROM items WHERE id = 1").await, 1);

    write("[cache]\nmode = \"opt_in\"\n[server]\nmax_client_connections = 7\n");
    // A second [server] table is a TOML error: RELOAD refuses, nothing changes.
    let (ok, _, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["RELOAD"]).await;
    assert!(!ok, "a broken file was accepted");
    assert!(err.contains("RELOAD failed"), "{err}");
    assert_eq!(hits_of_two("SELECT v + 1 FROM items WHERE id = 1").await, 1);

    write("[cache]\nmode = \"opt_in\"\n");
    let (ok, _, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["RELOAD", "SHOW CONFIG"]).await;
    assert!(ok, "{err}");
    assert_eq!(hits_of_two("SELECT v + 2 FROM items WHERE id = 1").await, 0);
    assert_eq!(
        hits_of_two("/*+ cache */ SELECT v + 2 FROM items WHERE id = 1").await,
        1
    );

    // What needs a restart is said so.
    write("[cache]\nmode = \"opt_in\"\n[cache.local]\nmax_bytes = 1048576\n");
    let (ok, _, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["RELOAD"]).await;
    assert!(ok, "{err}");
    assert!(
        err.contains("applied only at restart: cache.local.max_bytes"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_commands_and_the_extended_protocol_get_clear_errors() {
    let proxy = Proxy::start(config()).await;
    let (ok, _, err) = psql_admin(&proxy, "pgcache", PASSWORD, &["SELECT 1"]).await;
    assert!(!ok);
    assert!(
        err.contains("unknown admin command") && err.contains("SHOW STATS"),
        "{err}"
    );
    // The session survives an error.
    let (ok, out, err) = psql_admin(
        &proxy,
        "pgcache",
        PASSWORD,
        &["\\set ON_ERROR_STOP 0", "SHOW NONSENSE", "SHOW VERSION"],
    )
    .await;
    assert!(ok, "{err}");
    assert!(out.contains("pgcache "), "{out}");

    let client = tokio::time::timeout(
        Duration::from_secs(10),
        connect_dsn(&format!(
            "host=127.0.0.1 port={} user=pgcache password={PASSWORD} dbname=pgcache",
            proxy.addr.port()
        )),
    )
    .await
    .unwrap()
    .unwrap();
    let err = client.query("SHOW STATS", &[]).await.unwrap_err();
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("0A000"),
        "{err}"
    );
    let rows = client.simple_query("SHOW VERSION").await.unwrap();
    assert!(!rows.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_password_the_name_is_an_ordinary_database() {
    let proxy = Proxy::start(pg().proxy_config()).await;
    let (ok, _, err) = psql_admin(&proxy, "postgres", "", &["SHOW VERSION"]).await;
    assert!(!ok);
    assert!(err.contains("database \"pgcache\" does not exist"), "{err}");
}
