//! Fetching facts for named relations and functions: the SQL, its rows,
//! and the task that runs it on pgcache's own connection.
//!
//! Every lookup is by name through PostgreSQL's catalog indexes
//! (`pg_class (relname, relnamespace)`, `pg_proc (proname, ...)`,
//! `pg_policy (polrelid)`), so its cost does not grow with the database.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Fetched, FuncFacts, IMMUTABLE_CONSTRUCTS, RelFacts, Wanted};
use crate::cache::database::DbState;
use crate::cache::rowkey::Identity;
use crate::classify::policy_facts;
use crate::upstream::Upstream;

pub use crate::protocol::answer::Rows;

/// `s` as an escape string literal, which reads the same whatever
/// `standard_conforming_strings` says.
fn literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 3);
    out.push_str("E'");
    for c in s.chars() {
        match c {
            '\'' => out.push_str("\\'"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// `ARRAY[...]::name[]` of `names`.
fn name_array(names: &[&str]) -> String {
    let items: Vec<String> = names.iter().map(|n| literal(n)).collect();
    format!("ARRAY[{}]::pg_catalog.name[]", items.join(","))
}

/// A table's replica identity, for keys by row ([`crate::cache::rowkey`]):
/// its key columns in column order, as `name` US `type oid`, separated by
/// RS; NULL unless every one has a deterministic collation (equality is
/// then equality of the bytes).
const IDENTITY: &str = "(SELECT CASE WHEN pg_catalog.bool_and(coalesce(co.collisdeterministic, true))
      THEN pg_catalog.string_agg(a.attname || chr(31) || a.atttypid::text, chr(30) ORDER BY a.attnum) END
    FROM pg_catalog.pg_index i
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY (i.indkey)
    LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation
    WHERE i.indrelid = c.oid
      AND CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END)";

/// One row per relation name and function name asked for, and one per
/// policy of those relations, fully qualified so that no search_path can
/// redirect it. With `publication`, a relation counts as readable only if it
/// (or its partition root) is in it, and the last column says whether some
/// permanent table of the name (or its root) is missing from it.
pub fn facts_sql(rels: &[&str], funcs: &[&str], publication: Option<&str>) -> String {
    let mut parts = Vec::new();
    if !rels.is_empty() {
        let published = match publication {
            Some(name) => format!(
                "EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = {} AND (p.puballtables OR EXISTS \
                 (SELECT 1 FROM pg_catalog.pg_publication_rel pr WHERE pr.prpubid = p.oid \
                  AND pr.prrelid = coalesce(pg_catalog.pg_partition_root(c.oid), c.oid))))",
                literal(name)
            ),
            None => "true".to_owned(),
        };
        let names = name_array(rels);
        parts.push(format!(
            "SELECT 'r', c.relname::text,
  pg_catalog.bool_and(c.relkind IN ('r','p') AND c.relpersistence = 'p'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast')
    AND NOT (c.relkind = 'r' AND c.relhassubclass) AND {published})::text,
  pg_catalog.bool_or(c.relkind NOT IN ('r','p') OR c.relhasrules
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = c.oid AND NOT t.tgisinternal)
    OR EXISTS (SELECT 1 FROM pg_catalog.pg_constraint k WHERE k.confrelid = c.oid AND k.contype = 'f'
               AND (k.confupdtype NOT IN ('a','r') OR k.confdeltype NOT IN ('a','r')))
    OR (EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhrelid = c.oid) AND NOT c.relispartition))::text,
  pg_catalog.min(CASE WHEN c.relispartition THEN
    (SELECT r.relname FROM pg_catalog.pg_class r WHERE r.oid = pg_catalog.pg_partition_root(c.oid)) END)::text,
  pg_catalog.bool_and(c.relkind IN ('r','p','v','m','f') AND c.relpersistence = 'p'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast'))::text,
  pg_catalog.bool_and(c.relkind IN ('r','p') AND c.relpersistence <> 't'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast')
    AND NOT (c.relkind = 'r' AND c.relhassubclass))::text,
  pg_catalog.bool_or(c.relkind IN ('r','p') AND c.relpersistence = 'p'
    AND n.nspname NOT IN ('pg_catalog','information_schema','pg_toast') AND NOT {published})::text,
  CASE WHEN pg_catalog.count(*) = 1
    AND pg_catalog.bool_and(c.relkind = 'r' AND NOT c.relhassubclass AND NOT c.relispartition)
  THEN pg_catalog.min({IDENTITY}) END
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r','p','v','m','f','S') AND c.relname = ANY ({names})
GROUP BY c.relname
UNION ALL
SELECT 'p', c.relname::text, pg_catalog.pg_get_expr(pol.polqual, pol.polrelid), NULL, NULL, NULL, NULL, NULL, NULL
FROM pg_catalog.pg_policy pol JOIN pg_catalog.pg_class c ON c.oid = pol.polrelid
WHERE pol.polqual IS NOT NULL AND c.relname = ANY ({names})"
        ));
    }
    if !funcs.is_empty() {
        parts.push(format!(
            "SELECT 'f', p.proname::text, pg_catalog.bool_and(p.provolatile = 'i')::text,
  pg_catalog.bool_or(p.provolatile = 'v' AND p.pronamespace <> 'pg_catalog'::pg_catalog.regnamespace)::text,
  pg_catalog.bool_and(p.provolatile <> 'v')::text, NULL, NULL, NULL, NULL
FROM pg_catalog.pg_proc p WHERE p.proname = ANY ({}) GROUP BY p.proname",
            name_array(funcs)
        ));
    }
    parts.join("\nUNION ALL\n")
}

/// The facts in `rows` of [`facts_sql`], policies not yet applied.
#[derive(Default)]
struct Parsed {
    rels: HashMap<String, RelFacts>,
    funcs: HashMap<String, FuncFacts>,
    policies: Vec<(String, String)>,
    unwatched: BTreeSet<String>,
}

impl Parsed {
    fn add(&mut self, rows: &Rows) {
        for row in rows {
            let col = |i: usize| row.get(i).and_then(|c| c.as_deref());
            let (Some(kind), Some(name)) = (col(0), col(1)) else {
                continue;
            };
            match kind {
                "r" => {
                    // The publication lists partitioned tables by root.
                    if col(7) == Some("true") {
                        self.unwatched.insert(col(4).unwrap_or(name).to_owned());
                    }
                    self.rels.insert(
                        name.to_owned(),
                        RelFacts {
                            readable: col(2) == Some("true"),
                            write_hazard: col(3) != Some("false"),
                            family: col(4).unwrap_or(name).to_owned(),
                            ttl_ok: col(5) == Some("true"),
                            table: col(6) == Some("true"),
                            policy_functions: Vec::new(),
                            identity: col(8).and_then(Identity::parse).map(Arc::new),
                        },
                    );
                }
                "f" => {
                    self.funcs.insert(
                        name.to_owned(),
                        FuncFacts {
                            immutable: col(2) == Some("true"),
                            may_write: col(3) != Some("false"),
                            stable: col(4) == Some("true"),
                        },
                    );
                }
                "p" => self
                    .policies
                    .push((name.to_owned(), col(2).unwrap_or("").to_owned())),
                _ => {}
            }
        }
    }

    /// Functions the policies call that were not asked for.
    fn policy_functions(&self) -> BTreeSet<String> {
        self.policies
            .iter()
            .filter_map(|(_, expr)| policy_facts(expr))
            .flat_map(|p| p.functions)
            .filter(|f| !self.funcs.contains_key(f))
            .collect()
    }

    /// Applies the policies: a relation whose policy reads anything but
    /// immutable functions and settings is never cached.
    fn finish(mut self, asked_funcs: &[&str]) -> Fetched {
        let mut settings = BTreeSet::new();
        for (table, expr) in std::mem::take(&mut self.policies) {
            let facts = policy_facts(&expr);
            let ok = match &facts {
                Some(p) if !p.opaque => {
                    settings.extend(p.settings.iter().cloned());
                    p.functions.iter().all(|f| {
                        IMMUTABLE_CONSTRUCTS.contains(&f.as_str())
                            || self.funcs.get(f).is_some_and(|f| f.immutable)
                    })
                }
                _ => false,
            };
            if let Some(rel) = self.rels.get_mut(&table) {
                if let Some(p) = facts {
                    rel.policy_functions.extend(p.functions);
                }
                if !ok {
                    rel.readable = false;
                    rel.ttl_ok = false;
                }
            }
        }
        // Functions fetched only for the policies are not installed: no
        // ticket asked for them.
        self.funcs
            .retain(|name, _| asked_funcs.contains(&name.as_str()));
        Fetched {
            rels: self.rels,
            funcs: self.funcs,
            settings,
            unwatched: self.unwatched,
        }
    }
}

/// One lookup of wanted names, as queries to run in turn: the caller runs
/// each [`Lookup::next_query`] wherever it can, and hands back its rows.
pub struct Lookup {
    rels: Vec<String>,
    funcs: Vec<String>,
    publication: Option<String>,
    parsed: Parsed,
    /// Queries handed out so far.
    round: u8,
}

impl Lookup {
    pub fn new(wanted: &Wanted, publication: Option<&str>) -> Self {
        Self {
            rels: wanted.rels.iter().map(|(n, _)| n.clone()).collect(),
            funcs: wanted.funcs.iter().map(|(n, _)| n.clone()).collect(),
            publication: publication.map(str::to_owned),
            parsed: Parsed::default(),
            round: 0,
        }
    }

    /// The next query to run: one for the names, and one more if their
    /// policies call functions not asked for.
    pub fn next_query(&mut self) -> Option<String> {
        self.round += 1;
        match self.round {
            1 if !self.rels.is_empty() || !self.funcs.is_empty() => Some(facts_sql(
                &names(&self.rels),
                &names(&self.funcs),
                self.publication.as_deref(),
            )),
            1 | 2 => {
                self.round = 2;
                let more = self.parsed.policy_functions();
                (!more.is_empty()).then(|| {
                    let more: Vec<&str> = more.iter().map(String::as_str).collect();
                    facts_sql(&[], &more, None)
                })
            }
            _ => None,
        }
    }

    /// The rows of the last query handed out.
    pub fn add(&mut self, rows: &Rows) {
        self.parsed.add(rows);
    }

    pub fn finish(self) -> Fetched {
        self.parsed.finish(&names(&self.funcs))
    }
}

fn names(owned: &[String]) -> Vec<&str> {
    owned.iter().map(String::as_str).collect()
}

/// Runs `sql` on a tokio-postgres connection, rows as text.
async fn simple_rows(
    client: &tokio_postgres::Client,
    sql: String,
) -> Result<Rows, tokio_postgres::Error> {
    let mut rows = Vec::new();
    for message in client.simple_query(&sql).await? {
        if let tokio_postgres::SimpleQueryMessage::Row(row) = message {
            rows.push(
                (0..row.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            );
        }
    }
    Ok(rows)
}

async fn lookup(
    client: &tokio_postgres::Client,
    wanted: &Wanted,
    publication: Option<&str>,
) -> Result<Fetched, tokio_postgres::Error> {
    let mut lookup = Lookup::new(wanted, publication);
    while let Some(sql) = lookup.next_query() {
        lookup.add(&simple_rows(client, sql).await?);
    }
    Ok(lookup.finish())
}

/// Where the fetcher finds what it needs.
pub struct Fetcher {
    pub db: Arc<DbState>,
    pub upstream: Arc<Upstream>,
    /// The publication that decides which tables are readable, when
    /// replication is on.
    pub publication: Option<String>,
    pub drain: CancellationToken,
}

impl Fetcher {
    /// Fetches whatever sessions queue, in batches, until shutdown. Its
    /// connection is opened on first need, again after a failure, and
    /// again after pgcache let go of the database.
    pub async fn run(self) {
        let catalog = &self.db.catalog;
        let mut client: Option<tokio_postgres::Client> = None;
        let mut backoff = Duration::from_millis(100);
        let mut hold = self.db.hold.token();
        loop {
            let wanted = catalog.take_wanted();
            if wanted.is_empty() {
                tokio::select! {
                    _ = catalog.wake.notified() => continue,
                    _ = self.drain.cancelled() => return,
                    // pgcache lets go of the database: the connection
                    // closes, and opens again on the next need.
                    _ = hold.cancelled() => {
                        client = None;
                        hold = self.db.hold.token();
                        continue;
                    }
                }
            }
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                match self.upstream.control(&self.db.name).await {
                    Ok(c) => client = Some(c),
                    Err(e) => {
                        warn!(database = %self.db.name, error = %e,
                            "catalog: cannot connect; sessions look names up on their own connections");
                        catalog.set_fetcher_down(true);
                        catalog.abandon(&wanted);
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = self.drain.cancelled() => return,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            match lookup(c, &wanted, self.publication.as_deref()).await {
                Ok(fetched) => {
                    debug!(database = %self.db.name, rels = wanted.rels.len(),
                        funcs = wanted.funcs.len(), "catalog: names fetched");
                    catalog.install(&wanted, fetched);
                    catalog.set_fetcher_down(false);
                    backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    warn!(database = %self.db.name, error = %e, "catalog: fetch failed");
                    catalog.abandon(&wanted);
                    client = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cols: &[Option<&str>]) -> Vec<Option<String>> {
        cols.iter().map(|c| c.map(str::to_owned)).collect()
    }

    #[test]
    fn names_are_quoted_whatever_they_hold() {
        assert_eq!(
            name_array(&["t", "it's", "a\\b"]),
            r"ARRAY[E't',E'it\'s',E'a\\b']::pg_catalog.name[]"
        );
        let sql = facts_sql(&["t"], &[], Some("pub'x"));
        assert!(sql.contains(r"p.pubname = E'pub\'x'"), "{sql}");
        assert!(!facts_sql(&[], &["f"], None).contains("pg_class"));
    }

    #[test]
    fn rows_become_facts_and_policies_apply() {
        let wanted = Wanted {
            rels: ["t", "t_2024", "v", "secure", "guarded", "missing"]
                .iter()
                .map(|n| (n.to_string(), 1))
                .collect(),
            funcs: vec![("lower".into(), 1), ("bump".into(), 1)],
        };
        let mut lookup = Lookup::new(&wanted, None);
        let first = lookup.next_query().unwrap();
        assert!(first.contains("E'guarded'") && first.contains("E'bump'"));
        lookup.add(&vec![
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
            row(&[Some("f"), Some("lower"), Some("true"), Some("false")]),
            row(&[Some("f"), Some("bump"), Some("false"), Some("true")]),
            row(&[Some("r"), Some("secure"), Some("true"), Some("false"), None]),
            row(&[
                Some("p"),
                Some("secure"),
                Some("(tenant = current_setting('app.tenant'::text))"),
            ]),
            row(&[
                Some("r"),
                Some("guarded"),
                Some("true"),
                Some("false"),
                None,
            ]),
            row(&[Some("p"), Some("guarded"), Some("(tenant_of(id) > 0)")]),
        ]);
        // The second query asks for the policy's function only.
        let second = lookup.next_query().unwrap();
        assert!(second.contains("E'tenant_of'") && !second.contains("pg_class"));
        lookup.add(&vec![row(&[
            Some("f"),
            Some("tenant_of"),
            Some("false"),
            Some("true"),
        ])]);
        assert!(lookup.next_query().is_none());
        let fetched = lookup.finish();
        assert_eq!(fetched.rels["t"].family, "t");
        assert_eq!(fetched.rels["t_2024"].family, "t");
        assert!(!fetched.rels["v"].readable && fetched.rels["v"].write_hazard);
        assert!(fetched.rels["v"].ttl_ok, "a view may be cached with a TTL");
        assert!(!fetched.rels["t"].ttl_ok);
        assert!(fetched.funcs["lower"].immutable);
        assert!(fetched.funcs["bump"].may_write);
        assert!(!fetched.funcs.contains_key("tenant_of"), "not asked for");
        assert!(fetched.rels["secure"].readable);
        assert_eq!(fetched.settings.iter().collect::<Vec<_>>(), ["app.tenant"]);
        assert!(
            !fetched.rels["guarded"].readable,
            "its policy calls a volatile function"
        );
        assert_eq!(fetched.rels["guarded"].policy_functions, ["tenant_of"]);
        assert!(!fetched.rels.contains_key("missing"));
    }
}
