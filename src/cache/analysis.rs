//! What pgcache knows of a statement text, worked out once per text.

use std::sync::Arc;

use super::stats::{QueryStats, StatsRegistry};
use crate::classify::{self, Analysis, BypassReason, Effect, StatementInfo};
use crate::hints::{self, Scan};

pub struct Analyzed {
    pub analysis: Analysis,
    pub scan: Scan,
    pub stats: Arc<QueryStats>,
}

/// Statements longer than this are not parsed (nor cached): their effects
/// are assumed unknown.
pub const MAX_ANALYZED_SQL: usize = 64 * 1024;

/// Statement analyses, memoised by the hash of their text.
pub struct Analyses {
    memo: moka::sync::Cache<u128, Arc<Analyzed>>,
}

impl Analyses {
    pub fn new(capacity: u64) -> Self {
        Self {
            memo: moka::sync::Cache::new(capacity),
        }
    }

    /// The analysis of `sql` (hash `hash`), parsed once per text.
    pub fn get(&self, hash: u128, sql: &[u8], stats: &StatsRegistry) -> Arc<Analyzed> {
        if let Some(a) = self.memo.get(&hash) {
            return a;
        }
        let (analysis, scan) = match std::str::from_utf8(sql) {
            Ok(text) if sql.len() <= MAX_ANALYZED_SQL => {
                (classify::analyze(text), hints::scan(text))
            }
            _ => (
                opaque_analysis(),
                hints::scan(&String::from_utf8_lossy(&sql[..sql.len().min(4096)])),
            ),
        };
        let stats = stats.get(&scan.normalized);
        let analyzed = Arc::new(Analyzed {
            analysis,
            scan,
            stats,
        });
        self.memo.insert(hash, Arc::clone(&analyzed));
        analyzed
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
    });
    a
}
