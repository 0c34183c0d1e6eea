//! A plan's reads and writes of one table by row (see
//! [`crate::cache::rowkey`]): a read whose WHERE clause pins every column
//! of its table's replica identity depends on those rows alone, and a
//! write that pins them changes those rows alone.
//!
//! - A keyed read's entries are keyed by its table's `wide` version and its
//!   rows' stripes, not by the table's version: a change of another row
//!   leaves them be. The rows come from the text's literals (per text: a
//!   shape's texts share the plan) or the Bind's parameters, at each run.
//! - A keyed write moves its table's version (every other read of it) and
//!   its rows' stripes. A write of a table whose rows are not known moves
//!   the table's `wide` too, so every keyed read of the table misses; the
//!   replication stream then keys the same change by row, harmlessly.
//!   (The other way, waiting for the stream to pass the commit, would
//!   hold every such write's client for a round through the stream.)
//!
//! Anything this cannot read as the server will (a value of a form
//! [`crate::cache::rowkey`] does not take, a missing parameter) makes the
//! statement table-wide: a key read wrongly would miss an invalidation.

use std::sync::Arc;

use crate::cache::catalog::Facts;
use crate::cache::rowkey::{RowSet, Values};
use crate::cache::versions::{Family, Versions};
use crate::cache::{Bumps, Reads};
use crate::classify::pins::Pins;
use crate::classify::{Analysis, Effect, StatementInfo};
use crate::hints::Hints;

/// One table's rows a plan reads or writes by key.
#[derive(Debug)]
pub(super) struct Keyed {
    pub table: Arc<Family>,
    pub rows: RowSet,
    /// This plan began this instance's keying of the table: its mirrors of
    /// the rows' counters are to be read from Redis
    /// ([`crate::cache::versions::RowVersions`]).
    pub began: bool,
}

impl Keyed {
    /// A cacheable read of one plain table whose identity it pins: `None`
    /// for any other (a join, a partition tree, a tag read like a table,
    /// a table replication does not watch).
    pub fn read(
        analysis: &Analysis,
        hints: &Hints,
        facts: &Facts,
        versions: &Versions,
    ) -> Option<Arc<Keyed>> {
        if !hints.tags.is_empty() {
            return None;
        }
        let st = analysis.cacheable_select().ok()?;
        let Some(Pins::Where { columns, .. }) = &st.pins else {
            return None;
        };
        let (name, identity) = keyed_table(st, facts, false)?;
        let rows = RowSet::pinned(identity, columns)?;
        Some(Arc::new(Keyed::new(versions, name, rows)))
    }

    /// A write of one plain table's rows, by key: an UPDATE or DELETE that
    /// pins its identity (an UPDATE setting no column of it), or an INSERT
    /// whose VALUES give every column of it.
    pub fn write(analysis: &Analysis, facts: &Facts, versions: &Versions) -> Option<Arc<Keyed>> {
        let [st] = analysis.statements.as_slice() else {
            return None;
        };
        if !matches!(st.effect, Effect::Write(_)) {
            return None;
        }
        let (name, identity) = keyed_table(st, facts, true)?;
        let rows = match st.pins.as_ref()? {
            Pins::Where { columns, sets } => {
                if identity.columns.iter().any(|c| sets.contains(&c.name)) {
                    // The key itself moves: to where, the text may not say.
                    return None;
                }
                RowSet::pinned(identity, columns)?
            }
            Pins::Values { columns, rows } => RowSet::values(identity, columns, rows)?,
        };
        Some(Arc::new(Keyed::new(versions, name, rows)))
    }

    fn new(versions: &Versions, name: &str, rows: RowSet) -> Keyed {
        let table = versions.family(name);
        let began = table.rows().is_none();
        // The stream keys changes by row under the same identity.
        versions.rows(&table).plan_under(rows.identity.signature);
        Keyed { table, rows, began }
    }

    /// Whether reads by row may use the shared tier yet: with a shared
    /// tier, once this instance's mirrors of the table's rows were read
    /// from Redis (until then, its shared key reads the table's version,
    /// as before).
    pub fn ready(&self, shared: bool) -> bool {
        !shared || self.table.rows().is_some_and(|r| r.shared_ready())
    }

    /// What a read of these rows reads, with `values`; `None`: the whole
    /// table's version (a value not read).
    pub fn reads(&self, values: Values<'_, '_>) -> Option<Reads> {
        let stripes = self.rows.stripes(values, false)?;
        self.table.rows().map(|rows| rows.reads(&stripes))
    }

    /// What a write of these rows moves besides the table's version, with
    /// `values`: the rows' stripes, or the table's `wide` where a value is
    /// not read.
    pub fn bumps(&self, versions: &Versions, values: Values<'_, '_>) -> Bumps {
        let mut bumps = Bumps::default();
        match (self.rows.stripes(values, true), self.table.rows()) {
            (Some(stripes), Some(rows)) => {
                for stripe in stripes {
                    bumps.add_family(Arc::clone(&rows.stripes[stripe % rows.stripes.len()]));
                }
            }
            _ => bumps.add_family(versions.wide(&self.table)),
        }
        bumps
    }
}

/// The one table `st` names, if it is a plain one of this name whose
/// identity the catalog gives, and replication watches it; for a write
/// (`writing`), one whose writes change no other rows (no trigger, rule
/// or cascading foreign key: those make the write's effects unknown).
fn keyed_table<'f>(
    st: &StatementInfo,
    facts: &'f Facts,
    writing: bool,
) -> Option<(&'f str, &'f Arc<crate::cache::rowkey::Identity>)> {
    let [rel] = st.relations.as_slice() else {
        return None;
    };
    let table = facts.relation(&rel.name)?;
    if !table.readable || (writing && table.write_hazard) || table.family != rel.name {
        return None;
    }
    Some((&table.family, table.identity.as_ref()?))
}

/// What a simple Query's text `sql` reads under a keyed read: its rows, by
/// its own literals.
pub(super) fn text_reads(keyed: &Keyed, sql: &[u8]) -> Option<Reads> {
    let sql = std::str::from_utf8(sql).ok()?;
    literal_reads(keyed, &crate::hints::literals(sql))
}

/// What a simple Query's text reads under a keyed read, by `literals`,
/// the text's own.
pub(super) fn literal_reads(
    keyed: &Keyed,
    literals: &[crate::hints::Literal<'_>],
) -> Option<Reads> {
    keyed.reads(Values {
        literals,
        bound: None,
    })
}

/// What one run of a write moves: `effects`, or for a keyed write whose
/// rows this run's `values` name, the table's version and those rows'.
pub(super) fn run_effects(
    effects: &Bumps,
    keyed: Option<&(Arc<Keyed>, Bumps)>,
    versions: &Versions,
    values: Values<'_, '_>,
) -> Bumps {
    let Some((keyed, by_table)) = keyed else {
        return effects.clone();
    };
    let mut bumps = by_table.clone();
    bumps.merge(&keyed.bumps(versions, values));
    bumps
}
