//! What pgcache knows of a statement text: its own hints and normalised
//! text, and a parse shared by every text of the same shape.

use std::hash::Hash;
use std::sync::Arc;

use xxhash_rust::xxh3::{Xxh3, xxh3_128};

use super::stats::{QueryStats, StatsRegistry};
use crate::classify::{self, Analysis, BypassReason, Effect, StatementInfo};
use crate::hints::{self, Scan};

pub struct Analyzed {
    /// Shared by every text of the same shape (see [`Analyses::get`]).
    pub analysis: Arc<Analysis>,
    /// This text's own hints and normalised text.
    pub scan: Scan,
    pub stats: Arc<QueryStats>,
    /// Texts with the same key get the same plan from the same session
    /// state: one shape and the same hints (or, for a text whose literals
    /// matter, the text itself).
    pub plan_key: u128,
}

/// Statements longer than this are not parsed (nor cached): their effects
/// are assumed unknown.
pub const MAX_ANALYZED_SQL: usize = 64 * 1024;

/// Statement analyses, parsed once per *shape*: `WHERE k = 1` and
/// `WHERE k = 2` share one parse. What the cache takes from a parse (the
/// statements' kinds, the relations and functions they name) does not
/// depend on the literals the normalised text replaced, unless one of them
/// is a time input or a string with escapes, and the lexer says so
/// (`Scan::shape_exact`); such texts are memoised one by one.
///
/// A text of a known shape is lexed again rather than memoised: sessions
/// keep their plans by text, so this runs once per text and session, and a
/// memo of every distinct text (say, point selects with literal keys)
/// would churn: inserting and evicting in moka cost more than the lexer.
pub struct Analyses {
    texts: Memo<Analyzed>,
    shapes: Memo<Analysis>,
}

/// Keyed by digests: foldhash, not SipHash, which was a tenth of a lookup.
type Memo<T> = moka::sync::Cache<u128, Arc<T>, foldhash::fast::RandomState>;

fn memo<T: Send + Sync + 'static>(capacity: u64) -> Memo<T> {
    moka::sync::Cache::builder()
        .max_capacity(capacity)
        .build_with_hasher(foldhash::fast::RandomState::default())
}

impl Analyses {
    pub fn new(capacity: u64) -> Self {
        Self {
            texts: memo(capacity),
            shapes: memo(capacity),
        }
    }

    /// The analysis of `sql` (hash `hash`), parsed once per shape.
    pub fn get(&self, hash: u128, sql: &[u8], stats: &StatsRegistry) -> Arc<Analyzed> {
        self.finish(self.scan(hash, sql), sql, stats)
    }

    /// The first half of [`Analyses::get`]: the text's hints, normalised
    /// text and plan key. A session that planned another text of the same
    /// shape needs no more, and a new literal in a known statement (every
    /// statement of a workload with literal keys) stops here.
    pub fn scan(&self, hash: u128, sql: &[u8]) -> Scanned {
        let text = std::str::from_utf8(sql)
            .ok()
            .filter(|_| sql.len() <= MAX_ANALYZED_SQL);
        let parsable = text.is_some();
        let scan = match text {
            Some(text) => hints::scan(text),
            None => {
                // Too long, or not UTF-8: its hints come from the start of
                // the text, which stands for no other text.
                let mut scan = hints::scan(&String::from_utf8_lossy(&sql[..sql.len().min(4096)]));
                scan.shape_exact = false;
                // They stand in another string than the text.
                scan.spans.clear();
                scan
            }
        };
        // Only a text that is its own shape is memoised whole: the lexer
        // says which, so the memo is not searched for every other text.
        let plan_key = if scan.shape_exact {
            let mut key = Xxh3::new();
            key.update(scan.normalized.as_bytes());
            scan.hints.hash(&mut key);
            key.digest128()
        } else {
            if let Some(a) = self.texts.get(&hash) {
                return Scanned::Analyzed(a);
            }
            hash
        };
        Scanned::Text {
            hash,
            scan,
            plan_key,
            parsable,
        }
    }

    /// The second half of [`Analyses::get`]: the parse, shared by the
    /// texts of a shape, and the statement's statistics.
    pub fn finish(&self, scanned: Scanned, sql: &[u8], stats: &StatsRegistry) -> Arc<Analyzed> {
        let (hash, scan, plan_key, parsable) = match scanned {
            Scanned::Analyzed(a) => return a,
            Scanned::Text {
                hash,
                scan,
                plan_key,
                parsable,
            } => (hash, scan, plan_key, parsable),
        };
        let analysis = match std::str::from_utf8(sql) {
            Ok(text) if parsable && scan.shape_exact => {
                let shape = xxh3_128(scan.normalized.as_bytes());
                self.shapes
                    .get_with(shape, || Arc::new(classify::analyze(text)))
            }
            Ok(text) if parsable => Arc::new(classify::analyze(text)),
            _ => Arc::new(opaque_analysis()),
        };
        let stats = stats.get(&scan.normalized);
        let analyzed = Arc::new(Analyzed {
            analysis,
            scan,
            stats,
            plan_key,
        });
        if !analyzed.scan.shape_exact {
            self.texts.insert(hash, Arc::clone(&analyzed));
        }
        analyzed
    }
}

/// A text as [`Analyses::scan`] left it.
pub enum Scanned {
    /// Memoised whole: a text that is its own shape, seen before.
    Analyzed(Arc<Analyzed>),
    Text {
        hash: u128,
        scan: Scan,
        plan_key: u128,
        /// Short enough and UTF-8: parsed, not taken as opaque.
        parsable: bool,
    },
}

impl Scanned {
    pub fn scan(&self) -> &Scan {
        match self {
            Scanned::Analyzed(a) => &a.scan,
            Scanned::Text { scan, .. } => scan,
        }
    }

    pub fn plan_key(&self) -> u128 {
        match self {
            Scanned::Analyzed(a) => a.plan_key,
            Scanned::Text { plan_key, .. } => *plan_key,
        }
    }
}

fn opaque_analysis() -> Analysis {
    let mut a = classify::analyze("");
    a.statements.push(StatementInfo {
        effect: Effect::Opaque,
        cacheable: Err(BypassReason::TooLarge),
        relations: Vec::new(),
        functions: Default::default(),
        creates_temp: false,
        ddl: classify::Ddl::All,
        pins: None,
    });
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(a: &Analyses, sql: &str) -> Arc<Analyzed> {
        let hash = xxhash_rust::xxh3::xxh3_128(sql.as_bytes());
        a.get(hash, sql.as_bytes(), &StatsRegistry::new(10))
    }

    #[test]
    fn texts_of_one_shape_share_one_parse_but_keep_their_own_hints() {
        let a = Analyses::new(100);
        let one = get(&a, "SELECT v FROM t WHERE k = 1");
        let two = get(&a, "/*+ cache ttl=5s */ SELECT v FROM t WHERE k = 2");
        assert!(Arc::ptr_eq(&one.analysis, &two.analysis));
        assert_eq!(one.scan.hints.ttl, None);
        assert_eq!(two.scan.hints.ttl, Some(std::time::Duration::from_secs(5)));
        let again = get(&a, "SELECT v FROM t WHERE k = 1");
        assert!(Arc::ptr_eq(&one.analysis, &again.analysis));
        assert_eq!(
            a.texts.entry_count() + a.texts.weighted_size(),
            0,
            "shapes only"
        );
        assert_ne!(one.plan_key, two.plan_key, "other hints, another plan");
        let three = get(&a, "SELECT v FROM t WHERE k = 3");
        assert_eq!(one.plan_key, three.plan_key);
    }

    #[test]
    fn a_scan_alone_gives_the_plan_key_of_the_whole_analysis() {
        let a = Analyses::new(100);
        let now = "SELECT * FROM t WHERE ts < 'now'";
        for sql in [
            "SELECT v FROM t WHERE k = 1",
            "/*+ cache ttl=5s */ SELECT v FROM t WHERE k = 2",
            now,
        ] {
            let hash = xxhash_rust::xxh3::xxh3_128(sql.as_bytes());
            let scanned = a.scan(hash, sql.as_bytes());
            assert!(matches!(scanned, Scanned::Text { .. }), "{sql}");
            let key = scanned.plan_key();
            let whole = a.finish(scanned, sql.as_bytes(), &StatsRegistry::new(10));
            assert_eq!(key, whole.plan_key, "{sql}");
        }
        // A text that is its own shape is memoised whole once analysed.
        let hash = xxhash_rust::xxh3::xxh3_128(now.as_bytes());
        assert!(matches!(a.scan(hash, now.as_bytes()), Scanned::Analyzed(_)));
    }

    #[test]
    fn a_time_input_is_never_answered_by_another_texts_parse() {
        let a = Analyses::new(100);
        let plain = get(&a, "SELECT * FROM t WHERE ts < '2020-01-01'");
        assert!(plain.analysis.cacheable_select().is_ok());
        let now = get(&a, "SELECT * FROM t WHERE ts < 'now'");
        assert!(!Arc::ptr_eq(&plain.analysis, &now.analysis));
        assert_eq!(
            now.analysis.cacheable_select().err(),
            Some(BypassReason::TimeLiteral)
        );
        let escaped = get(&a, "SELECT * FROM t WHERE ts < E'\\x6eow'");
        assert!(!Arc::ptr_eq(&plain.analysis, &escaped.analysis));
        let again = get(&a, "SELECT * FROM t WHERE ts < 'now'");
        assert!(
            Arc::ptr_eq(&now, &again),
            "such texts are memoised one by one"
        );
        let later = get(&a, "SELECT * FROM t WHERE ts < 'tomorrow'");
        assert_ne!(now.plan_key, later.plan_key, "planned text by text");
    }

    #[test]
    fn a_text_too_long_to_parse_shares_nothing_with_the_text_its_start_looks_like() {
        let a = Analyses::new(100);
        let short = get(&a, "SELECT 'a'");
        let long = format!("SELECT '{}', now()", "x".repeat(MAX_ANALYZED_SQL));
        let long = get(&a, &long);
        assert!(short.analysis.cacheable_select().is_ok());
        assert!(long.analysis.cacheable_select().is_err());
        assert!(!long.scan.shape_exact);
        assert_ne!(short.plan_key, long.plan_key);
    }
}
