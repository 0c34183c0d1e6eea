//! What pgcache keeps per database: its versions, what it knows of its catalog, the
//! health of its replication stream and its sync state with the shared tier.
//! Each is its own type, written by one party: sessions and the replication
//! stream bump versions, the stream reports its health, the shared tier
//! records its sync.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::carry::CarriedDb;
use super::catalog::Catalog;
use super::hold::Hold;
use super::shared::state::SharedSync;
pub use super::stream::{StreamHealth, UNPUBLISHED_WARN_EVERY, Unfresh};
use super::versions::{Bumps, Ddl, Family, Versions};
use crate::metrics::DbMetrics;

/// Everything pgcache keeps for one database.
#[derive(Default)]
pub struct DbState {
    pub name: String,
    pub versions: Versions,
    pub catalog: Catalog,
    pub stream: StreamHealth,
    pub sync: SharedSync,
    pub hold: Hold,
    /// This database's lookup counters, resolved once.
    pub metrics: OnceLock<DbMetrics>,
    /// Mixed into its disk-tier keys: new with each state of the
    /// database, unless carried from the last run with its counters. The
    /// disk may hold entries of an earlier run keyed under counters that
    /// restarted from zero: under another nonce they are out of reach.
    pub disk_nonce: u128,
    /// The persistent slot to read the changes made since the last run
    /// from, when its counters were carried ([`super::carry`]).
    pub resume: std::sync::Mutex<Option<String>>,
    /// Its disk entries were carried from the last run: its first
    /// statements wait a little for its stream, which makes them servable.
    pub carried: bool,
}

impl DbState {
    /// Bumps the local counters only (see [`super::Cache::invalidate`] for
    /// the order that keeps the shared tier coherent).
    pub fn apply_local(&self, bumps: &Bumps) {
        let bump = |version: &super::versions::Version| match bumps.lsn {
            Some(lsn) => version.bump_at(lsn),
            None => version.bump_local(),
        };
        for f in &bumps.families {
            bump(&f.version);
        }
        self.catalog.forget(&bumps.ddl);
        if !bumps.ddl.is_none() {
            self.versions.schema_changed();
            self.stream.ddl_named(&bumps.ddl);
        }
        if !bumps.ddl.is_none() || bumps.epoch {
            bump(&self.versions.epoch);
        }
    }

    /// The position a server must have replayed past to answer as of
    /// `version` of this database; `None` while a bump's is not known.
    pub fn floor(&self, version: &super::versions::Version) -> Option<u64> {
        version.floor(|at| self.stream.covering(at))
    }

    /// The position the state of `reads` is as of: the last change of
    /// each, and the epoch; `None` while any is not known.
    pub fn reads_floor(&self, reads: &[Arc<Family>]) -> Option<u64> {
        let mut floor = self.floor(&self.versions.epoch)?;
        for family in reads {
            floor = floor.max(self.floor(&family.version)?);
        }
        Some(floor)
    }

    /// The bumps a user asks for by name (an admin command, or a NOTIFY on
    /// `pgcache_invalidate`): `tag:NAME` bumps a tag, `table:NAME` (or a
    /// bare NAME) a table and its partition tree. `None`: not a name.
    pub fn named_bumps(&self, item: &str) -> Option<Bumps> {
        let item = item.trim();
        let mut bumps = Bumps::default();
        match item.split_once(':') {
            Some(("tag", tag)) if crate::hints::valid_tag(tag) => {
                bumps.add_family(self.versions.tag(tag))
            }
            Some(("table", table)) if !table.is_empty() => {
                self.relation_families(table, &mut bumps)
            }
            None if !item.is_empty() => self.relation_families(item, &mut bumps),
            _ => return None,
        }
        Some(bumps)
    }

    /// A replicated change of relation `name`: its families (below), and
    /// where this instance reads it by row, the stripes of the rows it
    /// changed (`rows`: their stripes under an identity signature; `None`
    /// for a change of the whole table, or of rows the stream could not
    /// key). Under another identity than the one its plans hash under (the
    /// identity changed, and the facts are older), the whole table, and
    /// its facts are fetched again. The stripes of a table this instance
    /// does not key by row move in Redis only, for the instances that do
    /// (whose streams may be down).
    pub fn relation_changed(&self, name: &str, rows: Option<(u64, &[usize])>, bumps: &mut Bumps) {
        let table = self.versions.family(name);
        match (table.rows(), rows) {
            // Moved in Redis for the instances that key it.
            (None, Some((_, stripes))) => {
                self.table_families(name, bumps);
                bumps.elsewhere.extend(
                    stripes
                        .iter()
                        .map(|s| format!("{name}#k{}", s % super::rowkey::STRIPES)),
                );
            }
            (Some(keyed), Some((signature, stripes))) if signature == keyed.signature() => {
                self.table_families(name, bumps);
                for &stripe in stripes {
                    bumps.add_family(Arc::clone(&keyed.stripes[stripe % super::rowkey::STRIPES]));
                }
            }
            (keyed, rows) => {
                if keyed.is_some() && rows.is_some() {
                    self.catalog.forget(&Ddl::objects([name.to_owned()]));
                }
                self.relation_families(name, bumps);
            }
        }
    }

    /// The families a change of relation `name` as a whole invalidates: its
    /// own, its partition tree's if the catalog knows it, and the `wide`
    /// of each, which its reads by row read.
    pub fn relation_families(&self, name: &str, bumps: &mut Bumps) {
        let mut tables = Bumps::default();
        self.table_families(name, &mut tables);
        for family in tables.families {
            bumps.add_family(self.versions.wide(&family));
            bumps.add_family(family);
        }
    }

    /// Relation `name`'s own family, and its partition tree's.
    fn table_families(&self, name: &str, bumps: &mut Bumps) {
        bumps.add_family(self.versions.family(name));
        if let Some(facts) = self.catalog.relation(name)
            && facts.family != name
        {
            bumps.add_family(self.versions.family(&facts.family));
        }
    }
}

/// Every database this instance has served, by name.
#[derive(Default)]
pub struct Databases {
    map: Mutex<HashMap<String, Arc<DbState>>>,
    /// What the last run carried for databases not seen yet.
    carried: Mutex<HashMap<String, CarriedDb>>,
}

impl Databases {
    /// Every database seen so far, for metrics and readiness.
    pub fn all(&self) -> Vec<(String, Arc<DbState>)> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }

    pub fn get_or_add(&self, name: &str) -> Arc<DbState> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(map.entry(name.to_owned()).or_insert_with(|| {
            let carried = self
                .carried
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(name);
            let db = DbState {
                name: name.to_owned(),
                disk_nonce: carried.as_ref().map_or_else(rand::random, |c| c.nonce),
                carried: carried.is_some(),
                ..DbState::default()
            };
            if let Some(c) = carried {
                db.versions.restore(c.epoch, &c.families);
                *db.resume.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.slot);
            }
            Arc::new(db)
        }))
    }

    /// Hands over what the last run carried ([`super::carry`]).
    pub fn carry(&self, databases: impl IntoIterator<Item = (String, CarriedDb)>) {
        let mut carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        carried.extend(databases);
    }

    /// The databases carried and not seen yet.
    pub fn carried_names(&self) -> Vec<String> {
        let carried = self.carried.lock().unwrap_or_else(|e| e.into_inner());
        carried.keys().cloned().collect()
    }

    /// The state of a database this instance already serves.
    pub fn get(&self, name: &str) -> Option<Arc<DbState>> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get(name).cloned()
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_invalidations_are_tags_or_tables() {
        let db = DbState::default();
        let names = |item: &str| {
            db.named_bumps(item).map(|b| {
                b.families
                    .iter()
                    .map(|f| f.name.to_string())
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(names("tag:pricing"), Some(vec!["#tag:pricing".to_owned()]));
        // A table as a whole: its reads by row too.
        let table = Some(vec!["orders#all".to_owned(), "orders".to_owned()]);
        assert_eq!(names(" table:orders "), table);
        assert_eq!(names("orders"), table);
        assert_eq!(names("tag:"), None);
        assert_eq!(names("tag:a b"), None);
        assert_eq!(names("color:red"), None);
    }

    #[test]
    fn an_unpublishable_table_is_reported_once_per_change() {
        let health = StreamHealth::default();
        let t = |q: &str, b: &str| (q.to_owned(), b.to_owned());
        let news = health.note_unpublished(None, vec![t("public.a", "a"), t("public.b", "b")]);
        assert_eq!(news, ["public.a", "public.b"]);
        // DDL on `a` checks it again: nothing new to report.
        let again = health.note_unpublished(Some(&["a".to_owned()]), vec![t("public.a", "a")]);
        assert!(again.is_empty());
        assert_eq!(health.unpublished(), 2);
        // `b` got a primary key: it leaves the list...
        assert!(
            health
                .note_unpublished(Some(&["b".to_owned()]), vec![])
                .is_empty()
        );
        assert_eq!(health.unpublished(), 1);
        // ...and is reported again if it loses it.
        let lost = health.note_unpublished(Some(&["b".to_owned()]), vec![t("public.b", "b")]);
        assert_eq!(lost, ["public.b"]);
        // A full sync replaces the list.
        assert!(
            health
                .note_unpublished(None, vec![t("public.b", "b")])
                .is_empty()
        );
        assert_eq!(health.unpublished(), 1);
        // One bare name in two schemas: DDL that names it checks both.
        let both = health.note_unpublished(
            Some(&["a".to_owned()]),
            vec![t("s.a", "a"), t("public.a", "a")],
        );
        assert_eq!(both, ["s.a", "public.a"]);
        assert_eq!(health.unpublished(), 3);
        assert_eq!(health.unpublished_names(), ["public.a", "public.b", "s.a"]);
        let one_left = health.note_unpublished(Some(&["a".to_owned()]), vec![t("s.a", "a")]);
        assert!(one_left.is_empty());
        assert_eq!(health.unpublished(), 2);
        assert_eq!(health.unpublished_names(), ["public.b", "s.a"]);
    }

    #[test]
    fn ddl_forgets_what_it_touched_and_moves_the_epoch() {
        use super::super::catalog::{FuncFacts, RelFacts};
        let db = DbState::default();
        let (facts, queued) = db.catalog.facts(["t", "u"], ["f"]);
        assert!(queued && !facts.complete());
        let wanted = db.catalog.take_wanted();
        let rel = RelFacts {
            readable: true,
            write_hazard: false,
            family: String::new(),
            ttl_ok: true,
            table: true,
            policy_functions: Vec::new(),
            identity: None,
        };
        let mut fetched = super::super::catalog::Fetched::default();
        for name in ["t", "u"] {
            let family = name.to_owned();
            fetched.rels.insert(
                name.into(),
                RelFacts {
                    family,
                    ..rel.clone()
                },
            );
        }
        let func = FuncFacts {
            immutable: true,
            may_write: false,
            stable: true,
        };
        fetched.funcs.insert("f".into(), func);
        db.catalog.install(&wanted, fetched);
        assert!(db.catalog.knows(&["t", "u"], &["f"]));
        let table = db.versions.family("t");
        let mut bumps = Bumps::default();
        bumps.add_family(Arc::clone(&table));
        let generation = db.catalog.generation();
        db.apply_local(&bumps);
        assert_eq!((table.version.local(), db.versions.epoch.local()), (1, 0));
        assert_eq!(
            db.catalog.generation(),
            generation,
            "a write keeps the catalog"
        );
        db.apply_local(&Bumps::ddl(Ddl::objects(["t"])));
        assert_eq!(db.versions.epoch.local(), 1);
        assert!(!db.catalog.knows(&["t"], &[]), "DDL on t forgets t");
        assert!(db.catalog.knows(&["u"], &["f"]), "and only t");
        assert!(db.catalog.generation() > generation);
        db.apply_local(&Bumps::opaque());
        assert!(
            !db.catalog.knows(&["u"], &[]),
            "unknown DDL forgets everything"
        );
    }
}
