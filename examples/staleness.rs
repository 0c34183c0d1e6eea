//! Measures how long a write committed directly on PostgreSQL keeps being
//! served stale by pgcache: for each sample, make sure the old value is
//! cached, commit a new one on a direct connection, then read through
//! pgcache as fast as possible until the new value appears.
//!
//! `cargo run --release --example staleness -- DIRECT_DSN PGCACHE_DSN [SAMPLES] [async]`
//! Prints p50, p99 and max in milliseconds. With `async`, the writes commit
//! with `synchronous_commit = off`. Used by `bench/invalidation.sh`.
#![allow(clippy::print_stdout)] // its output is the report

use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

async fn connect(dsn: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(dsn, NoTls).await.expect("connect");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

async fn read(client: &Client) -> i64 {
    let rows = client
        .simple_query("SELECT v FROM stale_probe WHERE id = 1")
        .await
        .expect("read");
    rows.iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse().ok()),
            _ => None,
        })
        .expect("a row")
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (direct_dsn, cache_dsn) = (&args[1], &args[2]);
    let samples: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(300);
    let commit = args.get(4).map(String::as_str).unwrap_or("sync");
    let direct = connect(direct_dsn).await;
    let cached = connect(cache_dsn).await;
    direct
        .batch_execute(
            "DROP TABLE IF EXISTS stale_probe; CREATE TABLE stale_probe(id int PRIMARY KEY, v bigint);
             INSERT INTO stale_probe VALUES (1, 0)",
        )
        .await
        .expect("setup");
    // The probe must measure cache hits. Wait until the new table is
    // published and in pgcache's catalog: with the table locked on a direct
    // connection, a forwarded read would block, a cached one returns.
    let locker = connect(direct_dsn).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        read(&cached).await;
        read(&cached).await;
        locker
            .batch_execute("BEGIN; LOCK TABLE stale_probe IN ACCESS EXCLUSIVE MODE")
            .await
            .expect("lock");
        let hit = tokio::time::timeout(Duration::from_millis(300), read(&cached))
            .await
            .is_ok();
        locker.batch_execute("ROLLBACK").await.expect("unlock");
        if hit {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "reads through pgcache are never served from its cache"
        );
        // The blocked read was cancelled by the timeout; let it drain.
        read(&cached).await;
    }
    if commit == "async" {
        direct
            .batch_execute("SET synchronous_commit = off")
            .await
            .expect("set");
    }
    let mut stale = Vec::with_capacity(samples);
    let mut saw_stale = 0;
    for _ in 0..samples {
        let old = read(&cached).await;
        read(&cached).await; // cached now
        let row = direct
            .query_one(
                "UPDATE stale_probe SET v = v + 1 WHERE id = 1 RETURNING v",
                &[],
            )
            .await
            .expect("write");
        let committed = Instant::now();
        let new: i64 = row.get(0);
        assert!(new > old);
        let mut first = true;
        while read(&cached).await < new {
            if first {
                saw_stale += 1;
                first = false;
            }
            if committed.elapsed() > Duration::from_secs(10) {
                panic!("still stale after 10 s");
            }
        }
        stale.push(committed.elapsed());
    }
    stale.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let pct = |p: f64| stale[((stale.len() as f64 * p) as usize).min(stale.len() - 1)];
    println!(
        "{commit} commit: staleness over {} writes ({} of them read stale at least once): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        stale.len(),
        saw_stale,
        ms(pct(0.50)),
        ms(pct(0.99)),
        ms(*stale.last().unwrap())
    );
}
