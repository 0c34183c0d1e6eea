//! What pgcache knows of one database's catalog, learnt name by name.
//!
//! A statement's plan needs facts about the relations and functions it
//! names: is this relation a permanent table replication can watch, may
//! writing it change others, is this function immutable? [`Catalog::facts`]
//! answers from what is known and queues the names it does not know for
//! [`fetch`], which asks PostgreSQL for exactly those names on pgcache's own
//! connection, off every client's path. DDL forgets exactly the names it
//! touched ([`Catalog::forget`]). Nothing here depends on how many
//! relations or functions the database has.
//!
//! Facts are kept per bare name over every schema, conservatively: a name
//! is readable only if every relation of that name is a permanent table
//! outside the system schemas, and a write hazard if any of them is. That
//! is at least as strict as any `search_path` could resolve it, so one fact
//! serves every session; a session's own temporary objects are the
//! session's to track.

pub mod fetch;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::rowkey::Identity;
use super::versions::Ddl;

/// How long "no relation (function) of this name" is believed: such a name
/// is fetched again after this long, since a CREATE made where no event
/// trigger reports it would otherwise stay unknown.
const ABSENT_FOR: Duration = Duration::from_secs(1);

/// Names kept at most; beyond it everything is forgotten (a client naming
/// endless missing relations must not grow memory without bound).
const MAX_NAMES: usize = 100_000;

/// SQL constructs sqlparser reports as function calls that are not in
/// pg_proc, and are immutable.
const IMMUTABLE_CONSTRUCTS: &[&str] = &["coalesce", "nullif", "greatest", "least", "trim"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelFacts {
    /// Every relation of this name is a permanent table pgcache can watch.
    pub readable: bool,
    /// Writing to a relation of this name may change other relations
    /// (triggers, rules, cascading foreign keys, views, inheritance).
    pub write_hazard: bool,
    /// Versions are kept per partition tree: the root's name.
    pub family: String,
    /// Every relation of this name is permanent, outside the system
    /// schemas, and a table, view, materialized view or foreign table: it
    /// may be cached with a TTL even if replication cannot watch it.
    pub ttl_ok: bool,
    /// Every relation of this name is a table replication could watch if
    /// the publication had it: when it is not `readable`, it lacks a
    /// replica identity, is unlogged, or the statement that first used it
    /// has not added it yet.
    pub table: bool,
    /// Functions its row-level security policies call: these facts are
    /// stale when one of them changes.
    pub policy_functions: Vec<String>,
    /// Its replica identity, where its reads and writes may be keyed by row
    /// (one plain table of the name, its key columns of kinds
    /// [`crate::cache::rowkey`] knows).
    pub identity: Option<Arc<Identity>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FuncFacts {
    /// Every overload is IMMUTABLE.
    pub immutable: bool,
    /// Some overload is VOLATILE and outside pg_catalog: it may write.
    pub may_write: bool,
    /// No overload is VOLATILE: it cannot change the database.
    pub stable: bool,
}

/// What is known of one name.
#[derive(Debug)]
enum Entry<T> {
    /// Asked for; the answer to this ticket will be installed.
    Fetching(u64),
    Known(T),
    /// No object of this name, as of this instant.
    Absent(Instant),
}

/// Names a fetch is asked to look up, each with its ticket.
#[derive(Debug, Default)]
pub struct Wanted {
    pub rels: Vec<(String, u64)>,
    pub funcs: Vec<(String, u64)>,
}

impl Wanted {
    pub fn is_empty(&self) -> bool {
        self.rels.is_empty() && self.funcs.is_empty()
    }
}

/// What one fetch found: names missing from the maps do not exist.
#[derive(Debug, Default)]
pub struct Fetched {
    pub rels: HashMap<String, RelFacts>,
    pub funcs: HashMap<String, FuncFacts>,
    /// Custom settings the found relations' policies read.
    pub settings: BTreeSet<String>,
    /// Bare names of permanent tables (partition roots) found missing from
    /// the publication.
    pub unwatched: BTreeSet<String>,
}

#[derive(Default)]
struct Names {
    rels: HashMap<String, Entry<RelFacts>>,
    funcs: HashMap<String, Entry<FuncFacts>>,
    next_ticket: u64,
}

/// The facts one plan was made with: a small view of the catalog, for the
/// names its statement references.
#[derive(Debug, Default)]
pub struct Facts {
    rels: Vec<(String, RelFacts)>,
    funcs: Vec<(String, FuncFacts)>,
    /// Names referenced but not known yet (being fetched).
    pending: Vec<String>,
}

impl Facts {
    pub fn relation(&self, name: &str) -> Option<&RelFacts> {
        self.rels.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }

    pub fn function(&self, name: &str) -> Option<FuncFacts> {
        if IMMUTABLE_CONSTRUCTS.contains(&name) {
            return Some(FuncFacts {
                immutable: true,
                may_write: false,
                stable: true,
            });
        }
        self.funcs.iter().find(|(n, _)| n == name).map(|(_, f)| *f)
    }

    /// Whether `name` is being fetched (as opposed to known not to exist).
    pub fn is_pending(&self, name: &str) -> bool {
        self.pending.iter().any(|n| n == name)
    }

    /// Every name referenced is known (found or known absent).
    pub fn complete(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
impl From<Fetched> for Facts {
    fn from(fetched: Fetched) -> Facts {
        Facts {
            rels: fetched.rels.into_iter().collect(),
            funcs: fetched.funcs.into_iter().collect(),
            pending: Vec::new(),
        }
    }
}

/// What pgcache knows of one database's catalog.
#[derive(Default)]
pub struct Catalog {
    /// Bumped whenever facts are forgotten: plans made before are stale.
    generation: AtomicU64,
    names: RwLock<Names>,
    /// Custom settings that RLS policies of known relations read, with a
    /// generation bumped when the set grows: they are part of every cache
    /// key, so a session re-reads its settings when the set changes.
    settings: RwLock<(u64, Arc<[String]>)>,
    /// `settings`' generation, read by every statement without the lock.
    settings_generation: AtomicU64,
    wanted: Mutex<Wanted>,
    /// Wakes the fetcher when names are wanted.
    pub wake: Notify,
    fetcher_claimed: AtomicBool,
    /// pgcache's own connection cannot be opened: sessions fetch on their
    /// own idle connection instead.
    fetcher_down: AtomicBool,
    /// Lookups installed: a DDL statement must cause none (tested).
    fetches: AtomicU64,
    /// Signalled when a fetch was installed or abandoned.
    pub settled: Notify,
    /// Names DDL made or changed since this instance started (bounded): no
    /// tier can hold an answer about them worth waiting for.
    made_by_ddl: Mutex<HashSet<Box<str>>>,
    /// Tables a statement named and their lookup found missing from the
    /// publication (bare names, bounded), for the stream to add: a table
    /// joins the publication when a statement first uses it, not when DDL
    /// makes it, so tables nobody reads or writes through pgcache cost no
    /// publication change.
    unwatched: Mutex<BTreeSet<String>>,
    /// Wakes the stream when `unwatched` grows.
    pub unwatched_found: Notify,
}

impl Catalog {
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The facts for `rels` and `funcs`, queueing every name not known yet
    /// for the fetcher. Returns the facts and whether names were queued.
    pub fn facts<'a>(
        &self,
        rels: impl IntoIterator<Item = &'a str>,
        funcs: impl IntoIterator<Item = &'a str>,
    ) -> (Facts, bool) {
        let mut facts = Facts::default();
        let rels: Vec<&str> = rels.into_iter().collect();
        let funcs: Vec<&str> = funcs
            .into_iter()
            .filter(|f| !IMMUTABLE_CONSTRUCTS.contains(f))
            .collect();
        let (mut missing_rels, mut missing_funcs) = (Vec::new(), Vec::new());
        {
            let names = self.names.read().unwrap_or_else(|e| e.into_inner());
            look_up(
                &names.rels,
                &rels,
                &mut facts.rels,
                &mut facts.pending,
                &mut missing_rels,
            );
            let (known, pending) = (&mut facts.funcs, &mut facts.pending);
            look_up(&names.funcs, &funcs, known, pending, &mut missing_funcs);
        }
        if missing_rels.is_empty() && missing_funcs.is_empty() {
            return (facts, false);
        }
        let mut queued = Wanted::default();
        {
            let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
            if names.rels.len() + names.funcs.len() >= MAX_NAMES {
                names.rels.clear();
                names.funcs.clear();
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
            let names = &mut *names;
            let next = &mut names.next_ticket;
            facts.pending.extend(
                missing_rels
                    .iter()
                    .chain(&missing_funcs)
                    .map(|n| n.to_string()),
            );
            queued.rels = claim_all(&mut names.rels, next, &missing_rels);
            queued.funcs = claim_all(&mut names.funcs, next, &missing_funcs);
        }
        if queued.is_empty() {
            return (facts, false);
        }
        let mut wanted = self.wanted.lock().unwrap_or_else(|e| e.into_inner());
        wanted.rels.append(&mut queued.rels);
        wanted.funcs.append(&mut queued.funcs);
        drop(wanted);
        self.wake.notify_one();
        (facts, true)
    }

    /// Everything queued for fetching, emptying the queue.
    pub fn take_wanted(&self) -> Wanted {
        std::mem::take(&mut *self.wanted.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Installs what a fetch of `asked` found, for every name still waiting
    /// for that very ticket: a name forgotten (DDL) while it was being
    /// fetched is not installed, as the answer may predate the DDL.
    pub fn install(&self, asked: &Wanted, mut fetched: Fetched) {
        self.fetches.fetch_add(1, Ordering::Relaxed);
        // Settings first: a session that sees the facts must also see that
        // its key needs these settings.
        if !fetched.settings.is_empty() {
            let mut settings = self.settings.write().unwrap_or_else(|e| e.into_inner());
            let mut all: BTreeSet<String> = settings.1.iter().cloned().collect();
            let before = all.len();
            all.append(&mut fetched.settings);
            if all.len() != before {
                *settings = (settings.0 + 1, all.into_iter().collect());
                self.settings_generation
                    .store(settings.0, Ordering::Release);
            }
        }
        if !fetched.unwatched.is_empty() {
            let mut unwatched = self.unwatched.lock().unwrap_or_else(|e| e.into_inner());
            if unwatched.len() + fetched.unwatched.len() <= MAX_NAMES {
                unwatched.append(&mut fetched.unwatched);
                drop(unwatched);
                self.unwatched_found.notify_one();
            }
        }
        let now = Instant::now();
        let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
        settle(&mut names.rels, &asked.rels, fetched.rels, now);
        settle(&mut names.funcs, &asked.funcs, fetched.funcs, now);
        drop(names);
        self.settled.notify_waiters();
    }

    /// The tables found missing from the publication since the last call.
    pub fn take_unwatched(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.unwatched.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Tables whose publication change could not be made now, to try
    /// again at the stream's next wake-up.
    pub fn requeue_unwatched(&self, names: Vec<String>) {
        self.unwatched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(names);
    }

    /// A fetch of `asked` failed: the names are asked for again by the
    /// next statement that needs them.
    pub fn abandon(&self, asked: &Wanted) {
        let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
        release(&mut names.rels, &asked.rels);
        release(&mut names.funcs, &asked.funcs);
        drop(names);
        self.settled.notify_waiters();
    }

    /// Whether DDL made or changed one of `names` since start.
    pub fn made_by_ddl<'a>(&self, mut names: impl Iterator<Item = &'a str>) -> bool {
        let made = self.made_by_ddl.lock().unwrap_or_else(|e| e.into_inner());
        !made.is_empty() && names.any(|n| made.contains(n))
    }

    /// DDL changed `ddl`: forget what it touched (and relations whose
    /// policies call a function it touched).
    pub fn forget(&self, ddl: &Ddl) {
        tracing::debug!(?ddl, "catalog: forget");
        let mut names = self.names.write().unwrap_or_else(|e| e.into_inner());
        match ddl {
            Ddl::None => return,
            Ddl::Objects(objects) if objects.is_empty() => return,
            Ddl::Objects(objects) => {
                let mut made = self.made_by_ddl.lock().unwrap_or_else(|e| e.into_inner());
                if made.len() + objects.len() > MAX_NAMES {
                    made.clear();
                }
                for name in objects {
                    names.rels.remove(&**name);
                    names.funcs.remove(&**name);
                    made.insert(name.to_string().into_boxed_str());
                }
                names.rels.retain(|_, entry| match entry {
                    Entry::Known(f) => !f
                        .policy_functions
                        .iter()
                        .any(|p| objects.iter().any(|o| **o == **p)),
                    _ => true,
                });
            }
            Ddl::All => {
                names.rels.clear();
                names.funcs.clear();
            }
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The facts of relation `name`, if known.
    pub fn relation(&self, name: &str) -> Option<RelFacts> {
        let names = self.names.read().unwrap_or_else(|e| e.into_inner());
        match names.rels.get(name) {
            Some(Entry::Known(f)) => Some(f.clone()),
            _ => None,
        }
    }

    /// Whether every name is known (found or absent), as tests wait for.
    pub fn knows(&self, rels: &[&str], funcs: &[&str]) -> bool {
        let names = self.names.read().unwrap_or_else(|e| e.into_inner());
        rels.iter()
            .all(|n| matches!(names.rels.get(*n), Some(Entry::Known(_) | Entry::Absent(_))))
            && funcs.iter().all(|n| {
                matches!(
                    names.funcs.get(*n),
                    Some(Entry::Known(_) | Entry::Absent(_))
                )
            })
    }

    /// The generation of [`Self::policy_settings`].
    pub fn policy_settings_generation(&self) -> u64 {
        self.settings_generation.load(Ordering::Acquire)
    }

    /// The custom settings RLS policies read, with their generation.
    pub fn policy_settings(&self) -> (u64, Arc<[String]>) {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// True for the one caller that should start this database's fetcher.
    pub fn claim_fetcher(&self) -> bool {
        !self.fetcher_claimed.swap(true, Ordering::AcqRel)
    }

    pub fn set_fetcher_down(&self, down: bool) {
        self.fetcher_down.store(down, Ordering::Release);
    }

    pub fn fetcher_down(&self) -> bool {
        self.fetcher_down.load(Ordering::Acquire)
    }

    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }
}

/// Sorts `names` into the facts `map` knows, the names being fetched, and
/// the names to ask for (never seen, or absent for too long).
fn look_up<'a, T: Clone>(
    map: &HashMap<String, Entry<T>>,
    names: &[&'a str],
    known: &mut Vec<(String, T)>,
    pending: &mut Vec<String>,
    missing: &mut Vec<&'a str>,
) {
    for name in names {
        match map.get(*name) {
            Some(Entry::Known(f)) => known.push((name.to_string(), f.clone())),
            Some(Entry::Absent(at)) if at.elapsed() < ABSENT_FOR => {}
            Some(Entry::Fetching(_)) => pending.push(name.to_string()),
            _ => missing.push(name),
        }
    }
}

/// Marks each of `names` as being fetched under a new ticket, unless
/// another caller did meanwhile; returns those it marked.
fn claim_all<T>(
    map: &mut HashMap<String, Entry<T>>,
    next: &mut u64,
    names: &[&str],
) -> Vec<(String, u64)> {
    let mut claimed = Vec::new();
    for name in names {
        match map.get(*name) {
            Some(Entry::Fetching(_) | Entry::Known(_)) => {}
            Some(Entry::Absent(at)) if at.elapsed() < ABSENT_FOR => {}
            _ => {
                *next += 1;
                map.insert(name.to_string(), Entry::Fetching(*next));
                claimed.push((name.to_string(), *next));
            }
        }
    }
    claimed
}

/// Installs the answer for every name still waiting for its ticket.
fn settle<T>(
    map: &mut HashMap<String, Entry<T>>,
    asked: &[(String, u64)],
    mut found: HashMap<String, T>,
    now: Instant,
) {
    for (name, ticket) in asked {
        if let Some(entry) = map.get_mut(name)
            && matches!(entry, Entry::Fetching(t) if t == ticket)
        {
            *entry = match found.remove(name) {
                Some(f) => Entry::Known(f),
                None => Entry::Absent(now),
            };
        }
    }
}

/// Drops the marks of a failed fetch that are still its own.
fn release<T>(map: &mut HashMap<String, Entry<T>>, asked: &[(String, u64)]) {
    for (name, ticket) in asked {
        if matches!(map.get(name), Some(Entry::Fetching(t)) if t == ticket) {
            map.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(family: &str) -> RelFacts {
        RelFacts {
            readable: true,
            write_hazard: false,
            family: family.to_owned(),
            ttl_ok: true,
            table: true,
            policy_functions: Vec::new(),
            identity: None,
        }
    }

    #[test]
    fn names_ddl_made_are_known_as_such_and_the_rest_are_not() {
        let catalog = Catalog::default();
        assert!(!catalog.made_by_ddl(["t"].into_iter()));
        catalog.forget(&Ddl::objects(["t"]));
        assert!(catalog.made_by_ddl(["u", "t"].into_iter()));
        catalog.forget(&Ddl::All);
        assert!(
            !catalog.made_by_ddl(["u"].into_iter()),
            "forgetting everything (a stream's start) names nothing"
        );
    }

    #[test]
    fn tables_found_missing_from_the_publication_are_handed_to_the_stream_once() {
        let catalog = Catalog::default();
        let (_, _) = catalog.facts(["fresh", "old"], []);
        let wanted = catalog.take_wanted();
        let mut fetched = Fetched::default();
        fetched.rels.insert("fresh".into(), table("fresh"));
        fetched.rels.insert("old".into(), table("old"));
        fetched.unwatched.insert("fresh".into());
        catalog.install(&wanted, fetched);
        let found = catalog.unwatched_found.notified();
        futures_util::pin_mut!(found);
        assert!(
            futures_util::FutureExt::now_or_never(found).is_some(),
            "the stream is woken"
        );
        assert_eq!(catalog.take_unwatched(), BTreeSet::from(["fresh".into()]));
        assert!(catalog.take_unwatched().is_empty(), "taken once");
    }

    #[test]
    fn names_are_fetched_once_and_installed_when_found() {
        let catalog = Catalog::default();
        let (facts, queued) = catalog.facts(["t", "gone"], []);
        assert!(queued && facts.is_pending("t") && facts.is_pending("gone"));
        let (_, again) = catalog.facts(["t"], []);
        assert!(!again, "a name being fetched is not queued twice");
        let wanted = catalog.take_wanted();
        assert_eq!(wanted.rels.len(), 2);
        let mut fetched = Fetched::default();
        fetched.rels.insert("t".into(), table("t"));
        catalog.install(&wanted, fetched);
        let (facts, queued) = catalog.facts(["t", "gone"], []);
        assert!(!queued && facts.complete());
        assert!(facts.relation("t").is_some());
        assert!(facts.relation("gone").is_none(), "known not to exist");
        assert_eq!(catalog.fetches(), 1);
    }

    #[test]
    fn an_answer_that_may_predate_a_ddl_is_not_installed() {
        let catalog = Catalog::default();
        catalog.facts(["t"], []);
        let wanted = catalog.take_wanted();
        let generation = catalog.generation();
        catalog.forget(&Ddl::objects(["t"]));
        assert!(catalog.generation() > generation);
        let mut fetched = Fetched::default();
        fetched.rels.insert("t".into(), table("t"));
        catalog.install(&wanted, fetched);
        assert!(!catalog.knows(&["t"], &[]));
        let (facts, queued) = catalog.facts(["t"], []);
        assert!(queued && !facts.complete(), "asked for again");
    }

    #[test]
    fn a_failed_fetch_is_asked_again_and_absence_is_believed_briefly() {
        let catalog = Catalog::default();
        catalog.facts(["t"], []);
        let wanted = catalog.take_wanted();
        catalog.abandon(&wanted);
        assert!(catalog.facts(["t"], []).1, "queued again after a failure");
        let wanted = catalog.take_wanted();
        catalog.install(&wanted, Fetched::default());
        assert!(catalog.knows(&["t"], &[]));
        let mut names = catalog.names.write().unwrap();
        names
            .rels
            .insert("t".into(), Entry::Absent(Instant::now() - ABSENT_FOR));
        drop(names);
        assert!(
            catalog.facts(["t"], []).1,
            "an old absence is checked again"
        );
    }

    #[test]
    fn forgetting_a_function_forgets_relations_whose_policies_call_it() {
        let catalog = Catalog::default();
        catalog.facts(["secure", "plain"], ["tenant_of"]);
        let wanted = catalog.take_wanted();
        let mut fetched = Fetched::default();
        let secure = RelFacts {
            policy_functions: vec!["tenant_of".into()],
            ..table("secure")
        };
        fetched.rels.insert("secure".into(), secure);
        fetched.rels.insert("plain".into(), table("plain"));
        fetched.settings.insert("app.tenant".into());
        catalog.install(&wanted, fetched);
        let (generation, settings) = catalog.policy_settings();
        assert_eq!(
            (generation, &*settings),
            (1, &["app.tenant".to_owned()][..])
        );
        catalog.forget(&Ddl::objects(["tenant_of"]));
        assert!(!catalog.knows(&["secure"], &[]));
        assert!(catalog.knows(&["plain"], &[]));
        assert_eq!(catalog.policy_settings().0, 1, "settings are kept");
        assert_eq!(catalog.policy_settings_generation(), 1);
    }

    #[test]
    fn immutable_constructs_need_no_fetch() {
        let catalog = Catalog::default();
        let (facts, queued) = catalog.facts([], ["coalesce"]);
        assert!(!queued && facts.complete());
        assert!(facts.function("coalesce").unwrap().immutable);
    }
}
