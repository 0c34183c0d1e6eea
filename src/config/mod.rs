//! Configuration: built-in defaults < TOML file < environment < command line.
//!
//! Every key is documented, with its default, in `config/pgcache.toml`; a
//! unit test keeps that file and these defaults in step. Unknown keys and bad
//! values are refused at start-up with the key's name.

mod cache;
mod replicas;
mod validate;

pub use cache::*;
pub use replicas::*;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // The cause is part of the message, not a source: printed as a chain,
    // it would be said twice.
    #[error("cannot read config file {path}: {cause}")]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid configuration:\n  {}", .0.join("\n  "))]
    Invalid(Vec<String>),
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub cache: CacheConfig,
    pub redis: RedisConfig,
    pub metrics: MetricsConfig,
    pub replication: ReplicationConfig,
    pub admin: AdminConfig,
    pub tls: TlsConfig,
    pub auth: AuthConfig,
    pub pool: PoolConfig,
    pub log: LogConfig,
    pub replicas: ReplicasConfig,
}

/// How pgcache writes its log (levels follow `RUST_LOG`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Lines for people, or one JSON object a line for log pipelines.
    pub format: LogFormat,
}

/// The shape of a log line.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
#[derive(clap::ValueEnum)]
pub enum LogFormat {
    /// Plain text, coloured only on a terminal (and never with `NO_COLOR`).
    #[default]
    Text,
    /// One JSON object a line.
    Json,
}

/// Server connections kept for the next client once a session ends
/// ([`crate::pool`]).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Connections kept idle at most, over all users and databases (each
    /// holds one of PostgreSQL's `max_connections`); 0 (the default) turns
    /// reuse off, so a new client always gets a new backend, as directly.
    pub max_idle_servers: usize,
    /// An idle connection is closed after this long.
    pub server_idle_timeout_secs: u64,
    /// A connection older than this is closed when its session ends.
    pub server_lifetime_secs: u64,
    /// Time allowed for the reset or check query of a connection.
    pub check_timeout_ms: u64,
    /// How long a client holds a server connection ([`PoolMode`]).
    pub mode: PoolMode,
    /// Transaction mode: server connections per database and user.
    pub default_pool_size: usize,
    /// Transaction mode: connections per database and user kept open even
    /// when idle past `server_idle_timeout_secs`.
    pub min_pool_size: usize,
    /// Transaction mode: how long a client waits for a server connection
    /// before its statement fails with 57014; 0 waits for ever.
    pub query_wait_timeout_secs: u64,
    /// Transaction mode: statements kept prepared on each server
    /// connection; the least recently used is closed past this.
    pub max_prepared_statements: usize,
}

/// How long a client holds a server connection.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PoolMode {
    /// For its whole session (parked for the next client at its end).
    #[default]
    Session,
    /// Only while a transaction, an unfinished extended-protocol batch, a
    /// COPY or a pinned session needs one; cache hits need none.
    Transaction,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_idle_servers: 0,
            server_idle_timeout_secs: 60,
            server_lifetime_secs: 3600,
            check_timeout_ms: 2_000,
            mode: PoolMode::Session,
            default_pool_size: 20,
            min_pool_size: 0,
            query_wait_timeout_secs: 120,
            max_prepared_statements: 200,
        }
    }
}

impl PoolConfig {
    pub fn server_idle_timeout(&self) -> Duration {
        Duration::from_secs(self.server_idle_timeout_secs)
    }

    pub fn server_lifetime(&self) -> Duration {
        Duration::from_secs(self.server_lifetime_secs)
    }

    pub fn check_timeout(&self) -> Duration {
        Duration::from_millis(self.check_timeout_ms)
    }

    /// `None`: wait for ever.
    pub fn query_wait_timeout(&self) -> Option<Duration> {
        (self.query_wait_timeout_secs > 0)
            .then(|| Duration::from_secs(self.query_wait_timeout_secs))
    }
}

/// Who authenticates clients.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    /// PostgreSQL does, through pgcache (the exchange is relayed).
    #[default]
    Passthrough,
    /// pgcache does (SCRAM-SHA-256), then logs in to PostgreSQL as the user.
    Terminate,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    pub mode: AuthMode,
    /// terminate: user = password, or user = SCRAM-SHA-256 verifier.
    pub users: BTreeMap<String, String>,
    /// terminate: looks up users not in `users` ($1 = user name; one text
    /// column, a password or verifier), on a connection as upstream.url's user.
    pub auth_query: String,
}

/// TLS towards clients.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum SslMode {
    /// SSLRequest is answered 'N'.
    #[default]
    Disable,
    /// TLS when the client asks; plain text too.
    Allow,
    /// Only TLS: a plain-text startup is refused (28000).
    Require,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    pub ssl_mode: SslMode,
    /// PEM certificate chain offered to clients.
    pub cert_file: PathBuf,
    /// PEM private key of that certificate.
    pub key_file: PathBuf,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicationConfig {
    /// Invalidate from PostgreSQL logical replication.
    pub enabled: bool,
    /// Refuse to start when replication cannot work (else: TTL-only, loudly).
    pub required: bool,
    /// Publication the streams read.
    pub publication: String,
    /// Keep the publication listing every table with a replica identity.
    pub manage_publication: bool,
    /// Install an event trigger that announces DDL in the stream.
    pub ddl_event_trigger: bool,
    /// How often each stream's database gets a heartbeat message.
    pub heartbeat_ms: u64,
    /// A database's cache is served only while its newest heartbeat back
    /// through the stream was sent at most this long ago (the staleness
    /// lease). `max_lag_ms` is its former name.
    #[serde(alias = "max_lag_ms")]
    pub max_staleness_ms: u64,
    /// pgcache lets go of a database (closes its stream, whose active slot
    /// blocks `DROP DATABASE`, and its own connections there) when no
    /// client has used it for this long; 0 keeps hold while pgcache runs.
    pub idle_release_secs: u64,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            required: true,
            publication: "pgcache".to_owned(),
            manage_publication: true,
            ddl_event_trigger: true,
            heartbeat_ms: 100,
            max_staleness_ms: 1000,
            idle_release_secs: 60,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address clients connect to.
    pub listen: SocketAddr,
    /// Client connections served at once; one more gets SQLSTATE 53300.
    pub max_client_connections: usize,
    /// Largest single protocol message a client may send.
    pub max_message_bytes: usize,
    /// Time a new client has to finish its startup packet.
    pub startup_timeout_ms: u64,
    /// Connections from one address that may be in startup at once.
    pub max_startups_per_ip: usize,
    /// Close a session idle outside a transaction this long; 0 = never.
    pub client_idle_timeout_secs: u64,
    /// Close a session idle inside a transaction this long; 0 = never.
    pub idle_in_transaction_timeout_secs: u64,
    /// On SIGTERM/SIGINT, how long busy sessions may run before they are closed.
    pub shutdown_timeout_secs: u64,
    /// Threads that serve sessions; 0 = one per CPU.
    pub workers: usize,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// libpq URL or key=value string naming the PostgreSQL server.
    pub url: String,
    /// Time allowed to open a backend connection.
    pub connect_timeout_ms: u64,
    /// Streaming standbys of `url` that take reads ([`ReplicasConfig`]).
    pub replicas: Vec<ReplicaConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address of the Prometheus endpoint.
    pub listen: SocketAddr,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 6432)),
            max_client_connections: 1000,
            max_message_bytes: 64 * 1024 * 1024,
            startup_timeout_ms: 10_000,
            max_startups_per_ip: 1000,
            client_idle_timeout_secs: 0,
            idle_in_transaction_timeout_secs: 0,
            shutdown_timeout_secs: 30,
            workers: 0,
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            url: "postgres://127.0.0.1:5432".to_owned(),
            connect_timeout_ms: 5_000,
            replicas: Vec::new(),
        }
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9187)),
        }
    }
}

/// Settings given on the command line or in the environment; `None` leaves
/// the file's (or the default) value alone.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub upstream: Option<String>,
    pub redis: Option<String>,
    pub disk: Option<PathBuf>,
    pub metrics: Option<SocketAddr>,
    pub no_cache: bool,
    pub workers: Option<usize>,
    pub log_format: Option<LogFormat>,
}

impl Config {
    /// Parses TOML text; `origin` names the file in error messages.
    pub fn from_toml(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_owned(),
            message: e.to_string(),
        })
    }

    /// Reads `path` (if any), applies `overrides`, validates.
    pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
                    path: path.to_owned(),
                    cause,
                })?;
                Self::from_toml(&text, path)?
            }
            None => Self::default(),
        };
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

    pub fn apply(&mut self, o: &Overrides) {
        if let Some(listen) = o.listen {
            self.server.listen = listen;
        }
        if let Some(upstream) = &o.upstream {
            self.upstream.url.clone_from(upstream);
        }
        if let Some(redis) = &o.redis {
            self.redis.url.clone_from(redis);
        }
        if let Some(disk) = &o.disk {
            self.cache.disk.path.clone_from(disk);
        }
        if let Some(metrics) = o.metrics {
            self.metrics.listen = metrics;
        }
        if o.no_cache {
            self.cache.enabled = false;
        }
        if let Some(workers) = o.workers {
            self.server.workers = workers;
        }
        if let Some(format) = o.log_format {
            self.log.format = format;
        }
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream.connect_timeout_ms)
    }

    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.replication.heartbeat_ms)
    }

    pub fn max_staleness(&self) -> Duration {
        Duration::from_millis(self.replication.max_staleness_ms)
    }

    pub fn startup_timeout(&self) -> Duration {
        Duration::from_millis(self.server.startup_timeout_ms)
    }

    pub fn default_ttl(&self) -> Duration {
        Duration::from_secs(self.cache.default_ttl_secs)
    }

    pub fn shared_ttl(&self) -> Duration {
        Duration::from_secs(self.cache.shared.ttl_secs)
    }

    pub fn shared_timeout(&self) -> Duration {
        Duration::from_millis(self.cache.shared.timeout_ms)
    }

    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs(self.server.shutdown_timeout_secs)
    }
}

/// Hides the password in a URL such as `redis://user:secret@host`.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let creds = &url[scheme_end + 3..at];
            match creds.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme_end + 3],
                    &creds[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(text, Path::new("test.toml"))
    }

    #[test]
    fn shipped_config_file_matches_the_built_in_defaults() {
        let text = include_str!("../../config/pgcache.toml");
        let parsed = parse(text).expect("config/pgcache.toml parses");
        assert_eq!(parsed, Config::default());
    }

    #[test]
    fn a_reload_names_each_key_that_needs_a_restart() {
        let old = Config::default();
        let mut new = parse("[server]\nworkers = 3\n[cache.local]\nmax_bytes = 1048576\n").unwrap();
        new.cache.mode = CacheMode::OptIn;
        let restart = new.keep_restart_only(&old);
        assert_eq!(restart, ["server.workers", "cache.local.max_bytes"]);
        assert_eq!(new.server, old.server, "kept as it was");
        assert_eq!(new.cache.mode, CacheMode::OptIn, "applied live");
    }

    #[test]
    fn unknown_key_is_refused_with_its_name() {
        let err = parse("[server]\nlisten_adress = \"127.0.0.1:1\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("listen_adress"), "{msg}");
        assert!(msg.contains("test.toml"), "{msg}");
    }

    #[test]
    fn bad_value_is_refused_with_its_key() {
        let err = parse("[server]\nmax_client_connections = \"many\"\n").unwrap_err();
        assert!(err.to_string().contains("max_client_connections"), "{err}");
        let err = parse("[server]\nlisten = \"not an address\"\n").unwrap_err();
        assert!(err.to_string().contains("listen"), "{err}");
    }

    #[test]
    fn validation_reports_every_problem() {
        let mut c = Config::default();
        c.server.max_client_connections = 0;
        c.server.workers = 5000;
        c.upstream.url = "postgres://[bad".to_owned();
        c.redis.url = "http://x".to_owned();
        let ConfigError::Invalid(problems) = c.validate().unwrap_err() else {
            panic!("expected Invalid")
        };
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].starts_with("server.max_client_connections"));
        assert!(problems[1].starts_with("server.workers"));
        assert!(problems[2].starts_with("upstream.url"));
        assert!(problems[3].starts_with("redis.url"));
    }

    #[test]
    fn overrides_win_over_the_file() {
        let mut c =
            parse("[server]\nlisten = \"127.0.0.1:7000\"\n[cache]\nenabled = true\n").unwrap();
        assert_eq!(c.server.listen.port(), 7000);
        c.apply(&Overrides {
            listen: Some("127.0.0.1:7001".parse().unwrap()),
            no_cache: true,
            ..Default::default()
        });
        assert_eq!(c.server.listen.port(), 7001);
        assert!(!c.cache.enabled);
    }

    #[test]
    fn redis_url_names_one_node_or_a_cluster() {
        let mut r = RedisConfig::default();
        assert_eq!(r.nodes(), None);
        r.url = "redis://a:1".to_owned();
        assert_eq!(
            r.nodes().unwrap(),
            RedisNodes {
                urls: vec!["redis://a:1".into()],
                cluster: false,
                ca_file: None,
            }
        );
        r.url = "redis://a:1, redis://b:2".to_owned();
        let n = r.nodes().unwrap();
        assert!(n.cluster);
        assert_eq!(
            n.urls,
            vec!["redis://a:1".to_owned(), "redis://b:2".to_owned()]
        );
        r.url = "redis+cluster://a:1".to_owned();
        assert_eq!(
            r.nodes().unwrap(),
            RedisNodes {
                urls: vec!["redis://a:1".into()],
                cluster: true,
                ca_file: None,
            }
        );
        r.ca_file = "/etc/redis-ca.pem".into();
        assert_eq!(r.nodes().unwrap().ca_file, Some("/etc/redis-ca.pem".into()));
        let mut c = Config::default();
        c.redis.url = "redis://ok:1,http://bad".to_owned();
        c.cache.shared.ttl_secs = 0;
        let ConfigError::Invalid(problems) = c.validate().unwrap_err() else {
            panic!("expected Invalid")
        };
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("http://bad"), "{problems:?}");
        assert!(
            problems[1].starts_with("cache.shared.ttl_secs"),
            "{problems:?}"
        );
    }

    #[test]
    fn redact_hides_passwords_only() {
        assert_eq!(redact("redis://u:pw@h:1"), "redis://u:***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }
}
