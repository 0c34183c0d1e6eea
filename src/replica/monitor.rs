//! Watching the replicas: each is checked when pgcache connects to it
//! (in recovery, the primary's system identifier), then its replay
//! position is read every `replicas.poll_interval_ms`; the primary's own
//! position is sampled as often ([`PrimaryClock`](super::PrimaryClock)).
//! pgcache's connections for this are its own, as the user of each URL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Out, Replica, Replicas, parse_lsn};
use crate::upstream::Upstream;

/// How long a query of the watcher's may take before the server counts as
/// unreachable.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects to `replica` and checks it is a standby of the primary whose
/// system identifier is `primary_id`.
pub async fn check(replica: &Upstream, primary_id: &str) -> Result<tokio_postgres::Client, Out> {
    let unreachable = |e: &dyn std::fmt::Display| Out::Unreachable(e.to_string());
    let connect = replica.control(replica.default_database());
    let client = tokio::time::timeout(replica.connect_timeout + QUERY_TIMEOUT, connect)
        .await
        .map_err(|_| Out::Unreachable("connection timed out".to_owned()))?
        .map_err(|e| unreachable(&e))?;
    let sql = "SELECT pg_catalog.pg_is_in_recovery(), \
               (SELECT system_identifier::text FROM pg_catalog.pg_control_system())";
    let row = tokio::time::timeout(QUERY_TIMEOUT, client.query_typed_one(sql, &[]))
        .await
        .map_err(|_| Out::Unreachable("its check timed out".to_owned()))?
        .map_err(|e| unreachable(&e))?;
    let in_recovery: bool = row.try_get(0).map_err(|e| unreachable(&e))?;
    let found: String = row.try_get(1).map_err(|e| unreachable(&e))?;
    if found != primary_id {
        return Err(Out::OtherCluster {
            found,
            primary: primary_id.to_owned(),
        });
    }
    if !in_recovery {
        return Err(Out::NotInRecovery);
    }
    Ok(client)
}

/// Samples the primary's flushed WAL position (what a standby can have
/// received) until pgcache shuts down.
pub async fn watch_primary(
    upstream: Arc<Upstream>,
    replicas: Arc<Replicas>,
    drain: CancellationToken,
) {
    let poll = replicas.config.poll_interval();
    let sql = "SELECT pg_catalog.pg_current_wal_flush_lsn()::text";
    while !drain.is_cancelled() {
        let client = match upstream.control(upstream.default_database()).await {
            Ok(client) => client,
            Err(e) => {
                warn!(error = %e, "cannot sample the primary's WAL position");
                pause(&drain, poll.max(Duration::from_secs(1))).await;
                continue;
            }
        };
        loop {
            let answer =
                tokio::time::timeout(QUERY_TIMEOUT, client.query_typed_one(sql, &[])).await;
            let Ok(Ok(row)) = answer else {
                break;
            };
            if let Some(lsn) = row.try_get::<_, String>(0).ok().and_then(|t| parse_lsn(&t)) {
                replicas.primary.sample(Instant::now(), lsn);
            }
            if !pause(&drain, poll).await {
                return;
            }
        }
    }
}

/// Watches one replica until pgcache shuts down: checks it on every
/// connect, then reads its replay position every poll, taking it out of
/// rotation and putting it back as it goes.
pub async fn watch(replica: Arc<Replica>, replicas: Arc<Replicas>, drain: CancellationToken) {
    let poll = replicas.config.poll_interval();
    while !drain.is_cancelled() {
        let Some(primary_id) = replicas.primary_id.get() else {
            // The primary's identifier is read at start-up; without it no
            // replica can be vouched for.
            out(
                &replica,
                Out::Unreachable("the primary's system identifier is unknown".into()),
            );
            pause(&drain, Duration::from_secs(1)).await;
            continue;
        };
        let client = match check(&replica.upstream, primary_id).await {
            Ok(client) => client,
            Err(why) => {
                out(&replica, why);
                pause(&drain, poll.max(Duration::from_secs(1))).await;
                continue;
            }
        };
        // A standby that restarted resumes from its restartpoint: what was
        // read before this connection may be ahead of it now.
        replica.reset_replay();
        while let Some(verdict) = poll_once(&client, &replica, &replicas).await {
            match verdict {
                Ok(()) => {
                    if replica.good_poll(replicas.config.healthy_polls) {
                        info!(replica = %replica.name, "replica in rotation");
                    }
                }
                Err(why) => out(&replica, why),
            }
            if !pause(&drain, poll).await {
                return;
            }
        }
    }
}

/// One read of a replica's position. `None`: the connection is lost or
/// the replica is no longer a standby (checked again on reconnect).
async fn poll_once(
    client: &tokio_postgres::Client,
    replica: &Replica,
    replicas: &Replicas,
) -> Option<Result<(), Out>> {
    let sql = "SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.pg_last_wal_replay_lsn()::text";
    let asked = Instant::now();
    let row = match tokio::time::timeout(QUERY_TIMEOUT, client.query_typed_one(sql, &[])).await {
        Ok(Ok(row)) => row,
        Ok(Err(e)) => {
            out(replica, Out::Unreachable(e.to_string()));
            return None;
        }
        Err(_) => {
            out(
                replica,
                Out::Unreachable("its position read timed out".to_owned()),
            );
            return None;
        }
    };
    if !row.try_get::<_, bool>(0).unwrap_or(false) {
        out(replica, Out::NotInRecovery);
        return None;
    }
    let replayed = row
        .try_get::<_, Option<String>>(1)
        .ok()
        .flatten()
        .and_then(|t| parse_lsn(&t))
        .unwrap_or(0);
    let Some((bytes, lag)) = replicas.primary.lag(replayed, Instant::now()) else {
        return Some(Err(Out::Starting));
    };
    replica.record(replayed, bytes, lag);
    replica.observed(replayed, asked);
    let config = &replicas.config;
    let too_far = (config.max_lag_bytes > 0 && bytes > config.max_lag_bytes)
        || (config.max_lag_ms > 0 && lag > Duration::from_millis(config.max_lag_ms));
    Some(if too_far { Err(Out::Lagging) } else { Ok(()) })
}

/// Takes a replica out of rotation, saying so once.
fn out(replica: &Replica, why: Out) {
    if replica.take_out(why.clone()) {
        warn!(replica = %replica.name, "replica out of rotation: {why}");
    }
}

/// Waits `for_`; false if pgcache began shutting down meanwhile.
async fn pause(drain: &CancellationToken, for_: Duration) -> bool {
    tokio::select! {
        _ = drain.cancelled() => false,
        _ = tokio::time::sleep(for_) => true,
    }
}
