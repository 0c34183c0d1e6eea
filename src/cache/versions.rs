//! Version counters: invalidation is a bump, and a key is made of the
//! versions current when it was read (see [`crate::cache`]).
//!
//! **Two counters per version**: `local` is bumped by every invalidation
//! this instance learns of and keys the local tier; `shared` mirrors the
//! counter in Redis and keys the shared tier. Only Redis hands out shared
//! values, so two instances can never use one value for different states
//! of a table (see [`crate::cache::shared`]).

pub use crate::classify::Ddl;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::Reads;
use super::rowkey::STRIPES;
use std::time::Instant;

#[derive(Debug, Default)]
pub struct Version {
    local: AtomicU64,
    shared: AtomicU64,
    /// The WAL position of the change behind the current value, where
    /// the replication stream told it: a replica must have replayed past
    /// it for its answer to be stored ([`Version::floor`]).
    lsn: AtomicU64,
    /// When a bump of unknown position was applied ([`stamp`]); 0: none
    /// pending. Known once a heartbeat sent after it comes back.
    pending: AtomicU64,
    /// Invalidations seen, and when the last one was (Unix milliseconds).
    changes: AtomicU64,
    last_change_ms: AtomicU64,
    /// Entries stored under the current version (expiry and eviction are
    /// not subtracted).
    entries: AtomicU64,
}

impl Version {
    pub fn local(&self) -> u64 {
        self.local.load(Ordering::Acquire)
    }

    pub fn shared(&self) -> u64 {
        self.shared.load(Ordering::Acquire)
    }

    /// Takes back the local counter an earlier run of pgcache left (see
    /// [`crate::cache::carry`]): before anything is keyed under it.
    fn restore_local(&self, value: u64) {
        self.local.fetch_max(value, Ordering::AcqRel);
    }

    /// A bump whose WAL position is not known here: a write through
    /// pgcache, DDL, the epoch, a bump from Redis. Replica answers are not
    /// stored for it until this instance's stream has passed it.
    pub fn bump_local(&self) {
        self.pending.store(stamp(Instant::now()), Ordering::Release);
        self.bump();
    }

    /// A bump the replication stream made for a change committed at `lsn`.
    pub fn bump_at(&self, lsn: u64) {
        self.lsn.fetch_max(lsn, Ordering::AcqRel);
        self.bump();
    }

    fn bump(&self) {
        self.local.fetch_add(1, Ordering::AcqRel);
        self.changes.fetch_add(1, Ordering::Relaxed);
        self.last_change_ms.store(unix_ms(), Ordering::Relaxed);
        self.entries.store(0, Ordering::Relaxed);
    }

    /// The WAL position a server must have replayed past to answer as of
    /// this version; `None` while a bump's position is not known yet.
    /// `covering` gives the position of the first heartbeat back that was
    /// sent after an instant, past everything committed before it: a bump
    /// of unknown position is taken as at that position.
    pub fn floor(&self, covering: impl Fn(Instant) -> Option<u64>) -> Option<u64> {
        let pending = self.pending.load(Ordering::Acquire);
        if pending != 0 {
            let past = covering(instant(pending))?;
            self.lsn.fetch_max(past, Ordering::AcqRel);
            // A bump made meanwhile stays pending.
            let _ = self
                .pending
                .compare_exchange(pending, 0, Ordering::AcqRel, Ordering::Acquire);
        }
        Some(self.lsn.load(Ordering::Acquire))
    }

    /// A version made to stand for part of `from` (a table's rows, when
    /// its keying by row begins): replicas must have replayed as far for
    /// it as for `from`, whose changes it did not see.
    fn inherit_floor(&self, from: &Version) {
        self.lsn
            .fetch_max(from.lsn.load(Ordering::Acquire), Ordering::AcqRel);
        let pending = from.pending.load(Ordering::Acquire);
        if pending != 0 {
            self.pending.fetch_max(pending, Ordering::AcqRel);
        }
    }

    pub fn note_entry(&self) {
        self.entries.fetch_add(1, Ordering::Relaxed);
    }

    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Unix milliseconds of the last invalidation; 0 = never.
    pub fn last_change_ms(&self) -> u64 {
        self.last_change_ms.load(Ordering::Relaxed)
    }

    /// Redis says the counter is `value`. If that is news, the local
    /// counter moves too: *after* the shared one, so a reader that sees the
    /// new local value also sees the new shared value.
    pub fn raise_shared(&self, value: u64) -> bool {
        let raised = self.shared.fetch_max(value, Ordering::AcqRel) < value;
        if raised {
            self.bump_local();
        }
        raised
    }
}

/// Microseconds since a point of this process's own, rounded up (never
/// earlier than `at`, and never 0): an instant in an atomic.
fn stamp(at: Instant) -> u64 {
    at.saturating_duration_since(*ANCHOR).as_micros() as u64 + 1
}

fn instant(stamp: u64) -> Instant {
    *ANCHOR + std::time::Duration::from_micros(stamp)
}

static ANCHOR: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a [`Family`]'s version counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A table, a partition tree (by its root's name), or a tag.
    Table,
    /// A table's changes as a whole, which its reads by row read
    /// ([`Family::wide`], named `table#all`).
    Wide,
    /// One stripe of a table's rows ([`RowVersions`], `table#k<n>`).
    Row,
}

impl Scope {
    /// The scope of a family named `name`.
    pub fn of(name: &str) -> Scope {
        if name.ends_with("#all") {
            Scope::Wide
        } else if name
            .rsplit_once("#k")
            .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        {
            Scope::Row
        } else {
            Scope::Table
        }
    }
}

/// The version of one table, or of a partition tree (its root's name).
#[derive(Debug)]
pub struct Family {
    pub name: Box<str>,
    pub version: Version,
    pub scope: Scope,
    /// What a change of it as a whole moves besides `version` (its
    /// reads keyed by row read this, not `version`): made at first use,
    /// by a write of it, or a keyed read ([`Versions::wide`]).
    wide: OnceLock<Arc<Family>>,
    /// The versions of its rows, once a read or a write of it is keyed by
    /// row ([`Versions::rows`]).
    rows: OnceLock<RowVersions>,
}

impl Family {
    pub fn new(name: &str) -> Family {
        Family {
            name: name.into(),
            version: Version::default(),
            scope: Scope::of(name),
            wide: OnceLock::new(),
            rows: OnceLock::new(),
        }
    }

    /// Its rows' versions, if reads or writes of it were keyed by row.
    pub fn rows(&self) -> Option<&RowVersions> {
        self.rows.get()
    }

    /// Its changes of rows, each counted in the row's stripe, and of the
    /// whole table, that reached its reads by row.
    pub fn changes_by_scope(&self) -> (u64, u64) {
        let rows = self
            .rows()
            .map_or(0, |r| r.stripes.iter().map(|s| s.version.changes()).sum());
        let whole = self.wide.get().map_or(0, |w| w.version.changes());
        (rows, whole)
    }
}

/// The versions of one table's rows (see [`crate::cache::rowkey`]): a
/// change of a row moves the table's version and its row's stripe; a
/// change of the table as a whole (TRUNCATE, a write whose rows are not
/// known) moves the table's version and `wide`. A read keyed by row reads
/// `wide` and its rows' stripes, so a write to another row leaves it be.
///
/// Bound: [`STRIPES`] + 1 families a table, made once, a few hundred
/// bytes each, and the reads of each stripe: about 250 KiB for each table
/// read or written by key; in Redis, as many fields of the database's
/// version hash.
#[derive(Debug)]
pub struct RowVersions {
    pub wide: Arc<Family>,
    pub stripes: Box<[Arc<Family>]>,
    /// What a read of one stripe reads (`wide` and that stripe), made
    /// with them: a read by key takes one instead of making its own.
    singles: Box<[Reads]>,
    /// The identity ([`crate::cache::rowkey::signature`]) its keyed plans
    /// hash rows under: the stream keys a change by row only under the
    /// same one.
    signature: AtomicU64,
    /// Its stripes' and `wide`'s shared counters were read from Redis once
    /// this instance began keying the table ([`Self::shared_ready`]).
    mirrored: AtomicBool,
}

impl RowVersions {
    /// The versions a read of `stripes` (row stripes) depends on.
    pub fn reads(&self, stripes: &[usize]) -> Reads {
        if let [one] = stripes {
            return Arc::clone(&self.singles[one % STRIPES]);
        }
        let mut reads = Vec::with_capacity(stripes.len() + 1);
        reads.push(Arc::clone(&self.wide));
        for &s in stripes {
            let stripe = &self.stripes[s % STRIPES];
            if !reads.iter().any(|r| Arc::ptr_eq(r, stripe)) {
                reads.push(Arc::clone(stripe));
            }
        }
        reads.into()
    }

    /// Plans hash rows under `signature` from now on.
    pub fn plan_under(&self, signature: u64) {
        self.signature.store(signature, Ordering::Release);
    }

    pub fn signature(&self) -> u64 {
        self.signature.load(Ordering::Acquire)
    }

    /// Reads by row may use the shared tier: this instance's mirrors of
    /// the rows' counters were read from Redis since it began keying the
    /// table. (Every instance's stream moves a table's stripes in Redis,
    /// whether or not it keys the table; an instance that does not key it
    /// keeps no mirror of them.)
    pub fn shared_ready(&self) -> bool {
        self.mirrored.load(Ordering::Acquire)
    }

    /// The mirrors were read from Redis.
    pub fn mirrored(&self) {
        self.mirrored.store(true, Ordering::Release);
    }

    /// Every family of its rows: the stripes and `wide`.
    pub fn families(&self) -> impl Iterator<Item = &Arc<Family>> {
        self.stripes.iter().chain([&self.wide])
    }
}

/// The versions of one database.
#[derive(Debug, Default)]
pub struct Versions {
    /// Bumped by statements whose effects pgcache cannot see: part of every key.
    pub epoch: Version,
    /// Bumped (in Redis) by DDL, so other instances forget their catalog.
    pub ddl: Version,
    /// Bumped by every write a session of this instance completes: the
    /// position reads after it need of a replica (read-your-writes), not
    /// known until the stream has passed it.
    pub writes: Version,
    /// Moved by every DDL this instance learns of: the server names of
    /// transaction mode's shared prepared statements carry it, so no
    /// statement prepared before the DDL is reused after it (see
    /// [`crate::pool::prepared`]).
    pub schema: Arc<AtomicU64>,
    families: Mutex<HashMap<String, Arc<Family>>>,
}

impl Versions {
    /// DDL changed the schema: server statements prepared before it may
    /// be stale.
    pub fn schema_changed(&self) {
        self.schema.fetch_add(1, Ordering::AcqRel);
    }

    /// The version counter of a tag (`/*+ cache tags=... */`): a family
    /// like a table's, named so that no unquoted table name can be it.
    pub fn tag(&self, tag: &str) -> Arc<Family> {
        self.family(&format!("#tag:{tag}"))
    }

    /// The version counter of a partition tree (or plain table).
    pub fn family(&self, name: &str) -> Arc<Family> {
        let mut map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = map.get(name) {
            return Arc::clone(f);
        }
        let f = Arc::new(Family::new(name));
        map.insert(name.to_owned(), Arc::clone(&f));
        f
    }

    /// The row versions of `table` (made at first use).
    pub fn rows<'f>(&self, table: &'f Family) -> &'f RowVersions {
        table.rows.get_or_init(|| {
            let wide = self.wide(table);
            let stripes: Box<[Arc<Family>]> = (0..STRIPES)
                .map(|i| self.family(&format!("{}#k{i}", table.name)))
                .collect();
            // The table's changes so far were not kept by row.
            for f in stripes.iter().chain([&wide]) {
                f.version.inherit_floor(&table.version);
            }
            let singles = stripes
                .iter()
                .map(|stripe| Reads::from([Arc::clone(&wide), Arc::clone(stripe)]))
                .collect();
            RowVersions {
                wide,
                stripes,
                singles,
                signature: AtomicU64::new(0),
                mirrored: AtomicBool::new(false),
            }
        })
    }

    /// What a change of `table` as a whole moves besides its version. A
    /// write whose rows are not known moves it on every instance (through
    /// Redis), whether or not this one reads the table by key.
    pub fn wide(&self, table: &Family) -> Arc<Family> {
        Arc::clone(
            table
                .wide
                .get_or_init(|| self.family(&format!("{}#all", table.name))),
        )
    }

    /// The local counters to carry across a restart: the epoch's, and
    /// every family's that moved.
    pub fn carried(&self) -> (u64, Vec<(String, u64)>) {
        let map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        let families = map
            .iter()
            .map(|(name, f)| (name.clone(), f.version.local()))
            .filter(|(_, local)| *local > 0)
            .collect();
        (self.epoch.local(), families)
    }

    /// Takes back what [`Versions::carried`] gave.
    pub fn restore(&self, epoch: u64, families: &[(String, u64)]) {
        self.epoch.restore_local(epoch);
        for (name, local) in families {
            self.family(name).version.restore_local(*local);
        }
    }

    /// Every family known, for a resynchronisation with Redis.
    pub fn families(&self) -> Vec<Arc<Family>> {
        let map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        map.values().cloned().collect()
    }

    /// The families of tables, partition trees and tags: not their rows'.
    pub fn tables(&self) -> Vec<Arc<Family>> {
        let map = self.families.lock().unwrap_or_else(|e| e.into_inner());
        map.values()
            .filter(|f| f.scope == Scope::Table)
            .cloned()
            .collect()
    }
}

/// Invalidations to apply: table versions, the epoch, the catalog.
#[derive(Debug, Default, Clone)]
pub struct Bumps {
    pub families: Vec<Arc<Family>>,
    /// Unknown effects: everything in the database may have changed.
    pub epoch: bool,
    /// DDL: what pgcache knows of the catalog is stale too (with `epoch`).
    pub ddl: Ddl,
    /// The WAL position of the commit they come from, where the stream
    /// told it; `None`: not known here.
    pub lsn: Option<u64>,
    /// A write through this instance: under `read_your_writes` the
    /// database's writes watermark moves on every instance too
    /// ([`Versions::writes`]), so that no instance reads after it from a
    /// replica not known to have replayed it.
    pub watermark: bool,
    /// Stripes of tables this instance does not key by row, as their
    /// families are named (`table#k<n>`): moved in Redis only, for the
    /// instances that do ([`RowVersions::shared_ready`]).
    pub elsewhere: Vec<String>,
}

impl Bumps {
    /// Anything may have changed, the catalog included.
    pub fn opaque() -> Self {
        Self::ddl(Ddl::All)
    }

    /// DDL that changed `ddl`: it also moves the epoch, since its effects
    /// on stored results (a column dropped, a view redefined) are unknown.
    pub fn ddl(ddl: Ddl) -> Self {
        Self {
            families: Vec::new(),
            epoch: true,
            ddl,
            lsn: None,
            watermark: false,
            elsewhere: Vec::new(),
        }
    }

    pub fn add_family(&mut self, family: Arc<Family>) {
        if !self.families.iter().any(|f| Arc::ptr_eq(f, &family)) {
            self.families.push(family);
        }
    }

    pub fn merge(&mut self, other: &Bumps) {
        if other.is_empty() {
            return;
        }
        self.lsn = match (self.is_empty(), self.lsn, other.lsn) {
            (true, _, lsn) => lsn,
            (false, Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
        for f in &other.families {
            self.add_family(Arc::clone(f));
        }
        self.epoch |= other.epoch;
        self.ddl.merge(&other.ddl);
        self.watermark |= other.watermark;
        self.elsewhere.extend(other.elsewhere.iter().cloned());
    }

    pub fn is_empty(&self) -> bool {
        self.families.is_empty() && !self.epoch && self.ddl.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raised_shared_value_moves_the_local_counter_once() {
        let v = Version::default();
        assert!(v.raise_shared(3));
        assert_eq!((v.shared(), v.local()), (3, 1));
        assert!(!v.raise_shared(2), "an older value is no news");
        assert_eq!((v.shared(), v.local()), (3, 1));
    }

    #[test]
    fn a_version_has_a_floor_once_its_bumps_position_is_known() {
        let v = Version::default();
        let never = |_: Instant| None;
        let at = |lsn: u64| move |_: Instant| Some(lsn);
        assert_eq!(v.floor(never), Some(0), "never bumped");
        v.bump_at(100);
        assert_eq!(v.floor(never), Some(100), "the stream told its position");
        v.bump_local();
        assert_eq!(v.floor(never), None, "not passed by the stream yet");
        assert_eq!(v.floor(at(150)), Some(150), "passed: as at that heartbeat");
        assert_eq!(v.floor(never), Some(150), "and no longer pending");
        v.bump_at(120);
        assert_eq!(v.floor(never), Some(150), "positions only grow");
        // The heartbeat asked for is one sent after the bump.
        let before = Instant::now();
        v.bump_local();
        let sent_after = |at: Instant| (at >= before).then_some(999);
        assert_eq!(v.floor(sent_after), Some(999));
    }

    #[test]
    fn merged_bumps_keep_a_position_only_if_each_had_one() {
        let versions = Versions::default();
        let at = |lsn| Bumps {
            families: vec![versions.family("t")],
            lsn: Some(lsn),
            ..Bumps::default()
        };
        let mut a = Bumps::default();
        a.merge(&at(5));
        assert_eq!(a.lsn, Some(5));
        a.merge(&at(9));
        assert_eq!(a.lsn, Some(9));
        a.merge(&Bumps::default());
        assert_eq!(a.lsn, Some(9), "nothing merged");
        a.merge(&Bumps::opaque());
        assert_eq!(a.lsn, None, "a bump of unknown position");
    }

    #[test]
    fn merged_bumps_name_each_family_once() {
        let versions = Versions::default();
        let mut a = Bumps::default();
        a.add_family(versions.family("t"));
        let mut b = Bumps::default();
        b.add_family(versions.family("t"));
        b.add_family(versions.family("u"));
        a.merge(&b);
        assert_eq!(a.families.len(), 2);
        assert!(!a.epoch && !a.is_empty());
        a.merge(&Bumps::opaque());
        assert!(a.epoch && a.ddl == Ddl::All);
    }
}
