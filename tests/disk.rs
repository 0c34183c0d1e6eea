//! The disk tier: answers spill from memory to files and come back from
//! them, promoted to memory; `/*+ explain */` says which tier answered;
//! the files stay within their byte budget; an unusable path is a start-up
//! error; a directory that stops taking writes sets the tier aside while
//! every answer stays right.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use tokio_postgres::Client;

/// Rows of about 1.5 KB, as the check's; `random`: of hex digits that
/// do not compress (the check's repeat one string).
fn table(rows: u32, random: bool) -> String {
    let pad = match random {
        true => "(SELECT string_agg(md5(g::text || i::text), '') FROM generate_series(1, 47) i)",
        false => "repeat(md5(g::text), 47)",
    };
    format!(
        "CREATE TABLE t(k int PRIMARY KEY, v int, pad text); \
         INSERT INTO t SELECT g, g, {pad} FROM generate_series(1, {rows}) g"
    )
}

/// A memory tier of 64 KiB (a few dozen answers) over a disk tier of
/// `disk_bytes` at `dir`.
fn config(dir: &Path, disk_bytes: u64) -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.cache.local.max_bytes = 64 * 1024;
    config.cache.max_entry_bytes = 16 * 1024;
    config.cache.disk.path = dir.to_owned();
    config.cache.disk.max_bytes = disk_bytes;
    // The check's machine is slow at times: a read past the deadline is
    // a miss, which would make a count below flaky.
    config.cache.disk.read_timeout_ms = 2_000;
    config
}

async fn read(client: &Client, k: u32) -> Vec<Vec<Option<String>>> {
    let found = rows(client, &format!("SELECT k, v, pad FROM t WHERE k = {k}")).await;
    assert_eq!(found.len(), 1, "k = {k}");
    found
}

fn disk_hits(proxy: &Proxy) -> u64 {
    proxy.app.metrics.tiers.disk.hits.get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_spill_to_disk_come_back_from_it_and_explain_names_the_tier() {
    let db = pg().create_db("disk_spill");
    pg().psql_db(&db, &table(400, false));
    let dir = scratch_dir("disk-spill");
    let proxy = Proxy::start(config(&dir, 8 << 20)).await;
    proxy.learn(&db, &["t"], &[]).await;
    let direct = pg().direct(&db).await;
    let client = proxy.connect(&db).await;
    for k in 1..=400 {
        assert_eq!(read(&client, k).await, read(&direct, k).await);
    }
    // Memory holds a few dozen of them: the rest come from the disk.
    let before = (proxy.hits(), disk_hits(&proxy));
    for k in 1..=400 {
        assert_eq!(read(&client, k).await, read(&direct, k).await, "k = {k}");
    }
    let (hits, from_disk) = (proxy.hits() - before.0, disk_hits(&proxy) - before.1);
    assert!(hits >= 390, "{hits} hits of 400");
    assert!(from_disk >= 300, "{from_disk} of them from disk");
    assert!(proxy.app.metrics.disk.stores.get() >= 400);

    // A disk hit is promoted to memory: read again at once, memory answers.
    let (explained, mut notices) = connect_with_notices(&proxy.dsn("postgres", &db)).await;
    let on_disk = "SELECT k, v, pad FROM t WHERE k = 7";
    for _ in 0..300 {
        // Push k = 7 out of memory with other reads.
        let _ = read(&client, 1 + fastrand_k()).await;
    }
    let row = rows(&explained, &format!("/*+ explain */ {on_disk}")).await;
    assert_eq!(row, rows(&direct, on_disk).await);
    let first = notices.recv().await.unwrap();
    let again = {
        scalar(&explained, &format!("/*+ explain */ {on_disk}")).await;
        notices.recv().await.unwrap()
    };
    assert!(
        first.starts_with("NOTICE: pgcache: answered from disk in ")
            || first.starts_with("NOTICE: pgcache: answered from memory in "),
        "{first}"
    );
    assert!(
        again.starts_with("NOTICE: pgcache: answered from memory in "),
        "{again}"
    );
    // Not cached, and why; a miss names PostgreSQL.
    scalar(&explained, "/*+ explain */ SELECT now()").await;
    let why = notices.recv().await.unwrap();
    assert!(
        why.contains("answered by PostgreSQL in") && why.contains("not cached ("),
        "{why}"
    );
    scalar(
        &explained,
        "/*+ explain */ SELECT v FROM t WHERE k = 399 AND v > 0",
    )
    .await;
    let miss = notices.recv().await.unwrap();
    assert!(miss.contains("not in the cache"), "{miss}");
    assert!(
        notices.try_recv().is_err(),
        "one notice per explained statement"
    );
    // In the extended protocol too, reading the entry of the text
    // without the hint.
    let prepared = "SELECT v FROM t WHERE k = $1";
    explained.query(prepared, &[&11i32]).await.unwrap();
    explained.query(prepared, &[&11i32]).await.unwrap();
    let row = explained
        .query_one(&format!("/*+ explain */ {prepared}"), &[&11i32])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 11);
    // A hit on the plain text's entry (the memory tier, this small, may
    // not have admitted it: then the disk answers).
    let told = notices.recv().await.unwrap();
    assert!(
        ["memory", "disk"]
            .iter()
            .any(|t| told.starts_with(&format!("NOTICE: pgcache: answered from {t} in "))),
        "{told}"
    );
}

/// Spreads reads over keys 1..=399 but 7, in a fixed order.
fn fastrand_k() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let k = NEXT.fetch_add(37, Ordering::Relaxed) % 398;
    if k >= 6 { k + 1 } else { k }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_stay_within_their_budget_with_three_times_what_they_hold() {
    let db = pg().create_db("disk_budget");
    pg().psql_db(&db, &table(9_000, true));
    let dir = scratch_dir("disk-budget");
    let budget = 4 << 20;
    let proxy = Proxy::start(config(&dir, budget)).await;
    proxy.learn(&db, &["t"], &[]).await;
    let client = proxy.connect(&db).await;
    for k in 1..=9_000 {
        read(&client, k).await;
    }
    let tier = proxy.app.cache.disk().expect("a disk tier");
    let used = eventually(
        Duration::from_secs(10),
        "the writes to reach the files",
        || async {
            let used = tier.used_bytes();
            (used > budget / 2).then_some(used)
        },
    )
    .await;
    assert!(used <= budget, "{used} bytes on disk, budget {budget}");
    // What is still on disk is served; the oldest went with their files.
    let before = disk_hits(&proxy);
    for k in 8_900..=9_000 {
        read(&client, k).await;
    }
    assert!(
        disk_hits(&proxy) - before >= 50,
        "recent answers come back from disk"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_cannot_be_written_is_a_start_up_error() {
    let dir = scratch_dir("disk-unusable");
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let mut config = config(&file, 8 << 20);
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    let err = match pgcache::App::start(config).await {
        Ok(_) => panic!("pgcache started with a file as its disk tier's directory"),
        Err(e) => e.to_string(),
    };
    assert!(err.starts_with("cache.disk.path "), "{err}");
    assert!(err.contains("a-file"), "{err}");
    let mut small = pg().proxy_config();
    small.cache.disk.path = dir.join("d");
    small.cache.disk.max_bytes = 4096;
    let err = pgcache::App::start(small)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("cache.disk.max_bytes"), "{err}");
}
