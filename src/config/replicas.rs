//! Read replicas: the standbys of `upstream.url` that take reads
//! (`upstream.replicas`), and how reads are routed to them (`[replicas]`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One standby: a libpq URL or key=value string (TLS options as for
/// `upstream.url`), alone or with its weight.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum ReplicaConfig {
    Url(String),
    Weighted {
        url: String,
        /// Its share of routed reads, beside the others' weights.
        #[serde(default = "one")]
        weight: u32,
    },
}

fn one() -> u32 {
    1
}

impl ReplicaConfig {
    pub fn url(&self) -> &str {
        match self {
            ReplicaConfig::Url(url) | ReplicaConfig::Weighted { url, .. } => url,
        }
    }

    pub fn weight(&self) -> u32 {
        match self {
            ReplicaConfig::Url(_) => 1,
            ReplicaConfig::Weighted { weight, .. } => *weight,
        }
    }
}

/// Which reads go to the replicas.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Every statement goes to the primary.
    Off,
    /// Cache misses, and cacheable reads that bypassed the cache.
    #[default]
    Misses,
    /// Also the reads the cache may not keep but a standby answers as
    /// the primary would ([`crate::replica::Replicas::routes`]), outside a
    /// transaction block.
    AllReads,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicasConfig {
    /// Which reads the replicas take (with `upstream.replicas` listed).
    pub routing: Routing,
    /// A replica further behind the primary than this, in time, is taken
    /// out of rotation; 0: no limit.
    pub max_lag_ms: u64,
    /// The same, in bytes of WAL; 0: no limit.
    pub max_lag_bytes: u64,
    /// The primary's weight among the replicas' for routed reads; 0: the
    /// primary takes them only when no replica can.
    pub primary_weight: u32,
    /// How often each replica's replay position is read.
    pub poll_interval_ms: u64,
    /// Good polls in a row before a replica taken out is put back.
    pub healthy_polls: u32,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            routing: Routing::Misses,
            max_lag_ms: 1000,
            max_lag_bytes: 16 * 1024 * 1024,
            primary_weight: 0,
            poll_interval_ms: 100,
            healthy_polls: 3,
        }
    }
}

impl ReplicasConfig {
    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }

    /// Problems with these settings, each named by its key.
    pub fn check(&self, replicas: &[ReplicaConfig], staleness_ms: u64, problems: &mut Vec<String>) {
        for (i, replica) in replicas.iter().enumerate() {
            if let Err(e) = crate::upstream::UpstreamUrl::parse(replica.url()) {
                problems.push(format!("upstream.replicas[{i}]: {e}"));
            }
            if replica.weight() == 0 {
                problems.push(format!("upstream.replicas[{i}]: weight must be above 0"));
            }
        }
        if self.poll_interval_ms == 0 {
            problems.push("replicas.poll_interval_ms: must be above 0".to_owned());
        }
        if self.healthy_polls == 0 {
            problems.push("replicas.healthy_polls: must be at least 1".to_owned());
        }
        if self.max_lag_ms > 0 && self.max_lag_ms < self.poll_interval_ms {
            problems.push(format!(
                "replicas.max_lag_ms: {} is below replicas.poll_interval_ms ({}): \
                 a replica would be judged on positions older than its limit",
                self.max_lag_ms, self.poll_interval_ms
            ));
        }
        if self.max_lag_ms > staleness_ms {
            problems.push(format!(
                "replicas.max_lag_ms: {} is above replication.max_staleness_ms ({}): \
                 a replica's answers could be older than the cache may serve",
                self.max_lag_ms, staleness_ms
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_replica_is_a_url_or_a_url_with_its_weight() {
        let config = crate::Config::from_toml(
            "[upstream]\nreplicas = [\"postgres://a:5433\", { url = \"host=b port=5434\", weight = 3 }]\n",
            "t".as_ref(),
        )
        .expect("config");
        let replicas = &config.upstream.replicas;
        assert_eq!(replicas[0].url(), "postgres://a:5433");
        assert_eq!(replicas[0].weight(), 1);
        assert_eq!(replicas[1].url(), "host=b port=5434");
        assert_eq!(replicas[1].weight(), 3);
        config.validate().expect("valid");
    }

    #[test]
    fn bad_replica_settings_are_named_by_their_keys() {
        let config = crate::Config::from_toml(
            "[upstream]\nreplicas = [\"postgres://a?sslmode=sometimes\", { url = \"host=b\", weight = 0 }]\n\
             [replicas]\nrouting = \"misses\"\nmax_lag_ms = 5000\npoll_interval_ms = 0\n",
            "t".as_ref(),
        )
        .expect("config");
        let Err(crate::config::ConfigError::Invalid(problems)) = config.validate() else {
            panic!("invalid");
        };
        let text = problems.join("\n");
        for key in [
            "upstream.replicas[0]: sslmode",
            "upstream.replicas[1]: weight",
            "replicas.poll_interval_ms",
            "replicas.max_lag_ms: 5000 is above replication.max_staleness_ms",
        ] {
            assert!(text.contains(key), "{key} in {text}");
        }
        let bad = crate::Config::from_toml("[replicas]\nrouting = \"sometimes\"\n", "t".as_ref());
        assert!(bad.is_err(), "an unknown routing is refused");
    }
}
