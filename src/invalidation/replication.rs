//! The replication stream of one database, and the checks made at start-up.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};
use tracing::{debug, info, warn};

use super::pgoutput::{self, Change};
use crate::App;
use crate::cache::{Bumps, DbState};
use crate::config::{Config, UpstreamAddr};
use crate::upstream::{UpstreamTls, UpstreamUrl};

#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("replication check failed: {0}")]
    Preflight(String),
    #[error("control connection: {0}")]
    Control(#[from] tokio_postgres::Error),
    #[error("replication connection: {0}")]
    Stream(#[from] pgwire_replication::PgWireError),
    #[error("{0}")]
    Config(String),
}

/// Logical message prefix the DDL event trigger emits.
pub const DDL_MESSAGE_PREFIX: &str = "pgcache_ddl";

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// The control connection's settings: `upstream.url` with `database` swapped in.
fn control_config(
    config: &Config,
    database: &str,
) -> Result<tokio_postgres::Config, ReplicationError> {
    let mut pg = UpstreamUrl::parse(&config.upstream.url)
        .map_err(|e| ReplicationError::Config(format!("upstream.url: {e}")))?
        .pg;
    if pg.get_user().is_none() {
        pg.user("postgres");
    }
    pg.dbname(database);
    pg.application_name("pgcache");
    pg.connect_timeout(config.connect_timeout());
    Ok(pg)
}

async fn control(
    config: &Config,
    tls: &UpstreamTls,
    database: &str,
) -> Result<tokio_postgres::Client, ReplicationError> {
    let (client, conn) = control_config(config, database)?
        .connect(tls.make_tls())
        .await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!(error = %e, "control connection closed");
        }
    });
    Ok(client)
}

/// A control connection to upstream.url's own database.
pub async fn control_client(
    config: &Config,
    tls: &UpstreamTls,
) -> Result<tokio_postgres::Client, ReplicationError> {
    control(config, tls, &default_database(config)).await
}

/// Checks, once at start-up, that PostgreSQL can stream changes to pgcache:
/// `wal_level = logical` and a role allowed to replicate. The error says how
/// to fix what is missing.
pub async fn preflight(config: &Config, tls: &UpstreamTls) -> Result<(), ReplicationError> {
    let pg = control_config(config, &default_database(config))?;
    let user = pg.get_user().unwrap_or("postgres").to_owned();
    let (client, conn) = match pg.connect(tls.make_tls()).await {
        Ok(c) => c,
        // A TLS failure is the configuration's (sslmode, sslrootcert), not
        // a server that is still starting. tokio-postgres has no public
        // error kind; its TLS errors all read like this.
        Err(e) if e.to_string().starts_with("error performing TLS handshake") => {
            return Err(ReplicationError::Preflight(format!(
                "TLS to PostgreSQL failed ({e}); check sslmode and sslrootcert in upstream.url"
            )));
        }
        Err(e) if e.as_db_error().is_none() => {
            // PostgreSQL is not up (yet): not a configuration error. Streams
            // retry, and no database is served from the cache until its own
            // stream is up.
            warn!(error = %e, "cannot reach PostgreSQL to check replication now; streams will retry");
            return Ok(());
        }
        Err(e) => {
            return Err(ReplicationError::Preflight(format!(
                "cannot log in to PostgreSQL as {user:?} to check replication ({e}); pgcache uses the user \
                 and password in upstream.url for its own connections"
            )));
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

/// PostgreSQL's system identifier, which names the cluster in shared-tier
/// keys; `None` if it cannot be read within a few seconds.
pub async fn cluster_id(config: &Config, tls: &UpstreamTls) -> Option<String> {
    let query = async {
        let client = control(config, tls, &default_database(config)).await.ok()?;
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

fn default_database(config: &Config) -> String {
    UpstreamUrl::parse(&config.upstream.url)
        .ok()
        .and_then(|u| u.pg.get_dbname().map(str::to_owned))
        .unwrap_or_else(|| "postgres".to_owned())
}

/// Starts the stream of `database` unless it runs already.
pub fn ensure_stream(app: &Arc<App>, database: &str, db: &Arc<DbState>) {
    if !app.replication_on() || !db.claim_stream() {
        return;
    }
    let app = Arc::clone(app);
    let db = Arc::clone(db);
    let database = database.to_owned();
    tokio::spawn(async move {
        run(app, database, db).await;
    });
}

/// Keeps the stream of one database running until shutdown.
async fn run(app: Arc<App>, database: String, db: Arc<DbState>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        db.set_streaming(false);
        let result = tokio::select! {
            r = stream_once(&app, &database, &db) => r,
            _ = app.drain.cancelled() => return,
        };
        db.set_streaming(false);
        match result {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                warn!(database = %database, error = %e, retry_in = ?backoff, "replication stream down; cache off for this database");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = app.drain.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn stream_once(app: &App, database: &str, db: &Arc<DbState>) -> Result<(), ReplicationError> {
    let config = &app.config;
    let publication = &config.replication.publication;
    let ctl = control(config, &app.upstream_tls, database).await?;
    if config.replication.manage_publication {
        db.set_unpublished(sync_publication(&ctl, publication).await?);
    }
    if config.replication.ddl_event_trigger {
        install_ddl_trigger(&ctl, database).await;
    }

    let pg = control_config(config, database)?;
    let (host, port, tls) = match app.upstream.first() {
        Some(UpstreamAddr::Tcp { host, port }) => {
            (host.clone(), *port, app.upstream_tls.replication(host))
        }
        Some(UpstreamAddr::Unix { path }) => {
            let dir = path
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            let port = path
                .extension()
                .and_then(|e| e.to_str())
                .and_then(|e| e.parse().ok())
                .unwrap_or(5432);
            (dir, port, pgwire_replication::TlsConfig::disabled())
        }
        None => return Err(ReplicationError::Config("no upstream address".into())),
    };
    let password = pg
        .get_password()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    let slot = format!("pgcache_{:08x}", rand::random::<u32>());
    let cfg = ReplicationConfig::new(
        host,
        pg.get_user().unwrap_or("postgres"),
        password,
        database,
        &slot,
        publication.as_str(),
    )
    .with_port(port)
    .with_tls(tls)
    .with_application_name("pgcache-invalidation")
    .with_status_interval(Duration::from_secs(1));
    let mut stream = ReplicationClient::connect_gated(cfg).await?;
    stream
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'nothing')"
        ))
        .await?;
    stream.start().await?;
    stream.wait_started().await?;
    // Changes made while no stream was running were missed: everything
    // cached for this database is stale, and so is the catalog snapshot.
    app.invalidate(db, &Bumps::opaque()).await;
    db.stream_started();
    db.set_streaming(true);
    info!(database, slot, "replication stream up");

    let max_lag = config.replication.max_lag_ms as i64 * 1000;
    let mut relations: HashMap<u32, String> = HashMap::new();
    let mut touched: HashSet<u32> = HashSet::new();
    let mut in_transaction = false;
    let mut current_xid = 0u32;
    // A committed transaction that ran DDL, to act on once it is visible.
    let mut ddl_xid: Option<u32> = None;
    // Server WAL position seen and position applied, for the byte lag.
    let (mut server_lsn, mut applied_lsn) = (0u64, 0u64);
    loop {
        let Some(event) = stream.recv().await? else {
            return Ok(());
        };
        match event {
            ReplicationEvent::Begin { xid, .. } => {
                in_transaction = true;
                current_xid = xid;
                touched.clear();
            }
            ReplicationEvent::XLogData { data, wal_end, .. } => {
                server_lsn = server_lsn.max(wal_end.0);
                match pgoutput::decode(&data) {
                    Some(Change::Relation { oid, name, .. }) => {
                        relations.insert(oid, name);
                    }
                    Some(Change::Row { oid }) => {
                        touched.insert(oid);
                    }
                    Some(Change::Truncate { oids }) => touched.extend(oids),
                    Some(Change::Other) => {}
                    None => warn!(database, "malformed pgoutput message ignored"),
                }
            }
            ReplicationEvent::Commit {
                end_lsn,
                commit_time_micros,
                ..
            } => {
                in_transaction = false;
                let mut bumps = Bumps::default();
                for oid in touched.drain() {
                    match relations.get(&oid) {
                        Some(name) => db.relation_families(name, &mut bumps),
                        // A change without its Relation message cannot be
                        // attributed: assume anything changed.
                        None => bumps.epoch = true,
                    }
                }
                if !bumps.is_empty() {
                    app.invalidate(db, &bumps).await;
                }
                stream.update_applied_lsn(end_lsn);
                applied_lsn = applied_lsn.max(end_lsn.0);
                server_lsn = server_lsn.max(end_lsn.0);
                let lag = now_pg_micros() - commit_time_micros;
                db.set_lag(lag.max(0) as u64 / 1000, lag > max_lag);
            }
            ReplicationEvent::Message { prefix, .. } if prefix == DDL_MESSAGE_PREFIX => {
                debug!(database, "DDL seen in the stream");
                app.invalidate(db, &Bumps::opaque()).await;
                ddl_xid = Some(current_xid);
            }
            ReplicationEvent::Message { lsn, .. } => stream.update_applied_lsn(lsn),
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                server_lsn = server_lsn.max(wal_end.0);
                if !in_transaction {
                    // Idle and told where WAL ends: caught up.
                    stream.update_applied_lsn(wal_end);
                    applied_lsn = applied_lsn.max(wal_end.0);
                    db.set_lag(0, false);
                }
            }
            ReplicationEvent::StoppedAt { .. } => return Ok(()),
        }
        db.set_lag_bytes(server_lsn.saturating_sub(applied_lsn));
        db.set_applied_lsn(applied_lsn);
        if !in_transaction && let Some(xid) = ddl_xid.take() {
            // The stream can deliver a commit before the transaction is
            // visible to other sessions. Wait until it is, then make the
            // catalog snapshot (and the publication) reflect it.
            wait_visible(&ctl, xid).await?;
            app.invalidate(db, &Bumps::opaque()).await;
            if config.replication.manage_publication {
                match sync_publication(&ctl, publication).await {
                    Ok(unpublished) => db.set_unpublished(unpublished),
                    Err(e) => {
                        warn!(database, error = %e, "could not update the publication after DDL")
                    }
                }
            }
        }
    }
}

/// Waits until transaction `xid` (32-bit, from the stream) is visible in a
/// new snapshot of the control connection. Gives up after two seconds.
async fn wait_visible(ctl: &tokio_postgres::Client, xid: u32) -> Result<(), ReplicationError> {
    // Widen the xid with the epoch of the current snapshot's xmax.
    const VISIBLE: &str = "SELECT pg_catalog.pg_visible_in_snapshot(
        ((((x >> 32) - CASE WHEN $1 > (x & 4294967295) THEN 1 ELSE 0 END) << 32) | $1)::text::xid8, s)
        FROM pg_catalog.pg_current_snapshot() s,
             LATERAL (SELECT pg_catalog.pg_snapshot_xmax(s)::text::bigint AS x) m";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let visible: bool = ctl.query_one(VISIBLE, &[&i64::from(xid)]).await?.get(0);
        if visible || tokio::time::Instant::now() >= deadline {
            return Ok(());
        }
        // The window is the few microseconds between a commit's WAL flush
        // and its proc-array update: a short pause, not a synchronisation.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn now_pg_micros() -> i64 {
    let since_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    since_unix.as_micros() as i64 - PG_EPOCH_MICROS
}

/// Tables that may join the publication: permanent user tables (partitioned
/// roots rather than partitions) with a replica identity, so that publishing
/// their UPDATE/DELETE cannot make those writes fail.
const PUBLISHABLE: &str = "\
SELECT pg_catalog.format('%I.%I', n.nspname, c.relname), c.oid IN
    (SELECT pr.prrelid FROM pg_catalog.pg_publication_rel pr
     JOIN pg_catalog.pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1),
  c.relreplident = 'f'
    OR (c.relreplident = 'd' AND EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))
    OR (c.relreplident = 'i' AND EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisreplident))
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND c.relpersistence = 'p' AND NOT c.relispartition
  AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp)'";

/// Creates the publication if needed and makes it list exactly the tables
/// that have a replica identity. Returns how many tables are left out.
pub async fn sync_publication(
    ctl: &tokio_postgres::Client,
    publication: &str,
) -> Result<u64, ReplicationError> {
    let quoted = quote_ident(publication);
    let exists = ctl
        .query_opt(
            "SELECT puballtables FROM pg_catalog.pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    match exists {
        Some(row) if row.get::<_, bool>(0) => {
            // FOR ALL TABLES: PostgreSQL decides; nothing to manage.
            return Ok(0);
        }
        Some(_) => {}
        None => {
            ctl.batch_execute(&format!(
                "CREATE PUBLICATION {quoted} WITH (publish_via_partition_root = true)"
            ))
            .await?;
            info!(publication, "created publication");
        }
    }
    let rows = ctl.query(PUBLISHABLE, &[&publication]).await?;
    let mut add = Vec::new();
    let mut drop = Vec::new();
    let mut unpublishable = Vec::new();
    for row in rows {
        let name: String = row.get(0);
        let published: bool = row.get(1);
        let has_identity: bool = row.get(2);
        match (published, has_identity) {
            (false, true) => add.push(name),
            (true, false) => drop.push(name),
            (false, false) => unpublishable.push(name),
            (true, true) => {}
        }
    }
    if !add.is_empty() {
        ctl.batch_execute(&format!(
            "ALTER PUBLICATION {quoted} ADD TABLE {}",
            add.join(", ")
        ))
        .await?;
        debug!(
            publication,
            tables = add.len(),
            "added tables to the publication"
        );
    }
    if !drop.is_empty() {
        ctl.batch_execute(&format!(
            "ALTER PUBLICATION {quoted} DROP TABLE {}",
            drop.join(", ")
        ))
        .await?;
    }
    if !unpublishable.is_empty() || !drop.is_empty() {
        unpublishable.extend(drop);
        warn!(
            publication,
            tables = %unpublishable.join(", "),
            "tables without a replica identity (no primary key, identity index or FULL) are not cached"
        );
    }
    Ok(unpublishable.len() as u64)
}

/// Installs an event trigger that announces DDL in the stream, so DDL made
/// outside pgcache invalidates too. Needs superuser; without it pgcache logs
/// a warning and notices outside DDL only through the TTL and the snapshot
/// reload for unknown relations. The function can never fail the user's DDL.
async fn install_ddl_trigger(ctl: &tokio_postgres::Client, database: &str) {
    let sql = format!(
        "CREATE SCHEMA IF NOT EXISTS pgcache;
         CREATE OR REPLACE FUNCTION pgcache.announce_ddl() RETURNS event_trigger
           LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
           BEGIN
             PERFORM pg_catalog.pg_logical_emit_message(true, '{DDL_MESSAGE_PREFIX}', tg_tag);
           EXCEPTION WHEN OTHERS THEN NULL;
           END $$;
         DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl') THEN
             CREATE EVENT TRIGGER pgcache_ddl ON ddl_command_end EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
           IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger WHERE evtname = 'pgcache_ddl_drop') THEN
             CREATE EVENT TRIGGER pgcache_ddl_drop ON sql_drop EXECUTE FUNCTION pgcache.announce_ddl();
           END IF;
         END $$;"
    );
    if let Err(e) = ctl.batch_execute(&sql).await {
        warn!(database, error = %e, "cannot install the DDL event trigger (needs superuser): DDL made outside pgcache is not seen");
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
