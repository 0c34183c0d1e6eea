//! What a statement's text means for reusing its server connection, read
//! by a cheap scan (no parse), so that the pass-through relay can afford
//! it on every Query and Parse.
//!
//! Some things survive `DISCARD ALL` or make a parked connection harmful:
//! - a custom setting (`SET app.tenant = ...`, `set_config('app.x', ...)`)
//!   stays defined as a placeholder, so the next client's
//!   `current_setting('app.tenant', true)` gives '' instead of NULL; a
//!   `LOAD`ed library stays loaded; a temporary schema, once made, stays
//!   the backend's, so a transaction that touches `pg_temp` no longer
//!   counts as one that made it (`PREPARE TRANSACTION` then fails with
//!   another error; found by PostgreSQL's `temp` test): a session that
//!   names `temp`, `temporary` or `pg_temp` leaves its connection closed;
//! - `CREATE`/`DROP`/`ALTER DATABASE` fail while other connections use
//!   the database (or the template): parked connections are closed first.

/// What one statement text asks of the pool.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    /// The session's connection must not serve another client.
    pub taints: bool,
    /// Parked connections must be closed before the statement runs.
    pub evicts: bool,
    /// The text names UNLOGGED: not a pool matter, but found by the same
    /// scan, so the session knows when to look for `SET UNLOGGED`
    /// ([`crate::classify::prerequisites`]).
    pub unlogged: bool,
}

impl Marks {
    pub fn any(self) -> bool {
        self.taints || self.evicts
    }
}

/// Scans SQL text (any case, comments and literals included: a false
/// positive only costs one reuse) word by word.
pub fn marks(sql: &[u8]) -> Marks {
    let mut marks = Marks::default();
    let mut words = Words { sql, pos: 0 };
    while let Some((start, end)) = words.next() {
        let word = &sql[start..end];
        if is(word, b"database") {
            marks.evicts = true;
        } else if is(word, b"unlogged") {
            marks.unlogged = true;
        } else {
            marks.taints |= is(word, b"set_config")
                || is(word, b"temp")
                || is(word, b"temporary")
                || is(word, b"pg_temp")
                || (is(word, b"load") && next_byte(sql, end) == Some(b'\''))
                // A look ahead: the words after SET are scanned too
                // (`SET UNLOGGED`).
                || (is(word, b"set") && sets_custom(&mut Words { sql, pos: words.pos }));
        }
        if marks.taints && marks.evicts && marks.unlogged {
            break;
        }
    }
    marks
}

/// The first byte after `pos` that is not white space.
fn next_byte(sql: &[u8], pos: usize) -> Option<u8> {
    sql[pos..]
        .iter()
        .copied()
        .find(|b| !b.is_ascii_whitespace())
}

fn is(word: &[u8], keyword: &[u8]) -> bool {
    word.eq_ignore_ascii_case(keyword)
}

/// After SET: `[SESSION | LOCAL] name.name`, a setting with a dot in its
/// name, which only a placeholder or an extension's setting has.
fn sets_custom(words: &mut Words<'_>) -> bool {
    let Some(mut word) = words.next() else {
        return false;
    };
    let text = &words.sql[word.0..word.1];
    if is(text, b"session") || is(text, b"local") {
        let Some(next) = words.next() else {
            return false;
        };
        word = next;
    }
    words.sql.get(word.1) == Some(&b'.')
}

/// Identifier-like words of SQL text, as byte ranges.
struct Words<'a> {
    sql: &'a [u8],
    pos: usize,
}

impl Iterator for Words<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        let word_byte = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
        while self.pos < self.sql.len() && !word_byte(self.sql[self.pos]) {
            self.pos += 1;
        }
        if self.pos == self.sql.len() {
            return None;
        }
        let start = self.pos;
        while self.pos < self.sql.len() && word_byte(self.sql[self.pos]) {
            self.pos += 1;
        }
        Some((start, self.pos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(sql: &str) -> (bool, bool) {
        let marks = marks(sql.as_bytes());
        (marks.taints, marks.evicts)
    }

    #[test]
    fn custom_settings_and_load_taint() {
        assert_eq!(m("SET app.tenant = 4"), (true, false));
        assert_eq!(m("set session app.tenant to 4"), (true, false));
        assert_eq!(m("BEGIN; SET LOCAL myext.x = 1; COMMIT"), (true, false));
        assert_eq!(m("SELECT set_config('app.x', '1', false)"), (true, false));
        assert_eq!(m("LOAD 'auto_explain'"), (true, false));
        assert_eq!(m("SELECT 1; load  '$libdir/plugins/x'"), (true, false));
        assert_eq!(m("CREATE TEMP TABLE scratch(a int)"), (true, false));
        assert_eq!(m("create temporary view v as select 1"), (true, false));
        assert_eq!(m("SET search_path TO 'pg_temp'"), (true, false));
        assert_eq!(m("SELECT pg_temp.f()"), (true, false));
    }

    #[test]
    fn ordinary_statements_mark_nothing() {
        assert_eq!(m("SET work_mem = '64MB'"), (false, false));
        assert_eq!(m("SET SESSION AUTHORIZATION alice"), (false, false));
        assert_eq!(m("UPDATE t SET v = 1 WHERE k = 2"), (false, false));
        assert_eq!(m("SELECT * FROM payload WHERE loaded"), (false, false));
        assert_eq!(m("SELECT load FROM t"), (false, false));
        assert_eq!(m("SELECT databases FROM t"), (false, false));
    }

    #[test]
    fn database_statements_evict() {
        assert_eq!(m("DROP DATABASE app_test"), (false, true));
        assert_eq!(m("create database x template app"), (false, true));
        assert_eq!(m("ALTER DATABASE x RENAME TO y"), (false, true));
    }

    #[test]
    fn unlogged_is_seen_after_set() {
        assert!(marks(b"ALTER TABLE t SET UNLOGGED").unlogged);
        assert!(marks(b"alter table t set unlogged, set (fillfactor = 50)").unlogged);
        assert!(!marks(b"ALTER TABLE t SET LOGGED").unlogged);
    }
}
