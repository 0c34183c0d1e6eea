//! A client that pipelines large rows hears of an error as soon as it
//! would directly: it has written at most a bounded number of bytes more
//! when the error reaches it (asyncpg's `executemany` stops writing then).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::wire::{cstr, frame, parse, query, raw_login, read_message, sync};
use common::{Proxy, pg};
use tokio::io::AsyncWriteExt;

const ROWS: usize = 2048;
const ROW_BYTES: usize = 32 * 1024;

/// Bind of `statement` with text parameters.
fn bind_values(statement: &str, values: &[&[u8]]) -> Vec<u8> {
    let mut body = [cstr(""), cstr(statement), vec![0, 0]].concat();
    body.extend_from_slice(&(values.len() as u16).to_be_bytes());
    for v in values {
        body.extend_from_slice(&(v.len() as i32).to_be_bytes());
        body.extend_from_slice(v);
    }
    body.extend_from_slice(&[0, 0]);
    frame(b'B', &body)
}

fn execute() -> Vec<u8> {
    frame(b'E', &[cstr(""), vec![0, 0, 0, 0]].concat())
}

/// Pipelines `ROWS` inserts of `ROW_BYTES` each, the second of which
/// violates the primary key, stopping once the error has arrived; returns
/// how many rows were written by then.
async fn rows_written_before_the_error(addr: std::net::SocketAddr, db: &str) -> usize {
    let (socket, _) = raw_login(addr, db).await;
    let (mut read, mut write) = socket.into_split();
    let failed = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn({
        let failed = Arc::clone(&failed);
        async move {
            while let Some((tag, _)) = read_message(&mut read).await {
                if tag == b'E' {
                    failed.store(true, Ordering::Release);
                }
                if tag == b'Z' {
                    return;
                }
            }
        }
    });
    write
        .write_all(&parse("ins", "INSERT INTO wide VALUES ($1, $2)"))
        .await
        .unwrap();
    let payload = vec![b'x'; ROW_BYTES];
    let mut written = 0;
    for i in 0..ROWS {
        if failed.load(Ordering::Acquire) {
            break;
        }
        // Rows 0 and 1 share a key.
        let key = i.saturating_sub(1).to_string();
        let mut msg = bind_values("ins", &[key.as_bytes(), &payload]);
        msg.extend_from_slice(&execute());
        write.write_all(&msg).await.unwrap();
        written += 1;
    }
    write.write_all(&sync()).await.unwrap();
    reader.await.unwrap();
    assert!(failed.load(Ordering::Acquire), "the duplicate key failed");
    written
}

/// Rows of slack over the most the client wrote directly. pgcache's two
/// bounded socket buffers hold about 16 rows; the rest is how many rows
/// stream past while the error travels one hop more, which on a loaded
/// machine has reached 43. Autotuned, the buffers held up to 130 rows more
/// in every run.
const SLACK_ROWS: usize = 64;

/// Runs of each kind: the direct baseline is their most, pgcache's figure
/// their median, so one run that a busy scheduler slowed decides nothing.
const RUNS: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_reaches_a_pipelining_client_about_as_soon_as_directly() {
    let pg = pg();
    let db = pg.create_db("pipelining");
    pg.psql_db(&db, "CREATE TABLE wide (k int PRIMARY KEY, v text)");
    let direct_addr: std::net::SocketAddr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let proxy = Proxy::start(pg.proxy_config()).await;
    // Directly, how far a client gets varies from run to run: the most
    // of a few runs is the baseline.
    let mut direct = 0;
    let mut through = Vec::new();
    for _ in 0..RUNS {
        pg.psql_db(&db, "TRUNCATE wide");
        direct = direct.max(rows_written_before_the_error(direct_addr, &db).await);
        pg.psql_db(&db, "TRUNCATE wide");
        through.push(rows_written_before_the_error(proxy.addr, &db).await);
    }
    assert!(direct < ROWS, "directly, the client stops early ({direct})");
    through.sort_unstable();
    let median = through[RUNS / 2];
    assert!(
        median <= direct + SLACK_ROWS,
        "through pgcache the client wrote a median of {median} rows of {ROW_BYTES} bytes \
         ({through:?}) before the error reached it, directly at most {direct}"
    );
}

/// The messages up to the next ReadyForQuery: the values of its rows, and
/// the transaction status it reports.
async fn answer(socket: &mut tokio::net::TcpStream) -> (Vec<String>, u8) {
    let mut values = Vec::new();
    loop {
        let (tag, body) = read_message(socket).await.expect("a message");
        match tag {
            // One text column: count, length, value.
            b'D' => values.push(String::from_utf8_lossy(&body[6..]).into_owned()),
            b'E' => panic!("an error: {}", String::from_utf8_lossy(&body)),
            b'Z' => return (values, body[0]),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_or_a_write_pipelined_behind_a_read_still_keeps_its_transactions_reads_off_the_cache()
 {
    let pg = pg();
    let db = pg.create_db("pipelined_begin");
    pg.psql_db(
        &db,
        "CREATE TABLE kv (k int PRIMARY KEY, v text); INSERT INTO kv VALUES (1, 'old'), (2, 'two')",
    );
    let proxy = Proxy::start(pg.proxy_config()).await;
    proxy.wait_streaming(&db).await;
    let (mut socket, _) = raw_login(proxy.addr, &db).await;
    let read = query("SELECT v FROM kv WHERE k = 1");
    for _ in 0..2 {
        socket.write_all(&read).await.unwrap();
        assert_eq!(answer(&mut socket).await, (vec!["old".to_owned()], b'I'));
    }
    let hits = proxy.hits();
    assert!(hits > 0, "the read is cached");
    // A read the cache does not hold goes to PostgreSQL; the BEGIN (and
    // the write) behind it are decided before its answer comes back.
    for begin in [
        vec![query("BEGIN ISOLATION LEVEL REPEATABLE READ")],
        vec![query("BEGIN"), query("UPDATE kv SET v = 'new' WHERE k = 1")],
    ] {
        let n = begin.len();
        socket
            .write_all(
                &[
                    vec![query(&format!("SELECT v FROM kv WHERE k = 2 LIMIT {n}"))],
                    begin,
                ]
                .concat()
                .concat(),
            )
            .await
            .unwrap();
        assert_eq!(answer(&mut socket).await, (vec!["two".to_owned()], b'I'));
        for _ in 0..n {
            assert_eq!(answer(&mut socket).await.1, b'T');
        }
        // A snapshot's read, and a read after the transaction's own
        // write, are PostgreSQL's to answer.
        socket.write_all(&read).await.unwrap();
        let (values, status) = answer(&mut socket).await;
        assert_eq!(status, b'T');
        assert_eq!(values, [if n == 1 { "old" } else { "new" }]);
        assert_eq!(
            proxy.hits(),
            hits,
            "nothing served from the cache ({n} statements)"
        );
        socket.write_all(&query("ROLLBACK")).await.unwrap();
        assert_eq!(answer(&mut socket).await.1, b'I');
    }
}
