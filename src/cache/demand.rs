//! Whether a database's heartbeats are wanted.
//!
//! Heartbeats prove a database's cache fresh ([`crate::invalidation`]'s
//! `heartbeat`), and each costs PostgreSQL a commit that every walsender
//! of the cluster wakes to decode. So they are sent only while something
//! needs the proof: a lookup in the database's cache, a wait for the
//! stream to pass a point (the correctness sampler, a read routed to a
//! replica), or another instance that relies on this one's stream (it asks
//! through Redis). Past [`rest_after`] with no such need, the stream's
//! heartbeats rest; the next need wakes them, and a lookup then waits for
//! the first heartbeat back (a few milliseconds) before it is served: the
//! lease is never stretched over the rest.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Heartbeats rest after this long without a need, at least: a second, or
/// two heartbeat intervals when those are longer.
pub fn rest_after(every: Duration) -> Duration {
    (2 * every).max(Duration::from_secs(1))
}

/// A need noted less than this long after the last one is not noted again:
/// lookups on every core would otherwise write one shared word each.
const NOTE_EVERY_MICROS: u64 = 1_000;

/// How often the shared tier asks the other instances for heartbeats while
/// a lookup needs their vouch; well within [`rest_after`].
pub const ASK_EVERY: Duration = Duration::from_millis(250);

pub struct Demand {
    anchor: Instant,
    /// When a need was last noted, in microseconds since `anchor`.
    last: AtomicU64,
    /// The heartbeats rest, or have resumed and none sent since has come
    /// back yet.
    resting: AtomicBool,
    /// The heartbeat task waits in [`Demand::rest`]: a need wakes it. Kept
    /// apart from `resting`, which a heartbeat sent before the rest clears
    /// when it comes back late.
    asleep: AtomicBool,
    /// When the heartbeats last began to rest: a heartbeat sent before
    /// then that comes back later does not end `resting`.
    rested_at: AtomicU64,
    /// When they last resumed (0: they have not rested since the stream
    /// started).
    resumed: AtomicU64,
    /// Wakes resting heartbeats.
    wake: Notify,
    /// When a lookup last needed another instance's vouch (this
    /// instance's own stream not current).
    vouch: AtomicU64,
    /// Heartbeats sent, by every stream of the database since start.
    beats: AtomicU64,
}

impl Default for Demand {
    fn default() -> Self {
        Self {
            // Far enough back that "never" (0) reads as long ago.
            anchor: Instant::now()
                .checked_sub(Duration::from_secs(3600))
                .unwrap_or_else(Instant::now),
            last: AtomicU64::new(0),
            resting: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            rested_at: AtomicU64::new(0),
            resumed: AtomicU64::new(0),
            wake: Notify::new(),
            vouch: AtomicU64::new(0),
            beats: AtomicU64::new(0),
        }
    }
}

impl Demand {
    fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.anchor).as_micros() as u64 + 1
    }

    /// Heartbeats are needed now.
    pub fn note(&self) {
        let now = self.micros(Instant::now());
        if now.saturating_sub(self.last.load(Ordering::Relaxed)) >= NOTE_EVERY_MICROS {
            self.last.store(now, Ordering::SeqCst);
        }
        // `last` is written before `asleep` is read, and `rest` sets
        // `asleep` before it reads `last` (all sequentially consistent):
        // either the task sees this need, or this sees the task asleep.
        if self.asleep.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// Nothing needed heartbeats for `for_`.
    pub fn idle(&self, for_: Duration) -> bool {
        let now = self.micros(Instant::now());
        now.saturating_sub(self.last.load(Ordering::SeqCst)) > for_.as_micros() as u64
    }

    /// The stream (re)started: its heartbeats are needed to show it current
    /// (its heartbeat task may have begun with a rest: it wakes).
    pub fn started(&self) {
        self.note();
    }

    /// The heartbeat task rests until heartbeats are needed again (past
    /// `rest_after` idle), then says so.
    pub async fn rest(&self, rest_after: Duration) {
        self.resumed.store(0, Ordering::Release);
        self.rested_at
            .store(self.micros(Instant::now()), Ordering::Release);
        self.resting.store(true, Ordering::Release);
        self.asleep.store(true, Ordering::SeqCst);
        // A need noted before `asleep` was seen is not missed: checked
        // after it is set, and `wake` keeps a permit.
        while self.idle(rest_after) {
            self.wake.notified().await;
        }
        self.asleep.store(false, Ordering::SeqCst);
        self.resumed
            .store(self.micros(Instant::now()), Ordering::Release);
    }

    /// A heartbeat is sent.
    pub fn sent(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// Heartbeats sent since start.
    pub fn beats(&self) -> u64 {
        self.beats.load(Ordering::Relaxed)
    }

    /// A heartbeat sent at `sent` came back: the stream is shown current
    /// again, and lookups no longer wait, unless it was sent before the
    /// heartbeats last began to rest (it proves nothing about the rest; a
    /// heartbeat task that began since, after a stream restart, counts).
    pub fn beat_back(&self, sent: Instant) {
        if self.micros(sent) > self.rested_at.load(Ordering::Acquire) {
            self.resting.store(false, Ordering::Release);
        }
    }

    /// The heartbeats rest, or resumed less than `lease` ago and none has
    /// come back yet: a lookup waits for one. Past the lease, a stream that
    /// sent nothing back is stale.
    pub fn resting(&self, lease: Duration) -> bool {
        if !self.resting.load(Ordering::Acquire) {
            return false;
        }
        match self.resumed.load(Ordering::Acquire) {
            // Resting still, or woken and not yet resumed.
            0 => true,
            at => {
                let now = self.micros(Instant::now());
                now.saturating_sub(at) < lease.as_micros() as u64
            }
        }
    }

    /// A lookup needed another instance's vouch. True if none had for
    /// [`ASK_EVERY`]: the other instances are to be asked for heartbeats
    /// now (else the shared tier's next tick asks).
    pub fn want_vouch(&self) -> bool {
        let now = self.micros(Instant::now());
        let last = self.vouch.load(Ordering::Relaxed);
        if now.saturating_sub(last) < NOTE_EVERY_MICROS {
            return false;
        }
        self.vouch.store(now, Ordering::Release);
        now.saturating_sub(last) >= ASK_EVERY.as_micros() as u64
    }

    /// A lookup needed another instance's vouch within `within`.
    pub fn vouch_wanted(&self, within: Duration) -> bool {
        let at = self.vouch.load(Ordering::Acquire);
        at != 0 && self.micros(Instant::now()).saturating_sub(at) <= within.as_micros() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn heartbeats_rest_when_unneeded_and_wake_at_the_next_need() {
        let demand = std::sync::Arc::new(Demand::default());
        let rest_after = Duration::from_secs(1);
        assert!(demand.idle(rest_after), "never needed");
        let task = {
            let demand = std::sync::Arc::clone(&demand);
            tokio::spawn(async move { demand.rest(rest_after).await })
        };
        tokio::task::yield_now().await;
        assert!(demand.resting(rest_after), "a lookup would wait");
        assert!(!task.is_finished());
        demand.note();
        task.await.unwrap();
        assert!(!demand.idle(rest_after));
        assert!(demand.resting(rest_after), "until a heartbeat is back");
        demand.beat_back(Instant::now() + Duration::from_millis(1));
        assert!(!demand.resting(rest_after));
        // A stream that starts is needed at once.
        let fresh = Demand::default();
        fresh.started();
        assert!(!fresh.idle(rest_after) && !fresh.resting(rest_after));
    }

    #[tokio::test]
    async fn a_heartbeat_back_late_during_the_rest_neither_loses_the_wake_nor_ends_the_wait() {
        let demand = std::sync::Arc::new(Demand::default());
        let rest_after = Duration::from_secs(1);
        let sent_before = Instant::now();
        let task = {
            let demand = std::sync::Arc::clone(&demand);
            tokio::spawn(async move { demand.rest(rest_after).await })
        };
        tokio::task::yield_now().await;
        // The last heartbeat before the rest comes back only now.
        demand.beat_back(sent_before);
        assert!(demand.resting(rest_after), "still resting: a lookup waits");
        demand.note();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the need wakes the resting task")
            .unwrap();
        demand.beat_back(sent_before);
        assert!(
            demand.resting(rest_after),
            "sent before the rest: proves nothing new"
        );
        // One sent after the resume (a millisecond on, whatever the clock's
        // grain).
        demand.beat_back(Instant::now() + Duration::from_millis(1));
        assert!(!demand.resting(rest_after));
    }

    #[test]
    fn a_stream_restarted_during_a_rest_is_shown_current_by_its_first_heartbeat() {
        let demand = Demand::default();
        let rest_after = Duration::from_secs(1);
        // The old stream's heartbeat task is dropped while it rests.
        let mut resting = Box::pin(demand.rest(rest_after));
        assert!(futures_util::FutureExt::now_or_never(resting.as_mut()).is_none());
        drop(resting);
        assert!(demand.resting(rest_after));
        // The new stream starts, and its first heartbeat comes back.
        demand.started();
        let sent = Instant::now() + Duration::from_millis(1);
        demand.beat_back(sent);
        assert!(
            !demand.resting(rest_after),
            "a stall from now on is stale, not resting"
        );
    }

    #[test]
    fn a_need_noted_before_the_rest_is_not_missed() {
        let demand = Demand::default();
        demand.note();
        let rested = futures_util::FutureExt::now_or_never(demand.rest(Duration::from_secs(1)));
        assert!(rested.is_some(), "needed already: no rest");
    }

    #[test]
    fn a_resumed_stream_that_sends_nothing_back_is_stale_past_the_lease() {
        let demand = Demand::default();
        demand.note();
        futures_util::FutureExt::now_or_never(demand.rest(Duration::from_secs(1))).unwrap();
        assert!(demand.resting(Duration::from_secs(1)));
        assert!(!demand.resting(Duration::ZERO), "past the lease");
        assert!(!demand.vouch_wanted(Duration::from_secs(1)));
        assert!(demand.want_vouch(), "newly wanted: ask now");
        assert!(!demand.want_vouch(), "asked already");
        assert!(demand.vouch_wanted(Duration::from_secs(1)));
    }
}
