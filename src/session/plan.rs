//! What a statement text means for the cache, given the facts known of the
//! names it references and the policy: worked out once per statement shape
//! and database (memoised until facts are forgotten or the policy changes),
//! by pure functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::cache::catalog::Facts;
use crate::cache::database::DbState;
use crate::cache::rowkey::Values;
use crate::cache::stats::QueryStats;
use crate::cache::versions::Family;
use crate::cache::versions::Versions;
use crate::cache::{Analyzed, Bumps, Lifetime, Reads};
use crate::classify::{Analysis, Begin, BypassReason, Ddl, Effect, StatementInfo};
use crate::config::CacheMode;
use crate::hints::{Hints, Tier};
use crate::policy::Policy;
use crate::session::keyed::{self, Keyed};

pub(super) struct Plan {
    /// Catalog generation the plan was made with.
    pub generation: u64,
    pub policy_generation: u64,
    /// How entries of a cacheable read are kept.
    pub lifetime: Lifetime,
    pub tier: Tier,
    pub stats: Arc<QueryStats>,
    /// For a cacheable single SELECT: the version counters of its tables.
    pub read: Result<Reads, BypassReason>,
    /// A cacheable read of one table's rows by key: what it reads instead
    /// of `read`, for the rows each run names ([`Keyed::reads`]).
    pub keyed: Option<Arc<Keyed>>,
    /// Invalidations it causes when it completes. A write moves the
    /// versions of the tables it writes and their `wide` (every read of
    /// them by row), unless a run's rows are known ([`Self::keyed_write`]).
    pub effects: Bumps,
    /// A write of one table's rows by key: a run whose rows are known
    /// moves `effects` without the table's `wide`, and the rows' stripes.
    pub keyed_write: Option<(Arc<Keyed>, Bumps)>,
    /// It may change the session's settings.
    pub settings: bool,
    /// It may write (starts "after a write" in a transaction).
    pub writes: bool,
    pub creates_temp: bool,
    /// It starts a transaction block, so.
    pub begins: Option<Begin>,
    /// A cacheable read of a relation replication cannot watch (cached by
    /// TTL): its entries may lag PostgreSQL within their lifetime.
    pub unwatched: bool,
    /// Every function it calls is known to leave the database alone and
    /// to answer alike on any server of the cluster, and every relation it
    /// names is a permanent one outside the system schemas (a standby
    /// refuses unlogged tables; statistics are its own): a standby may run
    /// it (`replicas.routing = "all_reads"`).
    pub replica_safe: bool,
    /// `/*+ explain */`: the client is told where the answer came from.
    pub explain: bool,
}

/// Bounds [`SharedPlans`]: past it the memo starts again.
const MAX_SHARED_PLANS: usize = 16 * 1024;

/// The database state's address, and the plan key.
type SharedKey = (usize, u128);

/// The plan, and the database state it was made for.
type SharedPlan = (Weak<DbState>, Arc<Plan>);

/// Plans shared by every session, by database and plan key. A session's
/// first statement of a shape takes the plan another session made rather
/// than gathering the shape's facts and planning it again: a client that
/// connects for each transaction would otherwise do that for every
/// statement. Each session still keeps its own memo in front of this one,
/// which it reads without a lock.
#[derive(Default)]
pub struct SharedPlans {
    /// Keyed by the database state's address. The weak reference tells a
    /// dropped state (whose address another may take) from a live one.
    plans: Mutex<HashMap<SharedKey, SharedPlan, foldhash::fast::RandomState>>,
}

impl SharedPlans {
    pub(super) fn get(
        &self,
        db: &Arc<DbState>,
        plan_key: u128,
        generation: u64,
        policy_generation: u64,
    ) -> Option<Arc<Plan>> {
        let plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let (owner, plan) = plans.get(&(Arc::as_ptr(db) as usize, plan_key))?;
        (owner.strong_count() > 0
            && plan.generation == generation
            && plan.policy_generation == policy_generation)
            .then(|| Arc::clone(plan))
    }

    /// Keeps a plan made from complete facts.
    pub(super) fn put(&self, db: &Arc<DbState>, plan_key: u128, plan: &Arc<Plan>) {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if plans.len() >= MAX_SHARED_PLANS {
            plans.clear();
        }
        plans.insert(
            (Arc::as_ptr(db) as usize, plan_key),
            (Arc::downgrade(db), Arc::clone(plan)),
        );
    }
}

impl Plan {
    /// What one run of a simple Query's text `sql` under it moves.
    pub(super) fn text_effects(&self, versions: &Versions, sql: &[u8]) -> Bumps {
        if self.keyed_write.is_none() {
            return self.effects.clone();
        }
        let Ok(sql) = std::str::from_utf8(sql) else {
            return self.effects.clone();
        };
        let literals = crate::hints::literals(sql);
        let values = Values {
            literals: &literals,
            bound: None,
        };
        keyed::run_effects(&self.effects, self.keyed_write.as_ref(), versions, values)
    }

    /// The tables whose keying by row it began, if any: this instance's
    /// mirrors of their rows' counters are to be read from Redis before
    /// their reads by row use the shared tier.
    pub(super) fn began(&self) -> Vec<Arc<Family>> {
        let keyed = self
            .keyed
            .iter()
            .chain(self.keyed_write.iter().map(|(k, _)| k));
        keyed
            .filter(|k| k.began)
            .map(|k| Arc::clone(&k.table))
            .collect()
    }

    /// Whether it is a cacheable read, or why not, without its tables.
    pub fn read_or_why(&self) -> Result<(), BypassReason> {
        self.read.as_ref().map(|_| ()).map_err(|r| *r)
    }

    /// The relation and function names whose facts can change this text's
    /// plan: a cacheable read's (are its tables watched, its functions
    /// immutable?), a write's targets (which versions does it bump?), and
    /// functions called outside DDL (may they write?). DDL and other opaque
    /// statements bump everything whatever the facts say: they need none.
    /// With `every_read` (`replicas.routing = "all_reads"`), the tables of
    /// a read the cache may not keep for its functions or a time literal
    /// too: a standby may take it if they are permanent.
    pub fn names(analyzed: &Analyzed, every_read: bool) -> (Vec<&str>, Vec<&str>) {
        let analysis = &analyzed.analysis;
        let mut rels: Vec<&str> = Vec::new();
        let mut funcs: Vec<&str> = Vec::new();
        let read = match analysis.statements.as_slice() {
            [one] => match one.cacheable {
                Ok(()) => Some(one),
                Err(BypassReason::VolatileFunction | BypassReason::TimeLiteral) if every_read => {
                    Some(one)
                }
                Err(_) => None,
            },
            _ => None,
        };
        if let Some(st) = read {
            rels.extend(st.relations.iter().map(|r| r.name.as_str()));
        }
        for st in &analysis.statements {
            match &st.effect {
                Effect::Opaque => continue,
                Effect::Write(targets) => rels.extend(targets.iter().map(|r| r.name.as_str())),
                _ => {}
            }
            funcs.extend(st.functions.iter().map(String::as_str));
        }
        rels.sort_unstable();
        rels.dedup();
        funcs.sort_unstable();
        funcs.dedup();
        (rels, funcs)
    }

    pub fn new(
        analyzed: &Analyzed,
        facts: &Facts,
        versions: &Versions,
        generation: u64,
        policy: &Policy,
    ) -> Plan {
        let hints = &analyzed.scan.hints;
        let mut plan = Plan {
            generation,
            policy_generation: policy.generation,
            lifetime: Lifetime::default(),
            tier: hints.tier,
            stats: Arc::clone(&analyzed.stats),
            read: Err(BypassReason::NotSelect),
            keyed: None,
            effects: Bumps::default(),
            keyed_write: None,
            settings: false,
            writes: false,
            creates_temp: false,
            begins: None,
            unwatched: false,
            replica_safe: true,
            explain: hints.explain,
        };
        for st in &analyzed.analysis.statements {
            plan.add_effects(st, facts, versions);
            plan.replica_safe &= st
                .relations
                .iter()
                .all(|rel| facts.relation(&rel.name).is_some_and(|f| f.ttl_ok));
        }
        // Every read of a written table by row misses, unless a run's rows
        // are known.
        let by_table = plan.effects.clone();
        for table in &by_table.families {
            plan.effects.add_family(versions.wide(table));
        }
        plan.keyed_write =
            Keyed::write(&analyzed.analysis, facts, versions).map(|keyed| (keyed, by_table));
        let mut ttl = hints.ttl;
        let mut unwatched = false;
        plan.read = read_of(
            &analyzed.analysis,
            hints,
            facts,
            policy,
            &mut ttl,
            &mut unwatched,
        )
        .map(|families| {
            let tables = families.iter().map(|f| versions.family(f));
            // A tag is read like a table: bumping it retires the entry.
            tables
                .chain(hints.tags.iter().map(|t| versions.tag(t)))
                .collect()
        });
        plan.unwatched = unwatched;
        if plan.read.is_ok() && !unwatched {
            plan.keyed = Keyed::read(&analyzed.analysis, hints, facts, versions);
        }
        let ttl = ttl.or(policy.default_ttl);
        let refresh = hints
            .refresh
            .or(policy.refresh_after)
            .filter(|r| ttl.is_none_or(|t| *r < t));
        plan.lifetime = Lifetime { ttl, refresh };
        plan
    }

    /// What one statement changes: versions of what it writes (the epoch
    /// when that is unknown), the session's settings, the transaction.
    fn add_effects(&mut self, st: &StatementInfo, facts: &Facts, versions: &Versions) {
        match &st.effect {
            Effect::None => {}
            Effect::Write(rels) => {
                self.writes = true;
                for rel in rels {
                    match facts.relation(&rel.name) {
                        Some(facts) if !facts.write_hazard => {
                            self.effects.add_family(versions.family(&facts.family));
                        }
                        _ => self.effects.epoch = true,
                    }
                }
            }
            Effect::Settings => self.settings = true,
            Effect::Begin(begin) => self.begins = Some(*begin),
            Effect::Opaque => {
                self.effects.merge(&Bumps::ddl(st.ddl.clone()));
                // DDL whose objects the parser named cannot change the
                // session's settings (functions it calls are checked below);
                // anything else might.
                self.settings |= st.ddl == Ddl::All;
                self.writes = true;
            }
        }
        for f in &st.functions {
            self.replica_safe &= facts.function(f).is_some_and(|f| f.stable) && !server_local(f);
            match facts.function(f) {
                Some(facts) if !facts.may_write => {}
                _ => {
                    // A function that may write, or one not known yet.
                    self.effects.epoch = true;
                    self.writes = true;
                    self.settings = true;
                }
            }
            if f == "set_config" {
                self.settings = true;
            }
        }
        self.creates_temp |= st.creates_temp;
    }
}

/// A function whose answer is the server's own, not the cluster's: the
/// backend's pid or address, a transaction id, or a `pg_` function (WAL
/// positions, statistics, recovery, configuration files).
fn server_local(function: &str) -> bool {
    ["pg_", "inet_", "txid_"]
        .iter()
        .any(|prefix| function.starts_with(prefix))
}

/// Whether the statement is a read the cache may serve, and the families
/// (partition trees) it reads; narrows `ttl` to the tables' rules. Never an
/// unsafe statement, whatever the hints say.
fn read_of<'c>(
    analysis: &Analysis,
    hints: &Hints,
    known: &'c Facts,
    policy: &Policy,
    ttl: &mut Option<Duration>,
    unwatched: &mut bool,
) -> Result<Vec<&'c str>, BypassReason> {
    let st = analysis.cacheable_select()?;
    if hints.cache == Some(false) {
        return Err(BypassReason::Hint);
    }
    let pending = st.relations.iter().any(|r| known.is_pending(&r.name))
        || st.functions.iter().any(|f| known.is_pending(f));
    if pending {
        return Err(BypassReason::CatalogPending);
    }
    let mut families: Vec<&str> = Vec::with_capacity(st.relations.len());
    for rel in &st.relations {
        let facts = known
            .relation(&rel.name)
            .ok_or(BypassReason::UnknownRelation)?;
        let rule = policy.table(&rel.name);
        if rule.is_some_and(|r| !r.cache) {
            return Err(BypassReason::TableRule);
        }
        if let Some(secs) = rule.and_then(|r| r.ttl_secs) {
            let rule_ttl = Duration::from_secs(secs);
            *ttl = Some(ttl.map_or(rule_ttl, |t| t.min(rule_ttl)));
        }
        if !facts.readable {
            // Replication cannot watch it: cacheable only with a TTL the
            // user asked for, and never a temporary or system one.
            let ttl_asked = hints.ttl.is_some() || rule.is_some_and(|r| r.ttl_only);
            if !(facts.ttl_ok && ttl_asked) {
                return Err(if rel.name.starts_with("pg_") {
                    BypassReason::SystemCatalog
                } else if facts.table {
                    BypassReason::NotPublished
                } else {
                    BypassReason::NotATable
                });
            }
            *unwatched = true;
        }
        families.push(&facts.family);
    }
    if !st
        .functions
        .iter()
        .all(|f| known.function(f).is_some_and(|f| f.immutable))
    {
        return Err(BypassReason::VolatileFunction);
    }
    if policy.mode == CacheMode::OptIn && hints.cache != Some(true) {
        return Err(BypassReason::OptIn);
    }
    families.sort_unstable();
    families.dedup();
    Ok(families)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::analysis::Analyses;
    use crate::cache::catalog::{Catalog, Fetched, FuncFacts, RelFacts};
    use crate::cache::stats::StatsRegistry;
    use crate::classify::Isolation;
    use crate::config::CacheConfig;

    fn facts() -> Facts {
        let mut fetched = Fetched::default();
        for (name, readable, hazard, family) in [
            ("t", true, false, "t"),
            ("part_1", true, false, "part"),
            ("v", false, true, "v"),
            ("audited", true, true, "audited"),
            ("no_key", false, false, "no_key"),
            ("unlogged", false, false, "unlogged"),
        ] {
            let rel = RelFacts {
                readable,
                write_hazard: hazard,
                family: family.to_owned(),
                ttl_ok: name != "unlogged",
                table: name != "v",
                policy_functions: Vec::new(),
                identity: None,
            };
            fetched.rels.insert(name.to_owned(), rel);
        }
        for (name, immutable, may_write) in [
            ("lower", true, false),
            ("now", false, false),
            ("bump", false, true),
            // Stable, but the server's own.
            ("pg_backend_pid", false, false),
            ("inet_server_addr", false, false),
        ] {
            let func = FuncFacts {
                immutable,
                may_write,
                stable: !may_write,
            };
            fetched.funcs.insert(name.to_owned(), func);
        }
        Facts::from(fetched)
    }

    fn plan_with(sql: &str, policy: &Policy) -> (Plan, Versions) {
        let analyzed = Analyses::new(10).get(1, sql.as_bytes(), &StatsRegistry::new(10));
        let versions = Versions::default();
        let plan = Plan::new(&analyzed, &facts(), &versions, 3, policy);
        (plan, versions)
    }

    fn plan(sql: &str) -> Plan {
        plan_with(sql, &Policy::new(&CacheConfig::default(), 1)).0
    }

    fn read_names(p: &Plan) -> Vec<String> {
        p.read
            .as_ref()
            .unwrap()
            .iter()
            .map(|f| f.name.to_string())
            .collect()
    }

    #[test]
    fn a_shared_plan_is_the_same_databases_under_the_same_generations() {
        let shared = SharedPlans::default();
        let db = Arc::new(DbState::default());
        let other = Arc::new(DbState::default());
        let p = Arc::new(plan("SELECT * FROM t"));
        shared.put(&db, 7, &p);
        let got = shared.get(&db, 7, 3, 1).expect("kept");
        assert!(Arc::ptr_eq(&got, &p));
        assert!(shared.get(&db, 8, 3, 1).is_none(), "another shape");
        assert!(shared.get(&other, 7, 3, 1).is_none(), "another database");
        assert!(shared.get(&db, 7, 4, 1).is_none(), "facts changed since");
        assert!(shared.get(&db, 7, 3, 2).is_none(), "policy reloaded since");
        // A state made where a dropped one was does not inherit its plans.
        let dropped = Arc::downgrade(&db);
        drop(db);
        shared
            .plans
            .lock()
            .unwrap()
            .insert((Arc::as_ptr(&other) as usize, 7), (dropped, Arc::clone(&p)));
        assert!(shared.get(&other, 7, 3, 1).is_none());
    }

    #[test]
    fn a_select_of_watched_tables_reads_their_families() {
        let p = plan("SELECT * FROM part_1 JOIN t USING (id) WHERE lower(x) = 'a'");
        assert_eq!(read_names(&p), ["part", "t"], "partitions read their tree");
        assert!(p.effects.is_empty() && !p.writes && !p.settings);
        assert_eq!(p.generation, 3);
    }

    #[test]
    fn a_standby_may_run_stable_functions_but_not_volatile_or_the_servers_own() {
        assert!(plan("SELECT * FROM t WHERE lower(x) = 'a'").replica_safe);
        assert!(plan("SELECT now() FROM t").replica_safe, "stable");
        assert!(plan("SELECT current_user FROM t").replica_safe);
        assert!(!plan("SELECT bump() FROM t").replica_safe, "volatile");
        assert!(
            !plan("SELECT unknown_fn() FROM t").replica_safe,
            "not known"
        );
        assert!(
            !plan("SELECT pg_backend_pid()").replica_safe,
            "the server's"
        );
        assert!(!plan("SELECT inet_server_addr()").replica_safe);
        // Relations: a table out of the publication may go, an unlogged
        // one may not.
        assert!(plan("SELECT * FROM no_key").replica_safe);
        let unlogged = plan("SELECT * FROM unlogged");
        assert_eq!(unlogged.read.err(), Some(BypassReason::NotPublished));
        assert!(!unlogged.replica_safe);
        assert!(!plan("SELECT * FROM t JOIN unlogged USING (k)").replica_safe);
    }

    #[test]
    fn reads_the_cache_cannot_serve_say_why() {
        assert_eq!(
            plan("SELECT now() FROM t").read.err(),
            Some(BypassReason::VolatileFunction)
        );
        assert_eq!(
            plan("SELECT * FROM v").read.err(),
            Some(BypassReason::NotATable)
        );
        assert_eq!(
            plan("SELECT * FROM no_key").read.err(),
            Some(BypassReason::NotPublished)
        );
        assert_eq!(
            plan("SELECT * FROM nope").read.err(),
            Some(BypassReason::UnknownRelation)
        );
        assert_eq!(
            plan("/*+ nocache */ SELECT * FROM t").read.err(),
            Some(BypassReason::Hint)
        );
        assert_eq!(
            plan("UPDATE t SET a = 1").read.err(),
            Some(BypassReason::NotSelect)
        );
    }

    #[test]
    fn writes_bump_their_table_or_the_epoch_when_they_reach_further() {
        let (p, versions) = plan_with(
            "UPDATE t SET a = 1",
            &Policy::new(&CacheConfig::default(), 1),
        );
        assert!(p.writes && !p.effects.epoch);
        assert!(Arc::ptr_eq(&p.effects.families[0], &versions.family("t")));
        assert!(
            plan("DELETE FROM audited").effects.epoch,
            "triggers may write elsewhere"
        );
        // SQL's clock and session keywords are no functions that may write
        // (pgbench's tpcb script: a whole-database invalidation per write).
        let stamped =
            plan("INSERT INTO t VALUES (1, CURRENT_TIMESTAMP, current_date, LOCALTIME(2))");
        assert!(stamped.writes && !stamped.effects.epoch);
        assert_eq!(
            plan("SELECT CURRENT_TIMESTAMP FROM t").read.err(),
            Some(BypassReason::VolatileFunction)
        );
        let f = plan("SELECT bump()");
        assert!(
            f.effects.epoch && f.writes && f.settings,
            "a volatile user function"
        );
        let ddl = plan("CREATE TABLE x (a int)");
        assert!(ddl.effects.epoch && ddl.writes);
        assert_eq!(ddl.effects.ddl, Ddl::objects(["x"]));
        assert!(!ddl.settings, "named DDL leaves the settings alone");
        let default = plan("ALTER TABLE t ADD COLUMN c int DEFAULT next_id()");
        assert!(default.settings, "a function it runs might not");
        let opaque = plan("DO $$ BEGIN END $$");
        assert!(opaque.settings && opaque.effects.ddl == Ddl::All);
    }

    #[test]
    fn only_reads_writes_and_function_calls_need_facts() {
        let names = |sql: &str| {
            let analyzed = Analyses::new(10).get(1, sql.as_bytes(), &StatsRegistry::new(10));
            let (rels, funcs) = Plan::names(&analyzed, false);
            let owned = |v: Vec<&str>| v.into_iter().map(str::to_owned).collect::<Vec<_>>();
            (owned(rels), owned(funcs))
        };
        let strs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            names("SELECT v FROM t JOIN s.u USING (k)"),
            (strs(&["t", "u"]), vec![])
        );
        assert_eq!(names("UPDATE t SET v = 1"), (strs(&["t"]), vec![]));
        assert_eq!(names("SELECT bump()"), (vec![], strs(&["bump"])));
        // A standby may take an uncacheable read under `all_reads`, if its
        // tables are permanent.
        let sql = b"SELECT v, 'now'::timestamptz FROM t";
        let analyzed = Analyses::new(10).get(1, sql, &StatsRegistry::new(10));
        assert_eq!(Plan::names(&analyzed, false), (vec![], vec![]));
        assert_eq!(Plan::names(&analyzed, true), (vec!["t"], vec![]));
        assert_eq!(names("SET x.y = lower('A')"), (vec![], strs(&["lower"])));
        for sql in [
            "CREATE TABLE x (a int REFERENCES t)",
            "ALTER TABLE t ADD COLUMN c int DEFAULT lower('a')",
            "DROP TABLE t",
            "BEGIN",
            "SHOW search_path",
            "SELECT * FROM t FOR UPDATE",
        ] {
            assert_eq!(names(sql), (vec![], vec![]), "{sql}");
        }
    }

    #[test]
    fn a_plan_made_without_facts_is_the_one_made_with_them_when_it_needs_none() {
        for sql in ["CREATE TABLE x (a int)", "DROP TABLE t", "SHOW search_path"] {
            let analyzed = Analyses::new(10).get(1, sql.as_bytes(), &StatsRegistry::new(10));
            assert_eq!(Plan::names(&analyzed, false), (vec![], vec![]));
            let policy = Policy::new(&CacheConfig::default(), 1);
            let versions = Versions::default();
            let (with, _) = plan_with(sql, &policy);
            let without = Plan::new(&analyzed, &Facts::default(), &versions, 3, &policy);
            assert_eq!(with.read.err(), without.read.err(), "{sql}");
            assert_eq!(
                (
                    with.effects.epoch,
                    &with.effects.ddl,
                    with.effects.families.len()
                ),
                (
                    without.effects.epoch,
                    &without.effects.ddl,
                    without.effects.families.len()
                ),
                "{sql}"
            );
            assert_eq!(
                (with.settings, with.writes),
                (without.settings, without.writes)
            );
        }
    }

    #[test]
    fn a_read_whose_facts_are_being_fetched_is_a_counted_bypass() {
        let catalog = Catalog::default();
        let (pending, queued) = catalog.facts(["t"], ["lower"]);
        assert!(queued && !pending.complete());
        let sql = "SELECT lower(v) FROM t";
        let analyzed = Analyses::new(10).get(1, sql.as_bytes(), &StatsRegistry::new(10));
        let policy = Policy::new(&CacheConfig::default(), 1);
        let plan = Plan::new(&analyzed, &pending, &Versions::default(), 3, &policy);
        assert_eq!(plan.read.err(), Some(BypassReason::CatalogPending));
        let write = Analyses::new(10).get(2, b"UPDATE t SET v = 1", &StatsRegistry::new(10));
        let plan = Plan::new(&write, &pending, &Versions::default(), 3, &policy);
        assert!(
            plan.effects.epoch,
            "a write to a table not known yet bumps everything"
        );
    }

    #[test]
    fn transaction_and_settings_statements_are_noted() {
        assert_eq!(plan("BEGIN").begins, Some(Begin::AtDefault));
        assert_eq!(
            plan("BEGIN ISOLATION LEVEL SERIALIZABLE").begins,
            Some(Begin::At(Isolation::Snapshot))
        );
        assert!(plan("SET search_path = x").settings);
        assert!(plan("CREATE TEMP TABLE x (a int)").creates_temp);
    }

    #[test]
    fn the_policy_and_hints_shape_the_lifetime() {
        let config = CacheConfig {
            mode: CacheMode::OptIn,
            ..CacheConfig::default()
        };
        let policy = Policy::new(&config, 1);
        let (p, _) = plan_with("SELECT * FROM t", &policy);
        assert_eq!(p.read.err(), Some(BypassReason::OptIn));
        let (p, _) = plan_with("/*+ cache ttl=5s */ SELECT * FROM t", &policy);
        assert!(p.read.is_ok());
        assert_eq!(p.lifetime.ttl, Some(Duration::from_secs(5)));
    }
}
