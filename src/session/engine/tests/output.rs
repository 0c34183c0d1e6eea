//! The engine's one output surface ([`Engine::poll_io`]) and its intake of
//! the client's buffered bytes ([`Engine::on_client_data`]): what the
//! driver is asked to do, and in which order.

use super::*;
use crate::pool::PoolError;
use crate::session::SessionError;
use crate::session::engine::{Held, Io, Leg, Relayed};

const READ: &str = "SELECT v FROM items WHERE k = 1";

const HELD: Held = Held {
    attached: true,
    unread: false,
    client: false,
};

const DETACHED: Held = Held {
    attached: false,
    unread: false,
    client: false,
};

/// What the driver would do, polled until the engine asks nothing (or
/// for the client's bytes, or an own query's answer), each step done as
/// the driver does it (bytes written, actions carried out): the steps'
/// names, in order.
fn drive(rig: &mut Rig, held: Held) -> Vec<&'static str> {
    let mut steps = Vec::new();
    loop {
        let step = match rig.engine.poll_io(&*rig.app, held) {
            Io::Idle => return steps,
            Io::TakeClient => "take the client's bytes",
            Io::ReplicaDone(_) => "replica done",
            Io::ToServer(_) => "server",
            Io::Act(_) => "action",
            Io::Relay(..) => "relay",
            Io::ToClient => {
                rig.engine.client_sent();
                "client"
            }
            Io::Staged => {
                rig.engine.staged(&*rig.app).0.clear();
                "staged"
            }
            Io::CheckOut { queued: true } => "checkout for the client",
            Io::CheckOut { queued: false } => "checkout for pgcache",
            Io::Own => "own answer awaited",
            Io::Drop(_) => "drop",
            Io::Replica => "replica",
            Io::Part(_) => {
                // The driver holds no connection from here.
                rig.engine.detach_server();
                steps.push("part");
                return steps;
            }
        };
        steps.push(step);
        assert!(
            steps.len() < 16,
            "the engine asks again and again: {steps:?}"
        );
        if step == "own answer awaited" || step == "take the client's bytes" {
            return steps;
        }
    }
}

#[test]
fn the_driver_is_asked_in_the_engines_order_and_the_clients_bytes_are_taken_before_the_servers_go_out()
 {
    let mut rig = Rig::logged_in();
    let fill = || {
        let mut rig = Rig::logged_in();
        rig.engine.to_server.extend_from_slice(&query("SELECT 1"));
        rig.engine.actions.push(Action::Watch);
        rig.engine.relaying = Some((Leg::Primary, Relayed { end: 6, from: 0 }));
        rig.engine.out.extend_from_slice(&rfq(TxStatus::Idle));
        rig.engine
            .pipeline
            .to_backend
            .extend_from_slice(&query(READ));
        rig
    };
    assert!(drive(&mut rig, HELD).is_empty(), "nothing to do");

    let mut rig = fill();
    assert_eq!(
        drive(&mut rig, HELD),
        ["server", "action", "relay", "client", "staged"]
    );
    // Bytes came from the client: they are taken before what is staged
    // for the server goes out, and only while some are buffered.
    let mut rig = fill();
    rig.engine.client_arrived();
    let buffered = Held {
        client: true,
        ..HELD
    };
    assert_eq!(
        drive(&mut rig, buffered),
        [
            "server",
            "action",
            "relay",
            "client",
            "take the client's bytes"
        ]
    );
    assert_eq!(drive(&mut rig, HELD), ["staged"], "none buffered");
}

#[test]
fn a_client_that_ended_has_what_came_before_written_and_its_connection_kept_until_the_end() {
    let mut rig = Rig::pooled();
    rig.knows_table("items");
    rig.client(&query("UPDATE items SET v = 1"));
    assert_eq!(drive(&mut rig, HELD), ["staged"]);
    rig.backend(&[complete("UPDATE 1"), rfq(TxStatus::Idle)]);
    rig.engine.actions.clear();
    let mut buf = BytesMut::from(&b"X\0\0\0\x04"[..]);
    rig.engine.client_arrived();
    let now = ctx(&rig.app, &rig.entry);
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(None)));
    assert_eq!(rig.engine.flow(), Flow::Close);
    assert!(
        drive(&mut rig, HELD).is_empty(),
        "given back at the session's end, not now"
    );
}

#[test]
fn own_queries_go_first_on_the_held_connection_and_a_pooled_session_takes_one_for_them() {
    let mut rig = Rig::caching();
    let now = ctx(&rig.app, &rig.entry);
    let asked = rig.engine.on_client_frame(&now, &Bytes::from(query(READ)));
    assert!(
        matches!(asked, Err(Need::Own)),
        "the settings are asked first"
    );
    assert_eq!(drive(&mut rig, HELD), ["server", "own answer awaited"]);

    let mut rig = Rig::pooled();
    rig.knows_table("items");
    let now = ctx(&rig.app, &rig.entry);
    let asked = rig.engine.on_client_frame(&now, &Bytes::from(query(READ)));
    assert!(matches!(asked, Err(Need::Own)));
    assert_eq!(
        rig.engine.poll_io(&*rig.app, DETACHED).name(),
        "checkout for pgcache"
    );
    // No connection came: the own query goes unanswered, the statement
    // fails with the pool's error, and nothing more is asked of the
    // driver for it.
    let now = ctx(&rig.app, &rig.entry);
    let e = SessionError::Pool(PoolError::WaitTimeout(5));
    rig.engine
        .checkout_failed(&now, e)
        .expect("the session goes on");
    assert!(!rig.engine.own_pending());
    assert!(drive(&mut rig, DETACHED).is_empty());
}

#[test]
fn a_pooled_session_takes_a_connection_for_its_requests_and_lets_it_go_once_idle() {
    let mut rig = Rig::pooled();
    rig.knows_table("items");
    rig.client(&query("UPDATE items SET v = 1"));
    assert_eq!(
        rig.engine.poll_io(&*rig.app, DETACHED).name(),
        "checkout for the client"
    );
    assert_eq!(drive(&mut rig, HELD), ["staged"], "busy: kept");
    rig.backend(&[complete("UPDATE 1"), rfq(TxStatus::Idle)]);
    rig.engine.actions.clear();
    let unread = Held {
        unread: true,
        ..HELD
    };
    assert!(drive(&mut rig, unread).is_empty(), "unread: kept");
    assert_eq!(drive(&mut rig, HELD), ["part"]);
}

#[test]
fn the_clients_bytes_are_taken_whole_settled_after_what_a_frame_left_and_a_waiting_frame_kept() {
    let mut rig = Rig::caching();
    let mut buf = BytesMut::from(&[query(READ), query(READ)].concat()[..]);
    let now = ctx(&rig.app, &rig.entry);
    rig.engine.client_arrived();
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(Some(Need::Own))));
    assert_eq!(buf.len(), query(READ).len(), "the first frame waits, kept");
    let answer = rig.settings.clone().map(|row| vec![row]);
    crate::session::fuzz::answer_own(&mut rig.engine, &now, answer.as_deref());
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(None)));
    assert!(buf.is_empty());
    assert!(!rig.engine.takes_client(false), "every frame is taken");
    assert_eq!(
        rig.sent_to_backend(),
        [query(READ), query(READ)].concat(),
        "two misses, forwarded in one run"
    );

    // Stored, the same read is served: the driver settles after it.
    rig.backend(&[
        description(),
        row("a"),
        complete("SELECT 1"),
        rfq(TxStatus::Idle),
        description(),
        row("a"),
        complete("SELECT 1"),
        rfq(TxStatus::Idle),
    ]);
    rig.store();
    rig.sent_to_client();
    let mut buf = BytesMut::from(&[query(READ), query(READ)].concat()[..]);
    let now = ctx(&rig.app, &rig.entry);
    rig.engine.client_arrived();
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(None)));
    assert_eq!(buf.len(), query(READ).len(), "one frame at a time");
    assert!(!rig.engine.out.is_empty(), "the hit is staged");
    assert!(rig.engine.takes_client(true), "the rest is taken next");

    // A frame over the limit is the client's error.
    let mut buf = BytesMut::from(&query(READ)[..]);
    let taken = rig.engine.on_client_data(&now, &mut buf, 8);
    assert!(matches!(taken, Err(SessionError::ClientFrame(_))));
    assert_eq!(rig.engine.flow(), Flow::Close, "nothing more is taken");
}

#[test]
fn with_caching_off_the_clients_bytes_are_relayed_untouched() {
    let mut rig = Rig::logged_in();
    rig.engine.caching = false;
    let bytes = [query("SELECT 1"), parse("s", "SELECT 2"), sync()].concat();
    let mut buf = BytesMut::from(&bytes[..]);
    buf.extend_from_slice(&query("SELECT 3")[..3]);
    let now = ctx(&rig.app, &rig.entry);
    rig.engine.client_arrived();
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(None)));
    assert_eq!(rig.sent_to_backend(), bytes);
    assert_eq!(buf.len(), 3, "a partial frame waits for the rest");
    assert!(!rig.engine.takes_client(true), "and is not taken again");
}

impl Io {
    fn name(&self) -> &'static str {
        match self {
            Io::CheckOut { queued: true } => "checkout for the client",
            Io::CheckOut { queued: false } => "checkout for pgcache",
            Io::Idle => "idle",
            _ => "other",
        }
    }
}

#[test]
fn a_replicas_answered_read_lets_its_connection_go_before_the_clients_next_frames_are_taken() {
    use crate::session::replica::{ReadState, ReplicaLeg};
    let mut rig = Rig::pooled();
    let mut leg = ReplicaLeg::new(super::replica_books::server());
    leg.read = ReadState::Sent;
    rig.engine.replica = Some(Box::new(leg));
    rig.engine.client_arrived();
    let waiting = Held {
        client: true,
        ..DETACHED
    };
    assert!(
        drive(&mut rig, waiting).is_empty(),
        "the read is under way: the client's frames wait"
    );
    if let Some(leg) = &mut rig.engine.replica {
        leg.read = ReadState::Answered;
    }
    match rig.engine.poll_io(&*rig.app, waiting) {
        Io::ReplicaDone(Some(_)) => {}
        _ => panic!("transaction mode: the connection goes back with its books"),
    }
    assert_eq!(
        drive(&mut rig, waiting),
        ["take the client's bytes"],
        "let go of once"
    );
}
