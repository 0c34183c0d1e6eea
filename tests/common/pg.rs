//! The tests' PostgreSQL: one shared cluster per test binary, or a
//! dedicated one for fault tests.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use pgcache::Config;

use super::process::{on_process_exit, pg_bindir, scratch_dir, server_cmd, server_user};
use super::{connect_dsn, free_port, rand_suffix};

pub const MD5_USER: &str = "md5user";
pub const MD5_PASSWORD: &str = "md5-secret";
pub const SCRAM_USER: &str = "scramuser";
pub const SCRAM_PASSWORD: &str = "scram-secret";

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

    /// A streaming standby of this server (`pg_basebackup -R`), started on
    /// a port of its own and stopped when dropped.
    pub fn standby(&self) -> Pg {
        let dir = scratch_dir("standby-");
        let data = dir.join("data");
        let out = server_cmd(self.bindir.join("pg_basebackup"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-X", "stream", "-R", "-c", "fast", "-D"])
            .arg(&data)
            .output()
            .expect("run pg_basebackup");
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut standby = Pg {
            port: 0,
            dir,
            bindir: self.bindir.clone(),
            owned: true,
            extra: self.extra.clone(),
        };
        for _attempt in 0..5 {
            standby.port = free_port();
            if standby.ctl_start() {
                return standby;
            }
        }
        panic!(
            "the standby did not start; see {}",
            standby.dir.join("log").display()
        );
    }

    /// Promotes a standby to a primary of its own.
    pub fn promote(&self) {
        let status = server_cmd(self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(self.data())
            .args(["-w", "promote"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "pg_ctl promote failed");
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
        // Tests that count hits must not lose one to a heartbeat the
        // loaded test machine delivered late; the lease's own tests set it.
        config.replication.max_staleness_ms = 5_000;
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
