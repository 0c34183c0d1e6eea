//! Row-level-security policies: what a policy expression depends on, so
//! that the settings it reads become part of every cache key and a policy
//! pgcache cannot follow keeps its table out of the cache.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use sqlparser::ast::{Expr, FunctionArguments, Visit};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

use super::visitor::{Facts, function_name};

/// What a row-level-security policy expression depends on.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PolicyFacts {
    /// Functions called (other than `current_setting`).
    pub functions: BTreeSet<String>,
    /// Custom settings read with `current_setting('name')`.
    pub settings: Vec<String>,
    /// The expression reads relations or calls `current_setting` with a
    /// computed name: its result cannot be keyed.
    pub opaque: bool,
}

/// Analyses a policy expression as `pg_get_expr` prints it. `None` if it
/// does not parse.
pub fn policy_facts(expr: &str) -> Option<PolicyFacts> {
    let parsed = Parser::new(&PostgreSqlDialect {})
        .try_with_sql(expr)
        .ok()?
        .parse_expr()
        .ok()?;
    let mut facts = Facts::default();
    let _ = parsed.visit(&mut facts);
    let mut out = PolicyFacts {
        opaque: !facts.raw_relations.is_empty() || facts.time_literal,
        ..Default::default()
    };
    let _ = sqlparser::ast::visit_expressions(&parsed, |e| {
        if let Expr::Function(f) = e
            && function_name(&f.name) == "current_setting"
        {
            let literal = match &f.args {
                FunctionArguments::List(list) => list.args.first().and_then(|a| {
                    let text = a.to_string();
                    let name = text.split("::").next()?.trim();
                    (name.len() >= 2 && name.starts_with('\'') && name.ends_with('\''))
                        .then(|| name[1..name.len() - 1].to_ascii_lowercase())
                }),
                _ => None,
            };
            match literal {
                Some(name) => out.settings.push(name),
                None => out.opaque = true,
            }
        }
        ControlFlow::<()>::Continue(())
    });
    out.functions = facts.functions;
    // The role is part of every cache key; current_setting is handled above.
    for keyed in [
        "current_setting",
        "current_user",
        "session_user",
        "current_role",
        "user",
    ] {
        out.functions.remove(keyed);
    }
    Some(out)
}
