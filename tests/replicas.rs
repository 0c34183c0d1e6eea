//! Read replicas: real standbys of a throwaway primary (`pg_basebackup
//! -R`), checked at start-up, watched for health and lag, taken out of
//! rotation and put back.

mod common;

use std::time::Duration;

use common::*;
use pgcache::replica::Out;

const WAIT: Duration = Duration::from_secs(30);

/// pgcache in front of `primary` with these replicas.
fn config_with(primary: &Pg, replicas: &[&Pg]) -> pgcache::Config {
    let mut config = primary.proxy_config();
    config.upstream.replicas = replicas
        .iter()
        .map(|r| {
            pgcache::config::ReplicaConfig::Url(format!("postgres://postgres@127.0.0.1:{}", r.port))
        })
        .collect();
    config.replicas.healthy_polls = 2;
    config
}

/// Waits until the first replica is in rotation (`true`) or out of it.
async fn until_in_rotation(proxy: &Proxy, wanted: bool) -> pgcache::replica::Health {
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(WAIT, &format!("replica in rotation: {wanted}"), || {
        let replica = std::sync::Arc::clone(&replica);
        async move { (replica.in_rotation() == wanted).then(|| replica.health()) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_a_standby_of_the_primary_is_refused_at_start() {
    let primary = Pg::dedicated();
    let stranger = Pg::dedicated();
    let err = pgcache::App::start(config_with(&primary, &[&stranger]))
        .await
        .err()
        .expect("an unrelated cluster is refused");
    let text = err.to_string();
    assert!(text.contains("another cluster"), "{text}");
    assert!(
        text.contains(&stranger.port.to_string()),
        "names the replica: {text}"
    );
    // The primary itself is the right cluster, but not in recovery.
    let err = pgcache::App::start(config_with(&primary, &[&primary]))
        .await
        .err()
        .expect("a server not in recovery is refused");
    assert!(err.to_string().contains("not in recovery"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_joins_the_rotation_leaves_it_when_behind_and_comes_back() {
    let primary = Pg::dedicated();
    let standby = primary.standby();
    let mut config = config_with(&primary, &[&standby]);
    config.replicas.max_lag_bytes = 64 * 1024;
    let proxy = Proxy::start(config).await;
    let health = until_in_rotation(&proxy, true).await;
    assert_eq!(health.out, None);
    let (_, body) = proxy.http_get("/metrics").await;
    let server = &proxy.app.replicas.servers[0].name;
    assert!(
        body.contains(&format!("pgcache_replica_up{{server=\"{server}\"}} 1")),
        "{body}"
    );
    // Replay paused: the primary moves on, the standby does not.
    standby.psql_admin("SELECT pg_wal_replay_pause()");
    primary.psql_admin(
        "CREATE TABLE filler AS SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 5000) g",
    );
    let health = until_in_rotation(&proxy, false).await;
    assert_eq!(health.out, Some(Out::Lagging));
    assert!(health.lag_bytes > 64 * 1024, "{health:?}");
    assert!(health.lag > Duration::ZERO, "{health:?}");
    let (_, body) = proxy.http_get("/metrics").await;
    assert!(
        body.contains(&format!("pgcache_replica_up{{server=\"{server}\"}} 0")),
        "{body}"
    );
    // Caught up again: back after its good polls.
    standby.psql_admin("SELECT pg_wal_replay_resume()");
    let health = until_in_rotation(&proxy, true).await;
    assert!(health.lag_bytes <= 64 * 1024, "{health:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_standby_leaves_the_rotation_and_a_promoted_one_does_not_come_back() {
    let primary = Pg::dedicated();
    let standby = primary.standby();
    let proxy = Proxy::start(config_with(&primary, &[&standby])).await;
    until_in_rotation(&proxy, true).await;
    standby.stop();
    let health = until_in_rotation(&proxy, false).await;
    assert!(
        matches!(health.out, Some(Out::Unreachable(_))),
        "{health:?}"
    );
    standby.restart();
    until_in_rotation(&proxy, true).await;
    // Promoted: a primary of its own, never a replica again.
    standby.promote();
    let health = until_in_rotation(&proxy, false).await;
    assert!(
        matches!(health.out, Some(Out::NotInRecovery | Out::Unreachable(_))),
        "{health:?}"
    );
    // Checked again on reconnect: out because it is no standby.
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    eventually(WAIT, "the promoted server judged not a standby", || {
        let replica = std::sync::Arc::clone(&replica);
        async move { (replica.health().out == Some(Out::NotInRecovery)).then_some(()) }
    })
    .await;
    assert!(!replica.in_rotation());
}
