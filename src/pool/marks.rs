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
//!
//! In transaction mode the same scan finds what ties a client to one
//! server connection ([`Pin`]) and what may change its settings.

/// A feature whose state lives in one server connection, so a
/// transaction-mode client that uses it keeps its connection for the rest
/// of its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Temporary tables, views, sequences (and the temp schema).
    TempObjects,
    /// `LISTEN`: notifications arrive on the connection that listens.
    Listen,
    /// A session-level advisory lock (`pg_advisory_lock` and kin).
    AdvisoryLock,
    /// `DECLARE ... WITH HOLD`: the cursor outlives its transaction.
    HoldCursor,
    /// SQL-level `PREPARE` (protocol-level statements move with the client).
    SqlPrepare,
    /// `LOAD`: a library loaded into the backend.
    Load,
    /// PostgreSQL asked this client for a password in passthrough mode:
    /// pgcache cannot log in for it on another connection.
    Password,
    /// `pg_backend_pid()`: the client learned a backend's process id, to
    /// find itself in `pg_stat_activity` or to signal it; the id stays
    /// its own, as it would be directly.
    BackendPid,
}

impl Pin {
    pub const ALL: [Pin; 8] = [
        Pin::TempObjects,
        Pin::Listen,
        Pin::AdvisoryLock,
        Pin::HoldCursor,
        Pin::SqlPrepare,
        Pin::Load,
        Pin::Password,
        Pin::BackendPid,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Pin::TempObjects => "temp_objects",
            Pin::Listen => "listen",
            Pin::AdvisoryLock => "advisory_lock",
            Pin::HoldCursor => "hold_cursor",
            Pin::SqlPrepare => "sql_prepare",
            Pin::Load => "load",
            Pin::Password => "password",
            Pin::BackendPid => "backend_pid",
        }
    }
}

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
    /// Transaction mode: what pins the client to its connection.
    pub pin: Option<Pin>,
    /// It may change the session's settings (`SET`, `RESET`, `DISCARD`,
    /// `set_config`): read them again before the connection goes back.
    pub settings: bool,
    /// It may free prepared statements (`DEALLOCATE`, `DISCARD ALL`): the
    /// session forgets those it frees ([`crate::pool::reference::freed`]).
    pub frees: bool,
    /// A statement starts with `ALTER`, `CREATE` or `DROP`: statements
    /// prepared on server connections before it may be stale.
    pub schema: bool,
    /// A statement is a `LISTEN`: its channels are read from the text
    /// ([`listened`]).
    pub listen: bool,
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
    let mut previous: &[u8] = b"";
    // The word starts a statement: the first, or the first after a ';'.
    let mut first = true;
    let mut pos = 0;
    // One pass over the bytes: this runs on every Query and Parse.
    while pos < sql.len() {
        if !WORD_BYTE[usize::from(sql[pos])] {
            first |= sql[pos] == b';';
            pos += 1;
            continue;
        }
        let start = pos;
        while pos < sql.len() && WORD_BYTE[usize::from(sql[pos])] {
            pos += 1;
        }
        let end = pos;
        let word = &sql[start..end];
        if first && (is(word, b"alter") || is(word, b"create") || is(word, b"drop")) {
            marks.schema = true;
        }
        // Every word below starts with one of these: most words of a
        // statement are let go after one look.
        let pin = if !b"dhlprstu".contains(&word[0].to_ascii_lowercase()) {
            None
        } else if is(word, b"database") {
            marks.evicts = true;
            None
        } else if is(word, b"unlogged") {
            marks.unlogged = true;
            None
        } else if is(word, b"temp") || is(word, b"temporary") || is(word, b"pg_temp") {
            marks.taints = true;
            Some(Pin::TempObjects)
        } else if is(word, b"load") && next_byte(sql, end) == Some(b'\'') {
            marks.taints = true;
            Some(Pin::Load)
        } else if is(word, b"set_config") {
            marks.taints = true;
            marks.settings = true;
            None
        } else if is(word, b"set") {
            marks.settings |= first;
            // A look ahead: the words after SET are scanned too
            // (`SET UNLOGGED`).
            marks.taints |= sets_custom(&mut Words { sql, pos });
            None
        } else if is(word, b"reset") || is(word, b"discard") {
            marks.settings |= first;
            marks.frees |= is(word, b"discard");
            None
        } else if is(word, b"deallocate") {
            marks.frees = true;
            None
        } else if is(word, b"listen") && first {
            marks.listen = true;
            Some(Pin::Listen)
        } else if is(word, b"prepare") && first {
            Some(Pin::SqlPrepare)
        } else if is(word, b"hold") && is(previous, b"with") {
            Some(Pin::HoldCursor)
        } else if is_advisory_lock(word) {
            Some(Pin::AdvisoryLock)
        } else if is(word, b"pg_backend_pid") {
            Some(Pin::BackendPid)
        } else {
            None
        };
        if marks.pin.is_none() {
            marks.pin = pin;
        }
        previous = word;
        first = false;
    }
    marks
}

/// The channel of each `LISTEN` statement in `sql`, as PostgreSQL names it
/// (folded to lower case unless quoted), or `None` for one this scan
/// cannot read (a comment before it, a Unicode escape, a name PostgreSQL
/// would truncate).
pub fn listened(sql: &[u8]) -> Vec<Option<Vec<u8>>> {
    let mut found = Vec::new();
    let mut first = true;
    let mut pos = 0;
    while pos < sql.len() {
        if !WORD_BYTE[usize::from(sql[pos])] {
            first |= sql[pos] == b';';
            pos += 1;
            continue;
        }
        let start = pos;
        while pos < sql.len() && WORD_BYTE[usize::from(sql[pos])] {
            pos += 1;
        }
        if first && is(&sql[start..pos], b"listen") {
            let (channel, end) = channel(sql, pos);
            found.push(channel);
            pos = end;
        }
        first = false;
    }
    found
}

/// The identifier at `pos` (after white space) and where it ends.
fn channel(sql: &[u8], mut pos: usize) -> (Option<Vec<u8>>, usize) {
    /// NAMEDATALEN - 1: a longer name is truncated, by character.
    const MAX_NAME: usize = 63;
    while sql.get(pos).is_some_and(u8::is_ascii_whitespace) {
        pos += 1;
    }
    let mut name = Vec::new();
    match sql.get(pos) {
        Some(b'"') => {
            pos += 1;
            loop {
                match (sql.get(pos), sql.get(pos + 1)) {
                    (Some(b'"'), Some(b'"')) => {
                        name.push(b'"');
                        pos += 2;
                    }
                    (Some(b'"'), _) => {
                        pos += 1;
                        break;
                    }
                    (Some(&b), _) => {
                        name.push(b);
                        pos += 1;
                    }
                    (None, _) => return (None, pos),
                }
            }
        }
        Some(&b) if WORD_BYTE[usize::from(b)] && !b.is_ascii_digit() => {
            while let Some(&b) = sql.get(pos).filter(|b| WORD_BYTE[usize::from(**b)]) {
                name.push(b.to_ascii_lowercase());
                pos += 1;
            }
            if sql.get(pos) == Some(&b'&') {
                // U&"...": escapes this scan does not decode.
                return (None, pos);
            }
        }
        _ => return (None, pos),
    }
    let readable = !name.is_empty() && name.len() <= MAX_NAME;
    (readable.then_some(name), pos)
}

/// The session-level advisory lock functions (the `_xact_` ones end with
/// their transaction).
fn is_advisory_lock(word: &[u8]) -> bool {
    [
        &b"pg_advisory_lock"[..],
        b"pg_advisory_lock_shared",
        b"pg_try_advisory_lock",
        b"pg_try_advisory_lock_shared",
    ]
    .iter()
    .any(|f| is(word, f))
}

/// Whether `sql` ends a transaction as PostgreSQL allows in a failed one
/// (`COMMIT`, `END`, `ROLLBACK`, `ABORT`, `PREPARE TRANSACTION`): its
/// first two words, past white space and comments.
pub fn ends_transaction(sql: &[u8]) -> bool {
    let mut words = Words {
        sql: without_leading_comments(sql),
        pos: 0,
    };
    let mut word = || words.next().map(|(start, end)| &words.sql[start..end]);
    match word() {
        Some(w) if is(w, b"prepare") => word().is_some_and(|w| is(w, b"transaction")),
        Some(w) => [&b"commit"[..], b"end", b"rollback", b"abort"]
            .iter()
            .any(|k| is(w, k)),
        None => false,
    }
}

/// `sql` from its first byte that is neither white space nor in a comment
/// (`--` to the end of the line, `/* */`, nested as PostgreSQL nests them).
pub fn without_leading_comments(mut sql: &[u8]) -> &[u8] {
    loop {
        sql = sql.trim_ascii_start();
        if let Some(rest) = sql.strip_prefix(b"--") {
            let end = rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len());
            sql = &rest[end..];
        } else if sql.starts_with(b"/*") {
            let (mut depth, mut at) = (0usize, 0);
            while at < sql.len() {
                match &sql[at..] {
                    [b'/', b'*', ..] => (depth, at) = (depth + 1, at + 2),
                    [b'*', b'/', ..] => (depth, at) = (depth - 1, at + 2),
                    _ => at += 1,
                }
                if depth == 0 {
                    break;
                }
            }
            sql = &sql[at..];
        } else {
            return sql;
        }
    }
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
        let word_byte = |b: &u8| WORD_BYTE[usize::from(*b)];
        self.pos += self.sql[self.pos..]
            .iter()
            .take_while(|b| !word_byte(b))
            .count();
        if self.pos == self.sql.len() {
            return None;
        }
        let start = self.pos;
        self.pos += self.sql[self.pos..]
            .iter()
            .take_while(|b| word_byte(b))
            .count();
        Some((start, self.pos))
    }
}

/// Bytes of identifier-like words: letters, digits, `_`, `$`, and any
/// byte of a multibyte character.
const WORD_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80;
        b += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn m(sql: &str) -> (bool, bool) {
        let marks = marks(sql.as_bytes());
        (marks.taints, marks.evicts)
    }

    /// Every mark of session state, found alike whichever shape carries
    /// the text: a simple Query, an unnamed Parse and a named one (whose
    /// statement name comes first in its body, and is not SQL).
    #[test]
    fn every_mark_is_found_in_every_shape() {
        use crate::protocol::codec::frame_of;
        use crate::protocol::extended::statement_text;
        use crate::protocol::frontend as fe;
        let none = Marks::default();
        let table: &[(&str, Marks)] = &[
            (
                "LISTEN jobs",
                Marks {
                    pin: Some(Pin::Listen),
                    listen: true,
                    ..none
                },
            ),
            (
                "listen \"Jobs\"",
                Marks {
                    pin: Some(Pin::Listen),
                    listen: true,
                    ..none
                },
            ),
            (
                "PREPARE q AS SELECT 1",
                Marks {
                    pin: Some(Pin::SqlPrepare),
                    ..none
                },
            ),
            (
                "CREATE TEMP TABLE t(a int)",
                Marks {
                    taints: true,
                    pin: Some(Pin::TempObjects),
                    schema: true,
                    ..none
                },
            ),
            (
                "SELECT pg_advisory_lock(1)",
                Marks {
                    pin: Some(Pin::AdvisoryLock),
                    ..none
                },
            ),
            (
                "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
                Marks {
                    pin: Some(Pin::HoldCursor),
                    ..none
                },
            ),
            (
                "LOAD 'auto_explain'",
                Marks {
                    taints: true,
                    pin: Some(Pin::Load),
                    ..none
                },
            ),
            (
                "SELECT pg_backend_pid()",
                Marks {
                    pin: Some(Pin::BackendPid),
                    ..none
                },
            ),
            (
                "SET app.tenant = 4",
                Marks {
                    taints: true,
                    settings: true,
                    ..none
                },
            ),
            (
                "SET TimeZone = 'UTC'",
                Marks {
                    settings: true,
                    ..none
                },
            ),
            (
                "RESET ALL",
                Marks {
                    settings: true,
                    ..none
                },
            ),
            (
                "DISCARD ALL",
                Marks {
                    settings: true,
                    frees: true,
                    ..none
                },
            ),
            (
                "DEALLOCATE q",
                Marks {
                    frees: true,
                    ..none
                },
            ),
            (
                "SELECT set_config('app.x', '1', false)",
                Marks {
                    taints: true,
                    settings: true,
                    ..none
                },
            ),
            (
                "DROP DATABASE x",
                Marks {
                    evicts: true,
                    schema: true,
                    ..none
                },
            ),
            (
                "ALTER TABLE t SET UNLOGGED",
                Marks {
                    unlogged: true,
                    schema: true,
                    ..none
                },
            ),
            (
                "ALTER TABLE t ADD c int",
                Marks {
                    schema: true,
                    ..none
                },
            ),
            ("SELECT 1", none),
        ];
        let frame = |tag: u8, parts: &[&[u8]]| {
            let mut out = bytes::BytesMut::new();
            frame_of(&mut out, tag, parts);
            out.to_vec()
        };
        for (sql, want) in table {
            let text = sql.as_bytes();
            let shapes = [
                ("simple", frame(fe::QUERY, &[text, &[0]])),
                ("unnamed", frame(fe::PARSE, &[&[0], text, &[0], &[0, 0]])),
                (
                    "named",
                    frame(fe::PARSE, &[b"stmt_1\0", text, &[0], &[0, 0]]),
                ),
                (
                    "asyncpg",
                    frame(fe::PARSE, &[b"__asyncpg_stmt_2__\0", text, &[0], &[0, 0]]),
                ),
            ];
            for (shape, frame) in shapes {
                assert_eq!(marks(statement_text(&frame)), *want, "{sql} as {shape}");
            }
        }
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
    fn what_pins_a_pooled_client() {
        let pin = |sql: &str| marks(sql.as_bytes()).pin;
        assert_eq!(pin("CREATE TEMP TABLE t(a int)"), Some(Pin::TempObjects));
        assert_eq!(pin("LISTEN jobs"), Some(Pin::Listen));
        assert_eq!(pin("select 1; listen jobs"), Some(Pin::Listen));
        assert_eq!(pin("SELECT pg_advisory_lock(1)"), Some(Pin::AdvisoryLock));
        assert_eq!(
            pin("select pg_try_advisory_lock_shared(1)"),
            Some(Pin::AdvisoryLock)
        );
        assert_eq!(
            pin("DECLARE c CURSOR WITH HOLD FOR SELECT 1"),
            Some(Pin::HoldCursor)
        );
        assert_eq!(pin("PREPARE q AS SELECT 1"), Some(Pin::SqlPrepare));
        assert_eq!(pin("LOAD 'auto_explain'"), Some(Pin::Load));
        assert_eq!(pin("SELECT pg_backend_pid()"), Some(Pin::BackendPid));
        assert_eq!(pin("SELECT pg_advisory_xact_lock(1)"), None);
        assert_eq!(pin("DECLARE c CURSOR WITHOUT HOLD FOR SELECT 1"), None);
        assert_eq!(pin("SELECT listen, prepare FROM t"), None);
        assert_eq!(pin("SELECT 1"), None);
    }

    #[test]
    fn what_may_change_settings() {
        let settings = |sql: &str| marks(sql.as_bytes()).settings;
        assert!(settings("SET TimeZone = 'UTC'"));
        assert!(settings("select 1; set search_path = x"));
        assert!(settings("RESET ALL"));
        assert!(settings("DISCARD ALL"));
        assert!(settings("SELECT set_config('a.b', '1', false)"));
        assert!(!settings("UPDATE t SET v = 1"));
        assert!(!settings("SELECT 1"));
    }

    #[test]
    fn listened_channels_are_named_as_postgresql_names_them() {
        let names = |sql: &str| {
            listened(sql.as_bytes())
                .into_iter()
                .map(|c| c.map(|c| String::from_utf8(c).unwrap()))
                .collect::<Vec<_>>()
        };
        let some = |c: &str| Some(c.to_owned());
        assert_eq!(names("LISTEN Jobs"), [some("jobs")]);
        assert_eq!(
            names("listen \"Mixed \"\"Case\"\"\";"),
            [some("Mixed \"Case\"")]
        );
        assert_eq!(names("SELECT 1; LISTEN a;LISTEN b"), [some("a"), some("b")]);
        assert_eq!(names("LISTEN U&\"d\\0061t\""), [None]);
        assert_eq!(names("LISTEN /* c */ x"), [None]);
        assert_eq!(names(&format!("LISTEN {}", "x".repeat(64))), [None]);
        assert_eq!(names("UNLISTEN a"), Vec::<Option<String>>::new());
        assert_eq!(names("SELECT listen FROM t"), Vec::<Option<String>>::new());
    }

    #[test]
    fn unlogged_is_seen_after_set() {
        assert!(marks(b"ALTER TABLE t SET UNLOGGED").unlogged);
        assert!(marks(b"alter table t set unlogged, set (fillfactor = 50)").unlogged);
        assert!(!marks(b"ALTER TABLE t SET LOGGED").unlogged);
    }

    #[test]
    fn texts_that_may_deallocate_are_spotted_in_any_case() {
        for sql in [
            "DEALLOCATE ALL",
            "deallocate q",
            "SELECT 1; Discard All",
            "discard plans",
        ] {
            assert!(marks(sql.as_bytes()).frees, "{sql}");
        }
        for sql in ["SELECT 1", "SELECT 'd'", "UPDATE t SET d = 1", "discar", ""] {
            assert!(!marks(sql.as_bytes()).frees, "{sql}");
        }
    }

    #[test]
    fn a_transaction_ends_with_its_first_words_past_comments() {
        for sql in [
            "COMMIT",
            "  end work",
            "rollback to savepoint a",
            "ABORT",
            "PREPARE TRANSACTION 'x'",
            "-- why\nCOMMIT",
            "/* a /* nested */ comment */ ROLLBACK",
        ] {
            assert!(ends_transaction(sql.as_bytes()), "{sql}");
        }
        for sql in [
            "SELECT 1",
            "PREPARE p AS SELECT 1",
            "/* COMMIT */ SELECT 1",
            "-- ROLLBACK",
            "",
            "/* unclosed COMMIT",
        ] {
            assert!(!ends_transaction(sql.as_bytes()), "{sql}");
        }
    }
}
