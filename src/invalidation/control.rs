//! What pgcache asks PostgreSQL on its own connections, outside any
//! stream: the start-up checks, the cluster's identity, what DDL changed,
//! and the publication.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Statement};
use tracing::warn;

use super::ReplicationError;
use crate::upstream::Upstream;

/// Checks, once at start-up, that PostgreSQL can stream changes to pgcache:
/// `wal_level = logical` and a role allowed to replicate. The error says how
/// to fix what is missing.
pub async fn preflight(upstream: &Upstream) -> Result<(), ReplicationError> {
    let pg = upstream.control_config(upstream.default_database());
    let user = pg.get_user().unwrap_or("postgres").to_owned();
    let (client, conn) = match pg.connect(upstream.tls.make_tls()).await {
        Ok(c) => c,
        // A TLS failure is the configuration's (sslmode, sslrootcert), not
        // a server that is still starting. tokio-postgres has no public
        // error kind; its TLS errors all read like this.
        Err(e) if e.to_string().starts_with("error performing TLS handshake") => {
            return Err(ReplicationError::Preflight(format!(
                "TLS to PostgreSQL failed ({e}); check sslmode and sslrootcert in upstream.url"
            )));
        }
        // The server asked for a password and upstream.url has none.
        // tokio-postgres has no public error kind for it; its cause reads so.
        Err(e) if full_message(&e).contains("password missing") => {
            return Err(ReplicationError::Login(format!(
                "PostgreSQL asks for a password for user {user:?} and upstream.url has none: pgcache logs in with \
                 it for its own connections (replication, catalog). Put it in the URL: \
                 postgres://{user}:PASSWORD@host:port/database"
            )));
        }
        Err(e) if e.as_db_error().is_none() => {
            // PostgreSQL is not up (yet): not a configuration error.
            warn!(error = %full_message(&e), addr = %upstream.describe(),
                "cannot reach PostgreSQL; pgcache starts anyway: clients get 08006 until it is up, \
                 replication streams retry every 0.1-5 s and no database is served from the cache until \
                 its stream is up, and /readyz answers 503 meanwhile");
            return Ok(());
        }
        Err(e) => {
            let refused = e.as_db_error().is_some_and(|db| {
                db.code() == &tokio_postgres::error::SqlState::INVALID_PASSWORD
                    || db.code()
                        == &tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
            });
            let message = format!(
                "PostgreSQL refused pgcache's own login as {user:?} ({}); pgcache uses the user and password \
                 in upstream.url (postgres://USER:PASSWORD@host:port/database) for its own connections",
                full_message(&e)
            );
            return Err(if refused {
                ReplicationError::Login(message)
            } else {
                ReplicationError::Preflight(message)
            });
        }
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let wal_level: String = row.get(0);
    let can_replicate: bool = row.get(1);
    let mut problems = Vec::new();
    if wal_level != "logical" {
        problems.push(format!(
            "wal_level is {wal_level:?}: set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        ));
    }
    if !can_replicate {
        problems.push(format!("role {user:?} may not replicate: ALTER ROLE {user} REPLICATION (or use a superuser in upstream.url)"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ReplicationError::Preflight(format!(
            "{}; or set replication.required = false to run with TTL-only invalidation",
            problems.join("; ")
        )))
    }
}

/// Finds out, once, whether the upstream takes
/// [`crate::origin::ORIGIN_SETTING`]: a login with it on a connection of
/// pgcache's own. Unreachable: asked again at the next call.
pub async fn probe_origin(upstream: &Upstream) {
    let origin = &upstream.origin;
    if origin.known() {
        return;
    }
    let mut pg = upstream.control_config(upstream.default_database());
    crate::upstream::add_option(&mut pg, &origin.option());
    match pg.connect(upstream.tls.make_tls()).await {
        Ok(_) => origin.settle(true),
        Err(e) if e.as_db_error().is_some() => {
            warn!(error = %full_message(&e),
                "the upstream refuses the startup option {}: DDL sent through pgcache is handled as \
                 DDL made elsewhere (one catalog query after it)", crate::origin::ORIGIN_SETTING);
            origin.settle(false);
        }
        Err(_) => {}
    }
}

/// An error with its cause: tokio-postgres's Display leaves the cause out
/// ("invalid configuration", without "password missing").
pub fn full_message(e: &tokio_postgres::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// PostgreSQL's system identifier, which names the cluster in shared-tier
/// keys; `None` if it cannot be read within a few seconds.
pub async fn cluster_id(upstream: &Upstream) -> Option<String> {
    let query = async {
        let client = upstream.control(upstream.default_database()).await.ok()?;
        let row = client
            .query_one(
                "SELECT system_identifier::text FROM pg_catalog.pg_control_system()",
                &[],
            )
            .await
            .ok()?;
        row.try_get::<_, String>(0).ok()
    };
    tokio::time::timeout(Duration::from_secs(5), query)
        .await
        .ok()
        .flatten()
}

/// Whether pg_class row `c` has a replica identity, so that publishing its
/// UPDATE/DELETE cannot make them fail.
macro_rules! has_identity {
    () => {
        "(c.relreplident = 'f' OR EXISTS (SELECT FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid
        AND CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END))"
    };
}

/// Publication `$1`: whether it publishes every table (NULL: it does not
/// exist), and unless it does, the tables that may join it, one row each:
/// permanent user tables (partitioned roots rather than partitions) `c` of
/// `$from`, their qualified and bare names, whether the publication lists
/// them and whether they have a replica identity (`has_identity!`).
/// One round trip, as the stream runs it after every DDL; each
/// table's facts are looked up through indexes (`OFFSET 0` keeps them per
/// table), not by hashing every index and published table of the database.
macro_rules! publishable {
    ($publication:literal, $from:literal) => {
        concat!(
            "SELECT p.puballtables, t.qualified, t.name, t.published, t.identity
FROM (SELECT) one
LEFT JOIN pg_catalog.pg_publication p ON p.pubname = ",
            $publication,
            "
LEFT JOIN LATERAL (
  SELECT pg_catalog.format('%I.%I', n.nspname, c.relname), c.relname::text, f.published, f.identity
  FROM ",
            $from,
            " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  CROSS JOIN LATERAL (SELECT
      EXISTS (SELECT FROM pg_catalog.pg_publication_rel pr WHERE pr.prrelid = c.oid AND pr.prpubid = p.oid),
      ",
            has_identity!(),
            "
    OFFSET 0) f(published, identity)
  WHERE NOT p.puballtables AND c.relkind IN ('r', 'p') AND c.relpersistence = 'p' AND NOT c.relispartition
    AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp)'
) t(qualified, name, published, identity) ON true"
        )
    };
}

/// Every table of the database; run once per stream.
pub(super) const PUBLISHABLE: &str = publishable!("$1", "pg_catalog.pg_class c");

/// The tables of the bare names `$2`, after DDL named them, looked up name
/// by name in pg_class's name index so that a DDL statement's cost does not
/// grow with the database. `OFFSET 0` keeps the lookup per name: planned
/// once for any names, the join would scan pg_class.
const PUBLISHABLE_NAMED: &str = publishable!(
    "$1",
    "pg_catalog.unnest($2::pg_catalog.name[]) w(relname)
  CROSS JOIN LATERAL (SELECT * FROM pg_catalog.pg_class c WHERE c.relname = w.relname OFFSET 0) c"
);

/// Object types whose changes leave every fact pgcache keeps as it was (a
/// schema renamed keeps its relations' bare names; a dropped table's row
/// type, indexes and toast table are reported beside it).
macro_rules! no_facts {
    () => {
        "'schema', 'type', 'index', 'toast table', 'operator', 'operator class', \
    'operator family', 'publication', 'extension', 'statistics object', 'collation', 'cast'"
    };
}

/// Whether every transaction of `$1` (32-bit xids from the stream) is
/// visible in the statement's snapshot (each xid widened with the epoch of
/// the snapshot's xmax; NULL for none), and if so, one row per name whose
/// facts objects `($2, $3, $4)` (class, object and sub-object ids) changed:
/// each object's own relation or function name, plus the tables whose
/// facts depend on it (inheritance relatives, tables its foreign keys
/// reference). `named` marks those rows; a NULL name is an object that is
/// gone.
macro_rules! visible_names {
    () => { concat!(
    "SELECT v.visible, n.named, n.name
FROM (
  SELECT pg_catalog.bool_and(pg_catalog.pg_visible_in_snapshot(
    ((((m.x >> 32) - CASE WHEN d.xid > (m.x & 4294967295) THEN 1 ELSE 0 END) << 32) | d.xid)::text::xid8, s))
  FROM pg_catalog.pg_current_snapshot() s,
       LATERAL (SELECT pg_catalog.pg_snapshot_xmax(s)::text::bigint AS x) m,
       pg_catalog.unnest($1::int8[]) d(xid)
) v(visible)
LEFT JOIN LATERAL (
  SELECT true, x.name FROM (
    SELECT CASE WHEN a.type IS NULL OR cardinality(a.object_names) < 2 THEN NULL
        ELSE a.object_names[2] END
    FROM unnest($2::pg_catalog.oid[], $3::pg_catalog.oid[], $4::pg_catalog.int4[]) d(classid, objid, objsubid)
    CROSS JOIN LATERAL pg_catalog.pg_identify_object_as_address(d.classid, d.objid, d.objsubid) a
    WHERE a.type IS NULL OR a.type NOT IN (",
    no_facts!(),
    ")
    UNION ALL
    SELECT r.relname::text FROM unnest($3::pg_catalog.oid[]) d(objid)
      JOIN pg_catalog.pg_inherits i ON d.objid IN (i.inhrelid, i.inhparent)
      JOIN pg_catalog.pg_class r ON r.oid IN (i.inhrelid, i.inhparent)
    UNION ALL
    SELECT r.relname::text FROM unnest($3::pg_catalog.oid[]) d(objid)
      JOIN pg_catalog.pg_constraint k ON k.conrelid = d.objid AND k.contype = 'f'
      JOIN pg_catalog.pg_class r ON r.oid = k.confrelid
  ) x(name)
  WHERE v.visible IS NOT FALSE
) n(named, name) ON true"
    ) };
}

/// One round after DDL, in one statement and snapshot: [`visible_names!`]
/// (`$1`..`$4`) as rows `('n', visible, named, name)`, then, once every
/// transaction is visible and every object named, the publication `$5`'s
/// facts ([`publishable!`]) of the tables of those names and of the names
/// `$6` the trigger announced, as rows `('p', ...)` from the fifth column.
/// `$5` NULL (a publication pgcache does not manage) finds no tables.
const AFTER_DDL: &str = concat!(
    "WITH named(visible, named, name) AS MATERIALIZED (",
    visible_names!(),
    "),
wanted(relname) AS (
  SELECT DISTINCT x.relname FROM (
    SELECT named.name::pg_catalog.name FROM named WHERE named.named
    UNION ALL SELECT pg_catalog.unnest($6::pg_catalog.name[])
  ) x(relname)
  WHERE x.relname IS NOT NULL
    AND NOT EXISTS (SELECT FROM named WHERE named.visible IS FALSE OR (named.named AND named.name IS NULL))
)
SELECT 'n', named.visible, named.named, named.name,
  NULL::bool, NULL::text, NULL::text, NULL::bool, NULL::bool
FROM named
UNION ALL
SELECT 'p', NULL, NULL, NULL, q.* FROM (",
    publishable!(
        "$5",
        "wanted w
  CROSS JOIN LATERAL (SELECT * FROM pg_catalog.pg_class c WHERE c.relname = w.relname OFFSET 0) c"
    ),
    ") q"
);

/// An object a DDL command created or altered: `(classid, objid, objsubid)`
/// as `pg_event_trigger_ddl_commands()` reports it.
pub type ObjectAddress = (u32, u32, i32);

/// A stream's control connection, with the queries it runs after every DDL
/// transaction prepared on it. PostgreSQL takes longer to plan these
/// catalog queries than to run them: prepared, they are planned once per
/// connection instead of once per DDL statement.
pub struct Control {
    pub(super) client: Arc<Client>,
    after_ddl: Statement,
    pub(super) publishable: Statement,
}

/// What one round after DDL found ([`Control::after_ddl`]).
pub struct AfterDdl {
    /// The names of what the DDL changed; `None`: anything may have.
    pub names: Option<Vec<String>>,
    /// The publication as it stands for the tables of those names and of
    /// the names announced; `None` when it was not looked at (anything
    /// changed, or no publication pgcache manages).
    pub publication: Option<Publishable>,
}

/// A publication, and the tables it may list, as [`publishable!`] finds
/// them.
pub struct Publishable {
    /// Whether it lists every table (`FOR ALL TABLES`); `None`: it does not
    /// exist.
    pub(super) all: Option<bool>,
    pub(super) tables: Vec<Table>,
}

/// A table that may join a publication.
pub(super) struct Table {
    pub(super) qualified: String,
    pub(super) name: String,
    pub(super) published: bool,
    pub(super) identity: bool,
}

impl Publishable {
    /// From rows of [`publishable!`], its columns from `at` on.
    pub(super) fn from_rows<'r>(rows: impl IntoIterator<Item = &'r Row>, at: usize) -> Publishable {
        let mut all = None;
        let mut tables = Vec::new();
        for row in rows {
            all = row.get(at);
            // The one row of a publication with no table to look at.
            if let Some(qualified) = row.get::<_, Option<String>>(at + 1) {
                tables.push(Table {
                    qualified,
                    name: row.get(at + 2),
                    published: row.get(at + 3),
                    identity: row.get(at + 4),
                });
            }
        }
        Publishable { all, tables }
    }
}

impl Control {
    pub async fn prepare(client: Client) -> Result<Control, ReplicationError> {
        // Planned once for any arguments: left to choose, PostgreSQL plans
        // the publication's lookup anew every time, its estimate of a plan
        // for the given names being the lower.
        client
            .batch_execute("SET plan_cache_mode = force_generic_plan")
            .await?;
        let after_ddl = client
            .prepare_typed(
                AFTER_DDL,
                &[
                    Type::INT8_ARRAY,
                    Type::OID_ARRAY,
                    Type::OID_ARRAY,
                    Type::INT4_ARRAY,
                    Type::TEXT,
                    Type::NAME_ARRAY,
                ],
            )
            .await?;
        let publishable = client
            .prepare_typed(PUBLISHABLE_NAMED, &[Type::TEXT, Type::NAME_ARRAY])
            .await?;
        Ok(Control {
            client: Arc::new(client),
            after_ddl,
            publishable,
        })
    }

    /// The connection, for what else the stream asks on it (heartbeats,
    /// the start position, the trigger).
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// Waits until transactions `xids` (32-bit, from the stream) are
    /// visible, then names what `objects` changed and looks at the
    /// publication `publication` (if pgcache manages it) for the tables of
    /// those names and of `announced`: one statement ([`AFTER_DDL`]).
    /// Names `None`, meaning anything may have changed, for an object gone
    /// before it could be named, or transactions still invisible after two
    /// seconds.
    pub async fn after_ddl(
        &self,
        xids: &[u32],
        objects: &[ObjectAddress],
        announced: &[String],
        publication: Option<&str>,
    ) -> Result<AfterDdl, ReplicationError> {
        let xids: Vec<i64> = xids.iter().map(|x| i64::from(*x)).collect();
        let classids: Vec<u32> = objects.iter().map(|o| o.0).collect();
        let objids: Vec<u32> = objects.iter().map(|o| o.1).collect();
        let subids: Vec<i32> = objects.iter().map(|o| o.2).collect();
        let anything = AfterDdl {
            names: None,
            publication: None,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let params: [&(dyn ToSql + Sync); 6] =
                [&xids, &classids, &objids, &subids, &publication, &announced];
            let rows = match self.client.query(&self.after_ddl, &params).await {
                Ok(rows) => rows,
                // An object gone before it could be named.
                Err(e) if e.as_db_error().is_some() => return Ok(anything),
                Err(e) => return Err(e.into()),
            };
            let (named, tables): (Vec<&Row>, Vec<&Row>) =
                rows.iter().partition(|r| r.get::<_, &str>(0) == "n");
            let visible: Option<bool> = named.first().and_then(|r| r.get(1));
            if visible != Some(false) {
                let names: Option<Vec<String>> = named
                    .iter()
                    .filter(|r| r.get::<_, Option<bool>>(2).is_some())
                    .map(|r| r.get::<_, Option<String>>(3))
                    .collect();
                let publication = (names.is_some() && publication.is_some())
                    .then(|| Publishable::from_rows(tables, 4));
                return Ok(AfterDdl { names, publication });
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(anything);
            }
            // The window is the few microseconds between a commit's WAL
            // flush and its proc-array update: a short pause, not a
            // synchronisation.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

pub fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
