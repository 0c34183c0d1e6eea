//! What a client sees through pgcache is what PostgreSQL would show it:
//! its backend's process id, its unnamed statement kept across pgcache's
//! own queries, databases that can be dropped, and its own settings when
//! pgcache takes an earlier login's.

mod common;

use std::time::Duration;

use common::wire::*;
use common::*;
use tokio::io::AsyncWriteExt;

/// The process id in a login's BackendKeyData.
fn key_pid(login: &[(u8, Vec<u8>)]) -> u32 {
    let (_, body) = login
        .iter()
        .find(|(tag, _)| *tag == b'K')
        .expect("BackendKeyData");
    u32::from_be_bytes(body[..4].try_into().unwrap())
}

/// The first column of the first DataRow among `messages`, as text.
fn first_value(messages: &[(u8, Vec<u8>)]) -> String {
    let (_, row) = messages
        .iter()
        .find(|(tag, _)| *tag == b'D')
        .unwrap_or_else(|| panic!("a row among {}", tags(messages)));
    let len = i32::from_be_bytes(row[2..6].try_into().unwrap()) as usize;
    String::from_utf8(row[6..6 + len].to_vec()).unwrap()
}

async fn simple(s: &mut tokio::net::TcpStream, sql: &str) -> Vec<(u8, Vec<u8>)> {
    s.write_all(&query(sql)).await.unwrap();
    read_until_ready(s).await
}

#[tokio::test]
async fn the_client_sees_its_backends_real_pid_everywhere() {
    let db = pg().create_db("realpid");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let (mut s, login) = raw_login(proxy.addr, &db).await;
    let shown = key_pid(&login);
    let answer = simple(&mut s, "SELECT pg_backend_pid()").await;
    assert_eq!(first_value(&answer), shown.to_string(), "pg_backend_pid()");
    // A notification from the session itself carries the same pid.
    let answer = simple(&mut s, "LISTEN pid_check; NOTIFY pid_check, 'x'").await;
    let (_, note) = answer
        .iter()
        .find(|(tag, _)| *tag == b'A')
        .unwrap_or_else(|| panic!("a notification among {}", tags(&answer)));
    assert_eq!(u32::from_be_bytes(note[..4].try_into().unwrap()), shown);
    // Ending that pid directly ends this client's session with the server's
    // own error.
    let direct = pg().direct(&db).await;
    let ended: bool = direct
        .query_one("SELECT pg_terminate_backend($1)", &[&(shown as i32)])
        .await
        .unwrap()
        .get(0);
    assert!(ended);
    let (tag, body) = tokio::time::timeout(Duration::from_secs(10), read_message(&mut s))
        .await
        .expect("the session is told in time")
        .expect("an error before the connection closes");
    assert_eq!(tag, b'E');
    assert_eq!(sqlstate_of(&body).as_deref(), Some("57P01"));
    let message = pgcache::protocol::messages::error_field(&body, b'M').unwrap();
    assert!(message.contains("administrator command"), "{message}");
    assert!(
        read_message(&mut s).await.is_none(),
        "then the connection closes"
    );
}

#[tokio::test]
async fn a_cancel_with_the_real_pid_but_a_wrong_secret_cancels_nothing() {
    let db = pg().create_db("pidforge");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let (mut s, login) = raw_login(proxy.addr, &db).await;
    let pid = key_pid(&login);
    s.write_all(&query("SELECT pg_sleep(1)::text"))
        .await
        .unwrap();
    let direct = pg().direct(&db).await;
    eventually(Duration::from_secs(10), "pg_sleep to start", || async {
        let n: i64 = direct
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'",
                &[&(pid as i32)],
            )
            .await
            .unwrap()
            .get(0);
        (n == 1).then_some(())
    })
    .await;
    // PostgreSQL's own secret for that backend would not work either:
    // only pgcache's does, and a guess is not it.
    for secret in [[0u8, 0, 0, 0], [1, 2, 3, 4], [255, 255, 255, 255]] {
        let mut c = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        c.write_all(&pgcache::protocol::startup::encode_cancel(pid, &secret))
            .await
            .unwrap();
        assert!(read_message(&mut c).await.is_none());
    }
    let answer = read_until_ready(&mut s).await;
    assert!(
        !answer.iter().any(|(tag, _)| *tag == b'E'),
        "the query finished uncancelled: {}",
        tags(&answer)
    );
}

#[tokio::test]
async fn pgcaches_own_queries_leave_the_clients_unnamed_statement_alone() {
    let db = pg().create_db("unnamed");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let setup = proxy.connect(&db).await;
    setup
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'one')",
        )
        .await
        .unwrap();
    proxy.wait_streaming(&db).await;
    let settings_queries = || proxy.app.metrics.settings_queries.get();
    // asyncpg's way with a statement it does not keep: Parse the unnamed
    // statement, Describe it, Sync; later Bind and Execute it. A fresh
    // session's first cacheable read makes pgcache read the session's
    // settings on the client's connection, between the two.
    for round in 0..2 {
        let (mut s, _) = raw_login(proxy.addr, &db).await;
        let before = settings_queries();
        s.write_all(
            &[
                parse("", "SELECT v FROM t WHERE id = 1"),
                describe_statement(""),
                sync(),
            ]
            .concat(),
        )
        .await
        .unwrap();
        let described = read_until_ready(&mut s).await;
        assert_eq!(tags(&described), "1tTZ");
        s.write_all(&[bind(""), execute(), sync()].concat())
            .await
            .unwrap();
        let answer = read_until_ready(&mut s).await;
        assert_eq!(tags(&answer), "2DCZ", "round {round}: {answer:?}");
        assert_eq!(first_value(&answer), "one");
        assert!(
            settings_queries() > before,
            "round {round}: pgcache read the settings in between"
        );
    }
}

/// A database pgcache streams, with a table read through pgcache (so the
/// stream, its control connection and the catalog fetcher are all there),
/// and every client of it gone.
async fn used_database(proxy: &Proxy, name: &str) -> String {
    let db = pg().create_db(name);
    {
        let client = proxy.connect(&db).await;
        client
            .batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
            .await
            .unwrap();
        // Read until a hit: each read takes hold of the database again if
        // pgcache let go of it meanwhile (under load the helpers can take
        // longer than idle_release_secs).
        hits_again(proxy, &client).await;
        assert!(proxy.app.cache.db(&db).stream.slot().is_some());
    }
    db
}

#[tokio::test]
async fn databases_pgcache_streams_can_be_dropped_renamed_and_copied_through_it() {
    let proxy = Proxy::start(pg().proxy_config()).await;
    let home = pg().create_db("home");
    let admin = proxy.connect(&home).await;

    let dropped = used_database(&proxy, "dropme").await;
    admin
        .batch_execute(&format!("DROP DATABASE {dropped}"))
        .await
        .expect("DROP DATABASE through pgcache");

    // WITH (FORCE) ends a client still connected through pgcache too.
    let forced = used_database(&proxy, "force").await;
    let stays = proxy.connect(&forced).await;
    admin
        .batch_execute(&format!("DROP DATABASE {forced} WITH (FORCE)"))
        .await
        .expect("DROP DATABASE ... WITH (FORCE) through pgcache");
    assert!(stays.simple_query("SELECT 1").await.is_err());

    let renamed = used_database(&proxy, "rename").await;
    admin
        .batch_execute(&format!("ALTER DATABASE {renamed} RENAME TO {renamed}_2"))
        .await
        .expect("ALTER DATABASE ... RENAME through pgcache");
    admin
        .batch_execute(&format!("ALTER DATABASE {renamed}_2 RENAME TO {renamed}"))
        .await
        .unwrap();

    // The template's stream resumes when a client uses it again.
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {renamed}_copy TEMPLATE {renamed}"
        ))
        .await
        .expect("CREATE DATABASE ... TEMPLATE through pgcache");
    let again = proxy.connect(&renamed).await;
    let hits = proxy.hits();
    for _ in 0..3 {
        assert_eq!(rows(&again, "SELECT id FROM t").await, [[Some("1".into())]]);
    }
    assert!(proxy.hits() > hits, "the template is cached again");
    let copy = proxy.connect(&format!("{renamed}_copy")).await;
    assert_eq!(rows(&copy, "SELECT id FROM t").await, [[Some("1".into())]]);
}

#[tokio::test]
async fn a_database_no_client_uses_is_let_go_and_taken_again_on_use() {
    let mut config = pg().proxy_config();
    config.replication.idle_release_secs = 1;
    let proxy = Proxy::start(config).await;
    let kept = used_database(&proxy, "idlekept").await;
    let client = proxy.connect(&kept).await;
    let dropped = used_database(&proxy, "idledrop").await;
    for db in [&kept, &dropped] {
        let state = proxy.app.cache.db(db);
        eventually(Duration::from_secs(20), "pgcache to let go", || {
            let released = !state.stream.is_claimed();
            async move { released.then_some(()) }
        })
        .await;
        assert_eq!(proxy.app.cache.stream_state(&state), "released");
    }
    // Dropped directly: nothing of pgcache's is in the way. PostgreSQL
    // waits for sessions that are closing; off this thread, which runs
    // pgcache's tasks (its control connection's close among them).
    let drop_sql = format!("DROP DATABASE {dropped}");
    tokio::task::spawn_blocking(move || pg().psql_admin(&drop_sql))
        .await
        .unwrap();
    // The database still in use gets its stream back at the next read,
    // which PostgreSQL answers meanwhile.
    assert_eq!(
        rows(&client, "SELECT id FROM t").await,
        [[Some("1".into())]]
    );
    hits_again(&proxy, &client).await;
}

/// A table made directly while pgcache had let go of its database can only
/// join the publication through the database's stream: a read of it takes
/// hold of the database again, and it is cached.
#[tokio::test]
async fn a_table_made_while_pgcache_let_go_is_cached_once_read() {
    let mut config = pg().proxy_config();
    config.replication.idle_release_secs = 1;
    let proxy = Proxy::start(config).await;
    let db = used_database(&proxy, "idlemade").await;
    // Logged in (which takes hold) before pgcache lets go.
    let client = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap();
    let state = proxy.app.cache.db(&db);
    eventually(Duration::from_secs(20), "pgcache to let go", || {
        let released = !state.stream.is_claimed();
        async move { released.then_some(()) }
    })
    .await;
    pg().psql_db(
        &db,
        "CREATE TABLE made (id int PRIMARY KEY, v int); INSERT INTO made VALUES (1, 7)",
    );
    eventually(
        Duration::from_secs(20),
        "a hit on the new table",
        || async {
            let before = proxy.hits();
            let read = rows(&client, "SELECT v FROM made WHERE id = 1").await;
            assert_eq!(read, [[Some("7".into())]]);
            (proxy.hits() > before).then_some(())
        },
    )
    .await;
}

/// Reads `t` until a read is a hit.
async fn hits_again(proxy: &Proxy, client: &tokio_postgres::Client) {
    eventually(Duration::from_secs(20), "a hit", || async {
        let before = proxy.hits();
        let read = rows(client, "SELECT id FROM t").await;
        assert_eq!(read, [[Some("1".into())]]);
        (proxy.hits() > before).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_missing_or_wrong_password_for_pgcaches_own_login_stops_start_up_naming_it() {
    let url = |userinfo: &str| format!("postgres://{userinfo}@127.0.0.1:{}/postgres", pg().port);
    for (userinfo, expected) in [
        (SCRAM_USER.to_owned(), "asks for a password"),
        (
            format!("{SCRAM_USER}:not-the-password"),
            "refused pgcache's own login",
        ),
    ] {
        let mut config = pg().proxy_config();
        config.upstream.url = url(&userinfo);
        // Not even a cache without replication starts without credentials.
        config.replication.required = false;
        let e = match pgcache::App::start(config).await {
            Ok(_) => panic!("{userinfo}: pgcache started"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(expected), "{userinfo}: {e}");
        assert!(e.contains("upstream.url"), "{userinfo}: {e}");
    }
}

#[tokio::test]
async fn bypass_reasons_say_what_is_really_going_on() {
    use pgcache::classify::BypassReason;
    let (db, proxy, client, _direct) = setup_streaming(
        "reasons",
        "CREATE TABLE keyed (id int PRIMARY KEY); CREATE TABLE no_key (id int); \
         CREATE VIEW v AS SELECT id FROM keyed",
    )
    .await;
    let metrics = &proxy.app.metrics;
    for (sql, reason) in [
        ("SELECT id FROM no_key", BypassReason::NotPublished),
        ("SELECT id FROM v", BypassReason::NotATable),
    ] {
        let before = metrics.bypasses(reason);
        client.simple_query(sql).await.unwrap();
        assert_eq!(metrics.bypasses(reason), before + 1, "{sql}");
    }
    // With no stream up, the same read says that instead: pgcache let go
    // of the database, idle, and nothing has used it since.
    let mut config = pg().proxy_config();
    config.replication.idle_release_secs = 1;
    let idle = Proxy::start(config).await;
    let client = connect_dsn(&idle.dsn("postgres", &db)).await.unwrap();
    let state = idle.app.cache.db(&db);
    eventually(Duration::from_secs(20), "pgcache to let go", || {
        let released = !state.stream.is_claimed();
        async move { released.then_some(()) }
    })
    .await;
    idle.learn(&db, &["no_key"], &[]).await;
    let before = idle.app.metrics.bypasses(BypassReason::ReplicationDown);
    client.simple_query("SELECT id FROM no_key").await.unwrap();
    assert_eq!(
        idle.app.metrics.bypasses(BypassReason::ReplicationDown),
        before + 1
    );
}

#[tokio::test]
async fn set_unlogged_through_pgcache_works_and_the_table_is_cached_only_while_logged() {
    use pgcache::classify::BypassReason;
    let (_db, proxy, client, direct) = setup_streaming(
        "unlogged",
        "CREATE SCHEMA s; CREATE TABLE s.t (id int PRIMARY KEY, v text); INSERT INTO s.t VALUES (1, 'a')",
    )
    .await;
    client.batch_execute("SET search_path = s").await.unwrap();
    let read = "SELECT v FROM t WHERE id = 1";
    let hits = proxy.hits();
    for _ in 0..3 {
        assert_eq!(rows(&client, read).await, [[Some("a".into())]]);
    }
    assert!(proxy.hits() > hits, "cached while logged");
    // Directly, PostgreSQL refuses: the table is in pgcache's publication.
    let refused = direct.batch_execute("ALTER TABLE s.t SET UNLOGGED").await;
    let refused = refused.expect_err("a published table cannot be unlogged");
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE)
    );
    client
        .batch_execute("ALTER TABLE t SET UNLOGGED")
        .await
        .expect("SET UNLOGGED through pgcache");
    // Unlogged: replication cannot see its writes, so it is never served.
    let bypassed = proxy.app.metrics.bypasses(BypassReason::NotPublished);
    let hits = proxy.hits();
    for v in ["b", "c"] {
        direct
            .execute("UPDATE s.t SET v = $1 WHERE id = 1", &[&v])
            .await
            .unwrap();
        assert_eq!(rows(&client, read).await, [[Some(v.into())]]);
    }
    // Once pgcache knows the table again, its reads say why they bypass.
    eventually(
        Duration::from_secs(10),
        "a not_published bypass",
        || async {
            rows(&client, read).await;
            let said = proxy.app.metrics.bypasses(BypassReason::NotPublished) > bypassed;
            said.then_some(())
        },
    )
    .await;
    assert_eq!(proxy.hits(), hits, "nothing served while unlogged");
    // SET LOGGED puts it back in the publication, and in the cache.
    client
        .batch_execute("ALTER TABLE t SET LOGGED")
        .await
        .unwrap();
    eventually(Duration::from_secs(20), "hits again", || async {
        let before = proxy.hits();
        let fresh = rows(&client, read).await == [[Some("c".into())]];
        (fresh && proxy.hits() > before).then_some(())
    })
    .await;
}

/// Sends `frames` and reads the answer up to ReadyForQuery.
async fn exchange(s: &mut tokio::net::TcpStream, frames: &[Vec<u8>]) -> Vec<(u8, Vec<u8>)> {
    s.write_all(&frames.concat()).await.unwrap();
    read_until_ready(s).await
}

/// A database made by `sql`, pgcache streaming it, and two raw sessions
/// on it: through pgcache and straight to PostgreSQL.
async fn raw_pair(name: &str, sql: &str) -> (Proxy, tokio::net::TcpStream, tokio::net::TcpStream) {
    let (db, proxy, _client, _direct) = setup_streaming(name, sql).await;
    let direct_addr: std::net::SocketAddr = format!("127.0.0.1:{}", pg().port).parse().unwrap();
    let (via, _) = raw_login(proxy.addr, &db).await;
    let (direct, _) = raw_login(direct_addr, &db).await;
    (proxy, via, direct)
}

#[tokio::test]
async fn row_limited_executes_are_answered_as_postgresql_answers_them_and_cached() {
    let (proxy, mut via, mut direct) = raw_pair(
        "rowlimit",
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2), (3)",
    )
    .await;
    let one = "SELECT id FROM t WHERE id = 1";
    let all = "SELECT id FROM t ORDER BY id";
    // (statement, row limit, whether pgcache can answer it from the cache):
    // asyncpg's fetchrow is Execute(1). A result is stored once an Execute
    // completed within its limit; any limit is answered from a whole one.
    let steps = [
        (one, 1, false),
        (one, 1, true),
        (all, 1, false),
        (all, 1, false), // suspended at the limit: never whole
        (all, 3, false), // three rows: whole, stored, shown suspended
        (all, 1, true),
        (all, 2, true),
        (all, 3, true),
        (all, 4, true),
        (all, 0, true),
    ];
    for (i, (sql, limit, hit)) in steps.into_iter().enumerate() {
        let frames = [
            parse("", sql),
            bind(""),
            describe_statement(""),
            execute_limited(limit),
            sync(),
        ];
        // Only what the cache sees change decides: the first Parse of a
        // text goes out whatever happens.
        let hits = proxy.hits();
        let through = exchange(&mut via, &frames).await;
        let want = exchange(&mut direct, &frames).await;
        assert_eq!(
            through,
            want,
            "step {i}: {sql} limit {limit}: {} vs {}",
            tags(&through),
            tags(&want)
        );
        assert_eq!(proxy.hits() > hits, hit, "step {i}: {sql} limit {limit}");
    }
}

#[tokio::test]
async fn a_jdbc_style_fetch_size_cursor_in_a_transaction_reads_every_row() {
    let (_proxy, mut via, mut direct) = raw_pair(
        "fetchsize",
        "CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t SELECT generate_series(1, 5)",
    )
    .await;
    let portal_bind = frame(
        b'B',
        &[cstr("C_1"), cstr("S_1"), vec![0, 0, 0, 0, 0, 0]].concat(),
    );
    let portal_execute =
        |rows: u32| frame(b'E', &[cstr("C_1"), rows.to_be_bytes().to_vec()].concat());
    let script: Vec<Vec<Vec<u8>>> = vec![
        vec![query("BEGIN")],
        vec![
            parse("S_1", "SELECT id FROM t ORDER BY id"),
            portal_bind,
            portal_execute(2),
            sync(),
        ],
        vec![portal_execute(2), sync()],
        vec![portal_execute(2), sync()],
        vec![query("COMMIT")],
    ];
    for round in 0..2 {
        for (i, frames) in script.iter().enumerate() {
            let through = exchange(&mut via, frames).await;
            let want = exchange(&mut direct, frames).await;
            assert_eq!(
                through,
                want,
                "round {round}, step {i}: {} vs {}",
                tags(&through),
                tags(&want)
            );
        }
        exchange(
            &mut via,
            &[frame(b'C', &[b"S".to_vec(), cstr("S_1")].concat()), sync()],
        )
        .await;
        exchange(
            &mut direct,
            &[frame(b'C', &[b"S".to_vec(), cstr("S_1")].concat()), sync()],
        )
        .await;
    }
}

#[tokio::test]
async fn a_client_that_hangs_up_while_logging_in_is_closed_as_postgresql_closes_it() {
    let db = pg().create_db("hangup");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let direct_addr: std::net::SocketAddr = format!("127.0.0.1:{}", pg().port).parse().unwrap();
    let startup =
        pgcache::protocol::startup::encode_startup(&[("user", "postgres"), ("database", &db)]);
    let terminate = frame(b'X', &[]);
    // node-postgres ended while connecting writes Terminate first; other
    // clients write it right after their startup packet.
    for (name, bytes) in [
        (
            "startup, then Terminate",
            [startup.clone(), terminate.clone()].concat(),
        ),
        (
            "Terminate, then startup",
            [terminate.clone(), startup.clone()].concat(),
        ),
    ] {
        let mut seen = Vec::new();
        for addr in [proxy.addr, direct_addr] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&bytes).await.unwrap();
            let mut messages = Vec::new();
            while let Some((tag, _)) = read_message(&mut s).await {
                messages.push(tag);
            }
            assert!(!messages.contains(&b'E'), "{name}, {addr}: an error");
            seen.push(messages.last().copied());
        }
        assert_eq!(
            seen[0], seen[1],
            "{name}: the last message, through pgcache and direct"
        );
    }
}

#[tokio::test]
async fn a_login_like_an_earlier_one_takes_its_settings_until_a_database_setting_changes() {
    let db = pg().create_db("logins");
    let direct = pg().direct(&db).await;
    direct
        .batch_execute(
            "CREATE SCHEMA other;
             CREATE TABLE t (id int PRIMARY KEY, v text);
             CREATE TABLE other.t (id int PRIMARY KEY, v text);
             INSERT INTO t VALUES (1, 'public');
             INSERT INTO other.t VALUES (1, 'other')",
        )
        .await
        .unwrap();
    let proxy = Proxy::start(pg().proxy_config()).await;
    let read = "SELECT v FROM t WHERE id = 1";
    let reused = || proxy.app.metrics.settings_reused.get();
    {
        let first = proxy.connect(&db).await;
        eventually(Duration::from_secs(20), "a hit", || async {
            let hits = proxy.hits();
            assert_eq!(scalar(&first, read).await.as_deref(), Some("public"));
            (proxy.hits() > hits).then_some(())
        })
        .await;
    }
    assert_eq!(reused(), 0, "the first login reads everything");
    // Logged in alike: the probe matches, and the kept settings key a hit.
    let second = proxy.connect(&db).await;
    let hits = proxy.hits();
    assert_eq!(scalar(&second, read).await.as_deref(), Some("public"));
    assert_eq!(reused(), 1);
    assert_eq!(proxy.hits(), hits + 1, "the same key as the first login's");
    // A database setting changes what a fresh login starts with: the probe
    // shows it, everything is read again, and the read finds other.t.
    direct
        .batch_execute(&format!("ALTER DATABASE \"{db}\" SET search_path = other"))
        .await
        .unwrap();
    let third = proxy.connect(&db).await;
    assert_eq!(scalar(&third, read).await.as_deref(), Some("other"));
    assert_eq!(reused(), 1, "not taken: the database's settings changed");
    // What the third read is kept for the next login alike.
    let fourth = proxy.connect(&db).await;
    assert_eq!(scalar(&fourth, read).await.as_deref(), Some("other"));
    assert_eq!(reused(), 2);
    // The second session, logged in before the change, keeps its own.
    assert_eq!(scalar(&second, read).await.as_deref(), Some("public"));
}
