//! `SHOW POOLS`, `SHOW CLIENTS` and `SHOW SERVERS`, with PgBouncer's
//! columns where they apply.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;

use super::{table, timestamp};
use crate::App;
use crate::config::PoolMode;
use crate::pool::Pools;
use crate::pool::clients::Activity;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ago(d: Duration) -> u64 {
    now_ms().saturating_sub(d.as_millis() as u64)
}

fn mode(app: &App) -> &'static str {
    match app.config().pool.mode {
        PoolMode::Session => "session",
        PoolMode::Transaction => "transaction",
    }
}

/// A `SHOW POOLS` row of the primary's.
#[derive(Default)]
struct Row {
    active: usize,
    waiting: usize,
    idle: usize,
    oldest_wait_ms: u64,
    sv_active: usize,
    sv_idle: usize,
    sv_open: usize,
    checkouts: u64,
    avg_wait_us: u64,
}

/// The primary's pools: clients by state and server connections, per
/// database and user.
fn tally(app: &App) -> BTreeMap<(String, String), Row> {
    let now = now_ms();
    let mut rows: BTreeMap<(String, String), Row> = BTreeMap::new();
    for client in app.clients.all() {
        let row = rows
            .entry((client.database.clone(), client.user.clone()))
            .or_default();
        match client.state() {
            Activity::Active => row.active += 1,
            Activity::Idle => row.idle += 1,
            Activity::Waiting => {
                row.waiting += 1;
                row.oldest_wait_ms = row
                    .oldest_wait_ms
                    .max(now.saturating_sub(client.since_ms()));
            }
        }
    }
    for pool in app.pool.pooled.all() {
        let p = pool.row();
        let row = rows.entry((p.database, p.user)).or_default();
        row.sv_active = p.active;
        row.sv_idle = p.idle;
        row.sv_open = p.open;
        row.checkouts = p.checkouts;
        row.avg_wait_us = p.wait_us / p.checkouts.max(1);
    }
    rows
}

/// Per database and user: clients by state, server connections, waits;
/// then the connections sessions hold to each read replica, with its lag.
pub(super) fn pools(app: &App, out: &mut BytesMut) {
    let rows = tally(app);
    let mode = mode(app);
    let primary = app.upstream.describe();
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|((database, user), r)| {
            vec![
                database,
                user,
                r.active.to_string(),
                r.waiting.to_string(),
                r.idle.to_string(),
                r.sv_active.to_string(),
                r.sv_idle.to_string(),
                r.sv_open.to_string(),
                r.checkouts.to_string(),
                (r.oldest_wait_ms / 1000).to_string(),
                ((r.oldest_wait_ms % 1000) * 1000).to_string(),
                r.avg_wait_us.to_string(),
                mode.to_owned(),
                primary.clone(),
                "primary".to_owned(),
                "0".to_owned(),
            ]
        })
        .chain(replica_pools(app, mode))
        .collect();
    table(
        out,
        &[
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_idle",
            "sv_active",
            "sv_idle",
            "sv_open",
            "checkouts",
            "maxwait",
            "maxwait_us",
            "avg_wait_us",
            "pool_mode",
            "server",
            "role",
            "lag_ms",
        ],
        &rows,
    );
}

/// A replica's connections for one database and user.
#[derive(Default)]
struct Tally {
    active: usize,
    idle: usize,
    checkouts: u64,
    avg_wait_us: u64,
}

/// `SHOW POOLS` rows of the replicas: per replica, database and user, the
/// connections there (the sessions' own in session mode, the replica's
/// pool's in transaction mode; their clients are counted on the primary's
/// row).
fn replica_pools<'a>(app: &'a App, mode: &'a str) -> impl Iterator<Item = Vec<String>> + 'a {
    app.replicas.servers.iter().flat_map(move |replica| {
        let mut open: BTreeMap<(Box<str>, Box<str>), Tally> = BTreeMap::new();
        for c in replica.connections.all() {
            let n = open
                .entry((c.database.clone(), c.user.clone()))
                .or_default();
            match c.is_active() {
                true => n.active += 1,
                false => n.idle += 1,
            }
        }
        for pool in replica.pools.all() {
            let row = pool.row();
            let n = open
                .entry((row.database.into(), row.user.into()))
                .or_default();
            n.active += row.active;
            n.idle += row.idle;
            n.checkouts += row.checkouts;
            n.avg_wait_us = row.wait_us / row.checkouts.max(1);
        }
        let lag = replica.health().lag.as_millis().to_string();
        open.into_iter().map(move |((database, user), n)| {
            let zero = || "0".to_owned();
            vec![
                database.into(),
                user.into(),
                zero(),
                zero(),
                zero(),
                n.active.to_string(),
                n.idle.to_string(),
                (n.active + n.idle).to_string(),
                n.checkouts.to_string(),
                zero(),
                zero(),
                n.avg_wait_us.to_string(),
                mode.to_owned(),
                replica.name.clone(),
                "replica".to_owned(),
                lag.clone(),
            ]
        })
    })
}

pub(super) fn clients(app: &App, out: &mut BytesMut) {
    let now = now_ms();
    let rows: Vec<Vec<String>> = app
        .clients
        .all()
        .iter()
        .map(|c| {
            let state = c.state();
            let waited = match state {
                Activity::Waiting => now.saturating_sub(c.since_ms()),
                _ => 0,
            };
            let (server, pid) = c.server();
            vec![
                "C".to_owned(),
                c.user.clone(),
                c.database.clone(),
                state.as_str().to_owned(),
                c.addr.ip().to_string(),
                c.addr.port().to_string(),
                timestamp(c.connected_ms),
                timestamp(c.since_ms()),
                (waited / 1000).to_string(),
                ((waited % 1000) * 1000).to_string(),
                c.id.to_string(),
                if server == 0 {
                    String::new()
                } else {
                    server.to_string()
                },
                if pid == 0 {
                    String::new()
                } else {
                    pid.to_string()
                },
                c.tls.to_string(),
                c.application_name.clone(),
                c.pinned().to_owned(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "type",
            "user",
            "database",
            "state",
            "addr",
            "port",
            "connect_time",
            "request_time",
            "wait",
            "wait_us",
            "id",
            "link",
            "remote_pid",
            "tls",
            "application_name",
            "pinned",
        ],
        &rows,
    );
}

/// Transaction mode's server connections, held and idle, then the
/// sessions' connections to read replicas, each with its role and lag.
pub(super) fn servers(app: &App, out: &mut BytesMut) {
    let mut rows = Vec::new();
    pooled_servers(&app.pool.pooled, None, "0", &mut rows);
    for replica in &app.replicas.servers {
        let lag = replica.health().lag.as_millis().to_string();
        pooled_servers(&replica.pools, Some(&replica.name), &lag, &mut rows);
        for c in replica.connections.all() {
            rows.push(vec![
                "S".to_owned(),
                c.user.to_string(),
                c.database.to_string(),
                if c.is_active() { "active" } else { "idle" }.to_owned(),
                replica.name.clone(),
                timestamp(ago(c.born.elapsed())),
                timestamp(ago(c.since())),
                c.id.to_string(),
                c.pid.to_string(),
                c.client.to_string(),
                "0".to_owned(),
                "replica".to_owned(),
                lag.clone(),
            ]);
        }
    }
    table(
        out,
        &[
            "type",
            "user",
            "database",
            "state",
            "addr",
            "connect_time",
            "request_time",
            "id",
            "remote_pid",
            "link",
            "prepared_statements",
            "role",
            "lag_ms",
        ],
        &rows,
    );
}

/// `SHOW SERVERS` rows of a registry's pools: the primary's, or a
/// replica's (`replica`, named as the rows show it) with its lag.
fn pooled_servers(pools: &Pools, replica: Option<&str>, lag: &str, rows: &mut Vec<Vec<String>>) {
    for pool in pools.all() {
        for s in pool.servers() {
            rows.push(vec![
                "S".to_owned(),
                pool.id.user.to_string(),
                pool.id.database.to_string(),
                if s.active { "active" } else { "idle" }.to_owned(),
                replica.map_or(s.addr, str::to_owned),
                timestamp(ago(s.age)),
                timestamp(ago(s.since)),
                s.id.to_string(),
                s.pid.to_string(),
                if s.client == 0 {
                    String::new()
                } else {
                    s.client.to_string()
                },
                s.prepared.to_string(),
                replica.map_or("primary", |_| "replica").to_owned(),
                lag.to_owned(),
            ]);
        }
    }
}

/// Each read replica: whether it is in rotation (else why not), where it
/// replayed to, its lag, and the reads routed to it.
pub(super) fn replicas(app: &App, out: &mut BytesMut) {
    let rows: Vec<Vec<String>> = app
        .replicas
        .servers
        .iter()
        .map(|r| {
            let health = r.health();
            vec![
                r.name.clone(),
                "replica".to_owned(),
                match &health.out {
                    None => "in rotation".to_owned(),
                    Some(why) => format!("out: {why}"),
                },
                r.weight.to_string(),
                crate::replica::format_lsn(health.replay_lsn),
                health.lag_bytes.to_string(),
                health.lag.as_millis().to_string(),
                r.metrics.routed.get().to_string(),
                r.metrics.refused_fills.get().to_string(),
                r.metrics.retries.get().to_string(),
            ]
        })
        .collect();
    table(
        out,
        &[
            "server",
            "role",
            "state",
            "weight",
            "replay_lsn",
            "lag_bytes",
            "lag_ms",
            "routed",
            "fills_refused",
            "retried_on_primary",
        ],
        &rows,
    );
}
