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
pub(super) fn server() -> Arc<Replica> {
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

#[test]
fn a_replica_lost_mid_answer_fails_the_read_and_one_lost_before_it_sends_it_to_the_primary() {
    use crate::protocol::{TxStatus, messages, sqlstate};
    use crate::session::pipeline::Inflight;
    use crate::session::replica::{Routed, Verdict};
    let read = super::query("SELECT 1");
    for relayed in [false, true] {
        let mut rig = Rig::logged_in();
        let server = server();
        rig.engine.replica = Some(Box::new(ReplicaLeg::new(Arc::clone(&server))));
        let mut routed = Routed::new(server, (read.clone().into(), None), 0, None);
        if relayed {
            routed.verdict = Verdict::Relayed;
        }
        rig.engine.pipeline.push(Inflight {
            routed: Some(Box::new(routed)),
            ..Inflight::default()
        });
        let retried = rig.engine.on_replica_lost();
        assert_eq!(retried, !relayed);
        if relayed {
            let mut told = bytes::BytesMut::new();
            messages::error_response(
                &mut told,
                "ERROR",
                sqlstate::CONNECTION_FAILURE,
                "the replica's connection was lost while it answered",
            );
            told.extend_from_slice(&messages::ready_for_query(TxStatus::Idle));
            assert_eq!(rig.sent_to_client(), told.to_vec());
            assert!(rig.sent_to_backend().is_empty());
        } else {
            assert!(rig.sent_to_client().is_empty());
            assert_eq!(rig.sent_to_backend(), read, "the read goes to the primary");
        }
    }
}

#[test]
fn a_routed_read_gets_a_connection_then_the_settings_then_is_written_once() {
    use crate::session::engine::ReplicaStep;
    use crate::session::link::{Link, SessionLink};
    use crate::session::pipeline::Inflight;
    use crate::session::replica::{ReadState, Routed};
    let read = super::query("SELECT 1");
    let mut rig = Rig::logged_in();
    let server = server();
    let mut leg = ReplicaLeg::new(Arc::clone(&server));
    leg.read = ReadState::Chosen;
    rig.engine.replica = Some(Box::new(leg));
    let routed = Routed::new(Arc::clone(&server), (read.clone().into(), None), 0, None);
    rig.engine.pipeline.push(Inflight {
        routed: Some(Box::new(routed)),
        ..Inflight::default()
    });
    let now = Instant::now();
    assert!(
        matches!(
            rig.engine.replica_step(None, now),
            Some(ReplicaStep::Fail(_))
        ),
        "pgcache cannot log in there for the client"
    );

    let pool = rig.app.pool.pooled.pool("shop", "alice");
    pool.learn_trusted();
    rig.engine.link = Link::Session(SessionLink {
        checks: Some(pool),
        ..SessionLink::default()
    });
    match rig.engine.replica_step(None, now) {
        Some(ReplicaStep::Connect {
            server: s, pooled, ..
        }) => {
            assert!(Arc::ptr_eq(&s, &server));
            assert!(!pooled, "session mode: the session's own");
        }
        _ => panic!("a connection first"),
    }
    let session = rig.engine.link.state().id;
    rig.engine
        .replica_connected(session + 1, ServerStatements::default(), now);
    match rig.engine.replica_step(Some(&server), now) {
        Some(ReplicaStep::Apply(sql)) => assert_eq!(sql, rig.engine.link.state().apply_sql()),
        _ => panic!("the settings next"),
    }
    rig.engine.replica_settings_applied();
    match rig.engine.replica_step(Some(&server), now) {
        Some(ReplicaStep::Write(bytes)) => assert!(bytes.ends_with(&read)),
        _ => panic!("then the read"),
    }
    assert!(
        rig.engine.replica_step(Some(&server), now).is_none(),
        "once"
    );
}

/// A routed batch as the engine books it: `request` (the batch without
/// the client's Parse) in flight on the replica, which the session needs
/// at `needed` and whose probe said `replayed`, with the client's `parse`
/// kept from it and the answer captured for the cache.
fn routed_batch(
    rig: &mut Rig,
    request: &[u8],
    parse: Option<&[u8]>,
    (needed, replayed): (u64, u64),
) {
    use crate::cache::Fill;
    use crate::session::capture::Capture;
    use crate::session::pipeline::Inflight;
    use crate::session::replica::{ReadState, Routed};
    let server = server();
    let mut leg = ReplicaLeg::new(Arc::clone(&server));
    leg.read = ReadState::Sent;
    leg.replayed = Some(replayed);
    rig.engine.replica = Some(Box::new(leg));
    let mut routed = Routed::new(server, (request.to_vec().into(), None), needed, None);
    routed.parse = parse.map(|p| (bytes::Bytes::new(), p.to_vec().into()));
    rig.engine.pipeline.push(Inflight {
        routed: Some(Box::new(routed)),
        capture: Some(Capture::new(Fill::local_only(7))),
        ..Inflight::default()
    });
}

#[test]
fn a_statement_that_fails_to_prepare_on_the_replica_is_answered_by_the_primary_parse_and_all() {
    use super::{bind, describe_portal, error, execute, parse, rfq, sync};
    use crate::protocol::TxStatus;
    let mut rig = Rig::logged_in();
    let client_parse = parse("", "SELECT nosuch FROM items WHERE k = $1");
    let rest = [bind("", &["1"]), describe_portal(), execute(0), sync()].concat();
    routed_batch(&mut rig, &rest, Some(&client_parse), (0, 10));
    // pgcache's preparation there failed: its Bind finds no statement.
    let seen = rig.backend(&[error("26000"), rfq(TxStatus::Idle)]);
    assert!(
        seen.is_empty(),
        "no ParseComplete, nothing of the replica's"
    );
    assert_eq!(
        rig.sent_to_backend(),
        [client_parse, rest].concat(),
        "the primary answers the client's Parse, its error included"
    );
    assert!(rig.engine.known.unsent_parses.is_empty());
}

#[test]
fn a_replicas_answer_that_stands_follows_the_parse_pgcache_answers_and_owes_the_primary() {
    use super::{bind, bind_complete, complete, description, parse, parse_complete, rfq, row};
    use crate::protocol::TxStatus;
    let mut rig = Rig::logged_in();
    let client_parse = parse("", "SELECT v FROM items WHERE k = $1");
    routed_batch(&mut rig, &bind("", &["1"]), Some(&client_parse), (5, 10));
    let answer = [
        bind_complete(),
        description(),
        row("a"),
        complete("SELECT 1"),
        rfq(TxStatus::Idle),
    ];
    let seen = rig.backend(&answer);
    assert_eq!(seen, [parse_complete(), answer.concat()].concat());
    assert!(rig.sent_to_backend().is_empty());
    assert_eq!(
        rig.engine.known.unsent_parses.len(),
        1,
        "owed to the primary"
    );
    assert_eq!(rig.engine.known.unsent_parses[0].1, client_parse);
}

#[test]
fn a_replica_found_behind_by_its_probe_shows_none_of_its_rows() {
    use super::{bind_complete, complete, description, query, rfq, row};
    use crate::protocol::TxStatus;
    let read = query("SELECT v FROM items");
    let mut rig = Rig::logged_in();
    routed_batch(&mut rig, &read, None, (10, 5));
    let answer = [
        bind_complete(),
        description(),
        row("a"),
        row("b"),
        complete("SELECT 2"),
        rfq(TxStatus::Idle),
    ];
    let seen = rig.backend(&answer);
    assert!(seen.is_empty(), "the rows of a replica behind: {seen:?}");
    assert_eq!(rig.sent_to_backend(), read, "the read goes to the primary");
}
