//! The per-database catalog snapshot: which relation names are plain tables
//! whose changes pgcache can see, which are hazards for writes, which
//! functions are immutable, and which settings RLS policies read.
//!
//! It is loaded with one query ([`snapshot_sql`]) run on a client's own
//! backend connection while that session is idle, and reloaded after DDL.
//! Relations are known by bare name across all schemas, conservatively: a
//! name is readable only if every relation of that name is a permanent table
//! outside the system schemas, and a write hazard if any of them is.

use std::collections::{BTreeSet, HashMap};

use crate::classify::policy_facts;

/// One row per relation name, function name and policy, fully qualified so
/// that a client's search_path cannot redirect it. With `publication`, a
/// relation counts as readable only if it (or its partition root) is in it.
pub fn snapshot_sql(publication: Option<&str>) -> String {
    let published = match publication {
        Some(name) => format!(
            "EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = '{}' AND (p.puballtables OR EXISTS \
             (SELECT 1 FROM pg_catalog.pg_publication_rel pr WHERE pr.prpubid = p.oid \
              AND pr.prrelid = coalesce(pg_catalog.pg_partition_root(c.oid), c.oid))))",
            name.replace('\'', "''")
        ),
        None => "true".to_owned(),
    };
    format!(
        "SELECT 'r', c.relname,
  pg_catalog.bool_and(c.relkind IN ('r','p') AND c.relpersistence = 'p'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast')
    AND NOT (c.relkind = 'r' AND c.relhassubclass) AND {published})::text,
  pg_catalog.bool_or(c.relkind NOT IN ('r','p') OR c.relhasrules
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal)
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k WHERE k.confrelid = c.oid AND k.contype = 'f'
               AND (k.confupdtype NOT IN ('a','r') OR k.confdeltype NOT IN ('a','r')))
    OR (EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhrelid = c.oid) AND NOT c.relispartition))::text,
  pg_catalog.min(CASE WHEN c.relispartition THEN
    (SELECT r.relname FROM pg_catalog.pg_class r WHERE r.oid = pg_catalog.pg_partition_root(c.oid)) END),
  pg_catalog.bool_and(c.relkind IN ('r','p','v','m','f') AND c.relpersistence = 'p'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast'))::text
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r','p','v','m','f','S')
GROUP BY c.relname
UNION ALL
SELECT 'f', p.proname, pg_catalog.bool_and(p.provolatile = 'i')::text,
  pg_catalog.bool_or(p.provolatile = 'v' AND p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace)::text, NULL, NULL
FROM pg_catalog.pg_proc p GROUP BY p.proname
UNION ALL
SELECT 'p', c.relname, pg_catalog.pg_get_expr(pol.polqual, pol.polrelid), NULL, NULL, NULL
FROM pg_catalog.pg_policy pol JOIN pg_catalog.pg_class c ON c.oid = pol.polrelid
WHERE pol.polqual IS NOT NULL"
    )
}

/// SQL constructs sqlparser reports as function calls that are not in
/// pg_proc, and are immutable.
const IMMUTABLE_CONSTRUCTS: &[&str] = &["coalesce", "nullif", "greatest", "least", "trim"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelFacts {
    /// Every relation of this name is a permanent table pgcache can watch.
    pub readable: bool,
    /// Writing to a relation of this name may change other relations
    /// (triggers, rules, cascading foreign keys, views, inheritance).
    pub write_hazard: bool,
    /// Versions are kept per partition tree: the root's name.
    pub family: String,
    /// Every relation of this name is permanent, outside the system
    /// schemas, and a table, view, materialized view or foreign table: it
    /// may be cached with a TTL even if replication cannot watch it.
    pub ttl_ok: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FuncFacts {
    /// Every overload is IMMUTABLE.
    pub immutable: bool,
    /// Some overload is VOLATILE and outside pg_catalog: it may write.
    pub may_write: bool,
}

#[derive(Debug, Default)]
pub struct Catalog {
    rels: HashMap<String, RelFacts>,
    funcs: HashMap<String, FuncFacts>,
    /// Custom settings that RLS policies read: part of every cache key.
    pub policy_settings: Vec<String>,
}

impl Catalog {
    /// Builds the snapshot from [`snapshot_sql`]'s rows.
    pub fn from_rows(rows: &[Vec<Option<String>>]) -> Catalog {
        let mut catalog = Catalog::default();
        let mut policies: Vec<(String, String)> = Vec::new();
        for row in rows {
            let col = |i: usize| row.get(i).and_then(|c| c.as_deref());
            let (Some(kind), Some(name)) = (col(0), col(1)) else {
                continue;
            };
            match kind {
                "r" => {
                    catalog.rels.insert(
                        name.to_owned(),
                        RelFacts {
                            readable: col(2) == Some("true"),
                            write_hazard: col(3) != Some("false"),
                            family: col(4).unwrap_or(name).to_owned(),
                            ttl_ok: col(5) == Some("true"),
                        },
                    );
                }
                "f" => {
                    catalog.funcs.insert(
                        name.to_owned(),
                        FuncFacts {
                            immutable: col(2) == Some("true"),
                            may_write: col(3) != Some("false"),
                        },
                    );
                }
                "p" => policies.push((name.to_owned(), col(2).unwrap_or("").to_owned())),
                _ => {}
            }
        }
        let mut settings = BTreeSet::new();
        for (table, expr) in policies {
            let ok = match policy_facts(&expr) {
                Some(p) if !p.opaque => {
                    settings.extend(p.settings);
                    p.functions
                        .iter()
                        .all(|f| catalog.function(f).is_some_and(|f| f.immutable))
                }
                _ => false,
            };
            if let (false, Some(rel)) = (ok, catalog.rels.get_mut(&table)) {
                rel.readable = false;
                rel.ttl_ok = false;
            }
        }
        catalog.policy_settings = settings.into_iter().collect();
        catalog
    }

    pub fn relation(&self, name: &str) -> Option<&RelFacts> {
        self.rels.get(name)
    }

    pub fn function(&self, name: &str) -> Option<FuncFacts> {
        if IMMUTABLE_CONSTRUCTS.contains(&name) {
            return Some(FuncFacts {
                immutable: true,
                may_write: false,
            });
        }
        self.funcs.get(name).copied()
    }

    pub fn relation_count(&self) -> usize {
        self.rels.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cols: &[Option<&str>]) -> Vec<Option<String>> {
        cols.iter().map(|c| c.map(str::to_owned)).collect()
    }

    #[test]
    fn rows_become_facts() {
        let rows = vec![
            row(&[Some("r"), Some("t"), Some("true"), Some("false"), None]),
            row(&[
                Some("r"),
                Some("t_2024"),
                Some("true"),
                Some("false"),
                Some("t"),
            ]),
            row(&[
                Some("r"),
                Some("v"),
                Some("false"),
                Some("true"),
                None,
                Some("true"),
            ]),
            row(&[Some("f"), Some("lower"), Some("true"), Some("false"), None]),
            row(&[Some("f"), Some("bump"), Some("false"), Some("true"), None]),
            row(&[Some("r"), Some("secure"), Some("true"), Some("false"), None]),
            row(&[
                Some("p"),
                Some("secure"),
                Some("(tenant = current_setting('app.tenant'::text))"),
                None,
                None,
            ]),
            row(&[
                Some("r"),
                Some("guarded"),
                Some("true"),
                Some("false"),
                None,
            ]),
            row(&[Some("p"), Some("guarded"), Some("(bump() > 0)"), None, None]),
        ];
        let c = Catalog::from_rows(&rows);
        assert_eq!(c.relation("t").unwrap().family, "t");
        assert_eq!(c.relation("t_2024").unwrap().family, "t");
        assert!(!c.relation("v").unwrap().readable);
        assert!(c.relation("v").unwrap().write_hazard);
        assert!(
            c.relation("v").unwrap().ttl_ok,
            "a view may be cached with a TTL"
        );
        assert!(!c.relation("t").unwrap().ttl_ok);
        assert!(c.function("lower").unwrap().immutable);
        assert!(c.function("bump").unwrap().may_write);
        assert!(c.function("coalesce").unwrap().immutable);
        assert!(c.function("nope").is_none());
        assert!(c.relation("secure").unwrap().readable);
        assert_eq!(c.policy_settings, vec!["app.tenant".to_owned()]);
        assert!(
            !c.relation("guarded").unwrap().readable,
            "policy calls a volatile function"
        );
    }
}
