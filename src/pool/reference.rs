//! A SQL statement that names a prepared statement: `EXECUTE name`,
//! `EXPLAIN ... EXECUTE name`, `CREATE TABLE ... AS EXECUTE name`,
//! `DEALLOCATE [PREPARE] name` and `PREPARE name`. In transaction mode a
//! statement the client prepared through the protocol is known to the
//! server under pgcache's name, so such text is rewritten to that name
//! (see [`super::prepared`]); this module finds the name and where it is.
//!
//! Read from sqlparser's tokens, not a parse: sqlparser does not parse
//! every form (`CREATE TABLE ... AS EXECUTE`), and the rewrite must keep
//! every other byte of the client's text.

use std::ops::Range;

use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::tokenizer::{Token, TokenWithSpan, Tokenizer, Word};

/// What the statement does with the statement it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// Runs it (`EXECUTE`, also under `EXPLAIN` or `CREATE TABLE AS`).
    Execute,
    /// Frees it.
    Deallocate,
    /// Defines it.
    Prepare,
}

/// A name a statement text gives a prepared statement.
#[derive(Debug, PartialEq, Eq)]
pub struct Reference {
    pub verb: Verb,
    /// The name as PostgreSQL reads it: folded to lower case unless quoted.
    pub name: Vec<u8>,
    /// Where the name (with its quotes) is in the text, in bytes.
    pub span: Range<usize>,
}

/// Whether `sql` has a word that may make it a [`Reference`] or free
/// statements: a cheap scan run on every Query of a pooled client, so that
/// the tokenizer runs on few.
pub fn may_refer(sql: &[u8]) -> bool {
    const WORDS: [&[u8]; 4] = [b"execute", b"deallocate", b"prepare", b"discard"];
    let starts = |i: usize| i == 0 || !sql[i - 1].is_ascii_alphanumeric();
    memchr::memchr3_iter(b'e', b'd', b'p', sql)
        .chain(memchr::memchr3_iter(b'E', b'D', b'P', sql))
        .any(|i| {
            starts(i)
                && WORDS.iter().any(|w| {
                    sql.get(i..i + w.len())
                        .is_some_and(|s| s.eq_ignore_ascii_case(w))
                })
        })
}

/// The prepared statements a text frees, in any of its statements.
#[derive(Debug, PartialEq, Eq)]
pub enum Freed {
    /// `DEALLOCATE name`, by name as PostgreSQL reads it.
    Some(Vec<Vec<u8>>),
    /// `DEALLOCATE ALL` or `DISCARD ALL`.
    All,
}

/// What `sql` frees, if it may free anything ([`may_refer`] says when to
/// ask).
pub fn freed(sql: &str) -> Freed {
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize() else {
        // Unreadable: PostgreSQL will refuse it, but assume the worst.
        return Freed::All;
    };
    let tokens: Vec<&Token> = tokens
        .iter()
        .filter(|t| !matches!(t, Token::Whitespace(_)))
        .collect();
    let mut names = Vec::new();
    for t in tokens.split(|t| **t == Token::SemiColon) {
        let at = match keyword(t.first()) {
            Some(Keyword::DISCARD) if keyword(t.get(1)) == Some(Keyword::ALL) => {
                return Freed::All;
            }
            Some(Keyword::DEALLOCATE) if keyword(t.get(1)) == Some(Keyword::PREPARE) => 2,
            Some(Keyword::DEALLOCATE) => 1,
            _ => continue,
        };
        match t.get(at) {
            Some(Token::Word(w)) if w.quote_style.is_none() && w.keyword == Keyword::ALL => {
                return Freed::All;
            }
            Some(Token::Word(w)) => names.push(folded(w)),
            _ => {}
        }
    }
    Freed::Some(names)
}

/// The prepared statement `sql` names, when `sql` is one statement of
/// the forms above.
pub fn reference(sql: &str) -> Option<Reference> {
    let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql)
        .tokenize_with_location()
        .ok()?;
    let mut tokens: Vec<&TokenWithSpan> = tokens
        .iter()
        .filter(|t| !matches!(t.token, Token::Whitespace(_)))
        .collect();
    while tokens.last().is_some_and(|t| t.token == Token::SemiColon) {
        tokens.pop();
    }
    if tokens.iter().any(|t| t.token == Token::SemiColon) {
        return None;
    }
    let t: Vec<&Token> = tokens.iter().map(|t| &t.token).collect();
    let (verb, at) = match keyword(t.first())? {
        Keyword::EXECUTE => (Verb::Execute, 1),
        Keyword::DEALLOCATE if keyword(t.get(1)) == Some(Keyword::PREPARE) => (Verb::Deallocate, 2),
        Keyword::DEALLOCATE => (Verb::Deallocate, 1),
        Keyword::PREPARE => (Verb::Prepare, 1),
        Keyword::EXPLAIN => (Verb::Execute, explained(&t)? + 1),
        Keyword::CREATE => (Verb::Execute, created_as(&t)? + 1),
        _ => return None,
    };
    let Token::Word(word) = t.get(at)? else {
        return None;
    };
    // `DEALLOCATE ALL` and `PREPARE TRANSACTION` name no statement.
    if word.quote_style.is_none() && matches!(word.keyword, Keyword::ALL | Keyword::TRANSACTION) {
        return None;
    }
    let span = tokens[at].span;
    let start = offset(sql, span.start.line, span.start.column)?;
    let end = offset(sql, span.end.line, span.end.column)?;
    Some(Reference {
        verb,
        name: folded(word),
        span: start..end,
    })
}

fn keyword(token: Option<&&Token>) -> Option<Keyword> {
    match token? {
        Token::Word(w) if w.quote_style.is_none() => Some(w.keyword),
        _ => None,
    }
}

/// `EXPLAIN [ ( options ) ] [ ANALYZE ] [ VERBOSE ] EXECUTE`: where
/// `EXECUTE` is.
fn explained(t: &[&Token]) -> Option<usize> {
    let mut at = 1;
    if *t.get(at)? == &Token::LParen {
        let mut depth = 0;
        loop {
            match t.get(at)? {
                Token::LParen => depth += 1,
                Token::RParen => depth -= 1,
                _ => {}
            }
            at += 1;
            if depth == 0 {
                break;
            }
        }
    }
    while matches!(
        keyword(t.get(at)),
        Some(Keyword::ANALYZE | Keyword::VERBOSE)
    ) || matches!(t.get(at), Some(Token::Word(w)) if w.quote_style.is_none() && w.value.eq_ignore_ascii_case("analyse"))
    {
        at += 1;
    }
    (keyword(t.get(at)) == Some(Keyword::EXECUTE)).then_some(at)
}

/// `CREATE ... TABLE ... AS EXECUTE`, outside parentheses: where
/// `EXECUTE` is.
fn created_as(t: &[&Token]) -> Option<usize> {
    let mut depth = 0i32;
    for at in 1..t.len() {
        match t[at] {
            Token::LParen => depth += 1,
            Token::RParen => depth -= 1,
            _ if depth == 0
                && keyword(t.get(at)) == Some(Keyword::AS)
                && keyword(t.get(at + 1)) == Some(Keyword::EXECUTE) =>
            {
                return Some(at + 1);
            }
            _ => {}
        }
    }
    None
}

/// An identifier as PostgreSQL reads it.
fn folded(word: &Word) -> Vec<u8> {
    if word.quote_style.is_some() {
        word.value.as_bytes().to_vec()
    } else {
        word.value.to_ascii_lowercase().into_bytes()
    }
}

/// The byte offset of a tokenizer location (lines from 1, columns in
/// characters from 1).
fn offset(sql: &str, line: u64, column: u64) -> Option<usize> {
    let line_start = if line <= 1 {
        0
    } else {
        sql.match_indices('\n')
            .nth(usize::try_from(line - 2).ok()?)?
            .0
            + 1
    };
    let column = usize::try_from(column.checked_sub(1)?).ok()?;
    match sql[line_start..].char_indices().nth(column) {
        Some((at, _)) => Some(line_start + at),
        None => Some(sql.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(sql: &str) -> Option<(Verb, String, &str)> {
        let r = reference(sql)?;
        Some((
            r.verb,
            String::from_utf8(r.name).unwrap(),
            &sql[r.span.clone()],
        ))
    }

    #[test]
    fn names_are_found_where_they_are_written() {
        let cases = [
            ("EXECUTE _pg3_0(1, 'a')", Verb::Execute, "_pg3_0", "_pg3_0"),
            ("execute S1", Verb::Execute, "s1", "S1"),
            ("execute \"S1\" ;", Verb::Execute, "S1", "\"S1\""),
            ("/*+ ttl=5 */ EXECUTE q", Verb::Execute, "q", "q"),
            ("explain execute q(2)", Verb::Execute, "q", "q"),
            (
                "EXPLAIN (ANALYZE, COSTS off) EXECUTE q",
                Verb::Execute,
                "q",
                "q",
            ),
            ("explain analyse verbose execute q", Verb::Execute, "q", "q"),
            (
                "create temp table t (a) as execute q (1) with no data",
                Verb::Execute,
                "q",
                "q",
            ),
            (
                "CREATE TABLE t WITH (fillfactor = 70) AS\n  EXECUTE \"é q\"",
                Verb::Execute,
                "é q",
                "\"é q\"",
            ),
            ("DEALLOCATE _pg3_0", Verb::Deallocate, "_pg3_0", "_pg3_0"),
            ("deallocate prepare q;", Verb::Deallocate, "q", "q"),
            ("deallocate \"all\"", Verb::Deallocate, "all", "\"all\""),
            ("PREPARE q (int) AS select $1", Verb::Prepare, "q", "q"),
            ("-- é\nprepare q as select 1", Verb::Prepare, "q", "q"),
        ];
        for (sql, verb, name, written) in cases {
            assert_eq!(named(sql), Some((verb, name.to_owned(), written)), "{sql}");
            assert!(may_refer(sql.as_bytes()), "{sql}");
        }
    }

    #[test]
    fn what_a_text_frees() {
        let some =
            |names: &[&str]| Freed::Some(names.iter().map(|n| n.as_bytes().to_vec()).collect());
        for (sql, expected) in [
            ("DEALLOCATE _pg3_0", some(&["_pg3_0"])),
            ("deallocate prepare Q; DEALLOCATE \"Q\"", some(&["q", "Q"])),
            ("select 1; DEALLOCATE ALL", Freed::All),
            ("deallocate prepare all", Freed::All),
            ("/* x */ discard all", Freed::All),
            ("discard plans", some(&[])),
            ("select 'deallocate all'", some(&[])),
        ] {
            assert_eq!(freed(sql), expected, "{sql}");
        }
    }

    #[test]
    fn other_statements_name_none() {
        for sql in [
            "DEALLOCATE ALL",
            "deallocate prepare all",
            "DISCARD ALL",
            "PREPARE TRANSACTION 'x'",
            "select 'execute q'",
            "execute q; select 1",
            "create table t as select 1",
            "create trigger t after insert on x execute function f()",
            "explain select 1",
            "grant execute on function f() to r",
            "execute",
        ] {
            assert_eq!(named(sql), None, "{sql}");
        }
        for sql in [
            "select 1",
            "update t set x = 2",
            "select expected",
            "SELECT dp",
        ] {
            assert!(!may_refer(sql.as_bytes()), "{sql}");
        }
    }
}
