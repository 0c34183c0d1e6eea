//! The replication stream's health as the cache sees it: whether a
//! database's stream is up, and the heartbeats that prove its cache fresh.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::demand::Demand;
use super::versions::Ddl;

/// Heartbeats back kept per database: a minute's worth at the default
/// heartbeat.
const BEATS_KEPT: usize = 600;

/// At most one warning about tables left out of the publication per
/// database in this long.
pub const UNPUBLISHED_WARN_EVERY: Duration = Duration::from_secs(300);

/// The replication stream's health, as the stream reports it.
///
/// Freshness is proved, not assumed: the stream's heartbeats (see
/// [`crate::invalidation`]) come back through it, and the database's
/// cache is served only while the newest one was sent at most the lease
/// ago. Times are microseconds since `anchor`, so they fit in atomics.
pub struct StreamHealth {
    anchor: Instant,
    /// A replication stream task exists for this database.
    claimed: AtomicBool,
    /// The stream is up and has flushed what it may have missed.
    streaming: AtomicBool,
    /// When the newest heartbeat applied was sent; 0: none yet.
    fresh_as_of: AtomicU64,
    /// When the stream (re)started.
    started_at: AtomicU64,
    /// `replication.max_staleness_ms`, in microseconds.
    lease: AtomicU64,
    /// WAL announced by the server beyond what has been applied.
    lag_bytes: AtomicU64,
    /// The last commit LSN applied.
    applied_lsn: AtomicU64,
    /// The heartbeats back, when each was sent and where it was written
    /// ([`Self::covering`]), newest last.
    beats: Mutex<std::collections::VecDeque<(u64, u64)>>,
    /// How many times the stream (re)started.
    starts: AtomicU64,
    /// DDL transactions the stream handled, and the rounds of naming and
    /// publication checks it took (several arriving together share one).
    ddl_transactions: AtomicU64,
    ddl_rounds: AtomicU64,
    /// Tables left out of the publication for lack of a replica identity:
    /// their qualified names by bare name, as DDL names them (a DDL
    /// statement's update costs what it touched, not the whole list).
    unpublished: Mutex<BTreeMap<String, BTreeSet<String>>>,
    /// How many tables `unpublished` holds.
    unpublished_count: AtomicU64,
    /// Bare names in `unpublished` that DDL named since they were found
    /// so: DDL may have given them an identity, so the next read that
    /// finds one missing from the publication checks it again.
    recheck: Mutex<BTreeSet<String>>,
    /// When the last warning about them was logged, and their count then.
    unpublished_warned: Mutex<Option<(Instant, u64)>>,
    /// The slot of the running stream.
    slot: Mutex<Option<String>>,
    /// With a disk tier: the WAL the persistent slot kept while pgcache was
    /// stopped, when this run resumed it; -1: not resumed.
    slot_kept: std::sync::atomic::AtomicI64,
    /// Signalled when the stream task ends.
    ended: tokio::sync::Notify,
    /// When the newest heartbeat another instance's stream vouched for was
    /// sent (see [`StreamHealth::vouch`]); 0: none yet.
    vouched_as_of: AtomicU64,
    /// The lease a vouch is good for, in microseconds.
    vouch_lease: AtomicU64,
    /// The database's first statements may still wait for the cache to
    /// be able to answer them (`cache.first_read_wait_ms`): until it could
    /// once, or one wait ran out.
    warming: AtomicBool,
    /// Signalled when the database's cache may have become servable: a
    /// heartbeat back, a vouch, a stream up.
    pub changed: tokio::sync::Notify,
    /// Whether its heartbeats are wanted.
    pub demand: Demand,
}

impl Default for StreamHealth {
    fn default() -> Self {
        Self {
            // Far enough back that a time sent before the state existed
            // (a vouch) still reads as the past.
            anchor: Instant::now()
                .checked_sub(Duration::from_secs(3600))
                .unwrap_or_else(Instant::now),
            claimed: AtomicBool::new(false),
            streaming: AtomicBool::new(false),
            fresh_as_of: AtomicU64::new(0),
            started_at: AtomicU64::new(0),
            lease: AtomicU64::new(0),
            lag_bytes: AtomicU64::new(0),
            applied_lsn: AtomicU64::new(0),
            beats: Mutex::default(),
            starts: AtomicU64::new(0),
            ddl_transactions: AtomicU64::new(0),
            ddl_rounds: AtomicU64::new(0),
            unpublished: Mutex::default(),
            unpublished_count: AtomicU64::new(0),
            recheck: Mutex::default(),
            unpublished_warned: Mutex::default(),
            slot: Mutex::default(),
            slot_kept: std::sync::atomic::AtomicI64::new(-1),
            ended: tokio::sync::Notify::new(),
            vouched_as_of: AtomicU64::new(0),
            vouch_lease: AtomicU64::new(0),
            warming: AtomicBool::new(true),
            changed: tokio::sync::Notify::new(),
            demand: Demand::default(),
        }
    }
}

/// Why a database's cache may not be served now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfresh {
    /// No stream is up.
    Down,
    /// The stream is up, but no heartbeat came back within the lease.
    Stale,
    /// The stream is up, and its heartbeats rest for want of a need
    /// ([`Demand`]): one is sent, and a lookup waits for it.
    Resting,
}

impl StreamHealth {
    /// True for the one caller that should start this database's stream.
    pub fn claim(&self) -> bool {
        !self.claimed.swap(true, Ordering::AcqRel)
    }

    /// The stream task ended (pgcache let go of the database): the next
    /// [`StreamHealth::claim`] starts another. Its slot's name stays known:
    /// the walsender may outlive the task.
    pub fn unclaim(&self) {
        self.claimed.store(false, Ordering::Release);
        self.ended.notify_waiters();
    }

    pub fn is_claimed(&self) -> bool {
        self.claimed.load(Ordering::Acquire)
    }

    /// Waits up to `limit` until no stream task runs; true if none does.
    pub async fn wait_unclaimed(&self, limit: Duration) -> bool {
        let waiting = async {
            loop {
                let ended = self.ended.notified();
                if !self.is_claimed() {
                    return;
                }
                ended.await;
            }
        };
        tokio::time::timeout(limit, waiting).await.is_ok()
    }

    pub fn set_slot(&self, slot: Option<String>) {
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = slot;
    }

    pub fn slot(&self) -> Option<String> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The slot was resumed, having kept `bytes` of WAL.
    pub fn set_slot_kept(&self, bytes: i64) {
        self.slot_kept.store(bytes, Ordering::Relaxed);
    }

    /// What the resumed slot had kept; `None` if none was resumed.
    pub fn slot_kept(&self) -> Option<i64> {
        Some(self.slot_kept.load(Ordering::Relaxed)).filter(|b| *b >= 0)
    }

    pub fn set_streaming(&self, up: bool) {
        self.streaming.store(up, Ordering::Release);
        self.changed.notify_waiters();
    }

    /// Another instance's stream, continuous since Redis's counters were
    /// last voided, applied every change committed before a heartbeat sent
    /// at `sent` (this instance's clock) to those counters: while this
    /// instance's mirrors are in sync, its cache is as fresh as that, for
    /// `lease`.
    pub fn vouch(&self, sent: Instant, lease: Duration) {
        self.vouch_lease
            .store(lease.as_micros() as u64, Ordering::Release);
        self.vouched_as_of
            .fetch_max(self.micros(sent), Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// A vouch sent at most `within` ago was received.
    pub fn vouched_within(&self, within: Duration) -> bool {
        let as_of = self.vouched_as_of.load(Ordering::Acquire);
        as_of != 0 && self.micros(Instant::now()).saturating_sub(as_of) <= within.as_micros() as u64
    }

    /// Another instance vouches for the database within its lease.
    pub fn vouched(&self) -> bool {
        let lease = self.vouch_lease.load(Ordering::Acquire);
        self.vouched_within(Duration::from_micros(lease))
    }

    /// Whether the database's first statements may still wait.
    pub fn is_warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// Statements no longer wait for the cache to be able to answer.
    pub fn warmed(&self) {
        self.warming.store(false, Ordering::Release);
    }

    fn micros(&self, at: Instant) -> u64 {
        // Never 0, which means "none".
        (at.saturating_duration_since(self.anchor).as_micros() as u64).max(1)
    }

    /// Cached results may be served: the stream is up and its newest
    /// heartbeat back was sent within the lease.
    pub fn freshness(&self) -> Result<(), Unfresh> {
        self.freshness_at(Instant::now())
    }

    /// [`Self::freshness`] at `now`, a clock reading the caller has.
    pub fn freshness_at(&self, now: Instant) -> Result<(), Unfresh> {
        if !self.streaming.load(Ordering::Acquire) {
            return Err(Unfresh::Down);
        }
        let as_of = self.fresh_as_of.load(Ordering::Acquire);
        let lease = self.lease.load(Ordering::Acquire);
        if as_of == 0 || self.micros(now).saturating_sub(as_of) > lease {
            if self.demand.resting(Duration::from_micros(lease)) {
                return Err(Unfresh::Resting);
            }
            return Err(Unfresh::Stale);
        }
        Ok(())
    }

    /// Up and current, or resting (current as soon as it is needed): what
    /// `/readyz`, the metrics and the console show.
    pub fn is_current(&self) -> bool {
        matches!(self.freshness(), Ok(()) | Err(Unfresh::Resting))
    }

    /// `replication.max_staleness_ms`, as the stream last started with.
    pub fn lease(&self) -> Duration {
        Duration::from_micros(self.lease.load(Ordering::Acquire))
    }

    pub fn is_streaming(&self) -> bool {
        self.streaming.load(Ordering::Acquire)
    }

    /// The stream (re)started, with this lease.
    pub fn started(&self, lease: Duration) {
        self.starts.fetch_add(1, Ordering::AcqRel);
        self.lease
            .store(lease.as_micros() as u64, Ordering::Release);
        self.started_at
            .store(self.micros(Instant::now()), Ordering::Release);
        // Heartbeats of an earlier stream say nothing of this one.
        self.fresh_as_of.store(0, Ordering::Release);
        self.demand.started();
    }

    pub fn starts(&self) -> u64 {
        self.starts.load(Ordering::Acquire)
    }

    /// The stream handles `transactions` DDL transactions in one round.
    pub fn ddl_handled(&self, transactions: usize) {
        self.ddl_transactions
            .fetch_add(transactions as u64, Ordering::Relaxed);
        self.ddl_rounds.fetch_add(1, Ordering::Relaxed);
    }

    /// A DDL transaction a session of this instance sent and handled: it
    /// takes no round.
    pub fn ddl_handled_by_session(&self) {
        self.ddl_transactions.fetch_add(1, Ordering::Relaxed);
    }

    /// DDL transactions handled, and the rounds they took.
    pub fn ddl(&self) -> (u64, u64) {
        (
            self.ddl_transactions.load(Ordering::Relaxed),
            self.ddl_rounds.load(Ordering::Relaxed),
        )
    }

    /// A heartbeat sent at `at`, written at WAL position `lsn`, came
    /// back through the stream: every change committed before `at` has
    /// been applied, and lies before `lsn`.
    pub fn heartbeat_applied(&self, at: Instant, lsn: u64) {
        let sent = self.micros(at);
        {
            let mut beats = self.beats.lock().unwrap_or_else(|e| e.into_inner());
            if beats.len() == BEATS_KEPT {
                beats.pop_front();
            }
            beats.push_back((sent, lsn));
        }
        self.fresh_as_of.fetch_max(sent, Ordering::AcqRel);
        self.demand.beat_back(at);
        self.changed.notify_waiters();
    }

    /// The position of the first heartbeat back that was sent at or after
    /// `at`: past every change committed before `at`. `None`: none came
    /// back yet. (Past the heartbeats kept, the oldest kept stands in: a
    /// later position, so a stricter one.)
    pub fn covering(&self, at: Instant) -> Option<u64> {
        self.demand.note();
        let at = self.micros(at);
        let beats = self.beats.lock().unwrap_or_else(|e| e.into_inner());
        beats
            .iter()
            .find(|&&(sent, _)| sent >= at)
            .map(|&(_, lsn)| lsn)
    }

    /// Whether everything committed before `at` has been applied: a
    /// heartbeat sent after `at` came back. The caller needs heartbeats.
    pub fn covers(&self, at: Instant) -> bool {
        self.demand.note();
        self.proved(at)
    }

    /// [`Self::covers`], asking for no heartbeat: what a watcher reads.
    pub fn proved(&self, at: Instant) -> bool {
        self.fresh_as_of.load(Ordering::Acquire) >= self.micros(at)
    }

    /// How far behind the database the cache may be: the time since the
    /// newest heartbeat back was sent (or since the stream started, before
    /// the first). It grows while the stream stalls.
    pub fn lag(&self) -> Duration {
        if self.freshness() == Err(Unfresh::Resting) {
            // Nothing is served until a heartbeat is back.
            return Duration::ZERO;
        }
        let as_of = match self.fresh_as_of.load(Ordering::Acquire) {
            0 => self.started_at.load(Ordering::Acquire),
            t => t,
        };
        if as_of == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros(self.micros(Instant::now()).saturating_sub(as_of))
    }

    pub fn set_lag_bytes(&self, bytes: u64) {
        self.lag_bytes.store(bytes, Ordering::Release);
    }

    pub fn lag_bytes(&self) -> u64 {
        self.lag_bytes.load(Ordering::Acquire)
    }

    pub fn set_applied_lsn(&self, lsn: u64) {
        self.applied_lsn.store(lsn, Ordering::Release);
    }

    pub fn applied_lsn(&self) -> u64 {
        self.applied_lsn.load(Ordering::Acquire)
    }

    /// Records the tables a publication sync checked (all of them, or
    /// those of the bare names `checked`) and found unpublishable; returns
    /// the ones that were not so before, to be reported once.
    pub fn note_unpublished(
        &self,
        checked: Option<&[String]>,
        found: Vec<(String, String)>,
    ) -> Vec<String> {
        let mut tables = self.unpublished.lock().unwrap_or_else(|e| e.into_inner());
        let before = match checked {
            None => std::mem::take(&mut *tables),
            Some(names) => names
                .iter()
                .filter_map(|bare| Some((bare.clone(), tables.remove(bare)?)))
                .collect(),
        };
        // Kept under the lock, so the count never disagrees with the list.
        let mut count = match checked {
            None => 0,
            Some(_) => {
                let gone: usize = before.values().map(BTreeSet::len).sum();
                self.unpublished_count.load(Ordering::Acquire) - gone as u64
            }
        };
        let mut news = Vec::new();
        for (qualified, bare) in found {
            if !before.get(&bare).is_some_and(|q| q.contains(&qualified)) {
                news.push(qualified.clone());
            }
            if tables.entry(bare).or_default().insert(qualified) {
                count += 1;
            }
        }
        self.unpublished_count.store(count, Ordering::Release);
        news
    }

    /// Whether a table of bare name `bare` was left out of the publication
    /// (it has no replica identity, or is unlogged).
    pub fn is_unpublished(&self, bare: &str) -> bool {
        let tables = self.unpublished.lock().unwrap_or_else(|e| e.into_inner());
        tables.contains_key(bare)
    }

    /// DDL changed `ddl`: tables left out that it names are checked again
    /// when next read ([`Self::settled_unpublished`]).
    pub fn ddl_named(&self, ddl: &Ddl) {
        let tables = self.unpublished.lock().unwrap_or_else(|e| e.into_inner());
        if tables.is_empty() {
            return;
        }
        let mut recheck = self.recheck.lock().unwrap_or_else(|e| e.into_inner());
        match ddl {
            Ddl::None => {}
            Ddl::Objects(names) => recheck.extend(
                names
                    .iter()
                    .filter(|n| tables.contains_key(&***n))
                    .map(|n| n.to_string()),
            ),
            Ddl::All => recheck.extend(tables.keys().cloned()),
        }
    }

    /// Whether a table of bare name `bare` was left out of the publication
    /// and no DDL named it since (which this call forgets, once).
    pub fn settled_unpublished(&self, bare: &str) -> bool {
        let rechecked = self
            .recheck
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(bare);
        !rechecked && self.is_unpublished(bare)
    }

    /// The tables left out of the publication, qualified, in order.
    pub fn unpublished_names(&self) -> Vec<String> {
        let tables = self.unpublished.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> = tables.values().flatten().cloned().collect();
        names.sort_unstable();
        names
    }

    /// Whether the count of tables left out is worth a warning at `now`:
    /// it changed since the last one, and that was at least
    /// [`UNPUBLISHED_WARN_EVERY`] ago. A schema migration that makes
    /// hundreds of such tables warns once, not once a table.
    pub fn warn_unpublished(&self, count: u64, now: Instant) -> bool {
        let mut last = self
            .unpublished_warned
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match *last {
            Some((at, warned))
                if warned == count || now.duration_since(at) < UNPUBLISHED_WARN_EVERY =>
            {
                false
            }
            _ => {
                *last = Some((now, count));
                true
            }
        }
    }

    pub fn unpublished(&self) -> u64 {
        self.unpublished_count.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vouch_is_good_for_its_lease_from_when_its_heartbeat_was_sent() {
        let stream = StreamHealth::default();
        assert!(!stream.vouched(), "none yet");
        let lease = Duration::from_secs(1);
        stream.vouch(Instant::now() - Duration::from_secs(2), lease);
        assert!(!stream.vouched(), "sent longer ago than the lease");
        assert!(stream.vouched_within(Duration::from_secs(3)));
        stream.vouch(Instant::now() - Duration::from_millis(100), lease);
        assert!(stream.vouched());
        stream.vouch(Instant::now() - Duration::from_secs(5), lease);
        assert!(stream.vouched(), "an older vouch takes nothing back");
        assert!(
            stream.freshness().is_err(),
            "a vouch is not this stream's freshness"
        );
    }

    #[test]
    fn a_migration_of_many_unpublished_tables_warns_once() {
        let stream = StreamHealth::default();
        let start = Instant::now();
        assert!(stream.warn_unpublished(1, start), "the first one warns");
        for n in 2..200 {
            let at = start + Duration::from_millis(n * 100);
            assert!(
                !stream.warn_unpublished(n, at),
                "table {n}: not within the interval"
            );
        }
        let later = start + UNPUBLISHED_WARN_EVERY;
        assert!(
            !stream.warn_unpublished(1, later),
            "the same count: no news"
        );
        assert!(
            stream.warn_unpublished(199, later),
            "a new count, once the interval is over"
        );
        assert!(!stream.warn_unpublished(200, later + Duration::from_secs(1)));
    }
}
