//! Test harness: a throwaway PostgreSQL and redis-server per test binary,
//! and pgcache started in-process on port 0.
//!
//! - The shared PostgreSQL is created once per test binary (`initdb` into a
//!   temp dir, a free port, `wal_level=logical`, users for md5 and SCRAM).
//!   Each test makes its own database with [`Pg::create_db`], so tests run in
//!   parallel. Fault tests that stop PostgreSQL start a [`Pg::dedicated`] one.
//! - Servers are stopped and their directories removed when the test process
//!   exits, by a small watchdog process (statics are never dropped in Rust).
//! - `TEST_DATABASE_URL` is not needed: nothing here touches services the
//!   machine happens to run.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener as StdListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pgcache::Config;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const MD5_USER: &str = "md5user";
pub const MD5_PASSWORD: &str = "md5-secret";
pub const SCRAM_USER: &str = "scramuser";
pub const SCRAM_PASSWORD: &str = "scram-secret";

/// Polls `check` until it returns `Some`, or panics after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pg_bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries not found: run .ci/run or install postgresql")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .expect("no initdb under /usr/lib/postgresql/*/bin")
}

/// PostgreSQL refuses to run as root: run it as the `postgres` user then.
fn server_user() -> Option<(u32, u32)> {
    if current_uid() != 0 {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a postgres OS user")
    };
    Some((id("-u"), id("-g")))
}

fn current_uid() -> u32 {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A command that runs as the server user.
fn server_cmd(program: PathBuf) -> Command {
    let mut cmd = Command::new(program);
    if let Some((uid, gid)) = server_user() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

fn scratch_dir(prefix: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).unwrap();
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .unwrap()
        .keep();
    if let Some((uid, gid)) = server_user() {
        Command::new("chown")
            .arg(format!("{uid}:{gid}"))
            .arg(&dir)
            .status()
            .unwrap();
        // The parents must be traversable by the server user.
        Command::new("chmod").arg("o+x").arg(base).status().unwrap();
    }
    dir
}

/// Runs `script` (sh) once this test process has exited.
// The watchdog must outlive this process, so it is deliberately never waited on.
#[allow(clippy::zombie_processes)]
fn on_process_exit(script: &str) {
    let me = std::process::id();
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; {script}"
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn cleanup watchdog");
}

pub struct Pg {
    pub port: u16,
    pub dir: PathBuf,
    bindir: PathBuf,
    owned: bool,
    extra: String,
}

static SHARED_PG: OnceLock<Pg> = OnceLock::new();

/// The test binary's shared PostgreSQL.
pub fn pg() -> &'static Pg {
    SHARED_PG.get_or_init(|| {
        let pg = Pg::start();
        let ctl = pg.bindir.join("pg_ctl");
        let runas = if server_user().is_some() {
            "runuser -u postgres -- "
        } else {
            ""
        };
        on_process_exit(&format!(
            "{runas}{} -D {} stop -m immediate; rm -rf {}",
            ctl.display(),
            pg.data().display(),
            pg.dir.display()
        ));
        pg
    })
}

impl Pg {
    /// A PostgreSQL of the test's own, stopped when dropped.
    pub fn dedicated() -> Pg {
        Pg::dedicated_with("")
    }

    /// A dedicated PostgreSQL with extra server options (`-c name=value ...`).
    pub fn dedicated_with(extra: &str) -> Pg {
        let mut pg = Pg::start_with(extra, None);
        pg.owned = true;
        pg
    }

    /// A dedicated PostgreSQL that takes TCP connections (and replication)
    /// over TLS only, with this certificate and key.
    pub fn dedicated_tls(cert: &Path, key: &Path) -> Pg {
        let mut pg = Pg::start_with("-c ssl=on", Some((cert, key)));
        pg.owned = true;
        pg
    }

    fn start() -> Pg {
        Pg::start_with("", None)
    }

    fn start_with(extra: &str, tls: Option<(&Path, &Path)>) -> Pg {
        let bindir = pg_bindir();
        let dir = scratch_dir("pg-");
        let data = dir.join("data");
        let out = server_cmd(bindir.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // With TLS, "host" lines become "hostssl" and plain TCP is refused.
        let host = if tls.is_some() { "hostssl" } else { "host" };
        let mut hba = format!(
            "local all all trust\n\
             {host} all {MD5_USER} 127.0.0.1/32 md5\n\
             {host} all {SCRAM_USER} 127.0.0.1/32 scram-sha-256\n\
             {host} all all 127.0.0.1/32 trust\n\
             {host} replication all 127.0.0.1/32 trust\n"
        );
        if let Some((cert, key)) = tls {
            hba.push_str(
                "hostnossl all all 127.0.0.1/32 reject\n\
                 hostnossl replication all 127.0.0.1/32 reject\n",
            );
            for (from, to) in [(cert, "server.crt"), (key, "server.key")] {
                std::fs::copy(from, data.join(to)).unwrap();
                std::fs::set_permissions(data.join(to), std::fs::Permissions::from_mode(0o600))
                    .unwrap();
                if let Some((uid, gid)) = server_user() {
                    std::os::unix::fs::chown(data.join(to), Some(uid), Some(gid)).unwrap();
                }
            }
        }
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        let mut pg = Pg {
            port: 0,
            dir,
            bindir,
            owned: false,
            extra: extra.to_owned(),
        };
        for _attempt in 0..5 {
            pg.port = free_port();
            if pg.ctl_start() {
                pg.bootstrap();
                return pg;
            }
        }
        panic!(
            "PostgreSQL did not start; see {}",
            pg.dir.join("log").display()
        );
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn ctl_start(&self) -> bool {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c wal_level=logical -c fsync=off \
             -c full_page_writes=off -c max_connections=400 \
             -c max_replication_slots=40 -c max_wal_senders=40 -c shared_buffers=64MB \
             -c max_prepared_transactions=10 {}",
            self.port,
            self.dir.display(),
            self.extra
        );
        server_cmd(self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(self.data())
            .args(["-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "60", "start"])
            .stdout(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Stops the server (fast shutdown), keeping its data.
    pub fn stop(&self) {
        server_cmd(self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(self.data())
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
    }

    /// Starts it again on the same port.
    pub fn restart(&self) {
        assert!(self.ctl_start(), "PostgreSQL did not restart");
    }

    fn bootstrap(&self) {
        self.psql_admin(&format!(
            "SET password_encryption = 'md5';
             CREATE ROLE {MD5_USER} LOGIN PASSWORD '{MD5_PASSWORD}';
             SET password_encryption = 'scram-sha-256';
             CREATE ROLE {SCRAM_USER} LOGIN PASSWORD '{SCRAM_PASSWORD}';
             CREATE ROLE app LOGIN;"
        ));
    }

    /// Runs SQL as the superuser over the Unix socket, panicking on error.
    pub fn psql_admin(&self, sql: &str) -> String {
        self.psql_db("postgres", sql)
    }

    pub fn psql_db(&self, db: &str, sql: &str) -> String {
        let out = Command::new(self.bindir.join("psql"))
            .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&self.dir)
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "psql failed on {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A fresh database for one test, owned by `postgres`, usable by every role.
    pub fn create_db(&self, name: &str) -> String {
        let db = format!("t_{name}_{}", rand_suffix());
        self.psql_admin(&format!("CREATE DATABASE {db}"));
        self.psql_db(&db, "GRANT ALL ON SCHEMA public TO PUBLIC");
        db
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }

    /// A key=value connection string straight to PostgreSQL (bypassing pgcache).
    pub fn direct_dsn(&self, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={db}",
            self.port
        )
    }

    pub async fn direct(&self, db: &str) -> tokio_postgres::Client {
        connect_dsn(&self.direct_dsn(db))
            .await
            .expect("direct connection to PostgreSQL")
    }

    /// pgcache configuration pointing at this server, listening on port 0.
    pub fn proxy_config(&self) -> Config {
        let mut config = Config::default();
        config.upstream.url = format!("postgres://postgres@127.0.0.1:{}", self.port);
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.metrics.listen = "127.0.0.1:0".parse().unwrap();
        config
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        if self.owned {
            server_cmd(self.bindir.join("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .ok();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

pub fn rand_suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// A redis-server of the test's own, on a free port, stopped when dropped
/// (and, whatever happens, when the test process exits).
pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
}

static SHARED_REDIS: OnceLock<Redis> = OnceLock::new();

/// The test binary's shared redis-server.
pub fn redis() -> &'static Redis {
    SHARED_REDIS.get_or_init(Redis::dedicated)
}

impl Redis {
    pub fn dedicated() -> Redis {
        Self::start_with(free_port(), &[])
    }

    /// A server of the test's own on `port`, with extra redis-server flags.
    pub fn start_with(port: u16, extra: &[&str]) -> Redis {
        let dir = scratch_dir("redis-");
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "yes",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        for (flag, file) in [("--pidfile", "redis.pid"), ("--logfile", "redis.log")] {
            args.push(flag.to_owned());
            args.push(dir.join(file).display().to_string());
        }
        args.push("--dir".to_owned());
        args.push(dir.display().to_string());
        on_process_exit(&format!(
            "kill $(cat {}/redis.pid) 2>/dev/null; rm -rf {}",
            dir.display(),
            dir.display()
        ));
        let redis = Redis { port, dir, args };
        redis.restart();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again, on the same port, empty).
    pub fn restart(&self) {
        let ok = Command::new("redis-server")
            .args(&self.args)
            .status()
            .expect("redis-server not found: run .ci/run or install redis-server")
            .success();
        let deadline = Instant::now() + Duration::from_secs(10);
        while ok && Instant::now() < deadline {
            if redis_ping(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server did not start; see {}",
            self.dir.join("redis.log").display()
        )
    }

    /// Kills the server as a crash would (SIGKILL) and waits until it is gone.
    pub fn kill(&self) {
        let pid = std::fs::read_to_string(self.dir.join("redis.pid")).unwrap_or_default();
        Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while redis_ping(self.port) {
            assert!(Instant::now() < deadline, "redis-server did not die");
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(self.dir.join("redis.pid"));
    }

    /// A connection of the test's own, to inspect or tamper with Redis.
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.dir.join("redis.pid")).unwrap_or_default();
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of three masters, each a redis-server of its own.
pub struct RedisCluster {
    pub nodes: Vec<Redis>,
    /// Each node's TLS port, when started with TLS.
    tls_ports: Vec<u16>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_with(None)
    }

    /// A cluster whose nodes also take TLS (with this CA, certificate and
    /// key) and talk TLS among themselves; they tell TLS clients their TLS
    /// ports.
    pub fn start_tls(ca: &Path, cert: &Path, key: &Path) -> RedisCluster {
        RedisCluster::start_with(Some((ca, cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path, &Path)>) -> RedisCluster {
        let mut nodes = Vec::new();
        let mut tls_ports = Vec::new();
        while nodes.len() < 3 {
            // The cluster bus listens on port + 10000.
            let port = free_port();
            if port > 55_000 || !port_is_free(port + 10_000) {
                continue;
            }
            let mut args: Vec<String> =
                ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
                    .map(str::to_owned)
                    .to_vec();
            if let Some((ca, cert, key)) = tls {
                let tls_port = free_port();
                tls_ports.push(tls_port);
                for (flag, value) in [
                    ("--tls-port", tls_port.to_string()),
                    ("--tls-cert-file", cert.display().to_string()),
                    ("--tls-key-file", key.display().to_string()),
                    ("--tls-ca-cert-file", ca.display().to_string()),
                    ("--tls-auth-clients", "no".to_owned()),
                    ("--tls-cluster", "yes".to_owned()),
                ] {
                    args.extend([flag.to_owned(), value]);
                }
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(Redis::start_with(port, &args));
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "the cluster did not form");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes, tls_ports }
    }

    /// The seed list over TLS: `rediss://localhost:<tls port>,...`.
    pub fn tls_url(&self) -> String {
        self.tls_ports
            .iter()
            .map(|p| format!("rediss://localhost:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The seed list pgcache takes: every node, comma-separated.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn port_is_free(port: u16) -> bool {
    StdListener::bind(("127.0.0.1", port)).is_ok()
}

/// A CA of its own and a server certificate it signed for localhost and
/// 127.0.0.1, made with openssl: (CA certificate, certificate, key).
pub fn tls_certificate(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    tls_certificate_for(dir, name, "DNS:localhost,IP:127.0.0.1")
}

/// As [`tls_certificate`], for the names in `san` (openssl's subjectAltName).
pub fn tls_certificate_for(dir: &Path, name: &str, san: &str) -> (PathBuf, PathBuf, PathBuf) {
    let file = |ext: &str| dir.join(format!("{name}.{ext}"));
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (ca, ca_key) = (format!("{name}-ca.crt"), format!("{name}-ca.key"));
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pgcache test CA",
        "-keyout",
        &ca_key,
        "-out",
        &ca,
    ]);
    let (crt, key, csr, ext) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
    );
    std::fs::write(
        dir.join(&ext),
        format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        &key,
        "-out",
        &csr,
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext,
        "-out",
        &crt,
    ]);
    (dir.join(ca), file("crt"), file("key"))
}

/// Sends PING over a raw socket and checks for +PONG.
pub fn redis_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// pgcache running in this test's runtime.
pub struct Proxy {
    pub addr: SocketAddr,
    pub app: std::sync::Arc<pgcache::App>,
    shutdown: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Proxy {
    pub async fn start(config: Config) -> Proxy {
        // RUST_LOG=pgcache=debug shows pgcache's log in a failing test's output.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let listener = TcpListener::bind(config.server.listen).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let app = pgcache::App::start(config).await.expect("pgcache starts");
        let join = tokio::spawn(pgcache::serve(
            std::sync::Arc::clone(&app),
            listener,
            async {
                let _ = rx.await;
            },
        ));
        Proxy {
            addr,
            app,
            shutdown: Some(tx),
            join: Some(join),
        }
    }

    pub fn dsn(&self, user: &str, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} dbname={db}",
            self.addr.port()
        )
    }

    pub fn hits(&self) -> u64 {
        self.app.metrics.hits.get()
    }

    pub fn stores(&self) -> u64 {
        self.app.metrics.stores.get()
    }

    /// Connects as `postgres`, and waits until the database's replication
    /// stream is up (until then pgcache serves nothing from its cache).
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        let client = connect_dsn(&self.dsn("postgres", db))
            .await
            .expect("connect through pgcache");
        self.wait_streaming(db).await;
        client
    }

    pub async fn wait_streaming(&self, db: &str) {
        if self.app.replication_on() {
            let state = self.app.cache.db(db);
            eventually(Duration::from_secs(20), "the replication stream", || {
                let up = state.is_streaming();
                async move { up.then_some(()) }
            })
            .await;
        }
    }

    /// Starts shutdown; returns the task that finishes when pgcache stops.
    pub fn begin_shutdown(&mut self) -> JoinHandle<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.join.take().expect("already shut down")
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Holds `table` under ACCESS EXCLUSIVE on a direct connection until the
/// returned client is dropped or rolls back: a forwarded read of it would
/// block, a cached one returns at once.
pub async fn lock_table(db: &str, table: &str) -> tokio_postgres::Client {
    let locker = pg().direct(db).await;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
        ))
        .await
        .unwrap();
    locker
}

/// Connects with tokio-postgres and drives the connection in the background.
pub async fn connect_dsn(dsn: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Runs an external client (psql, pgbench) to completion.
pub async fn run_tool(program: &Path, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(program)
        .args(args)
        .env("PGCONNECT_TIMEOUT", "10")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

/// The first column of the first row of a simple query, as text.
pub async fn scalar(client: &tokio_postgres::Client, sql: &str) -> Option<String> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).map(str::to_owned)),
            _ => None,
        })
        .flatten()
}

/// All rows of a simple query, as text.
pub async fn rows(client: &tokio_postgres::Client, sql: &str) -> Vec<Vec<Option<String>>> {
    client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}
