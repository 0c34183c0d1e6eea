//! The tests' Redis: a shared redis-server per test binary, dedicated ones
//! for fault tests, and three-node clusters.

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::free_port;
use super::process::{on_process_exit, scratch_dir};

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
