//! The idle timeouts, decided by the engine under the clock the test
//! passes in.

use std::time::{Duration, Instant};

use super::{Rig, complete, ctx, query, rfq};
use crate::config::ServerConfig;
use crate::protocol::{TxStatus, sqlstate};
use crate::session::engine::{Engine, IdleTimeouts};

fn timeouts(idle: u64, in_transaction: u64) -> IdleTimeouts {
    IdleTimeouts::new(&ServerConfig {
        client_idle_timeout_secs: idle,
        idle_in_transaction_timeout_secs: in_transaction,
        ..ServerConfig::default()
    })
}

#[test]
fn the_deadline_follows_the_last_activity_and_the_transaction_state() {
    let mut rig = Rig::logged_in();
    let t0 = Instant::now();
    rig.engine.set_idle_timeouts(timeouts(10, 3), t0);
    assert!(rig.engine.tracks_activity());
    assert_eq!(
        rig.engine.poll_timeout(),
        Some(t0 + Duration::from_secs(10))
    );
    let t1 = t0 + Duration::from_secs(4);
    rig.engine.note_activity(t1);
    assert_eq!(
        rig.engine.poll_timeout(),
        Some(t1 + Duration::from_secs(10))
    );
    assert_eq!(
        rig.engine.on_timeout(&ctx(&rig.app, &rig.entry)).sqlstate(),
        sqlstate::IDLE_SESSION_TIMEOUT
    );

    // Waiting on the backend, the session does not idle.
    rig.client(&query("BEGIN"));
    assert_eq!(rig.engine.poll_timeout(), None, "a request to send");
    assert_eq!(rig.sent_to_backend(), query("BEGIN"));
    assert_eq!(rig.engine.poll_timeout(), None, "an answer owed");
    rig.backend(&[complete("BEGIN"), rfq(TxStatus::InTransaction)]);
    assert_eq!(rig.engine.poll_timeout(), Some(t1 + Duration::from_secs(3)));
    assert_eq!(
        rig.engine.on_timeout(&ctx(&rig.app, &rig.entry)).sqlstate(),
        sqlstate::IDLE_IN_TRANSACTION_TIMEOUT
    );

    rig.client(&query("COMMIT"));
    rig.sent_to_backend();
    rig.backend(&[complete("COMMIT"), rfq(TxStatus::Idle)]);
    assert_eq!(
        rig.engine.poll_timeout(),
        Some(t1 + Duration::from_secs(10))
    );
}

#[test]
fn only_a_set_timeout_of_the_current_state_makes_a_deadline() {
    let mut rig = Rig::logged_in();
    assert!(!rig.engine.tracks_activity());
    assert_eq!(rig.engine.poll_timeout(), None);

    // Only the idle-in-transaction timeout: none while idle.
    let t0 = Instant::now();
    rig.engine.set_idle_timeouts(timeouts(0, 3), t0);
    assert_eq!(rig.engine.poll_timeout(), None);
    rig.client(&query("BEGIN"));
    rig.sent_to_backend();
    rig.backend(&[complete("BEGIN"), rfq(TxStatus::InTransaction)]);
    assert_eq!(rig.engine.poll_timeout(), Some(t0 + Duration::from_secs(3)));

    // Before the login is over, the session waits on PostgreSQL.
    let mut fresh = Rig::new();
    fresh.engine.set_idle_timeouts(timeouts(10, 3), t0);
    assert_eq!(fresh.engine.poll_timeout(), None);
}

#[test]
fn a_draining_session_ends_once_idle_with_57p01() {
    let mut rig = Rig::logged_in();
    assert!(rig.engine.drained().is_none(), "not draining");
    rig.engine.drain();
    rig.client(&query("SELECT 1"));
    assert!(rig.engine.drained().is_none(), "a request to send");
    assert_eq!(rig.sent_to_backend(), query("SELECT 1"));
    assert!(rig.engine.drained().is_none(), "an answer owed");
    rig.backend(&[complete("SELECT 1"), rfq(TxStatus::Idle)]);
    let e = rig.engine.drained().expect("idle now");
    assert_eq!(e.sqlstate(), sqlstate::ADMIN_SHUTDOWN);
    assert_eq!(Engine::forced().sqlstate(), sqlstate::ADMIN_SHUTDOWN);
}

#[test]
fn a_backend_lost_unexpectedly_is_told_and_an_expected_close_is_not() {
    let mut rig = Rig::logged_in();
    let e = rig.engine.on_backend_lost(None).expect("unexpected");
    assert_eq!(e.sqlstate(), sqlstate::CONNECTION_FAILURE);
    assert!(
        e.to_string().contains("closed the connection unexpectedly"),
        "{e}"
    );
    rig.client(&super::frame(b'X', b""));
    assert!(
        rig.engine.on_backend_lost(None).is_none(),
        "after Terminate"
    );
}
