//! One walk of a statement's tree: the relations it reads, the functions it
//! calls, and the constructs that make it uncacheable.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use sqlparser::ast::{
    Expr, ObjectName, ObjectNamePart, Query, Select, SetExpr, Statement, TableFactor, Value,
    Visitor,
};

use super::{RelName, SPECIAL_IDENTIFIERS, TIME_LITERALS};

pub fn is_system_schema(schema: Option<&str>) -> bool {
    matches!(
        schema,
        Some("pg_catalog" | "information_schema" | "pg_toast")
    ) || schema.is_some_and(|s| s.starts_with("pg_temp") || s.starts_with("pg_toast_temp"))
}

pub fn normalize_ident(value: &str, quote: Option<char>) -> String {
    if quote.is_some() {
        value.to_owned()
    } else {
        value.to_lowercase()
    }
}

pub(super) fn rel_name(name: &ObjectName) -> Option<RelName> {
    let parts: Vec<String> = name
        .0
        .iter()
        .map(|p| match p {
            ObjectNamePart::Identifier(i) => Some(normalize_ident(&i.value, i.quote_style)),
            ObjectNamePart::Function(_) => None,
        })
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [name] => Some(RelName {
            schema: None,
            name: name.clone(),
        }),
        [.., schema, name] => Some(RelName {
            schema: Some(schema.clone()),
            name: name.clone(),
        }),
        [] => None,
    }
}

/// Lower-cased last part of a function name.
pub(super) fn function_name(name: &ObjectName) -> String {
    match name.0.last() {
        Some(ObjectNamePart::Identifier(i)) => normalize_ident(&i.value, i.quote_style),
        _ => String::new(),
    }
}

/// Everything the visitor collects in one walk of the tree.
#[derive(Default)]
pub(super) struct Facts {
    pub(super) raw_relations: Vec<Option<RelName>>,
    table_functions: Vec<RelName>,
    cte_names: BTreeSet<String>,
    pub(super) functions: BTreeSet<String>,
    statements: usize,
    pub(super) nested_dml: bool,
    pub(super) select_into: bool,
    pub(super) locking: bool,
    pub(super) special_identifier: bool,
    pub(super) time_literal: bool,
}

impl Facts {
    /// Relations read, minus CTE references and table functions, deduplicated.
    pub(super) fn relations(&self) -> Vec<RelName> {
        let mut functions = self.table_functions.clone();
        let mut out = BTreeSet::new();
        for rel in &self.raw_relations {
            let Some(rel) = rel else {
                continue;
            };
            if let Some(i) = functions.iter().position(|f| f == rel) {
                functions.swap_remove(i);
                continue;
            }
            if rel.schema.is_none() && self.cte_names.contains(&rel.name) {
                continue;
            }
            out.insert(rel.clone());
        }
        out.into_iter().collect()
    }
}

impl Visitor for Facts {
    type Break = ();

    fn pre_visit_statement(&mut self, stmt: &Statement) -> ControlFlow<()> {
        self.statements += 1;
        if self.statements > 1
            && matches!(
                stmt,
                Statement::Insert(_)
                    | Statement::Update(_)
                    | Statement::Delete(_)
                    | Statement::Merge(_)
            )
        {
            self.nested_dml = true;
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<()> {
        if let Some(with) = &query.with {
            for cte in &with.cte_tables {
                self.cte_names.insert(normalize_ident(
                    &cte.alias.name.value,
                    cte.alias.name.quote_style,
                ));
                if matches!(
                    *cte.query.body,
                    SetExpr::Insert(_)
                        | SetExpr::Update(_)
                        | SetExpr::Delete(_)
                        | SetExpr::Merge(_)
                ) {
                    self.nested_dml = true;
                }
            }
        }
        if !query.locks.is_empty() || query.for_clause.is_some() {
            self.locking = true;
        }
        if matches!(
            *query.body,
            SetExpr::Insert(_) | SetExpr::Update(_) | SetExpr::Delete(_) | SetExpr::Merge(_)
        ) {
            self.nested_dml = true;
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_select(&mut self, select: &Select) -> ControlFlow<()> {
        if select.into.is_some() {
            self.select_into = true;
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<()> {
        self.raw_relations.push(rel_name(relation));
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<()> {
        match factor {
            TableFactor::Table {
                name,
                args: Some(_),
                ..
            } => {
                if let Some(rel) = rel_name(name) {
                    self.table_functions.push(rel);
                }
                self.functions.insert(function_name(name));
            }
            TableFactor::Function { name, .. } => {
                self.functions.insert(function_name(name));
            }
            _ => {}
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<()> {
        match expr {
            Expr::Function(f) => {
                let name = function_name(&f.name);
                // CURRENT_TIMESTAMP, CURRENT_TIME(3) and the like are SQL
                // keywords, not pg_proc functions: they make a read
                // uncacheable but write nothing (as an unknown function
                // would be assumed to).
                if f.name.0.len() == 1 && SPECIAL_IDENTIFIERS.contains(&name.as_str()) {
                    self.special_identifier = true;
                } else {
                    self.functions.insert(name);
                }
            }
            Expr::Identifier(ident)
                if ident.quote_style.is_none()
                    && SPECIAL_IDENTIFIERS.contains(&ident.value.to_lowercase().as_str()) =>
            {
                self.special_identifier = true;
            }
            Expr::Value(v) if is_time_literal(&v.value) => self.time_literal = true,
            Expr::TypedString(t) if is_time_literal(&t.value.value) => self.time_literal = true,
            _ => {}
        }
        ControlFlow::Continue(())
    }
}

pub(super) fn is_time_literal(value: &Value) -> bool {
    value.clone().into_string().is_some_and(|s| {
        TIME_LITERALS
            .iter()
            .any(|t| s.trim().eq_ignore_ascii_case(t))
    })
}
