//! pgcache as a transparent proxy: every protocol feature a client uses works
//! through it exactly as it does directly against PostgreSQL.

mod common;

use std::time::{Duration, Instant};

use common::wire::{read_message, read_until_ready, sqlstate_of};
use common::*;
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, SimpleQueryMessage};

/// Connects and forwards notices and notifications to a channel.
type Messages = tokio::sync::mpsc::UnboundedReceiver<Result<AsyncMessage, tokio_postgres::Error>>;

async fn connect_with_messages(dsn: &str) -> (tokio_postgres::Client, Messages) {
    let (client, mut conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(msg) = stream.next().await {
            let failed = msg.is_err();
            let _ = tx.send(msg);
            if failed {
                break;
            }
        }
    });
    (client, rx)
}

#[tokio::test]
async fn simple_protocol_multi_statement_query_returns_every_result() {
    let db = pg().create_db("simple");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let msgs = client
        .simple_query("CREATE TABLE t(a int, b text); INSERT INTO t VALUES (1,'x'),(2,NULL); SELECT a, b FROM t ORDER BY a; SELECT 'ok'")
        .await
        .unwrap();
    let rows: Vec<(Option<String>, Option<String>)> = msgs
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some((
                r.get(0).map(str::to_owned),
                r.try_get(1).ok().flatten().map(str::to_owned),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (Some("1".into()), Some("x".into())),
            (Some("2".into()), None),
            (Some("ok".into()), None)
        ]
    );
    let completions = msgs
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::CommandComplete(_)))
        .count();
    assert_eq!(completions, 4);
}

#[tokio::test]
async fn errors_keep_their_sqlstate_and_the_session_goes_on() {
    let db = pg().create_db("errors");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let err = client.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::DIVISION_BY_ZERO));
    let err = client
        .query("SELECT * FROM no_such_table", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::UNDEFINED_TABLE));
    // Errors inside a transaction block leave it failed, then ROLLBACK recovers.
    client.batch_execute("BEGIN").await.unwrap();
    assert!(client.batch_execute("SELECT 1/0").await.is_err());
    let err = client.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::IN_FAILED_SQL_TRANSACTION));
    client.batch_execute("ROLLBACK").await.unwrap();
    let row = client.query_one("SELECT 41 + 1", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
}

#[tokio::test]
async fn notices_are_relayed() {
    let db = pg().create_db("notices");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let (client, mut rx) = connect_with_messages(&proxy.dsn("postgres", &db)).await;
    client
        .batch_execute("DO $$ BEGIN RAISE NOTICE 'hello from %', 'plpgsql'; END $$")
        .await
        .unwrap();
    match rx.recv().await {
        Some(Ok(AsyncMessage::Notice(n))) => {
            assert_eq!(n.message(), "hello from plpgsql");
            assert_eq!(n.severity(), "NOTICE");
        }
        other => panic!("expected a notice, got {other:?}"),
    }
}

#[tokio::test]
async fn extended_protocol_named_statements_binary_formats_and_nulls() {
    let db = pg().create_db("extended");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    client
        .batch_execute("CREATE TABLE items(id int PRIMARY KEY, name text, data bytea, price numeric, at timestamptz)")
        .await
        .unwrap();
    let insert = client
        .prepare("INSERT INTO items VALUES ($1, $2, $3, $4::text::numeric, now())")
        .await
        .unwrap();
    for i in 0..20i32 {
        let name = (i % 3 != 0).then(|| format!("item-{i}"));
        let data: Vec<u8> = (0..=255u8).cycle().take(i as usize * 100).collect();
        client
            .execute(&insert, &[&i, &name, &data, &format!("{i}.50")])
            .await
            .unwrap();
    }
    // tokio-postgres asks for binary results; the statement is reused with new parameters.
    let select = client
        .prepare("SELECT id, name, data, price::text FROM items WHERE id = $1")
        .await
        .unwrap();
    for i in [0i32, 7, 19] {
        let row = client.query_one(&select, &[&i]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), i);
        assert_eq!(
            row.get::<_, Option<String>>(1),
            (i % 3 != 0).then(|| format!("item-{i}"))
        );
        assert_eq!(row.get::<_, Vec<u8>>(2).len(), i as usize * 100);
        assert_eq!(row.get::<_, String>(3), format!("{i}.50"));
    }
    assert!(
        client
            .query_opt(&select, &[&1000i32])
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn pipelined_queries_on_one_connection_all_answer_in_order() {
    let db = pg().create_db("pipeline");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let stmt = client.prepare("SELECT $1::int * 2").await.unwrap();
    // tokio-postgres pipelines requests that are in flight together.
    let futures = (0..200i32).map(|i| {
        let client = &client;
        let stmt = &stmt;
        async move {
            client
                .query_one(stmt, &[&i])
                .await
                .map(|r| r.get::<_, i32>(0))
        }
    });
    let results = futures_util::future::try_join_all(futures).await.unwrap();
    assert_eq!(results, (0..200).map(|i| i * 2).collect::<Vec<_>>());
}

#[tokio::test]
async fn partial_execute_with_a_row_limit_resumes_the_portal() {
    let db = pg().create_db("portal");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let mut client = proxy.connect(&db).await;
    let tx = client.transaction().await.unwrap();
    let stmt = tx.prepare("SELECT generate_series(1, 10)").await.unwrap();
    let portal = tx.bind(&stmt, &[]).await.unwrap();
    let mut seen = Vec::new();
    loop {
        let rows = tx.query_portal(&portal, 3).await.unwrap();
        if rows.is_empty() {
            break;
        }
        assert!(rows.len() <= 3);
        seen.extend(rows.iter().map(|r| r.get::<_, i32>(0)));
    }
    assert_eq!(seen, (1..=10).collect::<Vec<_>>());
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn copy_from_stdin_and_to_stdout() {
    let db = pg().create_db("copy");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    client
        .batch_execute("CREATE TABLE c(a int, b text)")
        .await
        .unwrap();
    let sink = client.copy_in("COPY c FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    let mut data = String::new();
    for i in 0..50_000 {
        data.push_str(&format!("{i}\trow {i}\n"));
    }
    sink.send(bytes::Bytes::from(data.clone())).await.unwrap();
    let copied = sink.finish().await.unwrap();
    assert_eq!(copied, 50_000);
    let out = client
        .copy_out("COPY (SELECT * FROM c ORDER BY a) TO STDOUT")
        .await
        .unwrap();
    let chunks: Vec<bytes::Bytes> = out.try_collect().await.unwrap();
    let text: Vec<u8> = chunks.concat();
    assert_eq!(String::from_utf8(text).unwrap(), data);
    // A COPY that fails midway reports its error and the session continues.
    let sink = client.copy_in("COPY c FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    sink.send(bytes::Bytes::from_static(b"not-a-number\tx\n"))
        .await
        .unwrap();
    let err = sink.finish().await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INVALID_TEXT_REPRESENTATION));
    assert_eq!(
        client
            .query_one("SELECT count(*) FROM c", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        50_000
    );
}

#[tokio::test]
async fn notify_reaches_an_idle_listener() {
    let db = pg().create_db("notify");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let (listener, mut rx) = connect_with_messages(&proxy.dsn("postgres", &db)).await;
    listener.batch_execute("LISTEN jobs").await.unwrap();
    // The notifying session goes straight to PostgreSQL: the listener is idle
    // and only its connection to pgcache can deliver the message.
    let direct = pg().direct(&db).await;
    direct
        .batch_execute("NOTIFY jobs, 'payload-1'")
        .await
        .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("notification in time");
    match msg {
        Some(Ok(AsyncMessage::Notification(n))) => {
            assert_eq!(n.channel(), "jobs");
            assert_eq!(n.payload(), "payload-1");
        }
        other => panic!("expected a notification, got {other:?}"),
    }
}

#[tokio::test]
async fn cancel_request_stops_pg_sleep_within_a_second() {
    let db = pg().create_db("cancel");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let token = client.cancel_token();
    let started = Instant::now();
    let sleeper = tokio::spawn(async move { client.simple_query("SELECT pg_sleep(30)").await });
    // Wait until the backend is really sleeping before cancelling.
    let direct = pg().direct(&db).await;
    eventually(Duration::from_secs(10), "pg_sleep to start", || async {
        let n: i64 = direct
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'", &[])
            .await
            .unwrap()
            .get(0);
        (n == 1).then_some(())
    })
    .await;
    let cancelled_at = Instant::now();
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let err = sleeper.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::QUERY_CANCELED));
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(1),
        "cancel took {:?}",
        cancelled_at.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(29));
}

#[tokio::test]
async fn a_cancel_key_guessed_wrong_cancels_nothing() {
    let db = pg().create_db("cancelwrong");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    // Send a CancelRequest with a made-up key to pgcache.
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&pgcache::protocol::startup::encode_cancel(
        12345,
        &[1, 2, 3, 4],
    ))
    .await
    .unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(
        s.read(&mut buf).await.unwrap(),
        0,
        "pgcache closes a cancel connection without a reply"
    );
    let row = client
        .query_one("SELECT pg_sleep(0.2)::text", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "");
}

#[tokio::test]
async fn md5_and_scram_authentication_are_relayed() {
    let db = pg().create_db("auth");
    let proxy = Proxy::start(pg().proxy_config()).await;
    for (user, password) in [(MD5_USER, MD5_PASSWORD), (SCRAM_USER, SCRAM_PASSWORD)] {
        let dsn = format!("{} password={password}", proxy.dsn(user, &db));
        let client = connect_dsn(&dsn)
            .await
            .unwrap_or_else(|e| panic!("{user}: {e}"));
        let row = client
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), user);
        let wrong = format!("{} password=wrong", proxy.dsn(user, &db));
        let err = connect_dsn(&wrong).await.unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PASSWORD),
            "{user}: {err}"
        );
    }
}

#[tokio::test]
async fn unreachable_backend_gives_08006_and_pgcache_keeps_serving() {
    let mut config = pg().proxy_config();
    let (_reserved, port) = refused_port();
    config.upstream.url = format!("postgres://127.0.0.1:{port}");
    let proxy = Proxy::start(config).await;
    for _ in 0..3 {
        let err = connect_dsn(&proxy.dsn("postgres", "postgres"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::CONNECTION_FAILURE), "{err}");
        let message = err.as_db_error().unwrap().message();
        assert!(
            message.contains("could not connect to upstream"),
            "{message}"
        );
    }
}

/// Opens a raw connection, completes a trust login, returns the socket.
async fn raw_login(proxy: &Proxy, db: &str) -> TcpStream {
    wire::raw_login(proxy.addr, db).await.0
}

#[tokio::test]
async fn malformed_and_oversized_frames_get_08p01_and_only_that_client_is_closed() {
    let db = pg().create_db("malformed");
    let mut config = pg().proxy_config();
    config.server.max_message_bytes = 64 * 1024;
    let proxy = Proxy::start(config).await;
    let bystander = proxy.connect(&db).await;

    // Length field below 4.
    let mut s = raw_login(&proxy, &db).await;
    s.write_all(&[b'Q', 0, 0, 0, 2]).await.unwrap();
    let (tag, body) = read_message(&mut s).await.expect("an error response");
    assert_eq!(tag, b'E');
    assert_eq!(sqlstate_of(&body).as_deref(), Some("08P01"));
    assert!(
        read_message(&mut s).await.is_none(),
        "connection closed after the error"
    );

    // Oversized: refused from the header, before the body is sent.
    let mut s = raw_login(&proxy, &db).await;
    s.write_all(&[b'Q', 0, 0x10, 0, 0]).await.unwrap();
    let (tag, body) = read_message(&mut s).await.expect("an error response");
    assert_eq!(tag, b'E');
    assert_eq!(sqlstate_of(&body).as_deref(), Some("08P01"));
    assert!(String::from_utf8_lossy(&body).contains("over the limit"));

    // Garbage instead of a startup packet, or node-postgres's Terminate
    // before its startup packet (a client ended while connecting): closed
    // without a word, as PostgreSQL closes it.
    let direct_addr = format!("127.0.0.1:{}", pg().port);
    for garbage in [
        &[0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4][..],
        b"X\0\0\0\x04\0\0\0\x08",
    ] {
        for addr in [proxy.addr.to_string(), direct_addr.clone()] {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            s.write_all(garbage).await.unwrap();
            assert_eq!(read_message(&mut s).await, None, "{addr}: {garbage:?}");
        }
    }

    // A startup packet with a parameter but no value.
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let mut pkt = Vec::new();
    pkt.extend_from_slice(&14u32.to_be_bytes());
    pkt.extend_from_slice(&196_608u32.to_be_bytes());
    pkt.extend_from_slice(b"user\0\0");
    s.write_all(&pkt).await.unwrap();
    let (tag, _) = read_message(&mut s).await.expect("an error response");
    assert_eq!(tag, b'E');

    let row = bystander
        .query_one("SELECT 'still here'", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, &str>(0), "still here");
}

#[tokio::test]
async fn large_messages_under_the_limit_pass_intact() {
    let db = pg().create_db("large");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let big: Vec<u8> = (0..8 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    let row = client
        .query_one(
            "SELECT md5($1::bytea), length($1::bytea), $1::bytea",
            &[&big],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(1), big.len() as i32);
    assert_eq!(row.get::<_, Vec<u8>>(2), big);
    let huge_text = "x".repeat(3 * 1024 * 1024);
    let rows = client
        .simple_query(&format!("SELECT length('{huge_text}')"))
        .await
        .unwrap();
    let SimpleQueryMessage::Row(r) = &rows[1] else {
        panic!("{rows:?}")
    };
    assert_eq!(r.get(0), Some("3145728"));
}

#[tokio::test]
async fn startup_timeout_closes_silent_connections() {
    let mut config = pg().proxy_config();
    config.server.startup_timeout_ms = 300;
    let proxy = Proxy::start(config).await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&[0, 0]).await.unwrap(); // half a length word, then nothing
    let started = Instant::now();
    let (tag, body) = tokio::time::timeout(Duration::from_secs(5), read_message(&mut s))
        .await
        .expect("closed in time")
        .expect("an error before closing");
    assert_eq!(tag, b'E');
    assert_eq!(sqlstate_of(&body).as_deref(), Some("08000"));
    assert!(started.elapsed() >= Duration::from_millis(250));
}

#[tokio::test]
async fn backend_terminated_mid_query_gives_an_error_not_a_hang() {
    let db = pg().create_db("terminated");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let query =
        tokio::spawn(async move { client.simple_query("SELECT pg_sleep(60)").await.map(|_| ()) });
    let direct = pg().direct(&db).await;
    eventually(Duration::from_secs(10), "the query to start", || async {
        let active: bool = direct
            .query_one(
                "SELECT count(*) = 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active'",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        active.then_some(())
    })
    .await;
    direct
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("no hang")
        .unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::ADMIN_SHUTDOWN), "{err}");
}

#[tokio::test]
async fn client_disconnect_mid_result_frees_the_backend() {
    let db = pg().create_db("disconnect");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(&pgcache::protocol::startup::encode_startup(&[
        ("user", "postgres"),
        ("database", &db),
        ("application_name", "leaver"),
    ]))
    .await
    .unwrap();
    read_until_ready(&mut s).await;
    let sql = b"SELECT g, repeat('x', 100) FROM generate_series(1, 50000000) g\0";
    let mut q = vec![b'Q'];
    q.extend_from_slice(&((sql.len() + 4) as u32).to_be_bytes());
    q.extend_from_slice(sql);
    s.write_all(&q).await.unwrap();
    // Read a little of the result, then vanish.
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0;
    while got < 256 * 1024 {
        got += s.read(&mut buf).await.unwrap();
    }
    drop(s);
    let direct = pg().direct(&db).await;
    eventually(
        Duration::from_secs(10),
        "the backend to go away",
        || async {
            let n: i64 = direct
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'leaver'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (n == 0).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn connections_over_the_limit_get_53300() {
    let db = pg().create_db("limit");
    let mut config = pg().proxy_config();
    config.server.max_client_connections = 2;
    let proxy = Proxy::start(config).await;
    let a = proxy.connect(&db).await;
    let b = proxy.connect(&db).await;
    let err = connect_dsn(&proxy.dsn("postgres", &db)).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::TOO_MANY_CONNECTIONS), "{err}");
    a.query_one("SELECT 1", &[]).await.unwrap();
    drop(b);
    // The slot is given back once the session ends.
    let c = eventually(Duration::from_secs(10), "a free slot", || async {
        connect_dsn(&proxy.dsn("postgres", &db)).await.ok()
    })
    .await;
    c.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_lets_open_transactions_finish() {
    let db = pg().create_db("shutdown");
    pg().psql_db(&db, "CREATE TABLE s(a int)");
    let mut config = pg().proxy_config();
    config.server.shutdown_timeout_secs = 30;
    let mut proxy = Proxy::start(config).await;
    let (idle, mut idle_rx) = connect_with_messages(&proxy.dsn("postgres", &db)).await;
    let busy = proxy.connect(&db).await;
    busy.batch_execute("BEGIN; INSERT INTO s VALUES (1)")
        .await
        .unwrap();
    // Simple protocol only: a dropped prepared statement would queue a Close
    // whose response slot would swallow the shutdown error in tokio-postgres.
    idle.simple_query("SELECT 1").await.unwrap();

    let stopped = proxy.begin_shutdown();
    // The idle session is told why it is closed.
    let msg = tokio::time::timeout(Duration::from_secs(10), idle_rx.recv())
        .await
        .unwrap();
    match msg {
        Some(Err(e)) => assert_eq!(e.code(), Some(&SqlState::ADMIN_SHUTDOWN), "{e}"),
        other => panic!("expected a 57P01 error, got {other:?}"),
    }
    eventually(
        Duration::from_secs(10),
        "the idle session to close",
        || async { idle.is_closed().then_some(()) },
    )
    .await;
    // No new connections.
    eventually(Duration::from_secs(10), "the listener to close", || async {
        TcpStream::connect(proxy.addr).await.is_err().then_some(())
    })
    .await;
    // The open transaction can still commit, then its session closes too.
    busy.batch_execute("INSERT INTO s VALUES (2); COMMIT")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("pgcache stops")
        .unwrap();
    assert_eq!(pg().psql_db(&db, "SELECT count(*) FROM s").trim(), "2");
}

#[tokio::test]
async fn shutdown_timeout_closes_sessions_that_never_finish() {
    let db = pg().create_db("shutdownforce");
    let mut config = pg().proxy_config();
    config.server.shutdown_timeout_secs = 1;
    let mut proxy = Proxy::start(config).await;
    let busy = proxy.connect(&db).await;
    busy.batch_execute("BEGIN").await.unwrap();
    let started = Instant::now();
    let stopped = proxy.begin_shutdown();
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("pgcache stops")
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(busy.query_one("SELECT 1", &[]).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hundred_and_twenty_concurrent_sessions() {
    let db = pg().create_db("many");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let dsn = proxy.dsn("postgres", &db);
    let tasks: Vec<_> = (0..120i32)
        .map(|i| {
            let dsn = dsn.clone();
            tokio::spawn(async move {
                let client = connect_dsn(&dsn).await.unwrap();
                let mut sum = 0i64;
                for j in 0..20i32 {
                    let row = client
                        .query_one("SELECT $1::int + $2::int", &[&i, &j])
                        .await
                        .unwrap();
                    sum += i64::from(row.get::<_, i32>(0));
                }
                sum
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let i = i as i64;
        assert_eq!(t.await.unwrap(), 20 * i + (0..20).sum::<i64>());
    }
}

#[tokio::test]
async fn parameter_status_changes_reach_the_client() {
    let db = pg().create_db("params");
    let proxy = Proxy::start(pg().proxy_config()).await;
    let client = proxy.connect(&db).await;
    client
        .batch_execute("SET TimeZone = 'Asia/Tokyo'")
        .await
        .unwrap();
    let row = client
        .query_one("SELECT '2024-01-01 00:00:00+00'::timestamptz::text", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "2024-01-01 09:00:00+09");
}

/// Sends a CancelRequest for `key` (BackendKeyData's body) to `addr` and
/// waits for the connection to close, as libpq and asyncpg do before they
/// send their next statement.
async fn cancel_and_wait(addr: std::net::SocketAddr, key: &[u8]) {
    let pid = u32::from_be_bytes(key[..4].try_into().unwrap());
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&pgcache::protocol::startup::encode_cancel(pid, &key[4..]))
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0))), "the cancel connection closes");
}

/// A cancel that reaches an idle backend cancels nothing, and the client's
/// next statement, sent as soon as the cancel's connection closed, is not
/// the one cancelled: pgcache closes that connection only once PostgreSQL
/// has signalled the backend (and closed its own).
#[tokio::test]
async fn a_cancel_lands_before_the_next_statement_in_both_modes() {
    let db = pg().create_db("cancel_order");
    for mode in [
        pgcache::config::PoolMode::Session,
        pgcache::config::PoolMode::Transaction,
    ] {
        let mut config = pg().proxy_config();
        config.pool.mode = mode;
        // The cancel reaches PostgreSQL late, as on a loaded machine.
        let late = Faults {
            cancel_delay: Duration::from_millis(100),
            ..Faults::default()
        };
        let port = relay(pg().port, late).await;
        config.upstream.url = format!("postgres://postgres@127.0.0.1:{port}");
        let proxy = Proxy::start(config).await;
        let (mut s, login) = wire::raw_login(proxy.addr, &db).await;
        let key = login
            .iter()
            .find(|(tag, _)| *tag == b'K')
            .map(|(_, body)| body.clone())
            .expect("BackendKeyData");
        // A transaction holds a pooled connection, for the key to reach.
        s.write_all(&wire::query("BEGIN")).await.unwrap();
        wire::read_until_ready(&mut s).await;
        for round in 0..10 {
            cancel_and_wait(proxy.addr, &key).await;
            s.write_all(&wire::query("SELECT pg_sleep(0.1)"))
                .await
                .unwrap();
            let answer = wire::read_until_ready(&mut s).await;
            let error = answer
                .iter()
                .find(|(tag, _)| *tag == b'E')
                .and_then(|(_, body)| wire::sqlstate_of(body));
            assert_eq!(
                error, None,
                "{mode:?}, round {round}: the next statement was cancelled"
            );
        }
    }
}
