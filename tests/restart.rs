//! The disk tier across restarts, with the real binary: a clean stop
//! carries the entries to the next run, which serves them once its stream
//! has read what changed meanwhile (writes and DDL made while pgcache was
//! stopped are never answered from the old entries); a kill -9 leaves
//! entries nobody can prove fresh, and the next run serves none of them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use tokio::process::{Child, Command};

/// One pgcache process over a disk tier at `dir`.
struct Instance {
    child: Child,
    port: u16,
    metrics: u16,
}

impl Instance {
    async fn start(dir: &Path, log: &Path) -> Instance {
        Self::start_on(free_port(), dir, log).await
    }

    /// On `port`, which another pgcache may be listening on.
    async fn start_on(port: u16, dir: &Path, log: &Path) -> Instance {
        Self::start_in(&[], port, dir, log, "").await
    }

    /// Run by `wrapper` (a command that execs its arguments), with
    /// `disk` more lines of `[cache.disk]`.
    async fn start_in(wrapper: &[&str], port: u16, dir: &Path, log: &Path, disk: &str) -> Instance {
        let config = dir.with_extension("toml");
        std::fs::write(
            &config,
            format!(
                "[cache]\nmax_entry_bytes = 16384\n[cache.local]\nmax_bytes = 65536\n\
                 [cache.disk]\npath = {:?}\nmax_bytes = 8388608\nread_timeout_ms = 2000\n{disk}\n\
                 [replication]\nmax_staleness_ms = 5000\n",
                dir.display().to_string()
            ),
        )
        .unwrap();
        let metrics = free_port();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let pgcache = env!("CARGO_BIN_EXE_pgcache");
        let mut command = match wrapper {
            [] => Command::new(pgcache),
            [program, args @ ..] => {
                let mut c = Command::new(program);
                c.args(args).arg(pgcache);
                c
            }
        };
        let child = command
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--metrics", &format!("127.0.0.1:{metrics}")])
            .args(["--upstream", &pg().proxy_config().upstream.url])
            .arg("--config")
            .arg(&config)
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("pgcache runs");
        let instance = Instance {
            child,
            port,
            metrics,
        };
        // Its metrics endpoint answers once it listens (another pgcache
        // may answer on the port meanwhile).
        eventually(Duration::from_secs(20), "pgcache to start", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", instance.metrics))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        eventually(
            Duration::from_secs(20),
            "pgcache to accept connections",
            || async {
                connect_dsn(&instance.dsn("postgres"))
                    .await
                    .ok()
                    .map(|_| ())
            },
        )
        .await;
        instance
    }

    fn dsn(&self, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={db}",
            self.port
        )
    }

    async fn metric(&self, name: &str) -> f64 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics))
            .await
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: pgcache\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    /// Repeats a read until the cache answers it: the database's stream
    /// is up and its tables known.
    async fn until_cached(&self, db: &str) {
        let client = connect_dsn(&self.dsn(db)).await.unwrap();
        eventually(Duration::from_secs(20), "a hit", || async {
            rows(&client, &READ.replace("$k", "1")).await;
            (self
                .metric("pgcache_cache_lookups_total{result=\"hit\"}")
                .await
                > 0.0)
                .then_some(())
        })
        .await;
    }

    async fn disk_hits(&self) -> f64 {
        self.metric("pgcache_cache_hits_total{tier=\"disk\"}").await
    }

    /// SIGTERM, and the clean stop that carries the entries.
    async fn stop(mut self) {
        let pid = self.child.id().expect("running") as i32;
        unsafe_kill(pid, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("pgcache stops within 30 s")
            .unwrap();
        assert!(status.success(), "{status}");
    }

    async fn kill_9(mut self) {
        self.child.kill().await.unwrap();
    }
}

fn unsafe_kill(pid: i32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{signal} {pid}");
}

fn setup(name: &str) -> (String, PathBuf, PathBuf) {
    let db = pg().create_db(name);
    pg().psql_db(
        &db,
        "CREATE TABLE t(k int PRIMARY KEY, v int, pad text); \
         INSERT INTO t SELECT g, g, repeat(md5(g::text), 47) FROM generate_series(1, 300) g",
    );
    let scratch = scratch_dir(name);
    (db, scratch.join("disk"), scratch.join("pgcache.log"))
}

/// Reads every row through `dsn` and checks each against PostgreSQL's
/// own answer.
async fn read_all(dsn: &str, db: &str, sql: &str) {
    let via = connect_dsn(dsn).await.unwrap();
    let direct = pg().direct(db).await;
    for k in 1..=300 {
        let q = sql.replace("$k", &k.to_string());
        assert_eq!(rows(&via, &q).await, rows(&direct, &q).await, "{q}");
    }
}

const READ: &str = "SELECT k, v, pad FROM t WHERE k = $k";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_restart_is_warm_and_never_serves_what_changed_while_stopped() {
    let (db, dir, log) = setup("restart_clean");
    let a = Instance::start(&dir, &log).await;
    a.until_cached(&db).await;
    read_all(&a.dsn(&db), &db, READ).await;
    read_all(&a.dsn(&db), &db, "SELECT * FROM t WHERE k = $k").await;
    eventually(
        Duration::from_secs(10),
        "the answers to reach the disk",
        || async {
            (a.metric("pgcache_disk_stores_total{result=\"written\"}")
                .await
                >= 600.0)
                .then_some(())
        },
    )
    .await;
    a.stop().await;

    // Warm: the same reads come from disk.
    let b = Instance::start(&dir, &log).await;
    b.until_cached(&db).await;
    read_all(&b.dsn(&db), &db, READ).await;
    let warm = b.disk_hits().await;
    assert!(
        warm >= 290.0,
        "{warm} of 300 from disk after a clean restart"
    );
    // What the slot kept while pgcache was stopped is shown.
    let kept = b
        .metric(&format!(
            "pgcache_replication_slot_kept_bytes{{database=\"{db}\"}}"
        ))
        .await;
    assert!(kept >= 0.0, "the resumed slot's WAL: {kept}");
    b.stop().await;

    // Writes and DDL while stopped: never an old answer, then warm again
    // for what they left alone.
    pg().psql_db(&db, "UPDATE t SET v = -v WHERE k % 10 = 0");
    pg().psql_db(&db, "ALTER TABLE t ADD COLUMN extra int DEFAULT 7");
    let c = Instance::start(&dir, &log).await;
    read_all(&c.dsn(&db), &db, READ).await;
    read_all(&c.dsn(&db), &db, "SELECT * FROM t WHERE k = $k").await;
    let before = c.disk_hits().await;
    read_all(&c.dsn(&db), &db, READ).await;
    assert!(c.disk_hits().await >= before, "the refill is served");
    c.stop().await;

    // A stopped pgcache keeps one slot per database, which uninstall
    // would drop; a running one reads it.
    let slots = pg().psql_db(
        &db,
        "SELECT count(*) FROM pg_replication_slots \
         WHERE database = current_database() AND slot_name LIKE 'pgcache\\_disk\\_%' AND NOT active",
    );
    assert_eq!(slots.trim(), "1", "{slots}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_9_nothing_on_disk_is_served() {
    let (db, dir, log) = setup("restart_killed");
    let a = Instance::start(&dir, &log).await;
    a.until_cached(&db).await;
    read_all(&a.dsn(&db), &db, READ).await;
    // Handed to the operating system (the probe does it each second).
    eventually(
        Duration::from_secs(10),
        "the answers to reach the disk",
        || async { (a.metric("pgcache_disk_entries").await >= 300.0).then_some(()) },
    )
    .await;
    // A write through pgcache, acknowledged, then the process dies.
    let client = connect_dsn(&a.dsn(&db)).await.unwrap();
    client
        .simple_query("UPDATE t SET v = v + 1000000 WHERE k <= 150")
        .await
        .unwrap();
    a.kill_9().await;
    let b = Instance::start(&dir, &log).await;
    read_all(&b.dsn(&db), &db, READ).await;
    assert_eq!(
        b.disk_hits().await,
        0.0,
        "nothing of the killed run is served"
    );
    assert!(
        b.metric("pgcache_disk_discarded_entries_total").await > 0.0,
        "the entries it left are counted"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        said.matches("the disk tier starts empty").count(),
        1,
        "said once: {said}"
    );
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_takes_the_address_over_and_no_connection_fails() {
    let (db, dir, log) = setup("restart_takeover");
    let port = free_port();
    let a = Instance::start_on(port, &dir, &log).await;
    a.until_cached(&db).await;
    read_all(&a.dsn(&db), &db, READ).await;
    // Clients keep connecting, one at a time, through the whole handover.
    let dsn = a.dsn(&db);
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let clients = tokio::spawn(async move {
        let (mut ok, mut failed) = (0u32, Vec::new());
        while !*stopped.borrow_and_update() {
            match connect_dsn(&dsn).await {
                Ok(client) => match client.simple_query("SELECT v FROM t WHERE k = 3").await {
                    Ok(_) => ok += 1,
                    Err(e) => failed.push(e.to_string()),
                },
                Err(e) => failed.push(e.to_string()),
            }
        }
        (ok, failed)
    });
    let b = Instance::start_on(port, &dir, &log).await;
    let took = std::fs::read_to_string(&log).unwrap();
    assert!(took.contains("took the listening socket over"), "{took}");
    // The old one hands its disk tier over at once, while it still serves
    // its sessions, and the new one starts warm from it.
    eventually(
        Duration::from_secs(20),
        "the disk tier in the new pgcache",
        || async { (b.metric("pgcache_disk_capacity_bytes").await > 0.0).then_some(()) },
    )
    .await;
    b.until_cached(&db).await;
    read_all(&b.dsn(&db), &db, READ).await;
    let warm = b.disk_hits().await;
    assert!(warm >= 250.0, "{warm} of 300 from disk in the new pgcache");
    a.stop().await;
    stop.send(true).unwrap();
    let (ok, failed) = clients.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} failed of {}: {failed:?}",
        failed.len(),
        ok as usize + failed.len()
    );
    assert!(ok >= 10, "{ok} connections");
    read_all(&b.dsn(&db), &db, READ).await;
    b.stop().await;
}

/// A disk tier on a tmpfs of `size` of its own, mounted in a mount
/// namespace of pgcache's (no root needed where user namespaces are on).
async fn on_tmpfs(size: &str, dir: &Path, log: &Path) -> Instance {
    std::fs::create_dir_all(dir).unwrap();
    let mount = format!("mount -t tmpfs -o size={size} tmpfs \"$0\" && exec \"$@\"");
    let wrapper = [
        "unshare",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        &mount,
        dir.to_str().unwrap(),
    ];
    Instance::start_in(&wrapper, free_port(), dir, log, "").await
}

/// Runs `command` in `pid`'s mount namespace.
fn in_namespace_of(pid: u32, command: &[&str]) {
    let status = std::process::Command::new("nsenter")
        .args([
            "-t",
            &pid.to_string(),
            "--user",
            "--mount",
            "--preserve-credentials",
        ])
        .args(command)
        .status()
        .unwrap();
    assert!(status.success(), "{command:?} in {pid}'s namespace");
}

/// Rows whose text does not compress.
fn incompressible(db: &str) {
    pg().psql_db(
        db,
        "UPDATE t SET pad = (SELECT string_agg(md5(k::text || i::text), '') FROM generate_series(1, 47) i)",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_sets_the_tier_aside_once_and_every_answer_stays_right() {
    let (db, dir, log) = setup("disk_full");
    incompressible(&db);
    let a = on_tmpfs("256k", &dir, &log).await;
    a.until_cached(&db).await;
    for _ in 0..3 {
        read_all(&a.dsn(&db), &db, READ).await;
    }
    eventually(
        Duration::from_secs(20),
        "the full disk to set the tier aside",
        || async { (a.metric("pgcache_disk_up").await == 0.0).then_some(()) },
    )
    .await;
    read_all(&a.dsn(&db), &db, READ).await;
    assert_eq!(a.metric("pgcache_disk_set_aside_total").await, 1.0);
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(said.matches("takes no writes").count(), 1, "{said}");
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_becomes_read_only_sets_the_tier_aside_and_back() {
    let (db, dir, log) = setup("disk_read_only");
    let a = on_tmpfs("64m", &dir, &log).await;
    a.until_cached(&db).await;
    read_all(&a.dsn(&db), &db, READ).await;
    let pid = a.child.id().unwrap();
    // A read-only file system over the directory (its files stay open
    // for writing underneath, so it cannot simply be remounted).
    in_namespace_of(
        pid,
        &[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "ro,size=64k",
            "tmpfs",
            dir.to_str().unwrap(),
        ],
    );
    eventually(Duration::from_secs(20), "the tier set aside", || async {
        (a.metric("pgcache_disk_up").await == 0.0).then_some(())
    })
    .await;
    pg().psql_db(&db, "UPDATE t SET v = v + 1 WHERE k % 7 = 0");
    read_all(&a.dsn(&db), &db, READ).await;
    in_namespace_of(pid, &["umount", dir.to_str().unwrap()]);
    eventually(Duration::from_secs(20), "the tier back in use", || async {
        (a.metric("pgcache_disk_up").await == 1.0).then_some(())
    })
    .await;
    read_all(&a.dsn(&db), &db, READ).await;
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(said.matches("takes no writes").count(), 1, "{said}");
    assert_eq!(said.matches("takes writes again").count(), 1, "{said}");
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_entry_is_never_served() {
    let (db, dir, log) = setup("disk_corrupt");
    incompressible(&db);
    let a = Instance::start(&dir, &log).await;
    a.until_cached(&db).await;
    read_all(&a.dsn(&db), &db, READ).await;
    a.stop().await;
    // Damage the data blocks of every file the clean stop left (their
    // first halves; the index and trailer are at the end).
    let mut damaged = 0;
    for entry in walk(&dir.join("pgcache-disk-v1")) {
        let mut bytes = std::fs::read(&entry).unwrap();
        if bytes.len() < 4096 {
            continue;
        }
        for i in (64..bytes.len() / 2).step_by(97) {
            bytes[i] ^= 0x5a;
        }
        std::fs::write(&entry, bytes).unwrap();
        damaged += 1;
    }
    assert!(damaged > 0, "no file to damage");
    let b = Instance::start(&dir, &log).await;
    b.until_cached(&db).await;
    read_all(&b.dsn(&db), &db, READ).await;
    let refused = b.metric("pgcache_disk_reads_total{result=\"error\"}").await;
    assert!(
        b.disk_hits().await < 300.0
            && refused + b.metric("pgcache_disk_reads_total{result=\"miss\"}").await > 0.0,
        "damaged entries are misses"
    );
    b.stop().await;
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_pgcaches_slot_that_keeps_too_much_wal_is_dropped() {
    let (db, dir, log) = setup("disk_stale_slot");
    let stale = "pgcache_disk_deadbeef_00000000";
    pg().psql_db(
        &db,
        &format!("SELECT pg_create_logical_replication_slot('{stale}', 'pgoutput')"),
    );
    // More WAL than the limit below, kept by the stopped pgcache's slot.
    pg().psql_db(
        &db,
        "CREATE TABLE filler AS SELECT g, md5(g::text) AS m FROM generate_series(1, 50000) g",
    );
    let a = Instance::start_in(
        &[],
        free_port(),
        &dir,
        &log,
        "max_retained_wal_bytes = 1048576",
    )
    .await;
    a.until_cached(&db).await;
    let left = pg().psql_db(
        &db,
        &format!("SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{stale}'"),
    );
    assert_eq!(left.trim(), "0", "the stale slot is dropped");
    let own = pg().psql_db(
        &db,
        "SELECT count(*) FROM pg_replication_slots \
         WHERE database = current_database() AND slot_name LIKE 'pgcache\\_disk\\_%' AND active",
    );
    assert_eq!(own.trim(), "1", "its own stays");
    a.stop().await;
}
