//! Adaptive admission: a statement shape whose stored answers are retired
//! before anyone reads them stops being stored (and looked up) for a while,
//! so that reads which cannot stay cached cost what going direct costs.
//!
//! In the spirit of TinyLFU's doorkeeper, a small sketch remembers, for
//! each request (its key without versions), whether the answer last stored
//! for it was ever served. A miss of a request whose last stored answer
//! was never served means that answer was retired unread: invalidated
//! (or evicted) before its first hit. A shape is judged over windows of
//! [`WINDOW`] stores: when at least three quarters of a window's stores
//! follow such a wasted one, the shape is suspended for [`BASE_PAUSE`],
//! doubling with each suspension in a row up to [`MAX_PAUSE`]. After a
//! pause it is stored again, and judged again.
//!
//! The first store of a request is never counted as wasted: a shape that
//! is still filling (many keys, each read once so far) is not suspended.
//! The sketch is a fixed array; a collision costs a misjudgement, never a
//! wrong answer: admission only decides what is stored.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::key::RequestKey;

/// Requests the sketch tells apart (a power of two): 256 KiB.
const SLOTS: usize = 1 << 16;
/// Stores a shape is judged over.
pub const WINDOW: u32 = 64;
/// A window with at least this many wasted stores suspends the shape.
const WASTED: u32 = WINDOW * 3 / 4;
/// The first pause, and the longest: a shape paused by a burst of writes
/// is stored again at most this long after the burst, and one that stays
/// wasteful costs one window of stores per pause.
pub const BASE_PAUSE: Duration = Duration::from_secs(1);
pub const MAX_PAUSE: Duration = Duration::from_secs(4);

/// What a slot holds besides its request's tag: its answer was served.
const SERVED: u32 = 1;

/// The sketch of stored requests, shared by every shape.
pub struct Admission {
    slots: Box<[AtomicU32]>,
    /// Pauses end at milliseconds since this.
    anchor: Instant,
}

/// One statement shape's admission: its current window and pause.
#[derive(Debug, Default)]
pub struct Shape {
    window_stores: AtomicU32,
    window_wasted: AtomicU32,
    /// Milliseconds since [`Admission::anchor`] until which it is not
    /// stored; 0: admitted.
    paused_until: AtomicU64,
    /// Suspensions in a row: the next pause is `BASE_PAUSE << strikes`.
    strikes: AtomicU32,
    /// Times it was suspended, and requests not looked up meanwhile.
    suspensions: AtomicU64,
    not_admitted: AtomicU64,
}

impl Shape {
    /// Times it was suspended.
    pub fn suspensions(&self) -> u64 {
        self.suspensions.load(Ordering::Relaxed)
    }

    /// Requests of it sent to PostgreSQL without a lookup, suspended.
    pub fn not_admitted(&self) -> u64 {
        self.not_admitted.load(Ordering::Relaxed)
    }
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            anchor: Instant::now(),
        }
    }
}

impl Admission {
    /// Whether `shape`'s requests may be looked up and stored at `now`;
    /// one that may not is counted.
    pub fn admits(&self, shape: &Shape, now: Instant) -> bool {
        let until = shape.paused_until.load(Ordering::Relaxed);
        if until == 0 || self.millis(now) >= until {
            return true;
        }
        shape.not_admitted.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// A miss of `key`, of `shape`, is to be stored at `now`: counts it in
    /// the shape's window, wasted if the answer last stored for the same
    /// request was never served, and judges the window when it is full.
    pub fn missed(&self, shape: &Shape, key: RequestKey, now: Instant) {
        let (slot, tag) = self.slot(key);
        let wasted = slot.swap(tag, Ordering::Relaxed) == tag;
        if wasted {
            shape.window_wasted.fetch_add(1, Ordering::Relaxed);
        }
        if shape.window_stores.fetch_add(1, Ordering::Relaxed) + 1 < WINDOW {
            return;
        }
        // One thread closes the window; a store counted meanwhile falls in
        // the next.
        shape.window_stores.store(0, Ordering::Relaxed);
        let wasted = shape.window_wasted.swap(0, Ordering::Relaxed);
        if wasted < WASTED {
            shape.strikes.store(0, Ordering::Relaxed);
            return;
        }
        let strikes = shape.strikes.fetch_add(1, Ordering::Relaxed);
        let pause = BASE_PAUSE
            .saturating_mul(1 << strikes.min(31))
            .min(MAX_PAUSE);
        shape
            .paused_until
            .store(self.millis(now + pause).max(1), Ordering::Relaxed);
        shape.suspensions.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            pause_ms = pause.as_millis() as u64,
            wasted,
            "statement shape not stored for a while: its answers were retired unread"
        );
    }

    /// `key`'s stored answer was served.
    pub fn served(&self, key: RequestKey) {
        let (slot, tag) = self.slot(key);
        // Written only on the first hit of a stored answer: hot entries
        // leave the slot's cache line shared.
        if slot.load(Ordering::Relaxed) == tag {
            slot.store(tag | SERVED, Ordering::Relaxed);
        }
    }

    /// The slot of a request, and the tag (never 0, without `SERVED`) it
    /// holds there once stored.
    fn slot(&self, key: RequestKey) -> (&AtomicU32, u32) {
        let index = key.0 as usize & (SLOTS - 1);
        let tag = ((key.0 >> 96) as u32 | 2) & !SERVED;
        (&self.slots[index], tag)
    }

    fn millis(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.anchor).as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> RequestKey {
        RequestKey(n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
    }

    /// Stores `n` misses of keys `from..from + n` at `now`.
    fn miss_all(a: &Admission, shape: &Shape, from: u128, n: u128, now: Instant) {
        for k in from..from + n {
            a.missed(shape, key(k), now);
        }
    }

    #[test]
    fn first_stores_never_suspend_a_shape() {
        let a = Admission::default();
        let shape = Shape::default();
        let now = Instant::now();
        miss_all(&a, &shape, 0, 10 * WINDOW as u128, now);
        assert!(a.admits(&shape, now));
        assert_eq!(shape.suspensions(), 0);
    }

    #[test]
    fn answers_retired_unread_suspend_the_shape_with_a_growing_pause() {
        let a = Admission::default();
        let shape = Shape::default();
        let t0 = Instant::now();
        // Each key stored, then missed again without a hit.
        miss_all(&a, &shape, 0, WINDOW as u128, t0);
        assert!(a.admits(&shape, t0), "a first window of first stores");
        miss_all(&a, &shape, 0, WINDOW as u128, t0);
        assert!(!a.admits(&shape, t0));
        assert!(!a.admits(&shape, t0 + BASE_PAUSE - Duration::from_millis(5)));
        assert_eq!((shape.suspensions(), shape.not_admitted()), (1, 2));
        let t1 = t0 + BASE_PAUSE;
        assert!(a.admits(&shape, t1), "the pause ends");
        // Still wasted after it: twice as long.
        miss_all(&a, &shape, 0, WINDOW as u128, t1);
        assert!(!a.admits(&shape, t1 + BASE_PAUSE));
        assert!(a.admits(&shape, t1 + 2 * BASE_PAUSE));
        assert_eq!(shape.suspensions(), 2);
    }

    #[test]
    fn the_pause_of_a_shape_that_stays_wasteful_stops_growing_at_its_cap() {
        let a = Admission::default();
        let shape = Shape::default();
        let mut now = Instant::now();
        miss_all(&a, &shape, 0, WINDOW as u128, now);
        for _ in 0..10 {
            miss_all(&a, &shape, 0, WINDOW as u128, now);
            assert!(!a.admits(&shape, now));
            assert!(a.admits(&shape, now + MAX_PAUSE), "paused at most the cap");
            now += MAX_PAUSE;
        }
        assert_eq!(shape.suspensions(), 10);
        assert!(!a.admits(&shape, now - Duration::from_millis(5)));
        assert!(
            !a.admits(&shape, now - MAX_PAUSE + Duration::from_millis(5)),
            "the last pauses are the cap's length"
        );
    }

    #[test]
    fn served_answers_keep_a_shape_admitted_and_reset_its_pause() {
        let a = Admission::default();
        let shape = Shape::default();
        let now = Instant::now();
        for round in 0..8 {
            for k in 0..WINDOW as u128 {
                a.missed(&shape, key(k), now);
                // Half of them are read before they are retired.
                if k % 2 == round % 2 {
                    a.served(key(k));
                }
            }
        }
        assert!(a.admits(&shape, now));
        assert_eq!(shape.suspensions(), 0);
    }

    #[test]
    fn a_served_answer_is_not_counted_wasted_when_missed_again() {
        let a = Admission::default();
        let shape = Shape::default();
        let now = Instant::now();
        a.missed(&shape, key(7), now);
        a.served(key(7));
        a.missed(&shape, key(7), now);
        assert_eq!(shape.window_wasted.load(Ordering::Relaxed), 0);
        a.missed(&shape, key(7), now);
        assert_eq!(shape.window_wasted.load(Ordering::Relaxed), 1);
    }
}
