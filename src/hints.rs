//! Cache hints in SQL comments, and the normalised text statistics are
//! kept under. One pass of a small lexer over the statement text, run once
//! per distinct text (the result is memoised with the statement's plan), so
//! the hit path never scans SQL.
//!
//! | comment | meaning |
//! | --- | --- |
//! | `/*+ cache */`, `/*FORCE QUERY CACHE*/` | cache even where `cache.mode = "opt_in"` would not; never an unsafe statement |
//! | `/*+ nocache */`, `/*NO QUERY CACHE*/` | do not cache |
//! | `/*+ cache ttl=30s */` | entries live at most 30 s (units `ms`, `s`, `m`, `h`; a bare number is seconds); also allows relations replication cannot watch |
//! | `/*+ cache tier=local\|shared\|both */` | which tiers hold the entry |
//! | `/*+ cache ttl=60s refresh=50s */` | once an entry is 50 s old, a hit refreshes it in the background |
//! | `/*+ cache ttl=5m tags=pricing,eu */` | `INVALIDATE TAG pricing` (admin) or `NOTIFY pgcache_invalidate, 'tag:pricing'` drops the entry |
//!
//! Comments may stand anywhere a comment may; text in string literals,
//! quoted identifiers and dollar quotes is never read as a hint. A `/*+`
//! comment whose first word is not `cache`/`nocache` but has parentheses is
//! taken for pg_hint_plan's and ignored; any other one, and a malformed
//! `cache` hint, is reported (the statement runs under the configured policy).

use std::time::Duration;

/// Where an entry may be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Tier {
    Local,
    Shared,
    #[default]
    Both,
}

impl Tier {
    pub fn local(self) -> bool {
        self != Tier::Shared
    }

    pub fn shared(self) -> bool {
        self != Tier::Local
    }
}

/// What the hints of a statement ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Hints {
    /// `Some(true)`: cache; `Some(false)`: do not; `None`: no hint.
    pub cache: Option<bool>,
    pub ttl: Option<Duration>,
    pub refresh: Option<Duration>,
    pub tier: Tier,
    /// `tags=a,b`: names an admin command or a NOTIFY can invalidate the
    /// entry by; sorted, without duplicates.
    pub tags: Vec<String>,
    /// `/*+ explain */`: the client is also told, in a NOTICE, where the
    /// answer came from and how long it took.
    pub explain: bool,
    /// Hints that were malformed or unknown, as written, with why.
    pub problems: Vec<String>,
}

/// The hints and the normalised text of a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    pub hints: Hints,
    /// Comments dropped, whitespace collapsed, literals replaced with `?`.
    pub normalized: String,
    /// The normalised text stands for every text that normalises to it:
    /// it was not cut short, and no literal it replaced could change what
    /// the statement means to the cache (a time input such as `'now'`, or
    /// a string with escapes that might spell one).
    pub shape_exact: bool,
    /// Where the text's literals stand, in order: with the text,
    /// [`Scan::literals`] gives them, so that reading a text's values does
    /// not lex it again.
    pub spans: Vec<LiteralSpan>,
    /// Where the `/*+ explain */` comment stands, with the white space
    /// after it: the text without it is the statement's key.
    pub explain_at: Option<(usize, usize)>,
}

impl Default for Scan {
    fn default() -> Self {
        Self {
            hints: Hints::default(),
            normalized: String::new(),
            shape_exact: true,
            spans: Vec::new(),
            explain_at: None,
        }
    }
}

/// `sql` without its `/*+ explain */` comment, if it has one: the text an
/// explained statement is cached under, so that it reads the entry the
/// same statement without the hint would.
pub fn unexplained(sql: &str) -> Option<String> {
    let (start, end) = scan(sql).explain_at?;
    Some([&sql[..start], &sql[end..]].concat())
}

impl Scan {
    /// The literals of `sql`, the text this scan was made of.
    pub fn literals<'a>(&self, sql: &'a str) -> Vec<Literal<'a>> {
        self.spans.iter().map(|s| s.of(sql)).collect()
    }
}

/// Longest normalised text kept (statistics show it; it is not a key).
const MAX_NORMALIZED: usize = 2048;
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

pub fn scan(sql: &str) -> Scan {
    let mut lexer = Lexer {
        sql,
        b: sql.as_bytes(),
        i: 0,
        space: false,
        out: Scan {
            // The normalised text is at most as long as the statement's:
            // one allocation rather than one per doubling.
            normalized: String::with_capacity(sql.len().min(MAX_NORMALIZED + 1)),
            ..Scan::default()
        },
        normalize: true,
    };
    while lexer.i < lexer.b.len() {
        lexer.token();
    }
    lexer.out
}

/// A literal the normalised text replaced with `?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Literal<'a> {
    /// Where it starts in the text, in bytes.
    pub start: usize,
    pub kind: LiteralKind,
    /// A number's text, or a quoted string's between its quotes (quotes
    /// doubled, not undone).
    pub raw: &'a str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiteralKind {
    Number,
    /// `'...'`, no prefix.
    Quoted,
    /// `E'...'`, `$$...$$` and the like: not read here.
    Other,
}

/// Where a [`Literal`] stands in its text: kept with a [`Scan`], which
/// outlives the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiteralSpan {
    start: usize,
    /// Its raw text, as byte offsets.
    raw: (usize, usize),
    kind: LiteralKind,
}

impl LiteralSpan {
    fn of(self, sql: &str) -> Literal<'_> {
        Literal {
            start: self.start,
            kind: self.kind,
            raw: sql.get(self.raw.0..self.raw.1).unwrap_or_default(),
        }
    }
}

/// The literals of `sql`, in the order the normalised text has them: the
/// `n`th is the `n`th `?` of every text of the same shape.
pub fn literals(sql: &str) -> Vec<Literal<'_>> {
    let mut lexer = Lexer {
        sql,
        b: sql.as_bytes(),
        i: 0,
        space: false,
        out: Scan::default(),
        normalize: false,
    };
    while lexer.i < lexer.b.len() {
        lexer.token();
    }
    lexer.out.literals(sql)
}

/// Walks a statement's text token by token, collecting hints from its
/// comments and writing its normalised text.
struct Lexer<'a> {
    sql: &'a str,
    b: &'a [u8],
    i: usize,
    /// White space or a comment came before the next token.
    space: bool,
    out: Scan,
    /// The normalised text is written: not when only the literals are
    /// asked for ([`literals`]).
    normalize: bool,
}

impl<'a> Lexer<'a> {
    /// Appends a token, keeping the text within MAX_NORMALIZED bytes; not
    /// when only the literals are asked for.
    fn push(&mut self, s: &str) {
        if !self.normalize {
            return;
        }
        let n = &mut self.out.normalized;
        if self.space && !n.is_empty() && n.len() < MAX_NORMALIZED {
            n.push(' ');
        }
        self.space = false;
        let room = MAX_NORMALIZED.saturating_sub(n.len());
        if s.len() <= room {
            n.push_str(s);
            return;
        }
        self.out.shape_exact = false;
        let mut take = room;
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        n.push_str(&s[..take]);
    }

    /// Reads one token (or white space, or a comment) at `self.i`.
    fn token(&mut self) {
        let (b, i, sql) = (self.b, self.i, self.sql);
        let c = b[i];
        match c {
            b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' => {
                self.space = true;
                self.i = run(b, i + 1, SPACE);
            }
            b'-' if b.get(i + 1) == Some(&b'-') => {
                self.i = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                self.space = true;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => self.block_comment(),
            b'\'' => {
                // E'', B'', X'', N'', U&'': not read here.
                let prefixed = i > 0 && (b[i - 1].is_ascii_alphabetic() || b[i - 1] == b'&');
                self.i = skip_quoted(b, i + 1, b'\'', i > 0 && matches!(b[i - 1], b'e' | b'E'));
                let end = self.i.saturating_sub(1).max(i + 1);
                self.literal(&b[i + 1..end]);
                let kind = if prefixed || self.i <= i + 1 || b[self.i - 1] != b'\'' {
                    LiteralKind::Other
                } else {
                    LiteralKind::Quoted
                };
                self.out.spans.push(LiteralSpan {
                    start: i,
                    raw: (i + 1, end),
                    kind,
                });
                self.push("?");
            }
            b'"' => {
                self.i = skip_quoted(b, i + 1, b'"', false);
                self.push(&sql[i..self.i]);
            }
            b'$' => self.dollar(),
            b'0'..=b'9' => {
                self.push("?");
                self.i = run(b, i + 1, NUMBER);
                self.out.spans.push(LiteralSpan {
                    start: i,
                    raw: (i, self.i),
                    kind: LiteralKind::Number,
                });
            }
            _ if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => self.word(),
            _ => {
                // ASCII: every byte from 0x80 up starts a word.
                self.push(&sql[i..=i]);
                self.i = i + 1;
            }
        }
    }

    /// A string literal about to be replaced with `?`: one whose value may
    /// matter to the cache keeps the text from sharing its shape.
    fn literal(&mut self, raw: &[u8]) {
        if raw.contains(&b'\\') || crate::classify::is_time_literal_text(raw) {
            self.out.shape_exact = false;
        }
    }

    /// A `/* ... */` comment (they nest): its hints are read.
    fn block_comment(&mut self) {
        let b = self.b;
        let start = self.i + 2;
        let mut depth = 1;
        let mut i = start;
        while i < b.len() && depth > 0 {
            if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                depth += 1;
                i += 2;
            } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                depth -= 1;
                i += 2;
            } else {
                i += 1;
            }
        }
        let end = if depth == 0 { i - 2 } else { b.len() };
        let explain = comment(&self.sql[start..end], &mut self.out.hints);
        if explain && self.out.explain_at.is_none() {
            let after = i + b[i..]
                .iter()
                .take_while(|c| c.is_ascii_whitespace())
                .count();
            self.out.explain_at = Some((start - 2, after));
        }
        self.i = i;
        self.space = true;
    }

    /// `$1` (a parameter) or `$tag$ ... $tag$` (a string).
    fn dollar(&mut self) {
        let (b, i, sql) = (self.b, self.i, self.sql);
        let mut j = i + 1;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
            j += 1;
        }
        if b.get(j) == Some(&b'$') && !b[i + 1..j].first().is_some_and(u8::is_ascii_digit) {
            let tag = &sql[i..=j];
            let (body_end, end) = match sql[j + 1..].find(tag) {
                Some(k) => (j + 1 + k, j + 1 + k + tag.len()),
                None => (b.len(), b.len()),
            };
            self.literal(&b[j + 1..body_end]);
            self.i = end;
            self.out.spans.push(LiteralSpan {
                start: i,
                raw: (i, i),
                kind: LiteralKind::Other,
            });
            self.push("?");
        } else {
            self.push(&sql[i..j]);
            self.i = j;
        }
    }

    /// A keyword or identifier, or the prefix of `E'...'` and friends.
    fn word(&mut self) {
        let (b, i, sql) = (self.b, self.i, self.sql);
        let j = run(b, i, WORD);
        // E'...' and friends: the prefix is part of the literal.
        if j == i + 1
            && b.get(j) == Some(&b'\'')
            && matches!(b[i], b'e' | b'E' | b'b' | b'B' | b'x' | b'X' | b'n' | b'N')
        {
            self.i = j;
            return;
        }
        self.push(&sql[i..j]);
        self.i = j;
    }
}

/// Byte classes for the lexer's runs of white space, words and numbers:
/// one table look a byte instead of a token's worth of matching (pgbench
/// `-S` through the cache, every text first seen: 2.1k -> 1.8k
/// instructions a statement).
const SPACE: u8 = 1;
/// Continues a keyword or identifier.
const WORD: u8 = 2;
/// Continues a numeric literal (`1.5e10`, `0x1F`, `1_000`).
const NUMBER: u8 = 4;

static CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c') {
            t[c] |= SPACE;
        }
        if b.is_ascii_alphanumeric() || b == b'_' {
            t[c] |= WORD | NUMBER;
        }
        if b == b'$' || b >= 0x80 {
            t[c] |= WORD;
        }
        if b == b'.' {
            t[c] |= NUMBER;
        }
        c += 1;
    }
    t
};

/// The end of the run of `class` bytes starting at `i`.
fn run(b: &[u8], i: usize, class: u8) -> usize {
    b[i..]
        .iter()
        .position(|&c| CLASS[usize::from(c)] & class == 0)
        .map_or(b.len(), |p| i + p)
}

/// Skips to just past the closing quote; a doubled quote is an escaped
/// one, and with `backslash` so is `\'`.
fn skip_quoted(b: &[u8], mut i: usize, quote: u8, backslash: bool) -> usize {
    while i < b.len() {
        if backslash && b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == quote {
            if b.get(i + 1) == Some(&quote) {
                i += 2;
                continue;
            }
            return i + 1;
        }
        i += 1;
    }
    b.len()
}

/// Reads one block comment's text; true if it is `/*+ explain */`.
fn comment(text: &str, hints: &mut Hints) -> bool {
    let trimmed = text.trim();
    if let Some(body) = trimmed.strip_prefix('+') {
        let mut words = body.split_whitespace();
        match words.next().map(str::to_ascii_lowercase).as_deref() {
            Some("explain") => {
                if words.next().is_none() {
                    hints.explain = true;
                    return true;
                }
                hints
                    .problems
                    .push(format!("/*{trimmed}*/: explain takes no options"));
            }
            Some("cache") => cache_hint(words, hints, trimmed),
            Some("nocache") => {
                let rest: Vec<&str> = words.collect();
                if rest.is_empty() {
                    hints.cache = Some(false);
                } else {
                    hints
                        .problems
                        .push(format!("/*{trimmed}*/: nocache takes no options"));
                }
            }
            _ if body.contains('(') => {} // pg_hint_plan's, not ours
            _ => hints.problems.push(format!(
                "/*{trimmed}*/: unknown hint (expected cache, nocache or explain)"
            )),
        }
        return false;
    }
    let words: Vec<String> = trimmed
        .split_whitespace()
        .map(str::to_ascii_uppercase)
        .collect();
    match words.join(" ").as_str() {
        "NO QUERY CACHE" => hints.cache = Some(false),
        "FORCE QUERY CACHE" if hints.cache.is_none() => hints.cache = Some(true),
        _ => {}
    }
    false
}

fn cache_hint<'a>(words: impl Iterator<Item = &'a str>, hints: &mut Hints, text: &str) {
    let mut parsed = Hints::default();
    for word in words {
        let problem = match word.split_once('=') {
            Some((key, value)) => match key.to_ascii_lowercase().as_str() {
                "ttl" => duration(value)
                    .map(|d| parsed.ttl = Some(d))
                    .map_err(|e| e.to_string()),
                "refresh" => duration(value)
                    .map(|d| parsed.refresh = Some(d))
                    .map_err(|e| e.to_string()),
                "tier" => match value.to_ascii_lowercase().as_str() {
                    "local" => Ok(Tier::Local),
                    "shared" => Ok(Tier::Shared),
                    "both" => Ok(Tier::Both),
                    _ => Err(format!("tier={value}: expected local, shared or both")),
                }
                .map(|tier| parsed.tier = tier),
                "tags" => value
                    .split(',')
                    .map(|tag| {
                        valid_tag(tag).then(|| tag.to_owned()).ok_or_else(|| {
                            format!("tags={value}: a tag is letters, digits, _ - or .")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(|tags| parsed.tags = tags),
                _ => Err(format!("unknown option {key:?}")),
            },
            None => Err(format!("{word:?} is not key=value")),
        };
        if let Err(why) = problem {
            hints.problems.push(format!("/*{text}*/: {why}"));
            return;
        }
    }
    if let (Some(refresh), ttl) = (parsed.refresh, parsed.ttl)
        && ttl.is_some_and(|ttl| refresh >= ttl)
    {
        hints
            .problems
            .push(format!("/*{text}*/: refresh must be shorter than ttl"));
        return;
    }
    // NO QUERY CACHE / nocache win over cache.
    if hints.cache != Some(false) {
        hints.cache = Some(true);
    }
    hints.ttl = parsed.ttl.or(hints.ttl);
    hints.refresh = parsed.refresh.or(hints.refresh);
    hints.tags.extend(parsed.tags);
    hints.tags.sort_unstable();
    hints.tags.dedup();
    if parsed.tier != Tier::Both {
        hints.tier = parsed.tier;
    }
}

/// Why a hint's duration was ignored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration such as 30s")]
    NotANumber(String),
    #[error("{0:?}: unit must be ms, s, m or h")]
    Unit(String),
    #[error("{0:?} must be above 0 and at most 30 days")]
    Range(String),
}

/// `30s`, `500ms`, `5m`, `1h`, or a bare number of seconds.
pub fn duration(text: &str) -> Result<Duration, DurationError> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| DurationError::NotANumber(text.to_owned()))?;
    let d = match unit.to_ascii_lowercase().as_str() {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(DurationError::Unit(text.to_owned())),
    };
    if d.is_zero() || d > MAX_DURATION {
        return Err(DurationError::Range(text.to_owned()));
    }
    Ok(d)
}

/// A tag is a word: letters, digits, `_`, `-`, `.`.
pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 63
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_that_differ_in_literals_share_an_exact_shape_unless_a_literal_matters() {
        let a = scan("SELECT v FROM t WHERE k = 1 AND s = 'x'");
        let b = scan("select_ignored");
        assert!(a.shape_exact && b.shape_exact);
        assert_eq!(
            a.normalized,
            scan("SELECT v FROM t WHERE k = 42 AND s = 'yy'").normalized
        );
        for time in ["'now'", "' Today '", "$$now$$", "E'\\x6eow'", "E'a\\'b'"] {
            let s = scan(&format!("SELECT * FROM t WHERE ts < {time}"));
            assert!(!s.shape_exact, "{time}");
        }
        let long = scan(&format!("SELECT {} FROM t", "x, ".repeat(2000)));
        assert!(!long.shape_exact, "a cut text stands for nothing else");
    }

    fn hints(sql: &str) -> Hints {
        scan(sql).hints
    }

    #[test]
    fn hint_forms() {
        let cases: &[(&str, Option<bool>, Option<u64>, Tier)] = &[
            ("SELECT 1", None, None, Tier::Both),
            ("/*+ cache */ SELECT 1", Some(true), None, Tier::Both),
            (
                "SELECT /*+ nocache */ 1",
                None.or(Some(false)),
                None,
                Tier::Both,
            ),
            (
                "SELECT 1 /*+ cache ttl=30s */",
                Some(true),
                Some(30_000),
                Tier::Both,
            ),
            (
                "SELECT 1 /*+ cache ttl=500ms */",
                Some(true),
                Some(500),
                Tier::Both,
            ),
            (
                "SELECT 1 /*+ CACHE TTL=5m tier=local */",
                Some(true),
                Some(300_000),
                Tier::Local,
            ),
            (
                "SELECT 1 /*+ cache ttl=1h tier=shared */",
                Some(true),
                Some(3_600_000),
                Tier::Shared,
            ),
            (
                "SELECT 1 /*+ cache ttl=45 */",
                Some(true),
                Some(45_000),
                Tier::Both,
            ),
            ("/*NO QUERY CACHE*/ SELECT 1", Some(false), None, Tier::Both),
            (
                "/* FORCE QUERY CACHE */ SELECT 1",
                Some(true),
                None,
                Tier::Both,
            ),
            (
                "/*+ cache */ /*NO QUERY CACHE*/ SELECT 1",
                Some(false),
                None,
                Tier::Both,
            ),
            ("SELECT 1 -- /*+ cache */\n", None, None, Tier::Both),
            ("SELECT '/*+ cache */'", None, None, Tier::Both),
            ("SELECT \"/*+ cache */\"", None, None, Tier::Both),
            ("SELECT $x$ /*+ cache */ $x$", None, None, Tier::Both),
            ("SELECT E'\\' /*+ cache */'", None, None, Tier::Both),
            (
                "/* outer /* inner */ /*+ cache */ */ SELECT 1",
                None,
                None,
                Tier::Both,
            ),
            ("/*+ SeqScan(t) */ SELECT 1", None, None, Tier::Both),
        ];
        for (sql, cache, ttl_ms, tier) in cases {
            let h = hints(sql);
            assert_eq!(h.cache, *cache, "{sql}");
            assert_eq!(h.ttl.map(|d| d.as_millis() as u64), *ttl_ms, "{sql}");
            assert_eq!(h.tier, *tier, "{sql}");
            assert!(h.problems.is_empty(), "{sql}: {:?}", h.problems);
        }
        let h = hints("/*+ cache ttl=60s refresh=50s */ SELECT 1");
        assert_eq!(h.refresh, Some(Duration::from_secs(50)));
    }

    #[test]
    fn tags_are_sorted_words_and_a_bad_one_is_reported() {
        let h = scan("/*+ cache ttl=5m tags=pricing,eu,pricing */ SELECT 1").hints;
        assert_eq!(
            (h.cache, h.tags.as_slice()),
            (Some(true), &["eu".to_owned(), "pricing".to_owned()][..])
        );
        let bad = scan("/*+ cache tags=a,b;c */ SELECT 1").hints;
        assert!(bad.tags.is_empty() && bad.cache.is_none());
        assert_eq!(bad.problems.len(), 1, "{:?}", bad.problems);
    }

    #[test]
    fn malformed_and_unknown_hints_are_reported_and_ignored() {
        for sql in [
            "/*+ cache ttl=abc */ SELECT 1",
            "/*+ cache ttl=0s */ SELECT 1",
            "/*+ cache ttl=10d */ SELECT 1",
            "/*+ cache tier=disk */ SELECT 1",
            "/*+ cache color=blue */ SELECT 1",
            "/*+ cache forever */ SELECT 1",
            "/*+ cache ttl=10s refresh=20s */ SELECT 1",
            "/*+ nocache please */ SELECT 1",
            "/*+ cash */ SELECT 1",
        ] {
            let h = hints(sql);
            assert_eq!(h.problems.len(), 1, "{sql}: {h:?}");
            assert!(h.problems[0].starts_with("/*+"), "{:?}", h.problems);
            assert_eq!(h.cache, None, "{sql}: a bad hint changes nothing");
        }
    }

    #[test]
    fn normalisation_drops_comments_and_literals() {
        let n = |s: &str| scan(s).normalized;
        assert_eq!(
            n("SELECT  v FROM t\n WHERE id = 42 AND name = 'x''y' /*+ cache */"),
            "SELECT v FROM t WHERE id = ? AND name = ?"
        );
        assert_eq!(
            n("select * from t1 where a=$1"),
            "select * from t1 where a=$1"
        );
        assert_eq!(n("SELECT E'a\\'b', $q$x$q$, 1.5e3"), "SELECT ?, ?, ?");
        assert_eq!(
            n("SELECT \"Odd Name\" FROM x -- c\n"),
            "SELECT \"Odd Name\" FROM x"
        );
        assert_eq!(n("SELECT 'ünï', ç FROM t"), "SELECT ?, ç FROM t");
        assert_eq!(n("SELECT 'unterminated"), "SELECT ?");
        assert_eq!(n("/* unterminated"), "");
    }

    #[test]
    fn a_scan_keeps_the_literals_its_text_has() {
        let sql =
            "SELECT v FROM t WHERE id = 42 AND n = 'x''y' AND e = E'z' AND d = $q$w$q$ AND k = -7";
        let found = scan(sql).literals(sql);
        assert_eq!(found, literals(sql));
        let raws: Vec<_> = found.iter().map(|l| (l.kind, l.raw)).collect();
        assert_eq!(
            raws,
            [
                (LiteralKind::Number, "42"),
                (LiteralKind::Quoted, "x''y"),
                (LiteralKind::Other, "z"),
                (LiteralKind::Other, ""),
                (LiteralKind::Number, "7"),
            ]
        );
        assert_eq!(found[0].start, sql.find("42").unwrap());
    }

    #[test]
    fn normalised_text_is_bounded_even_for_one_huge_token() {
        let huge = format!("SELECT {} FROM t", "x".repeat(100_000));
        assert_eq!(scan(&huge).normalized.len(), MAX_NORMALIZED);
        let wide = format!("SELECT '{}', {}", "a", "é".repeat(5000));
        assert!(scan(&wide).normalized.len() <= MAX_NORMALIZED);
    }

    #[test]
    fn durations() {
        assert_eq!(duration("30s"), Ok(Duration::from_secs(30)));
        assert!(matches!(duration("5y"), Err(DurationError::Unit(_))));
        assert_eq!(duration("2h"), Ok(Duration::from_secs(7200)));
        assert!(duration("").is_err());
        assert!(duration("s").is_err());
        assert!(duration("99999999999999999999").is_err());
    }
}
