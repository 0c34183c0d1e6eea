//! Checks of a configuration: every problem is reported at once, each
//! named by its key; and which sections a reload cannot change.

use super::{AuthMode, Config, ConfigError, SslMode, redact};

const MIN_MESSAGE: usize = 16 * 1024;
const MAX_MESSAGE: usize = 1 << 30;

impl Config {
    /// Checks every value and reports all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check_server(&mut problems);
        self.check_pool(&mut problems);
        self.check_replication(&mut problems);
        self.check_connections(&mut problems);
        self.check_cache(&mut problems);
        self.check_shared(&mut problems);
        self.check_access(&mut problems);
        self.replicas.check(
            &self.upstream.replicas,
            self.replication.max_staleness_ms,
            &mut problems,
        );
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    fn check_server(&self, problems: &mut Vec<String>) {
        if self.server.max_client_connections == 0 {
            problems.push("server.max_client_connections: must be at least 1".to_owned());
        }
        if !(MIN_MESSAGE..=MAX_MESSAGE).contains(&self.server.max_message_bytes) {
            problems.push(format!(
                "server.max_message_bytes: {} is outside {MIN_MESSAGE}..={MAX_MESSAGE}",
                self.server.max_message_bytes
            ));
        }
        if self.server.workers > 1024 {
            problems.push("server.workers: at most 1024 (0 = one per CPU)".to_owned());
        }
        if self.server.max_startups_per_ip == 0 {
            problems.push("server.max_startups_per_ip: must be at least 1".to_owned());
        }
        if self.server.startup_timeout_ms == 0 {
            problems.push("server.startup_timeout_ms: must be above 0".to_owned());
        }
    }

    fn check_replication(&self, problems: &mut Vec<String>) {
        let r = &self.replication;
        if r.heartbeat_ms == 0 {
            problems.push("replication.heartbeat_ms: must be above 0".to_owned());
        }
        if r.max_staleness_ms <= r.heartbeat_ms {
            problems.push(format!(
                "replication.max_staleness_ms: {} must be above replication.heartbeat_ms ({})",
                r.max_staleness_ms, r.heartbeat_ms
            ));
        }
    }

    fn check_pool(&self, problems: &mut Vec<String>) {
        let pool = &self.pool;
        let transaction = pool.mode == super::PoolMode::Transaction;
        if (pool.max_idle_servers > 0 || transaction) && pool.server_idle_timeout_secs == 0 {
            problems.push("pool.server_idle_timeout_secs: must be above 0".to_owned());
        }
        if transaction {
            if pool.default_pool_size == 0 {
                problems.push("pool.default_pool_size: must be above 0".to_owned());
            }
            if pool.min_pool_size > pool.default_pool_size {
                problems.push(format!(
                    "pool.min_pool_size: {} is above pool.default_pool_size ({})",
                    pool.min_pool_size, pool.default_pool_size
                ));
            }
            if pool.max_prepared_statements == 0 {
                problems.push("pool.max_prepared_statements: must be above 0".to_owned());
            }
        }
        if pool.check_timeout_ms == 0 {
            problems.push("pool.check_timeout_ms: must be above 0".to_owned());
        }
    }

    fn check_cache(&self, problems: &mut Vec<String>) {
        if self.cache.max_entry_bytes == 0
            || (self.cache.local.max_bytes > 0
                && self.cache.max_entry_bytes as u64 > self.cache.local.max_bytes)
        {
            problems.push(format!(
                "cache.max_entry_bytes: {} must be between 1 and cache.local.max_bytes ({})",
                self.cache.max_entry_bytes, self.cache.local.max_bytes
            ));
        }
        if !(0.0..=1.0).contains(&self.cache.verify_sample_rate) {
            problems.push(format!(
                "cache.verify_sample_rate: {} must be between 0 and 1",
                self.cache.verify_sample_rate
            ));
        }
        for (i, rule) in self.cache.tables.iter().enumerate() {
            if rule.name.trim().is_empty() {
                problems.push(format!("cache.tables[{i}].name: must not be empty"));
            }
            if rule.ttl_secs == Some(0) {
                problems.push(format!("cache.tables[{i}].ttl_secs: must be above 0"));
            }
            if rule.ttl_only && rule.ttl_secs.is_none() {
                problems.push(format!(
                    "cache.tables[{i}] ({}): ttl_only needs ttl_secs, the only way its changes are seen",
                    rule.name
                ));
            }
        }
        if self.cache.coalesce_wait_ms > 60_000 {
            problems.push(format!(
                "cache.coalesce_wait_ms: {} is above 60000",
                self.cache.coalesce_wait_ms
            ));
        }
        if self.cache.first_read_wait_ms > 10_000 {
            problems.push(format!(
                "cache.first_read_wait_ms: {} is above 10000",
                self.cache.first_read_wait_ms
            ));
        }
        let disk = &self.cache.disk;
        if disk.enabled() && disk.max_bytes < crate::cache::disk::MIN_BYTES {
            problems.push(format!(
                "cache.disk.max_bytes: {} is below {} (a disk tier needs at least a few blocks)",
                disk.max_bytes,
                crate::cache::disk::MIN_BYTES
            ));
        }
        if disk.enabled() && !(1..=10_000).contains(&disk.read_timeout_ms) {
            problems.push(format!(
                "cache.disk.read_timeout_ms: {} must be between 1 and 10000",
                disk.read_timeout_ms
            ));
        }
        if self.replication.publication.is_empty() {
            problems.push("replication.publication: must not be empty".to_owned());
        }
    }

    fn check_shared(&self, problems: &mut Vec<String>) {
        let shared = &self.cache.shared;
        if shared.ttl_secs == 0 {
            problems.push(
                "cache.shared.ttl_secs: must be above 0 (every Redis key has a TTL)".to_owned(),
            );
        }
        if shared.timeout_ms == 0 || shared.timeout_ms > 10_000 {
            problems.push(format!(
                "cache.shared.timeout_ms: {} is outside 1..=10000",
                shared.timeout_ms
            ));
        }
        if shared.max_entry_bytes == 0 || shared.max_entry_bytes > 512 * 1024 * 1024 {
            problems.push(format!(
                "cache.shared.max_entry_bytes: {} is outside 1..=536870912 (Redis's largest value)",
                shared.max_entry_bytes
            ));
        }
        if shared.breaker_failures == 0 {
            problems.push("cache.shared.breaker_failures: must be at least 1".to_owned());
        }
        if shared.max_pending_stores == 0 {
            problems.push("cache.shared.max_pending_stores: must be at least 1".to_owned());
        }
        if shared.prefix.contains(char::is_whitespace) {
            problems.push(format!(
                "cache.shared.prefix: {:?} must not contain whitespace",
                shared.prefix
            ));
        }
    }

    /// `upstream.url` and `redis.url`.
    fn check_connections(&self, problems: &mut Vec<String>) {
        if self.upstream.connect_timeout_ms == 0 {
            problems.push("upstream.connect_timeout_ms: must be above 0".to_owned());
        }
        if let Err(e) = crate::upstream::UpstreamUrl::parse(&self.upstream.url) {
            problems.push(format!("upstream.url: {e}"));
        }
        if let Some(nodes) = self.redis.nodes() {
            for url in &nodes.urls {
                if let Err(e) = redis::Client::open(url.as_str()) {
                    problems.push(format!("redis.url: {:?}: {e}", redact(url)));
                }
            }
            if nodes.cluster
                && nodes
                    .urls
                    .iter()
                    .any(|u| u.starts_with("unix:") || u.starts_with("redis+unix:"))
            {
                problems.push(
                    "redis.url: a Redis Cluster is reached over TCP, not Unix sockets".to_owned(),
                );
            }
        }
    }

    /// Authentication, the admin console and TLS.
    fn check_access(&self, problems: &mut Vec<String>) {
        problems.extend(crate::scram::validate_users(&self.auth.users));
        if self.auth.mode == AuthMode::Terminate
            && self.auth.users.is_empty()
            && self.auth.auth_query.is_empty()
        {
            problems.push(
                "auth.mode = \"terminate\" needs auth.users or auth.auth_query to check passwords against"
                    .to_owned(),
            );
        }
        if !self.admin.password.is_empty()
            && (self.admin.database.is_empty() || self.admin.user.is_empty())
        {
            problems.push(
                "admin.database and admin.user: must not be empty when admin.password is set"
                    .to_owned(),
            );
        }
        if self.tls.ssl_mode != SslMode::Disable
            && (self.tls.cert_file.as_os_str().is_empty()
                || self.tls.key_file.as_os_str().is_empty())
        {
            problems.push(
                "tls.cert_file and tls.key_file: needed when tls.ssl_mode is allow or require"
                    .to_owned(),
            );
        }
    }

    /// After a reload: keeps this configuration's sections that apply only
    /// at restart as they are in `old` (in force), and names those that
    /// changed.
    pub fn keep_restart_only(&mut self, old: &Config) -> Vec<String> {
        /// Keeps `old`, naming each key of it that `new` changed
        /// (`server.workers`, not `server`).
        fn keep<T: PartialEq + Clone + serde::Serialize>(
            new: &mut T,
            old: &T,
            name: &str,
            out: &mut Vec<String>,
        ) {
            if new == old {
                return;
            }
            let table = |v: &T| match toml::Value::try_from(v) {
                Ok(toml::Value::Table(t)) => Some(t),
                _ => None,
            };
            match (table(new), table(old)) {
                (Some(n), Some(o)) => {
                    let keys: std::collections::BTreeSet<&String> =
                        n.keys().chain(o.keys()).collect();
                    out.extend(
                        keys.into_iter()
                            .filter(|k| n.get(*k) != o.get(*k))
                            .map(|k| format!("{name}.{k}")),
                    );
                }
                _ => out.push(name.to_owned()),
            }
            *new = old.clone();
        }
        let mut changed = Vec::new();
        let c = &mut changed;
        keep(&mut self.server, &old.server, "server", c);
        keep(&mut self.upstream, &old.upstream, "upstream", c);
        keep(&mut self.redis, &old.redis, "redis", c);
        keep(&mut self.metrics, &old.metrics, "metrics", c);
        keep(&mut self.replication, &old.replication, "replication", c);
        keep(
            &mut self.cache.enabled,
            &old.cache.enabled,
            "cache.enabled",
            c,
        );
        let max_entry = &old.cache.max_entry_bytes;
        keep(
            &mut self.cache.max_entry_bytes,
            max_entry,
            "cache.max_entry_bytes",
            c,
        );
        keep(&mut self.cache.local, &old.cache.local, "cache.local", c);
        keep(&mut self.cache.shared, &old.cache.shared, "cache.shared", c);
        keep(&mut self.tls.ssl_mode, &old.tls.ssl_mode, "tls.ssl_mode", c);
        keep(&mut self.auth.mode, &old.auth.mode, "auth.mode", c);
        keep(&mut self.pool.mode, &old.pool.mode, "pool.mode", c);
        keep(&mut self.log, &old.log, "log", c);
        changed
    }
}
