//! What a statement needs of pgcache before it goes out, where pgcache's
//! own objects would make PostgreSQL refuse it:
//! - databases free of other connections: `DROP DATABASE x`,
//!   `ALTER DATABASE x RENAME TO ...` and `ALTER DATABASE x SET
//!   TABLESPACE ...`, and the template of `CREATE DATABASE ... TEMPLATE x`;
//! - tables out of the publication: `ALTER TABLE x SET UNLOGGED`.
//!
//! Read from tokens rather than a parse: sqlparser does not know every
//! option these statements take, and a missed name only costs a refused
//! statement, as it would have been.

use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::tokenizer::{Token, Tokenizer, Word};

/// What `sql` (any number of statements) needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Prerequisites {
    /// Databases to let go of, by name.
    pub free_databases: Vec<String>,
    /// Tables to take out of the publication, as SQL names
    /// (`s."T"`), to resolve in the client's session.
    pub unpublish: Vec<String>,
}

pub fn prerequisites(sql: &str) -> Prerequisites {
    let mut needs = Prerequisites::default();
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize() else {
        return needs;
    };
    let tokens: Vec<Token> = tokens
        .into_iter()
        .filter(|t| !matches!(t, Token::Whitespace(_)))
        .collect();
    for statement in tokens.split(|t| *t == Token::SemiColon) {
        if let Some(name) = database_needing_free(statement) {
            needs.free_databases.push(name);
        }
        if let Some(name) = table_set_unlogged(statement) {
            needs.unpublish.push(name);
        }
    }
    needs
}

/// `ALTER TABLE [IF EXISTS] [ONLY] name ... SET UNLOGGED ...`: the name.
fn table_set_unlogged(t: &[Token]) -> Option<String> {
    let kw = |i: usize, k: Keyword| matches!(t.get(i), Some(Token::Word(w)) if w.keyword == k);
    if !(kw(0, Keyword::ALTER) && kw(1, Keyword::TABLE)) {
        return None;
    }
    let sets_unlogged = t.windows(2).any(|w| {
        matches!(&w[0], Token::Word(a) if a.keyword == Keyword::SET)
            && matches!(&w[1], Token::Word(b) if b.quote_style.is_none() && b.value.eq_ignore_ascii_case("unlogged"))
    });
    if !sets_unlogged {
        return None;
    }
    let mut at = 2;
    if kw(at, Keyword::IF) && kw(at + 1, Keyword::EXISTS) {
        at += 2;
    }
    if kw(at, Keyword::ONLY) {
        at += 1;
    }
    let mut parts = Vec::new();
    loop {
        match t.get(at)? {
            Token::Word(w) if w.quote_style.is_some() => {
                parts.push(format!("\"{}\"", w.value.replace('"', "\"\"")))
            }
            Token::Word(w) => parts.push(w.value.clone()),
            _ => return None,
        }
        if t.get(at + 1) != Some(&Token::Period) {
            return Some(parts.join("."));
        }
        at += 2;
    }
}

fn database_needing_free(t: &[Token]) -> Option<String> {
    let kw = |i: usize, k: Keyword| matches!(t.get(i), Some(Token::Word(w)) if w.keyword == k);
    if !kw(1, Keyword::DATABASE) {
        return None;
    }
    if kw(0, Keyword::DROP) {
        let at = if kw(2, Keyword::IF) && kw(3, Keyword::EXISTS) {
            4
        } else {
            2
        };
        return name(t.get(at)?);
    }
    if kw(0, Keyword::ALTER) {
        let moves = kw(3, Keyword::RENAME) || (kw(3, Keyword::SET) && kw(4, Keyword::TABLESPACE));
        return if moves { name(t.get(2)?) } else { None };
    }
    if kw(0, Keyword::CREATE) {
        let at = (3..t.len()).find(|&i| kw(i, Keyword::TEMPLATE))?;
        let at = if t.get(at + 1) == Some(&Token::Eq) {
            at + 2
        } else {
            at + 1
        };
        return name(t.get(at)?);
    }
    None
}

/// A database name as PostgreSQL folds it: quoted as written, unquoted in
/// lower case.
fn name(token: &Token) -> Option<String> {
    match token {
        Token::Word(Word {
            value,
            quote_style: Some(_),
            ..
        }) => Some(value.clone()),
        Token::Word(Word { value, .. }) => Some(value.to_lowercase()),
        Token::SingleQuotedString(value) => Some(value.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::prerequisites;

    fn needing_free(sql: &str) -> Vec<String> {
        prerequisites(sql).free_databases
    }

    fn unpublish(sql: &str) -> Vec<String> {
        prerequisites(sql).unpublish
    }

    #[test]
    fn tables_set_unlogged_leave_the_publication() {
        assert_eq!(unpublish("ALTER TABLE t SET UNLOGGED"), ["t"]);
        assert_eq!(
            unpublish("alter table if exists only s.\"My T\" set unlogged"),
            ["s.\"My T\""]
        );
        assert_eq!(
            unpublish("ALTER TABLE t ADD COLUMN c int, SET UNLOGGED"),
            ["t"]
        );
        assert!(unpublish("ALTER TABLE t SET LOGGED").is_empty());
        assert!(unpublish("CREATE UNLOGGED TABLE t (a int)").is_empty());
        assert!(unpublish("ALTER TABLE t SET (fillfactor = 70)").is_empty());
    }

    #[test]
    fn the_statements_that_need_a_database_free() {
        let cases = [
            ("DROP DATABASE app", vec!["app"]),
            ("drop database if exists \"App\" with (force)", vec!["App"]),
            ("ALTER DATABASE App RENAME TO app2", vec!["app"]),
            ("ALTER DATABASE app SET TABLESPACE t", vec!["app"]),
            (
                "CREATE DATABASE c TEMPLATE = tmpl ENCODING 'UTF8'",
                vec!["tmpl"],
            ),
            ("CREATE DATABASE c WITH OWNER x TEMPLATE tmpl", vec!["tmpl"]),
            ("SELECT 1; DROP DATABASE a; DROP DATABASE b", vec!["a", "b"]),
        ];
        for (sql, want) in cases {
            assert_eq!(needing_free(sql), want, "{sql}");
        }
    }

    #[test]
    fn others_need_nothing() {
        for sql in [
            "ALTER DATABASE app SET work_mem = '1MB'",
            "CREATE DATABASE c",
            "SELECT current_database()",
            "SELECT 'DROP DATABASE x'",
            "DROP TABLE database",
            "DROP DATABASE",
        ] {
            assert!(needing_free(sql).is_empty(), "{sql}");
        }
    }
}
