//! The session's protocol rules against a scripted backend: a task in the
//! test plays PostgreSQL frame by frame, and a raw client sends exactly the
//! frames a driver would. What the client reads is compared frame by frame,
//! and a shutdown proves the session's books balanced: an idle session is
//! closed at once ("due to pgcache shutdown"), a session that still thinks
//! a request is in flight only when the shutdown timeout expires.
//!
//! Real PostgreSQL answers these sequences too (tests/passthrough.rs); the
//! script makes the backend's side of each exchange exact and repeatable.

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::Proxy;
use common::wire::*;
use pgcache::Config;
use pgcache::protocol::codec::{HEADER_LEN, parse_frame};
use pgcache::protocol::messages::error_field;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Reads whole frames until one with `tag` (inclusive; 0: any one);
/// returns their tags and the last frame's body.
async fn read_until(stream: &mut TcpStream, buf: &mut BytesMut, tag: u8) -> (Vec<u8>, Vec<u8>) {
    let mut tags = Vec::new();
    loop {
        while let Some(len) = parse_frame(buf, 1 << 20).unwrap() {
            let f = buf.split_to(len);
            tags.push(f[0]);
            if f[0] == tag || tag == 0 {
                return (tags, f[HEADER_LEN..].to_vec());
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read_buf(buf))
            .await
            .unwrap_or_else(|_| panic!("no frame within 20 s; frames so far: {tags:?}"))
            .unwrap();
        assert!(n > 0, "connection closed; frames so far: {tags:?}");
    }
}

/// The scripted backend's side of one connection.
struct Backend {
    stream: TcpStream,
    buf: BytesMut,
}

impl Backend {
    /// Accepts pgcache's connection and logs it in (trust).
    async fn accept(listener: &TcpListener) -> Backend {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut buf = BytesMut::new();
        loop {
            while buf.len() < 4 {
                stream.read_buf(&mut buf).await.unwrap();
            }
            let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            while buf.len() < len {
                stream.read_buf(&mut buf).await.unwrap();
            }
            let packet = buf.split_to(len);
            if packet[4..8] == [4, 210, 22, 47] {
                stream.write_all(b"N").await.unwrap(); // SSLRequest
                continue;
            }
            break;
        }
        let mut hello = frame(b'R', &[0, 0, 0, 0]);
        hello.extend(frame(
            b'S',
            &[cstr("server_version"), cstr("15.0")].concat(),
        ));
        hello.extend(frame(b'K', &[0, 0, 0, 42, 1, 2, 3, 4]));
        hello.extend(ready(b'I'));
        stream.write_all(&hello).await.unwrap();
        Backend { stream, buf }
    }

    /// The next frame pgcache sends for its client. pgcache's own queries
    /// (catalog, settings) are refused the way PostgreSQL refuses a failing
    /// Parse, and skipped.
    async fn next(&mut self) -> (u8, Vec<u8>) {
        loop {
            let (tags, body) = read_until(&mut self.stream, &mut self.buf, 0).await;
            let tag = tags[0];
            // pgcache's own query: Close, Parse, Bind, Execute, Close,
            // Close, Sync under a name of its own; the Parse fails.
            if tag == b'C' && String::from_utf8_lossy(&body).contains("__pgcache_hidden") {
                let (rest, _) = read_until(&mut self.stream, &mut self.buf, b'S').await;
                assert_eq!(rest, b"PBECCS", "the hidden query's frames");
                let mut reply = frame(b'3', &[]);
                reply.extend(error("42501", "permission denied for pgcache's probe"));
                reply.extend(ready(b'I'));
                self.send(&reply).await;
                continue;
            }
            return (tag, body);
        }
    }

    /// The tags of the client's frames up to one with `tag`.
    async fn expect_until(&mut self, tag: u8) -> Vec<u8> {
        let mut tags = Vec::new();
        loop {
            let (t, _) = self.next().await;
            tags.push(t);
            if t == tag {
                return tags;
            }
        }
    }

    /// The client's next frame, which must be a Query: its text.
    async fn expect_client_query(&mut self) -> String {
        let (tag, body) = self.next().await;
        assert_eq!(tag, b'Q');
        String::from_utf8_lossy(&body[..body.len() - 1]).into_owned()
    }

    async fn send(&mut self, frames: &[u8]) {
        self.stream.write_all(frames).await.unwrap();
    }
}

/// pgcache (caching on, no replication) in front of a scripted backend,
/// and a raw client connected to it. A busy session is closed
/// `shutdown_secs` after a shutdown begins.
async fn start_with(shutdown_secs: u64) -> (Proxy, TcpListener, TcpStream, BytesMut) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = Config::default();
    config.upstream.url = format!(
        "host=127.0.0.1 port={} user=tester sslmode=disable",
        listener.local_addr().unwrap().port()
    );
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.metrics.listen = "127.0.0.1:0".parse().unwrap();
    config.server.shutdown_timeout_secs = shutdown_secs;
    config.replication.enabled = false;
    let proxy = Proxy::start(config).await;
    let client = TcpStream::connect(proxy.addr).await.unwrap();
    (proxy, listener, client, BytesMut::new())
}

async fn start() -> (Proxy, TcpListener, TcpStream, BytesMut) {
    start_with(15).await
}

async fn log_in(client: &mut TcpStream, buf: &mut BytesMut, listener: &TcpListener) -> Backend {
    let startup = pgcache::protocol::startup::encode_startup(&[("user", "tester")]);
    client.write_all(&startup).await.unwrap();
    let backend = Backend::accept(listener).await;
    let (tags, _) = read_until(client, buf, b'Z').await;
    assert_eq!(tags, b"RSKZ");
    backend
}

/// Shuts pgcache down and returns the message the client is closed with.
async fn closed_with(proxy: &mut Proxy, client: &mut TcpStream, buf: &mut BytesMut) -> String {
    let _stopped = proxy.begin_shutdown();
    let (_, body) = read_until(client, buf, b'E').await;
    assert_eq!(error_field(&body, b'C'), Some("57P01"));
    error_field(&body, b'M').unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_ignored_in_copy_in_mode_leaves_the_session_idle() {
    let (mut proxy, listener, mut client, mut buf) = start().await;
    let mut backend = log_in(&mut client, &mut buf, &listener).await;
    // tokio-postgres's COPY: Parse, Bind, Execute, Sync, then the data,
    // CopyDone and a second Sync. PostgreSQL ignores the first Sync.
    let mut copy = [parse("", "COPY t FROM STDIN"), bind(""), execute(), sync()].concat();
    copy.extend(frame(b'd', b"1\n"));
    copy.extend(frame(b'c', &[]));
    copy.extend(sync());
    client.write_all(&copy).await.unwrap();
    assert_eq!(backend.expect_until(b'S').await, b"PBES");
    let mut answer = frame(b'1', &[]);
    answer.extend(frame(b'2', &[]));
    answer.extend(frame(b'G', &[0, 0, 1, 0, 0]));
    backend.send(&answer).await;
    assert_eq!(backend.expect_until(b'S').await, b"dcS");
    backend
        .send(&[complete("COPY 1"), ready(b'I')].concat())
        .await;
    let (tags, _) = read_until(&mut client, &mut buf, b'Z').await;
    assert_eq!(tags, b"12GCZ", "one ReadyForQuery for the two Syncs");
    // Nothing is owed: the session is idle and closes at once.
    let message = closed_with(&mut proxy, &mut client, &mut buf).await;
    assert!(message.contains("due to pgcache shutdown"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_hidden_query_is_never_seen_and_pipelined_requests_keep_their_order() {
    let (mut proxy, listener, mut client, mut buf) = start().await;
    let mut backend = log_in(&mut client, &mut buf, &listener).await;
    // Two cacheable reads in one write: the first makes pgcache look up the
    // catalog (refused here), the second is pipelined behind it.
    client
        .write_all(&[query("SELECT 1"), query("SELECT 2")].concat())
        .await
        .unwrap();
    assert_eq!(backend.expect_client_query().await, "SELECT 1");
    assert_eq!(backend.expect_client_query().await, "SELECT 2");
    let row = |v: &str| {
        let mut f = frame(
            b'D',
            &[&[0, 1][..], &(v.len() as u32).to_be_bytes(), v.as_bytes()].concat(),
        );
        f.extend(complete("SELECT 1"));
        f.extend(ready(b'I'));
        f
    };
    backend.send(&[row("1"), row("2")].concat()).await;
    let (first, _) = read_until(&mut client, &mut buf, b'Z').await;
    let (second, _) = read_until(&mut client, &mut buf, b'Z').await;
    assert_eq!(
        (first.as_slice(), second.as_slice()),
        (&b"DCZ"[..], &b"DCZ"[..])
    );
    let message = closed_with(&mut proxy, &mut client, &mut buf).await;
    assert!(message.contains("due to pgcache shutdown"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_mid_batch_is_relayed_once_and_the_batch_ends_at_sync() {
    let (mut proxy, listener, mut client, mut buf) = start().await;
    let mut backend = log_in(&mut client, &mut buf, &listener).await;
    // A driver's pipeline: a write, then a statement that fails to parse,
    // then one PostgreSQL skips, all before one Sync.
    let batch = [
        parse("s1", "INSERT INTO t VALUES (1)"),
        bind("s1"),
        execute(),
        parse("s2", "SELEC broken"),
        bind("s2"),
        execute(),
        sync(),
    ]
    .concat();
    client.write_all(&batch).await.unwrap();
    assert_eq!(backend.expect_until(b'S').await, b"PBEPBES");
    let mut answer = [frame(b'1', &[]), frame(b'2', &[]), complete("INSERT 0 1")].concat();
    answer.extend(error("42601", "syntax error at or near \"SELEC\""));
    answer.extend(ready(b'I'));
    backend.send(&answer).await;
    let (tags, _) = read_until(&mut client, &mut buf, b'Z').await;
    assert_eq!(tags, b"12CEZ");
    // The session goes on: the next request is relayed and answered.
    client.write_all(&query("SET x.y = 1")).await.unwrap();
    assert_eq!(backend.expect_client_query().await, "SET x.y = 1");
    backend.send(&[complete("SET"), ready(b'I')].concat()).await;
    let (tags, _) = read_until(&mut client, &mut buf, b'Z').await;
    assert_eq!(tags, b"CZ");
    let message = closed_with(&mut proxy, &mut client, &mut buf).await;
    assert!(message.contains("due to pgcache shutdown"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_owes_an_answer_is_closed_only_at_the_shutdown_timeout() {
    let (mut proxy, listener, mut client, mut buf) = start_with(1).await;
    let mut backend = log_in(&mut client, &mut buf, &listener).await;
    client.write_all(&query("SET x.y = 1")).await.unwrap();
    // The query reached the backend, which never answers: the session is
    // busy, not idle.
    assert_eq!(backend.expect_client_query().await, "SET x.y = 1");
    let message = closed_with(&mut proxy, &mut client, &mut buf).await;
    assert!(message.contains("shutdown timeout reached"), "{message}");
}
