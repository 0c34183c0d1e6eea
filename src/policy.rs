//! The caching policy from `[cache]`: mode, rules per table, role and
//! database. Swapped whole by `RELOAD`; sessions notice through its
//! generation and re-plan.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::config::{CacheConfig, CacheMode, TableRule};

#[derive(Debug, Default)]
pub struct Policy {
    pub generation: u64,
    pub mode: CacheMode,
    /// `None`: entries live until evicted or invalidated.
    pub default_ttl: Option<Duration>,
    pub refresh_after: Option<Duration>,
    pub coalesce_wait: Duration,
    /// `cache.first_read_wait_ms`.
    pub first_read_wait: Duration,
    /// The share of hits the correctness sampler checks, and at most how
    /// many a second.
    pub verify_rate: f64,
    pub verify_max_per_sec: u32,
    /// `cache.adaptive_admission`.
    pub admission: bool,
    tables: HashMap<String, TableRule>,
    roles: BTreeMap<String, bool>,
    databases: BTreeMap<String, bool>,
}

impl Policy {
    pub fn new(config: &CacheConfig, generation: u64) -> Self {
        let nonzero = |secs: u64| (secs > 0).then(|| Duration::from_secs(secs));
        Self {
            generation,
            mode: config.mode,
            default_ttl: nonzero(config.default_ttl_secs),
            refresh_after: nonzero(config.refresh_after_secs),
            coalesce_wait: Duration::from_millis(config.coalesce_wait_ms),
            first_read_wait: Duration::from_millis(config.first_read_wait_ms),
            verify_rate: config.verify_sample_rate,
            verify_max_per_sec: config.verify_max_per_sec,
            admission: config.adaptive_admission,
            tables: config
                .tables
                .iter()
                .map(|rule| (bare_name(&rule.name).to_owned(), rule.clone()))
                .collect(),
            roles: config.roles.clone(),
            databases: config.databases.clone(),
        }
    }

    /// The rule for a relation, by the name pgcache knows it by.
    pub fn table(&self, name: &str) -> Option<&TableRule> {
        self.tables.get(name)
    }

    pub fn role_allowed(&self, role: &str) -> bool {
        self.roles.get(role).copied().unwrap_or(true)
    }

    pub fn database_allowed(&self, database: &str) -> bool {
        self.databases.get(database).copied().unwrap_or(true)
    }
}

/// `schema.name` → `name` (pgcache tracks relations by name).
fn bare_name(name: &str) -> &str {
    name.rsplit_once('.')
        .map_or(name, |(_, n)| n)
        .trim_matches('"')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_by_bare_name_and_on_off_lists() {
        let mut c = CacheConfig::default();
        c.tables.push(TableRule {
            name: "public.audit".into(),
            cache: false,
            ttl_secs: None,
            ttl_only: false,
        });
        c.roles.insert("reporting".into(), false);
        c.databases.insert("analytics".into(), false);
        c.default_ttl_secs = 0;
        let p = Policy::new(&c, 1);
        assert!(!p.table("audit").unwrap().cache);
        assert!(p.table("other").is_none());
        assert!(!p.role_allowed("reporting"));
        assert!(p.role_allowed("app"));
        assert!(!p.database_allowed("analytics"));
        assert!(p.database_allowed("shop"));
        assert_eq!(p.default_ttl, None);
    }
}
