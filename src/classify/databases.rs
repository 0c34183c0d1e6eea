//! The databases a statement needs free of other connections:
//! `DROP DATABASE x`, `ALTER DATABASE x RENAME TO ...` and
//! `ALTER DATABASE x SET TABLESPACE ...`, and the template of
//! `CREATE DATABASE ... TEMPLATE x`. Read from tokens rather than a parse:
//! sqlparser does not know every option these statements take, and a
//! missed name only costs a refused statement, as it would have been.

use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::tokenizer::{Token, Tokenizer, Word};

/// The databases `sql` (any number of statements) needs free.
pub fn needing_free(sql: &str) -> Vec<String> {
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize() else {
        return Vec::new();
    };
    let tokens: Vec<Token> = tokens
        .into_iter()
        .filter(|t| !matches!(t, Token::Whitespace(_)))
        .collect();
    let mut names = Vec::new();
    for statement in tokens.split(|t| *t == Token::SemiColon) {
        if let Some(name) = needing_free_one(statement) {
            names.push(name);
        }
    }
    names
}

fn needing_free_one(t: &[Token]) -> Option<String> {
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
    use super::needing_free;

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
