//! What a session knows of itself, for the cache: its settings (as a key
//! prefix), its role, its prepared statements and portals, and the plans of
//! the statement texts it ran.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;

use super::plan::Plan;
use crate::cache::Reads;
use crate::cache::key::{self, sql_hash};
use crate::policy::Policy;
use crate::pool::marks::{Marks, marks};
use crate::pool::reference::{Freed, freed};
use crate::pool::transaction::SettingsRow;
use crate::protocol::extended;
use crate::protocol::startup::Startup;

const MAX_PLANS: usize = 4096;

/// Looked up on every statement: foldhash, not SipHash (its keys are the
/// session's own, or digests).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

fn current(plan: Option<&Arc<Plan>>, generation: u64, policy_generation: u64) -> Option<Arc<Plan>> {
    plan.filter(|p| p.generation == generation && p.policy_generation == policy_generation)
        .cloned()
}

/// A prepared statement as the client defined it.
pub(super) struct Statement {
    pub hash: u128,
    pub sql: Bytes,
    pub param_types: Bytes,
}

/// A statement text the session ran.
struct KnownText {
    plan: Arc<Plan>,
    /// Its word scan ([`crate::pool::marks`]), which depends on the text
    /// alone: once known, a repeated text skips the scan, which cost a
    /// would-be hit (shadow mode) or a hit about a tenth of its
    /// instructions.
    marks: Option<Marks>,
    /// What a keyed read of the plan reads, for this text's rows
    /// ([`crate::session::keyed`]): worked out once per text and plan.
    keyed_reads: Option<Reads>,
}

pub(super) struct Known {
    /// Hash of the session's identity and settings, with the catalog
    /// generation it was computed under. `None`: settings may have changed.
    pub prefix: Option<(u128, u64)>,
    /// The session created temporary objects: its names may shadow tables.
    pub temp: bool,
    /// The policy the plans were made under.
    pub policy: Arc<Policy>,
    /// `current_user`, read with the settings.
    pub role: Option<String>,
    /// Statement texts whose hint problems this client was told of.
    warned: HashSet<u128>,
    /// Plans by text. (Another text of a known shape finds its plan in
    /// the database's plans, [`crate::session::SharedPlans`].)
    plans: HashMap<u128, KnownText>,
    pub statements: HashMap<Bytes, Arc<Statement>>,
    /// The unnamed portal, which nearly every Bind makes: apart, as
    /// hashing its empty name into `portals` was most of a Bind's cost.
    unnamed_portal: Option<Arc<Statement>>,
    portals: HashMap<Bytes, Arc<Statement>>,
    /// Parse messages answered from the cache that the backend has not seen.
    pub unsent_parses: Vec<(Bytes, Bytes)>,
    /// The word scans of Parse texts, and with caching off of Query texts
    /// too, by hash of the text (a Parse's statement name is not scanned): a repeated text skips the scan, which was a
    /// tenth of relaying a pgbench statement through a pool. (A Query's
    /// marks with caching on are kept with its text's plan, found by the
    /// same lookup.)
    text_marks: HashMap<u128, Marks>,
}

impl Known {
    pub fn new(policy: Arc<Policy>) -> Self {
        Self {
            prefix: None,
            temp: false,
            policy,
            role: None,
            warned: HashSet::new(),
            plans: HashMap::default(),
            statements: HashMap::default(),
            unnamed_portal: None,
            portals: HashMap::default(),
            unsent_parses: Vec::new(),
            text_marks: HashMap::default(),
        }
    }

    /// Takes the settings query's answer as the session's role and cache-key
    /// prefix (read under the policy's `generation` of settings).
    pub fn adopt_settings(
        &mut self,
        row: &SettingsRow,
        generation: u64,
        startup: &Startup,
    ) -> u128 {
        self.role = row.cells.first().cloned().flatten();
        let params = startup.params.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let prefix = key::session_prefix(startup.database(), params, row.digest);
        self.prefix = Some((prefix, generation));
        prefix
    }

    /// The memoised plan of a text, if made under these generations.
    pub fn plan(&self, hash: u128, generation: u64, policy_generation: u64) -> Option<Arc<Plan>> {
        current(
            self.plans.get(&hash).map(|t| &t.plan),
            generation,
            policy_generation,
        )
    }

    /// What one lookup knows of a text: its plan, if made under these
    /// generations, and its marks, whatever the generations.
    pub fn text(
        &self,
        hash: u128,
        generation: u64,
        policy_generation: u64,
    ) -> (Option<Arc<Plan>>, Option<Marks>) {
        match self.plans.get(&hash) {
            Some(t) => (
                current(Some(&t.plan), generation, policy_generation),
                t.marks,
            ),
            None => (None, None),
        }
    }

    /// Keeps the marks of a text whose plan is remembered.
    pub fn remember_marks(&mut self, hash: u128, marks: Marks) {
        if let Some(t) = self.plans.get_mut(&hash) {
            t.marks = Some(marks);
        }
    }

    /// The marks of a Parse's text, or of a Query's relayed with caching
    /// off (`frame`, header included).
    pub fn frame_marks(&mut self, frame: &[u8]) -> Marks {
        let text = extended::statement_text(frame);
        let hash = sql_hash(text);
        if let Some(known) = self.text_marks.get(&hash) {
            return *known;
        }
        if self.text_marks.len() >= MAX_PLANS {
            self.text_marks.clear();
        }
        let found = marks(text);
        self.text_marks.insert(hash, found);
        found
    }

    pub fn remember_plan(&mut self, hash: u128, plan: &Arc<Plan>) {
        if self.plans.len() >= MAX_PLANS {
            self.plans.clear();
        }
        self.plans
            .entry(hash)
            .and_modify(|t| {
                t.plan = Arc::clone(plan);
                t.keyed_reads = None;
            })
            .or_insert_with(|| KnownText {
                plan: Arc::clone(plan),
                marks: None,
                keyed_reads: None,
            });
    }

    /// What a run of text `sql` (hash `hash`) under `plan` reads when the
    /// plan reads its rows by key: memoised with the text's plan.
    pub fn keyed_reads(&mut self, hash: u128, plan: &Arc<Plan>, sql: &[u8]) -> Option<Reads> {
        let keyed = plan.keyed.as_ref()?;
        let memo = self
            .plans
            .get_mut(&hash)
            .filter(|t| Arc::ptr_eq(&t.plan, plan));
        if let Some(reads) = memo.as_ref().and_then(|t| t.keyed_reads.clone()) {
            return Some(reads);
        }
        let reads = crate::session::keyed::text_reads(keyed, sql)?;
        if let Some(t) = memo {
            t.keyed_reads = Some(reads.clone());
        }
        Some(reads)
    }

    /// What a run of text `hash` under `plan` reads, worked out where the
    /// text was scanned: kept as [`Known::keyed_reads`] keeps it.
    pub fn seed_keyed_reads(&mut self, hash: u128, plan: &Arc<Plan>, reads: Reads) {
        if let Some(t) = self
            .plans
            .get_mut(&hash)
            .filter(|t| Arc::ptr_eq(&t.plan, plan))
        {
            t.keyed_reads = Some(reads);
        }
    }

    /// True the first time a text's hint problems come up.
    pub fn first_warning(&mut self, hash: u128) -> bool {
        if self.warned.len() >= MAX_PLANS {
            self.warned.clear();
        }
        self.warned.insert(hash)
    }

    /// A Parse defined statement `name`.
    pub fn define(&mut self, name: Bytes, statement: Statement) {
        if name.is_empty() {
            self.unsent_parses.retain(|(n, _)| !n.is_empty());
        }
        self.statements.insert(name, Arc::new(statement));
    }

    /// A Bind made portal `name`, of `statement`.
    pub fn bind_portal(&mut self, name: Bytes, statement: Arc<Statement>) {
        if name.is_empty() {
            self.unnamed_portal = Some(statement);
        } else {
            self.portals.insert(name, statement);
        }
    }

    pub fn portal(&self, name: &[u8]) -> Option<&Arc<Statement>> {
        if name.is_empty() {
            self.unnamed_portal.as_ref()
        } else {
            self.portals.get(name)
        }
    }

    /// Portal `name` is gone (closed, or its Bind was not understood).
    pub fn close_portal(&mut self, name: &[u8]) {
        if name.is_empty() {
            self.unnamed_portal = None;
        } else {
            self.portals.remove(name);
        }
    }

    /// A Query or Parse (`frame`) that may free prepared statements
    /// (`DEALLOCATE`, `DISCARD ALL`): they are forgotten from now on,
    /// whether or not it runs, so that no Bind of theirs is answered from
    /// the cache (PostgreSQL would refuse it). Their unsent Parses stay,
    /// to go out before it.
    pub fn forget_freed(&mut self, frame: &[u8]) {
        let sql = extended::statement_text(frame);
        match freed(&String::from_utf8_lossy(sql)) {
            Freed::All => self.statements.clear(),
            Freed::Some(names) => {
                for name in names {
                    self.statements.remove(name.as_slice());
                }
            }
        }
    }

    /// The backend is owed the client's Parse of statement `name`
    /// (`raw`), answered by pgcache: it is replayed before anything else
    /// the backend is sent ([`Self::unsent_parses`]).
    pub fn owe_parse(&mut self, name: Bytes, raw: &[u8]) {
        self.unsent_parses.retain(|(n, _)| *n != name);
        // A copy: it may wait while the session idles, and a view keeps
        // the read buffer alive.
        self.unsent_parses.push((name, Bytes::copy_from_slice(raw)));
    }

    /// A Close of statement `name` went out.
    pub fn close_statement(&mut self, name: &[u8]) {
        self.statements.remove(name);
        self.unsent_parses.retain(|(n, _)| n.as_ref() != name);
    }
}

/// Columns of the settings query that are the session's own settings, as
/// [`ClientState`](super::link::ClientState) reads them:
/// `current_setting('role')`, and the settings set at startup or by the
/// session as a JSON object. Left out of the key prefix, which hashes every
/// setting already (and never `application_name`).
pub(super) const ROLE_COLUMN: usize = 4;
pub(super) const OWN_SETTINGS_COLUMN: usize = 5;

/// The columns after the settings query's own (and the probe's identity):
/// what a fresh backend's settings depend on beyond its login.
const FINGERPRINT: &str = "pg_catalog.pg_conf_load_time(), pg_catalog.pg_is_in_recovery(), \
     r.setdatabase, r.setrole, r.setconfig";
pub(super) const FINGERPRINT_COLUMNS: usize = 5;
/// Joined to the settings query's row: one row per role or database
/// setting, or one of nulls.
const FINGERPRINT_JOIN: &str = " LEFT JOIN pg_catalog.pg_db_role_setting r ON true";

/// The probe: the session's identity, then the fingerprint.
pub(super) fn probe_sql() -> String {
    format!(
        "SELECT current_user, session_user, \
         pg_catalog.current_setting('default_transaction_isolation'), \
         pg_catalog.current_setting('role'), {FINGERPRINT} FROM (SELECT) v{FINGERPRINT_JOIN}"
    )
}

/// pgcache's own query for a session's settings: its identity, default
/// isolation, every setting, and those the policy's rules name; then what
/// a fresh login's settings depend on ([`crate::session::logins`]), one
/// row per role or database setting. `pg_show_all_settings()` is the
/// `pg_settings` view's own function: read directly, a fresh backend does
/// not load the view's definition first.
pub(super) fn settings_sql(policy_settings: &[String]) -> String {
    let mut sql = String::from(
        "SELECT current_user, session_user, pg_catalog.current_setting('default_transaction_isolation'), s.everything, \
         pg_catalog.current_setting('role'), s.own_settings",
    );
    for name in policy_settings {
        sql.push_str(", pg_catalog.current_setting('");
        sql.push_str(&name.replace('\'', "''"));
        sql.push_str("', true)");
    }
    sql.push_str(", ");
    sql.push_str(FINGERPRINT);
    sql.push_str(
        " FROM (SELECT pg_catalog.string_agg(name || '=' || setting, E'\\n' ORDER BY name) \
           FILTER (WHERE name <> 'application_name' AND source <> 'default') AS everything, \
         pg_catalog.json_object_agg(name, setting) FILTER (WHERE source IN ('client', 'session') \
           AND name NOT IN ('session_authorization', 'role')) AS own_settings \
         FROM pg_catalog.pg_show_all_settings()) s",
    );
    sql.push_str(FINGERPRINT_JOIN);
    sql
}

/// The columns of [`settings_sql`]'s answer before the fingerprint.
pub(super) fn settings_columns(policy_settings: usize) -> usize {
    OWN_SETTINGS_COLUMN + 1 + policy_settings
}

/// The settings query's answer, with the digest of the columns that go into
/// the cache key: not the role (the key has `current_user`) nor the
/// client's own settings (every setting is there already).
pub(super) fn settings_row(cells: Vec<Option<String>>) -> Arc<SettingsRow> {
    let digest = key::settings_digest(
        cells
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ROLE_COLUMN && *i != OWN_SETTINGS_COLUMN)
            .map(|(_, value)| value),
    );
    Arc::new(SettingsRow { cells, digest })
}
