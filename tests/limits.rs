//! Hostile and careless clients: half-open startups (slowloris) and idle
//! sessions never exhaust pgcache, and other clients go on being served.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Waits for the server to answer or close `s`; returns what it sent.
async fn server_reply(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 1024];
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return None,
        }
    }
}

fn sqlstate(reply: &[u8]) -> Option<String> {
    let body = reply.get(5..)?;
    let at = body.windows(2).position(|w| w[0] == 0 && w[1] == b'C')? + 2;
    let end = body[at..].iter().position(|b| *b == 0)?;
    Some(String::from_utf8_lossy(&body[at..at + end]).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_startups_cannot_exhaust_pgcache() {
    let db = pg().create_db("slowloris");
    let mut config = pg().proxy_config();
    config.server.startup_timeout_ms = 1500;
    config.server.max_startups_per_ip = 20;
    config.server.max_client_connections = 5;
    let proxy = Proxy::start(config).await;

    // 100 sockets from 127.0.0.1, each sending three bytes of a startup packet.
    let mut sockets = Vec::new();
    for _ in 0..100 {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(&[0, 0, 0]).await.unwrap();
        sockets.push(s);
    }
    // All at once, well within the startup timeout.
    let replies = futures_util::future::join_all(sockets.into_iter().map(|mut s| async move {
        let reply = server_reply(&mut s, Duration::from_millis(300)).await;
        (s, reply)
    }))
    .await;
    let (mut held, mut refused) = (Vec::new(), 0);
    for (s, reply) in replies {
        match reply {
            Some(reply) => {
                assert_eq!(sqlstate(&reply).as_deref(), Some("53300"), "{reply:?}");
                refused += 1;
            }
            None => held.push(s),
        }
    }
    assert_eq!(held.len(), 20, "at most max_startups_per_ip are held");
    assert_eq!(refused, 80);

    // A client from another address is served meanwhile; the half-open
    // sockets hold no place under max_client_connections.
    let mut clients = Vec::new();
    for _ in 0..5 {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let stream = socket.connect(proxy.addr).await.unwrap();
        let mut pgconfig: tokio_postgres::Config = proxy.dsn("postgres", &db).parse().unwrap();
        pgconfig.connect_timeout(Duration::from_secs(10));
        let (client, conn) = pgconfig
            .connect_raw(stream, tokio_postgres::NoTls)
            .await
            .expect("a client from another address logs in");
        tokio::spawn(conn);
        assert_eq!(scalar(&client, "SELECT 1").await.as_deref(), Some("1"));
        clients.push(client);
    }

    // The held ones are closed when startup_timeout_ms runs out.
    for mut s in held {
        let reply = server_reply(&mut s, Duration::from_secs(10))
            .await
            .expect("closed after the startup timeout");
        assert_eq!(sqlstate(&reply).as_deref(), Some("08000"), "{reply:?}");
    }
    // And the address may start connections again.
    drop(clients);
    eventually(
        Duration::from_secs(10),
        "a place for a new client",
        || async {
            let c = connect_dsn(&proxy.dsn("postgres", &db)).await.ok()?;
            scalar(&c, "SELECT 2").await
        },
    )
    .await;
}

/// Connects and returns the client and the error its connection ends with.
async fn connect_watching(
    dsn: &str,
) -> (
    tokio_postgres::Client,
    tokio::task::JoinHandle<Option<String>>,
) {
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let ended = tokio::spawn(async move {
        conn.await
            .err()
            .and_then(|e| e.as_db_error().map(|d| d.code().code().to_owned()))
    });
    (client, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_closed_with_postgresqls_sqlstates() {
    let db = pg().create_db("idle_timeouts");
    pg().psql_db(&db, "CREATE TABLE t(id int PRIMARY KEY)");
    let mut config = pg().proxy_config();
    config.server.client_idle_timeout_secs = 1;
    config.server.idle_in_transaction_timeout_secs = 1;
    let proxy = Proxy::start(config).await;
    let dsn = proxy.dsn("postgres", &db);

    // Busy is not idle: a query longer than the timeout completes.
    let (busy, _) = connect_watching(&dsn).await;
    busy.simple_query("SELECT pg_sleep(1.5)").await.unwrap();

    let (idle, idle_end) = connect_watching(&dsn).await;
    scalar(&idle, "SELECT 1").await;
    let (in_tx, in_tx_end) = connect_watching(&dsn).await;
    in_tx
        .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    assert_eq!(idle_end.await.unwrap().as_deref(), Some("57P05"));
    assert_eq!(in_tx_end.await.unwrap().as_deref(), Some("25P03"));
    assert!(idle.is_closed() && in_tx.is_closed());
    // The open transaction was rolled back.
    let check = pg().direct(&db).await;
    assert_eq!(
        scalar(&check, "SELECT count(*) FROM t").await.as_deref(),
        Some("0")
    );
}
