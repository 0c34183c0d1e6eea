//! `/*+ explain */`: the cache's `EXPLAIN ANALYZE`. The statement is
//! answered as usual, and its client is also told, in a NOTICE before the
//! ReadyForQuery, where the answer came from and how long that took, or
//! why it was not cached.

use std::time::{Duration, Instant};

use bytes::BytesMut;

use crate::cache::{Lookup, Source};
use crate::classify::BypassReason;
use crate::protocol::{messages, sqlstate};

/// Where an explained statement's answer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Explained {
    /// A tier of the cache, in so long.
    Hit(Source, Duration),
    /// PostgreSQL, the cache not holding it yet; its answer is stored.
    Miss,
    /// PostgreSQL, the cache not answering it, for this reason.
    Bypass(BypassReason),
    /// PostgreSQL: shadow mode serves nothing from the cache, though it
    /// holds this answer.
    Shadow,
}

impl Explained {
    /// What a lookup's outcome means for where the answer comes from.
    pub fn of(looked: &Result<Lookup, BypassReason>) -> Self {
        match looked {
            Err(reason) | Ok(Lookup::Bypass(reason)) => Explained::Bypass(*reason),
            Ok(Lookup::Hit { from, took, .. }) => Explained::Hit(*from, *took),
            Ok(Lookup::Miss(_)) => Explained::Miss,
            Ok(Lookup::WouldHit(_)) => Explained::Shadow,
        }
    }
}

/// An explained statement, from its arrival.
#[derive(Debug)]
pub(crate) struct Explain {
    pub what: Explained,
    pub started: Instant,
}

impl Explain {
    /// For a statement that arrived at `started`, after its lookup.
    pub fn new(looked: &Result<Lookup, BypassReason>, started: Instant) -> Box<Self> {
        Box::new(Self {
            what: Explained::of(looked),
            started,
        })
    }

    /// The NOTICE, its answer complete at `now` (a hit's own time is its
    /// lookup's).
    pub fn notice(&self, now: Instant, out: &mut BytesMut) {
        let took = now.saturating_duration_since(self.started);
        messages::notice_response(
            out,
            "NOTICE",
            sqlstate::SUCCESSFUL_COMPLETION,
            &self.text(took),
        );
    }

    fn text(&self, took: Duration) -> String {
        match self.what {
            Explained::Hit(from, took) => {
                format!("pgcache: answered from {} in {took:?}", from.label())
            }
            Explained::Miss => format!(
                "pgcache: answered by PostgreSQL in {took:?}: not in the cache (memory, disk, Redis) yet; the answer is stored"
            ),
            Explained::Bypass(reason) => format!(
                "pgcache: answered by PostgreSQL in {took:?}: not cached ({})",
                reason.label()
            ),
            Explained::Shadow => format!(
                "pgcache: answered by PostgreSQL in {took:?}: shadow mode (the cache holds this answer but serves nothing)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_names_where_the_answer_came_from() {
        let took = Duration::from_micros(85);
        let text = |what| {
            Explain {
                what,
                started: Instant::now(),
            }
            .text(took)
        };
        let hit = |from| text(Explained::Hit(from, Duration::from_micros(12)));
        assert_eq!(hit(Source::Disk), "pgcache: answered from disk in 12µs");
        assert!(hit(Source::Memory).contains("from memory"));
        assert!(hit(Source::Redis).contains("from Redis"));
        assert!(text(Explained::Miss).starts_with("pgcache: answered by PostgreSQL in 85µs"));
        let bypass = text(Explained::Bypass(BypassReason::NotSelect));
        assert!(bypass.ends_with("not cached (not_select)"), "{bypass}");
        let mut out = BytesMut::new();
        Explain {
            what: Explained::Miss,
            started: Instant::now(),
        }
        .notice(Instant::now(), &mut out);
        assert_eq!(out[0], b'N');
    }
}
