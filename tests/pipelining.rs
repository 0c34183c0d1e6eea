//! A client that pipelines large rows hears of an error as soon as it
//! would directly: it has written at most a bounded number of bytes more
//! when the error reaches it (asyncpg's `executemany` stops writing then).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::wire::{cstr, frame, parse, raw_login, read_message, sync};
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
