//! The circuit breaker in front of Redis.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Stops pgcache from waiting on a Redis that fails: after `threshold`
/// consecutive failures it stays open for `open_for`; then the next
/// operation is a trial, and one more failure opens it again.
pub(super) struct Breaker {
    threshold: u32,
    open_for: Duration,
    failures: AtomicU32,
    /// Milliseconds since `start` until which the breaker is open.
    open_until: AtomicU64,
    start: Instant,
}

impl Breaker {
    pub(super) fn allows(&self) -> bool {
        self.start.elapsed().as_millis() as u64 >= self.open_until.load(Ordering::Acquire)
    }

    pub(super) fn success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Returns true when this failure opened the breaker.
    pub(super) fn failure(&self) -> bool {
        if self.failures.fetch_add(1, Ordering::AcqRel) + 1 < self.threshold {
            return false;
        }
        let until = self.start.elapsed() + self.open_for;
        self.open_until
            .store(until.as_millis() as u64, Ordering::Release);
        // Half-open afterwards: the first failure opens it again.
        self.failures
            .store(self.threshold.saturating_sub(1), Ordering::Release);
        true
    }
}

impl Breaker {
    pub(super) fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold,
            open_for,
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            start: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_after_consecutive_failures_and_reopens_at_the_trial() {
        let b = Breaker::new(3, Duration::from_millis(30));
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.allows());
        assert!(b.failure(), "third consecutive failure opens it");
        assert!(!b.allows());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !b.allows() {
            assert!(Instant::now() < deadline, "the breaker never closed");
            std::thread::yield_now();
        }
        assert!(b.failure(), "one failure at the trial opens it again");
        assert!(!b.allows());
    }
}
