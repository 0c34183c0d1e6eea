//! The primary's WAL position, sampled against time by pgcache itself: a
//! replica's lag in time is how long ago the primary was where the replica
//! has replayed to. (`pg_last_xact_replay_timestamp()` cannot tell: it
//! grows on an idle primary, where no transaction commits.)

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Samples kept: a minute at the default poll interval. A replica further
/// behind than the oldest sample is at least that far behind.
const SAMPLES: usize = 600;

#[derive(Default)]
pub struct PrimaryClock {
    samples: Mutex<VecDeque<(Instant, u64)>>,
}

impl PrimaryClock {
    /// The primary was at `lsn` at `at`.
    pub fn sample(&self, at: Instant, lsn: u64) {
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.back().is_some_and(|&(_, last)| last > lsn) {
            // A restarted or replaced primary: its history is not ours.
            samples.clear();
        }
        if samples.len() == SAMPLES {
            samples.pop_front();
        }
        samples.push_back((at, lsn));
    }

    /// The primary's latest position, if sampled.
    pub fn position(&self) -> Option<u64> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.back().map(|&(_, lsn)| lsn)
    }

    /// How far behind the primary a server that replayed to `replayed`
    /// is, at `now`: in bytes, and in time since the primary first went
    /// past `replayed`. `None` before the primary was sampled.
    pub fn lag(&self, replayed: u64, now: Instant) -> Option<(u64, Duration)> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let &(_, latest) = samples.back()?;
        let bytes = latest.saturating_sub(replayed);
        if bytes == 0 {
            return Some((0, Duration::ZERO));
        }
        // The first sample past `replayed`: the primary moved past it
        // after the sample before that one was taken.
        let first_past = samples.partition_point(|&(_, lsn)| lsn <= replayed);
        let since = match first_past {
            0 => samples.front().map(|&(at, _)| at),
            i => samples.get(i - 1).map(|&(at, _)| at),
        };
        Some((
            bytes,
            since.map_or(Duration::ZERO, |at| now.saturating_duration_since(at)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_is_how_long_ago_the_primary_was_where_the_replica_is() {
        let clock = PrimaryClock::default();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(clock.lag(0, t0), None, "not sampled yet");
        clock.sample(at(0), 100);
        clock.sample(at(100), 100);
        clock.sample(at(200), 300);
        clock.sample(at(300), 500);
        // Caught up: no lag, however old the samples.
        assert_eq!(clock.lag(500, at(1000)), Some((0, Duration::ZERO)));
        // At 300: the primary left 300 after the sample at 200 ms.
        assert_eq!(
            clock.lag(300, at(400)),
            Some((200, Duration::from_millis(200)))
        );
        // At 150: the primary was last at or below it at 100 ms.
        assert_eq!(
            clock.lag(150, at(400)),
            Some((350, Duration::from_millis(300)))
        );
        // Before every sample: at least as old as the oldest.
        assert_eq!(
            clock.lag(50, at(400)),
            Some((450, Duration::from_millis(400)))
        );
        // An idle primary: the replica at its position stays lag-free.
        clock.sample(at(5000), 500);
        assert_eq!(clock.lag(500, at(9000)), Some((0, Duration::ZERO)));
        // A primary whose position went back is a new history.
        clock.sample(at(6000), 10);
        assert_eq!(clock.position(), Some(10));
        assert_eq!(clock.lag(10, at(6000)), Some((0, Duration::ZERO)));
    }
}
