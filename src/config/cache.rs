//! The cache's configuration: what is cached and for how long, the local
//! tier, and the shared (Redis) tier.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// false = pure pass-through (same as --no-cache).
    pub enabled: bool,
    /// Results larger than this are streamed to the client and not stored.
    pub max_entry_bytes: usize,
    /// Lifetime of an entry; 0 = until evicted or invalidated.
    pub default_ttl_secs: u64,
    /// `auto`: every safe SELECT; `opt_in`: only hinted ones; `shadow`:
    /// serve nothing, but do and count everything else as `auto` would.
    pub mode: CacheMode,
    /// A hit on an entry older than this refreshes it in the background;
    /// 0 = only when a hint asks (`refresh=`).
    pub refresh_after_secs: u64,
    /// How long a miss waits for a concurrent identical one to fill the
    /// cache before going to PostgreSQL itself.
    pub coalesce_wait_ms: u64,
    /// With a shared tier, how long a statement waits for this instance to
    /// be able to answer it from the cache before it goes to PostgreSQL:
    /// for the catalog facts of names not looked up yet, and for a
    /// database's first statements, its stream or another instance's
    /// vouching for the shared counters; 0 = never waits. Never for names
    /// DDL made since start.
    pub first_read_wait_ms: u64,
    /// The share of hits checked against PostgreSQL after they are served
    /// (0: none). See docs/trust.md.
    pub verify_sample_rate: f64,
    /// At most this many checks a second, whatever the rate.
    pub verify_max_per_sec: u32,
    /// A statement whose stored answers are invalidated before they are
    /// read stops being stored for a while, at most 4 s at a time (see
    /// docs/invalidation.md). Off by default: a paused statement stays
    /// uncached for up to 4 s after its writes stop.
    pub adaptive_admission: bool,
    /// Rules per table (by name, as pgcache knows tables: without schema).
    pub tables: Vec<TableRule>,
    /// Caching on or off per role (`current_user`).
    pub roles: BTreeMap<String, bool>,
    /// Caching on or off per database.
    pub databases: BTreeMap<String, bool>,
    pub local: LocalCacheConfig,
    pub disk: DiskCacheConfig,
    pub shared: SharedCacheConfig,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    #[default]
    Auto,
    OptIn,
    /// Every statement goes to PostgreSQL; pgcache classifies, keys and
    /// fills as in `auto`, and checks each would-be hit against
    /// PostgreSQL's answer.
    Shadow,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TableRule {
    /// Table, view or foreign table name (a `schema.` prefix is ignored).
    pub name: String,
    /// false: results reading it are never cached.
    #[serde(default = "yes")]
    pub cache: bool,
    /// Entries reading it live at most this long.
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    /// Cache it although replication cannot watch it (a view, a foreign
    /// table, a table without replica identity): changes are seen only
    /// when `ttl_secs` runs out.
    #[serde(default)]
    pub ttl_only: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// The virtual database that is pgcache's admin console.
    pub database: String,
    pub user: String,
    /// Empty: the console is off.
    pub password: String,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            database: "pgcache".to_owned(),
            user: "pgcache".to_owned(),
            password: String::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SharedCacheConfig {
    /// Lifetime of a Redis entry (every key gets one).
    pub ttl_secs: u64,
    /// Prefix of every Redis key and of the invalidation channel.
    pub prefix: String,
    /// Deadline of one Redis operation.
    pub timeout_ms: u64,
    /// Results larger than this are kept in the local tier only.
    pub max_entry_bytes: usize,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker keeps pgcache from trying Redis.
    pub breaker_open_ms: u64,
    /// Stores to Redis in flight at once; more are dropped (and counted).
    pub max_pending_stores: usize,
    /// What a read may miss of writes made through other instances.
    pub consistency: Consistency,
}

impl Default for SharedCacheConfig {
    fn default() -> Self {
        Self {
            ttl_secs: 300,
            prefix: "pgcache:".to_owned(),
            timeout_ms: 50,
            max_entry_bytes: 512 * 1024,
            breaker_failures: 3,
            breaker_open_ms: 2000,
            max_pending_stores: 256,
            consistency: Consistency::Eventual,
        }
    }
}

/// `cache.shared.consistency`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// A write through one instance reaches the others by pub/sub, about
    /// a millisecond later.
    #[default]
    Eventual,
    /// No read is answered from a state older than a write any instance
    /// acknowledged before the read began: each read confirms its versions
    /// with Redis first.
    ReadYourWrites,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LocalCacheConfig {
    /// Memory budget of the in-process tier, entries and bookkeeping.
    pub max_bytes: u64,
}

impl Default for LocalCacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

/// The disk tier, between memory and Redis (see docs/design.md).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiskCacheConfig {
    /// Directory of the tier's files; empty = no disk tier.
    pub path: PathBuf,
    /// Bytes the tier's files may take on disk.
    pub max_bytes: u64,
    /// A disk read slower than this counts as a miss.
    pub read_timeout_ms: u64,
    /// A restarted pgcache serves the entries it carried only if the
    /// replication slot that kept the changes made while it was stopped
    /// holds at most this much WAL; past it, the slot is dropped.
    pub max_retained_wal_bytes: u64,
}

impl DiskCacheConfig {
    pub fn enabled(&self) -> bool {
        !self.path.as_os_str().is_empty()
    }
}

impl Default for DiskCacheConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            max_bytes: 1024 * 1024 * 1024,
            read_timeout_ms: 20,
            max_retained_wal_bytes: 1024 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// Shared tier; empty = local tier only. Several comma-separated URLs,
    /// or a `redis+cluster://` URL, name the nodes of a Redis Cluster.
    pub url: String,
    /// The URL names a Redis Cluster even though it lists one node.
    pub cluster: bool,
    /// PEM CA certificate(s) trusted for `rediss://`; empty = the system's.
    pub ca_file: PathBuf,
}

/// Where the shared tier lives, parsed from `redis.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisNodes {
    pub urls: Vec<String>,
    pub cluster: bool,
    pub ca_file: Option<PathBuf>,
}

impl RedisConfig {
    /// The node URLs, or `None` when no shared tier is configured.
    pub fn nodes(&self) -> Option<RedisNodes> {
        let mut cluster = self.cluster;
        let urls: Vec<String> = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(|u| {
                for (from, to) in [
                    ("redis+cluster://", "redis://"),
                    ("rediss+cluster://", "rediss://"),
                ] {
                    if let Some(rest) = u.strip_prefix(from) {
                        cluster = true;
                        return format!("{to}{rest}");
                    }
                }
                u.to_owned()
            })
            .collect();
        cluster |= urls.len() > 1;
        let ca_file = (!self.ca_file.as_os_str().is_empty()).then(|| self.ca_file.clone());
        (!urls.is_empty()).then_some(RedisNodes {
            urls,
            cluster,
            ca_file,
        })
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_entry_bytes: 1024 * 1024,
            default_ttl_secs: 300,
            mode: CacheMode::Auto,
            refresh_after_secs: 0,
            coalesce_wait_ms: 2000,
            first_read_wait_ms: 300,
            verify_sample_rate: 0.001,
            verify_max_per_sec: 10,
            adaptive_admission: false,
            tables: Vec::new(),
            roles: BTreeMap::new(),
            databases: BTreeMap::new(),
            local: LocalCacheConfig::default(),
            disk: DiskCacheConfig::default(),
            shared: SharedCacheConfig::default(),
        }
    }
}
