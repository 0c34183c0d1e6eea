//! What the session's replica leg keeps of its connection: the settings
//! state it was given and the statements it holds.

use std::sync::Arc;
use std::time::Instant;

use super::Rig;
use crate::pool::prepared::ServerStatements;
use crate::replica::{Replica, Replicas};
use crate::session::link::UNKNOWN_STATE;
use crate::session::replica::ReplicaLeg;

/// A replica of a configuration that lists one.
fn server() -> Arc<Replica> {
    let config = crate::Config::from_toml(
        "[upstream]\nreplicas = [\"postgres://a:1\"]\n",
        "t".as_ref(),
    )
    .expect("config");
    let replicas = Replicas::new(&config, &crate::metrics::Metrics::new()).expect("replicas");
    Arc::clone(&replicas.servers[0])
}

#[test]
fn settings_are_given_once_and_unknown_until_taken() {
    let mut rig = Rig::new();
    assert_eq!(
        rig.engine.replica_settings_due(),
        None,
        "no leg, nothing due"
    );
    rig.engine.replica = Some(Box::new(ReplicaLeg::new(server())));
    let session = rig.engine.link.state().id;

    // A connection in another state: the session's settings are due, and
    // in doubt until applied.
    rig.engine
        .replica_connected(session + 1, ServerStatements::default(), Instant::now());
    let sql = rig.engine.replica_settings_due().expect("due");
    assert_eq!(sql, rig.engine.link.state().apply_sql());
    assert_eq!(rig.engine.replica().map(|l| l.applied), Some(UNKNOWN_STATE));
    assert_eq!(
        rig.engine.replica_settings_due(),
        Some(sql),
        "a failed apply is tried again"
    );
    rig.engine.replica_settings_applied();
    assert_eq!(rig.engine.replica().map(|l| l.applied), Some(session));
    assert_eq!(rig.engine.replica_settings_due(), None, "given once");

    // Given back: the books go with the connection, and the leg knows
    // nothing of the next one.
    assert_eq!(rig.engine.replica_books().map(|(a, _)| a), Some(session));
    assert_eq!(rig.engine.replica().map(|l| l.applied), Some(UNKNOWN_STATE));
}
