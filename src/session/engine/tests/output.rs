//! The engine's one output surface ([`Engine::poll_io`]) and its intake of
//! the client's buffered bytes ([`Engine::on_client_data`]): what the
//! driver is asked to do, and in which order.

use super::*;
use crate::pool::PoolError;
use crate::session::SessionError;
use crate::session::engine::{Held, Io, Leg, Relayed, Taken, Upto};

const READ: &str = "SELECT v FROM items WHERE k = 1";

const HELD: Held = Held {
    attached: true,
    unread: false,
};

const DETACHED: Held = Held {
    attached: false,
    unread: false,
};

/// What the driver would do, polled up to `upto` until the engine asks
/// nothing, each step done as the driver does it (bytes written, actions
/// carried out): the steps' names, in order.
fn drive(rig: &mut Rig, held: Held, upto: Upto) -> Vec<&'static str> {
    let mut steps = Vec::new();
    loop {
        let step = match rig.engine.poll_io(&rig.app, held, upto) {
            Io::Idle => return steps,
            Io::ToServer(_) => "server",
            Io::Act(_) => "action",
            Io::Relay(..) => "relay",
            Io::ToClient => {
                rig.engine.client_sent();
                "client"
            }
            Io::Staged => {
                rig.engine.staged(&rig.app).0.clear();
                "staged"
            }
            Io::CheckOut { queued: true } => "checkout for the client",
            Io::CheckOut { queued: false } => "checkout for pgcache",
            Io::Own(Some(_)) => "own query",
            Io::Own(None) => "own answer awaited",
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
        if step == "own answer awaited" {
            return steps;
        }
    }
}

#[test]
fn the_driver_is_asked_in_the_engines_order_and_each_stage_stops_where_it_should() {
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
    assert!(
        drive(&mut rig, HELD, Upto::Link).is_empty(),
        "nothing to do"
    );

    let mut rig = fill();
    assert_eq!(
        drive(&mut rig, HELD, Upto::Link),
        ["server", "action", "relay", "client", "staged"]
    );
    // A server's answer read: what the server is owed and the actions go
    // before the client is sent the answer, and nothing else yet.
    let mut rig = fill();
    assert_eq!(
        drive(&mut rig, HELD, Upto::Relayed),
        ["server", "action", "relay"]
    );
    assert_eq!(
        drive(&mut rig, HELD, Upto::Decided),
        ["client"],
        "a frame decided: its bytes for the client, not yet the server's"
    );
    assert_eq!(drive(&mut rig, HELD, Upto::Staged), ["staged"]);
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
    assert_eq!(
        drive(&mut rig, HELD, Upto::Decided),
        ["own query", "own answer awaited"]
    );

    let mut rig = Rig::pooled();
    rig.knows_table("items");
    let now = ctx(&rig.app, &rig.entry);
    let asked = rig.engine.on_client_frame(&now, &Bytes::from(query(READ)));
    assert!(matches!(asked, Err(Need::Own)));
    assert_eq!(
        rig.engine.poll_io(&rig.app, DETACHED, Upto::Decided).name(),
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
    assert!(drive(&mut rig, DETACHED, Upto::Decided).is_empty());
}

#[test]
fn a_pooled_session_takes_a_connection_for_its_requests_and_lets_it_go_once_idle() {
    let mut rig = Rig::pooled();
    rig.knows_table("items");
    rig.client(&query("UPDATE items SET v = 1"));
    assert_eq!(
        rig.engine.poll_io(&rig.app, DETACHED, Upto::Link).name(),
        "checkout for the client"
    );
    assert_eq!(drive(&mut rig, HELD, Upto::Link), ["staged"], "busy: kept");
    rig.backend(&[complete("UPDATE 1"), rfq(TxStatus::Idle)]);
    rig.engine.actions.clear();
    let unread = Held {
        attached: true,
        unread: true,
    };
    assert!(
        drive(&mut rig, unread, Upto::Link).is_empty(),
        "unread: kept"
    );
    assert!(drive(&mut rig, HELD, Upto::Staged).is_empty(), "not yet");
    assert_eq!(drive(&mut rig, HELD, Upto::Link), ["part"]);
}

#[test]
fn the_clients_bytes_are_taken_whole_settled_after_what_a_frame_left_and_a_waiting_frame_kept() {
    let mut rig = Rig::caching();
    let mut buf = BytesMut::from(&[query(READ), query(READ)].concat()[..]);
    let now = ctx(&rig.app, &rig.entry);
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(Taken::Need(Need::Own))));
    assert_eq!(buf.len(), query(READ).len(), "the first frame waits, kept");
    let answer = rig.settings.clone().map(|row| vec![row]);
    crate::session::fuzz::answer_own(&mut rig.engine, &now, answer.as_deref());
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(Taken::Done(Flow::Continue))));
    assert!(buf.is_empty());
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
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(Taken::Settle)));
    assert_eq!(buf.len(), query(READ).len(), "one frame at a time");
    assert!(!rig.engine.out.is_empty(), "the hit is staged");

    // A frame over the limit is the client's error.
    let mut buf = BytesMut::from(&query(READ)[..]);
    let taken = rig.engine.on_client_data(&now, &mut buf, 8);
    assert!(matches!(taken, Err(SessionError::ClientFrame(_))));
}

#[test]
fn with_caching_off_the_clients_bytes_are_relayed_untouched() {
    let mut rig = Rig::logged_in();
    rig.engine.caching = false;
    let bytes = [query("SELECT 1"), parse("s", "SELECT 2"), sync()].concat();
    let mut buf = BytesMut::from(&bytes[..]);
    buf.extend_from_slice(&query("SELECT 3")[..3]);
    let now = ctx(&rig.app, &rig.entry);
    let taken = rig.engine.on_client_data(&now, &mut buf, 1 << 20);
    assert!(matches!(taken, Ok(Taken::Done(Flow::Continue))));
    assert_eq!(rig.sent_to_backend(), bytes);
    assert_eq!(buf.len(), 3, "a partial frame waits for the rest");
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
