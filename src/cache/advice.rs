//! Caching advice per statement shape, from what pgcache saw of it: what
//! `SHOW QUERIES` and `/stats.json` recommend.

use super::stats::QueryRow;
use crate::classify::BypassReason;
use crate::config::CacheMode;

/// What to do about one statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advice {
    /// `cache`, `leave` or `ttl`.
    pub action: &'static str,
    /// Why, in a few words.
    pub why: String,
    /// The hint to paste into the statement, if one is needed.
    pub hint: &'static str,
}

/// Calls below which a statement is not worth a word.
const FEW_CALLS: u64 = 10;

pub fn advise(q: &QueryRow, mode: CacheMode) -> Advice {
    let advice = |action, why: String, hint| Advice { action, why, hint };
    let reads = q.hits + q.misses + q.would_hits;
    if reads == 0 {
        return match q.last_bypass {
            None => advice("leave", "not a read pgcache could cache".into(), ""),
            Some(BypassReason::NotATable | BypassReason::NotPublished) => advice(
                "ttl",
                "replication cannot watch what it reads: only a TTL lets it be cached".into(),
                "/*+ cache ttl=60s */",
            ),
            Some(BypassReason::OptIn) if q.calls >= FEW_CALLS => advice(
                "cache",
                format!("{} calls; opt in to cache it", q.calls),
                "/*+ cache */",
            ),
            Some(BypassReason::OptIn) => advice("leave", "rarely called".into(), ""),
            Some(reason) => advice("leave", format!("not cacheable: {}", reason.label()), ""),
        };
    }
    // Adaptive admission stopped storing it, and it was sent straight to
    // PostgreSQL more often than it was served.
    if q.suspensions > 0 && q.not_admitted >= q.hits {
        return advice(
            "leave",
            format!(
                "its answers were invalidated before they were read: not stored for a while, \
                 {} times ({} requests sent straight to PostgreSQL)",
                q.suspensions, q.not_admitted
            ),
            "/*+ nocache */",
        );
    }
    // Each invalidation of what it reads costs the next read a miss.
    if reads >= FEW_CALLS && q.invalidations * 2 >= reads {
        return advice(
            "leave",
            format!(
                "its tables were invalidated {} times in {reads} reads",
                q.invalidations
            ),
            "/*+ nocache */",
        );
    }
    let served = if mode == CacheMode::Shadow {
        q.would_hits
    } else {
        q.hits
    };
    advice(
        "cache",
        format!(
            "{served} of {reads} reads answered from the cache{}",
            if mode == CacheMode::Shadow {
                " (would be)"
            } else {
                ""
            }
        ),
        "",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        calls: u64,
        hits: u64,
        misses: u64,
        invalidations: u64,
        last_bypass: Option<BypassReason>,
    ) -> QueryRow {
        QueryRow {
            id: 1,
            text: String::new(),
            calls,
            hits,
            misses,
            mean_hit_ms: 0.0,
            mean_miss_ms: 0.0,
            hit_bytes: 0,
            would_hits: 0,
            would_save_ms: 0.0,
            mismatches: 0,
            verify_mismatches: 0,
            backend_ms: 0.0,
            bypasses: 0,
            last_bypass,
            invalidations,
            last_invalidation_ms: 0,
            suspensions: 0,
            not_admitted: 0,
        }
    }

    #[test]
    fn advice_follows_what_was_seen() {
        let a = |q: &QueryRow| advise(q, CacheMode::Auto);
        assert_eq!(a(&row(100, 95, 5, 4, None)).action, "cache");
        let churn = a(&row(100, 20, 80, 70, None));
        assert_eq!((churn.action, churn.hint), ("leave", "/*+ nocache */"));
        let suspended = |hits, not_admitted| QueryRow {
            suspensions: 2,
            not_admitted,
            ..row(1000, hits, 128, 3, Some(BypassReason::NotAdmitted))
        };
        let paused = a(&suspended(10, 800));
        assert_eq!((paused.action, paused.hint), ("leave", "/*+ nocache */"));
        assert!(
            paused.why.contains("2 times (800 requests"),
            "{}",
            paused.why
        );
        assert_eq!(a(&suspended(800, 10)).action, "cache", "served since");
        let view = a(&row(50, 0, 0, 0, Some(BypassReason::NotATable)));
        assert_eq!((view.action, view.hint), ("ttl", "/*+ cache ttl=60s */"));
        assert_eq!(
            a(&row(50, 0, 0, 0, Some(BypassReason::VolatileFunction))).action,
            "leave"
        );
        let opt = advise(
            &row(50, 0, 0, 0, Some(BypassReason::OptIn)),
            CacheMode::OptIn,
        );
        assert_eq!((opt.action, opt.hint), ("cache", "/*+ cache */"));
        assert_eq!(
            advise(
                &row(3, 0, 0, 0, Some(BypassReason::OptIn)),
                CacheMode::OptIn
            )
            .action,
            "leave"
        );
    }
}
