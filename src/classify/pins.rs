//! The rows of its one table a statement names by value, as far as its text
//! tells: the WHERE clause's `col = value` and `col IN (value, ...)`
//! conjuncts of a single-table SELECT, UPDATE or DELETE, and the rows of an
//! `INSERT (cols) VALUES`. A value is a literal or a parameter. Whether the
//! columns pinned make up the table's replica identity, and so whether the
//! statement may be keyed by row, is the catalog's to say
//! ([`crate::cache::rowkey`]).
//!
//! Only conjuncts count: the rows a statement touches are among those every
//! conjunct allows, so one pin narrows them whatever the other conjuncts
//! say. Any other table reference anywhere (a join, a subquery, a CTE)
//! leaves the statement without pins: its result or its effect may then
//! depend on other rows.

use sqlparser::ast::{
    AssignmentTarget, BinaryOperator, Expr, FromTable, Ident, ObjectNamePart, OnConflictAction,
    OnInsert, Query, SetExpr, Statement, TableFactor, TableWithJoins, UnaryOperator, Value,
};

/// Where a pinned value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeySource {
    /// The text's `ordinal`th literal ([`crate::hints::literals`]), a
    /// number or a plain quoted string (`negative`: a minus before the
    /// number). By position, not value: every text of a statement's shape
    /// shares its analysis, each with literals of its own.
    Literal { ordinal: usize, negative: bool },
    /// Parameter `$n + 1`.
    Param(usize),
}

/// Finds the literals of the text being analysed by their place in it.
pub(super) struct Literals<'a> {
    text: &'a str,
    found: Vec<crate::hints::Literal<'a>>,
}

impl<'a> Literals<'a> {
    pub(super) fn new(text: &'a str) -> Self {
        Self {
            text,
            found: crate::hints::literals(text),
        }
    }

    /// The ordinal of the literal the parser saw as `value` at `at`, if the
    /// lexer found the same literal there.
    fn ordinal(&self, at: sqlparser::tokenizer::Location, value: &Value) -> Option<usize> {
        let offset = byte_offset(self.text, at)?;
        let ordinal = self.found.iter().position(|l| l.start == offset)?;
        let literal = &self.found[ordinal];
        let same = match (value, literal.kind) {
            (Value::Number(n, false), crate::hints::LiteralKind::Number) => literal.raw == n,
            (Value::SingleQuotedString(s), crate::hints::LiteralKind::Quoted) => {
                literal.raw.replace("''", "'") == *s
            }
            _ => false,
        };
        same.then_some(ordinal)
    }
}

/// The byte offset of a parser location (1-based line and column, in
/// characters).
fn byte_offset(text: &str, at: sqlparser::tokenizer::Location) -> Option<usize> {
    let mut line_start = 0;
    for _ in 1..at.line {
        line_start += text[line_start..].find('\n')? + 1;
    }
    let column = usize::try_from(at.column).ok()?.checked_sub(1)?;
    text[line_start..]
        .char_indices()
        .nth(column)
        .map(|(i, _)| line_start + i)
}

/// The value of `source` in a text of the shape (`literals`: its
/// literals), and the parameters bound: `None` for a value of a kind not
/// read here.
pub fn literal_text(
    literals: &[crate::hints::Literal<'_>],
    ordinal: usize,
    negative: bool,
) -> Option<String> {
    let literal = literals.get(ordinal)?;
    match literal.kind {
        crate::hints::LiteralKind::Number => Some(match negative {
            true => format!("-{}", literal.raw),
            false => literal.raw.to_owned(),
        }),
        crate::hints::LiteralKind::Quoted if !negative => Some(literal.raw.replace("''", "'")),
        _ => None,
    }
}

/// What one statement pins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pins {
    /// A single-table SELECT, UPDATE or DELETE: each column the WHERE
    /// clause pins, with its values (one, or an IN list's); for an UPDATE,
    /// the columns it sets.
    Where {
        columns: Vec<(String, Vec<KeySource>)>,
        sets: Vec<String>,
    },
    /// `INSERT INTO t (columns) VALUES ...`: each row's value per column
    /// (`None`: an expression, DEFAULT).
    Values {
        columns: Vec<String>,
        rows: Vec<Vec<Option<KeySource>>>,
    },
}

/// The pins of `stmt`, if it is of a shape that has them. `references`:
/// how many table references the statement has in all.
pub(super) fn pins_of(stmt: &Statement, references: usize, lits: &Literals<'_>) -> Option<Pins> {
    if references != 1 {
        return None;
    }
    match stmt {
        Statement::Query(query) => select_pins(query, lits),
        Statement::Update(update) => {
            if update.from.is_some() || !single(&update.table) {
                return None;
            }
            let mut sets = Vec::new();
            for a in &update.assignments {
                match &a.target {
                    AssignmentTarget::ColumnName(name) => sets.push(last_part(name)?),
                    AssignmentTarget::Tuple(names) => {
                        for name in names {
                            sets.push(last_part(name)?);
                        }
                    }
                }
            }
            Some(Pins::Where {
                columns: where_pins(update.selection.as_ref()?, lits),
                sets,
            })
        }
        Statement::Delete(delete) => {
            let tables = match &delete.from {
                FromTable::WithFromKeyword(t) | FromTable::WithoutKeyword(t) => t,
            };
            if delete.using.is_some()
                || !delete.tables.is_empty()
                || !matches!(tables.as_slice(), [t] if single(t))
            {
                return None;
            }
            Some(Pins::Where {
                columns: where_pins(delete.selection.as_ref()?, lits),
                sets: Vec::new(),
            })
        }
        Statement::Insert(insert) => {
            // An update on conflict may change the row of another key.
            if matches!(&insert.on, Some(OnInsert::OnConflict(c)) if !matches!(c.action, OnConflictAction::DoNothing))
                || insert.columns.is_empty()
            {
                return None;
            }
            let columns = insert
                .columns
                .iter()
                .map(last_part)
                .collect::<Option<Vec<_>>>()?;
            let SetExpr::Values(values) = insert.source.as_ref()?.body.as_ref() else {
                return None;
            };
            let rows = values
                .rows
                .iter()
                .map(|row| row.content.iter().map(|e| source(e, lits)).collect())
                .collect();
            Some(Pins::Values { columns, rows })
        }
        _ => None,
    }
}

fn select_pins(query: &Query, lits: &Literals<'_>) -> Option<Pins> {
    if query.with.is_some() {
        return None;
    }
    let SetExpr::Select(select) = query.body.as_ref() else {
        return None;
    };
    if !matches!(select.from.as_slice(), [t] if single(t)) {
        return None;
    }
    Some(Pins::Where {
        columns: where_pins(select.selection.as_ref()?, lits),
        sets: Vec::new(),
    })
}

/// A plain table, no joins.
fn single(t: &TableWithJoins) -> bool {
    t.joins.is_empty() && matches!(&t.relation, TableFactor::Table { args: None, .. })
}

/// The `col = value` and `col IN (values)` conjuncts of `expr`.
fn where_pins(expr: &Expr, lits: &Literals<'_>) -> Vec<(String, Vec<KeySource>)> {
    let mut pins = Vec::new();
    conjuncts(expr, &mut |conjunct| match conjunct {
        Expr::BinaryOp {
            left,
            op: BinaryOperator::Eq,
            right,
        } => {
            let pinned = match (column(left), column(right)) {
                (Some(col), None) => source(right, lits).map(|v| (col, v)),
                (None, Some(col)) => source(left, lits).map(|v| (col, v)),
                _ => None,
            };
            if let Some((col, value)) = pinned {
                pins.push((col, vec![value]));
            }
        }
        Expr::InList {
            expr,
            list,
            negated: false,
        } => {
            if let Some(col) = column(expr)
                && let Some(values) = list
                    .iter()
                    .map(|e| source(e, lits))
                    .collect::<Option<Vec<_>>>()
            {
                pins.push((col, values));
            }
        }
        _ => {}
    });
    pins
}

fn conjuncts<'a>(expr: &'a Expr, each: &mut impl FnMut(&'a Expr)) {
    match expr {
        Expr::BinaryOp {
            left,
            op: BinaryOperator::And,
            right,
        } => {
            conjuncts(left, each);
            conjuncts(right, each);
        }
        Expr::Nested(inner) => conjuncts(inner, each),
        other => each(other),
    }
}

/// A column of the statement's one table, by name as PostgreSQL reads it.
fn column(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Identifier(ident) => Some(ident_name(ident)),
        Expr::CompoundIdentifier(parts) => parts.last().map(ident_name),
        Expr::Nested(inner) => column(inner),
        _ => None,
    }
}

fn ident_name(ident: &Ident) -> String {
    super::normalize_ident(&ident.value, ident.quote_style)
}

fn last_part(name: &sqlparser::ast::ObjectName) -> Option<String> {
    match name.0.last()? {
        ObjectNamePart::Identifier(ident) => Some(ident_name(ident)),
        ObjectNamePart::Function(_) => None,
    }
}

/// A literal or a parameter.
fn source(expr: &Expr, lits: &Literals<'_>) -> Option<KeySource> {
    match expr {
        Expr::Value(v) => match &v.value {
            Value::Placeholder(p) => {
                let n: usize = p.strip_prefix('$')?.parse().ok()?;
                n.checked_sub(1).map(KeySource::Param)
            }
            value => lits
                .ordinal(v.span.start, value)
                .map(|ordinal| KeySource::Literal {
                    ordinal,
                    negative: false,
                }),
        },
        Expr::UnaryOp {
            op: UnaryOperator::Minus,
            expr,
        } => match expr.as_ref() {
            Expr::Value(v) if matches!(v.value, Value::Number(_, false)) => lits
                .ordinal(v.span.start, &v.value)
                .map(|ordinal| KeySource::Literal {
                    ordinal,
                    negative: true,
                }),
            _ => None,
        },
        Expr::Nested(inner) => source(inner, lits),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::analyze;
    use super::*;

    fn pins(sql: &str) -> Option<Pins> {
        analyze(sql).statements.into_iter().next()?.pins
    }

    fn lit(ordinal: usize) -> KeySource {
        KeySource::Literal {
            ordinal,
            negative: false,
        }
    }

    fn wher(columns: &[(&str, Vec<KeySource>)], sets: &[&str]) -> Option<Pins> {
        Some(Pins::Where {
            columns: columns
                .iter()
                .map(|(c, v)| (c.to_string(), v.clone()))
                .collect(),
            sets: sets.iter().map(|s| s.to_string()).collect(),
        })
    }

    #[test]
    fn a_read_pins_its_where_conjuncts() {
        assert_eq!(
            pins("SELECT v FROM t WHERE id = $1"),
            wher(&[("id", vec![KeySource::Param(0)])], &[])
        );
        assert_eq!(
            pins("select * from s.t x where x.\"Id\" = 7 and 'a' = name and v > 3"),
            wher(&[("Id", vec![lit(0)]), ("name", vec![lit(1)])], &[])
        );
        assert_eq!(
            pins("SELECT v FROM t WHERE (id IN (1, -2, $3)) AND (k = 'x')"),
            wher(
                &[
                    (
                        "id",
                        vec![
                            lit(0),
                            KeySource::Literal {
                                ordinal: 1,
                                negative: true
                            },
                            KeySource::Param(2)
                        ]
                    ),
                    ("k", vec![lit(2)])
                ],
                &[]
            )
        );
        // An OR, a NOT, a comparison: not pins, but other conjuncts still are.
        assert_eq!(
            pins("SELECT v FROM t WHERE id = 1 AND (a = 1 OR b = 2) AND NOT c = 3 AND d < 4"),
            wher(&[("id", vec![lit(0)])], &[])
        );
        assert_eq!(
            pins("SELECT v FROM t WHERE id = 1 OR id = 2"),
            wher(&[], &[])
        );
    }

    #[test]
    fn literals_are_found_by_place_in_every_text_of_the_shape() {
        let sql = "SELECT v FROM t\n WHERE é = 'x' AND id = 'it''s' AND k = -12";
        let Some(Pins::Where { columns, .. }) = pins(sql) else {
            panic!("pins")
        };
        let found = crate::hints::literals(sql);
        let text = |s: &KeySource| match *s {
            KeySource::Literal { ordinal, negative } => literal_text(&found, ordinal, negative),
            KeySource::Param(_) => None,
        };
        let values: Vec<Option<String>> = columns.iter().map(|(_, v)| text(&v[0])).collect();
        assert_eq!(
            values,
            [Some("x".into()), Some("it's".into()), Some("-12".into())]
        );
        // Another text of the same shape: its own values, by the same places.
        let other =
            crate::hints::literals("SELECT v FROM t WHERE é = 'yy' AND id = 'z' AND k = -7");
        assert_eq!(literal_text(&other, 2, true).as_deref(), Some("-7"));
        assert_eq!(literal_text(&other, 0, false).as_deref(), Some("yy"));
        // Prefixed strings are not read.
        assert_eq!(pins("SELECT v FROM t WHERE id = E'a\\n'"), wher(&[], &[]));
    }

    #[test]
    fn other_tables_anywhere_leave_no_pins() {
        for sql in [
            "SELECT v FROM t JOIN u USING (id) WHERE id = 1",
            "SELECT v FROM t, u WHERE t.id = 1",
            "SELECT v FROM t WHERE id = 1 AND v > (SELECT avg(v) FROM t)",
            "SELECT v FROM t WHERE id = (SELECT max(id) FROM t)",
            "WITH c AS (SELECT 1) SELECT v FROM t WHERE id = 1",
            "SELECT v FROM t WHERE id = 1 UNION SELECT v FROM t WHERE id = 2",
            "SELECT v FROM generate_series(1, 3) g(id) WHERE id = 1",
            "UPDATE t SET v = 1 FROM u WHERE t.id = u.id AND t.id = 1",
            "DELETE FROM t USING u WHERE t.id = 1",
            "INSERT INTO t (id, v) SELECT id, v FROM u",
        ] {
            assert_eq!(pins(sql), None, "{sql}");
        }
    }

    #[test]
    fn writes_pin_their_rows_and_say_what_they_set() {
        assert_eq!(
            pins("UPDATE pgbench_accounts SET abalance = abalance + $1 WHERE aid = $2"),
            wher(&[("aid", vec![KeySource::Param(1)])], &["abalance"])
        );
        assert_eq!(
            pins("update kf set k = 50001 where k = 150"),
            wher(&[("k", vec![lit(1)])], &["k"])
        );
        assert_eq!(
            pins("DELETE FROM t WHERE id IN (1, 2)"),
            wher(&[("id", vec![lit(0), lit(1)])], &[])
        );
        assert_eq!(pins("DELETE FROM t"), None, "no WHERE: every row");
        assert_eq!(
            pins("INSERT INTO t (id, v) VALUES (1, 'a'), ($1, now())"),
            Some(Pins::Values {
                columns: vec!["id".into(), "v".into()],
                rows: vec![
                    vec![Some(lit(0)), Some(lit(1))],
                    vec![Some(KeySource::Param(0)), None]
                ],
            })
        );
        assert_eq!(pins("INSERT INTO t VALUES (1, 2)"), None, "columns unnamed");
        assert_eq!(
            pins("INSERT INTO t (id) VALUES (1) ON CONFLICT (email) DO UPDATE SET v = 1"),
            None
        );
        assert!(pins("INSERT INTO t (id) VALUES (1) ON CONFLICT DO NOTHING").is_some());
    }
}
