//! The backend's side: what the client is sent, what is stored.

use bytes::{BufMut, BytesMut};

use super::*;

#[test]
fn logging_in_watches_the_database_once() {
    let mut rig = Rig::new();
    rig.backend(&[rfq(TxStatus::Idle)]);
    assert!(rig.engine.logged_in());
    assert!(matches!(rig.engine.actions.as_slice(), [Action::Watch]));
    rig.engine.actions.clear();
    rig.backend(&[rfq(TxStatus::Idle)]);
    assert!(rig.engine.actions.is_empty());
}

#[test]
fn a_complete_answer_is_stored_at_its_ready_for_query_and_relayed_as_it_is() {
    let mut rig = Rig::logged_in();
    rig.miss(7);
    let answer = [description(), row("a"), row("b"), complete("SELECT 2")];
    let sent = rig.backend(&answer);
    assert_eq!(sent, answer.concat());
    assert!(rig.stored().is_empty(), "nothing before ReadyForQuery");
    let sent = rig.backend(&[rfq(TxStatus::Idle)]);
    assert_eq!(sent, rfq(TxStatus::Idle));
    assert_eq!(rig.stored(), vec![(7, answer.concat())]);
    assert!(rig.engine.pipeline.is_quiet());
}

#[test]
fn a_failed_answer_is_not_stored() {
    let mut rig = Rig::logged_in();
    rig.miss(7);
    let sent = rig.backend(&[description(), row("a"), error("57014"), rfq(TxStatus::Idle)]);
    assert!(sent.ends_with(&rfq(TxStatus::Idle)));
    assert!(rig.stored().is_empty());
}

#[test]
fn an_answer_with_a_notice_is_relayed_but_not_stored() {
    let mut rig = Rig::logged_in();
    rig.miss(7);
    let mut notice = BytesMut::new();
    messages::notice_response(&mut notice, "NOTICE", "00000", "hello");
    let answer = [description(), notice.to_vec(), complete("SELECT 0")];
    let sent = rig.backend(&[answer.concat(), rfq(TxStatus::Idle)]);
    assert_eq!(sent, [answer.concat(), rfq(TxStatus::Idle)].concat());
    assert!(rig.stored().is_empty());
}

#[test]
fn a_row_limited_answer_is_cut_for_the_client_and_stored_whole() {
    let mut rig = Rig::logged_in();
    // Execute(1) went out as Execute(2), and the portal completed.
    rig.engine.pipeline.push(Inflight {
        capture: Some(Capture::new(Fill::local_only(9))),
        row_cut: Some(RowCut::new(1)),
        ..Inflight::default()
    });
    let answer = [row("a"), complete("SELECT 1")];
    let sent = rig.backend(&[answer.concat(), rfq(TxStatus::Idle)]);
    assert_eq!(
        sent,
        [row("a"), PORTAL_SUSPENDED.to_vec(), rfq(TxStatus::Idle)].concat()
    );
    assert_eq!(rig.stored(), vec![(9, answer.concat())]);
}

#[test]
fn a_suspended_portal_is_not_stored() {
    let mut rig = Rig::logged_in();
    rig.miss(7);
    let sent = rig.backend(&[row("a"), PORTAL_SUSPENDED.to_vec(), rfq(TxStatus::Idle)]);
    assert!(sent.starts_with(&row("a")));
    assert!(rig.stored().is_empty());
}

#[test]
fn the_answers_to_pgcaches_own_requests_reach_nobody() {
    let mut rig = Rig::logged_in();
    rig.engine.pipeline.push_hidden(Inflight::hidden(None));
    rig.engine.pipeline.push(Inflight::default());
    let status = frame(be::PARAMETER_STATUS, b"TimeZone\0UTC\0");
    let sent = rig.backend(&[
        description(),
        row("secret"),
        status.clone(),
        complete("SELECT 1"),
        rfq(TxStatus::Idle),
        complete("SET"),
        rfq(TxStatus::Idle),
    ]);
    // A setting the server reports is the client's to know.
    assert_eq!(
        sent,
        [status, complete("SET"), rfq(TxStatus::Idle)].concat()
    );
}

#[test]
fn a_fill_inside_a_transaction_waits_for_the_commit_and_a_rollback_drops_it() {
    for (end, kept) in [("COMMIT", true), ("ROLLBACK", false)] {
        let mut rig = Rig::logged_in();
        rig.engine.tx.begin(crate::classify::Begin::AtDefault);
        rig.engine.pipeline.push(Inflight::default());
        rig.backend(&[complete("BEGIN"), rfq(TxStatus::InTransaction)]);
        rig.miss(7);
        rig.backend(&[row("a"), complete("SELECT 1"), rfq(TxStatus::InTransaction)]);
        assert!(rig.stored().is_empty(), "{end}: stored before the end");
        rig.engine.pipeline.push(Inflight::default());
        rig.backend(&[complete(end), rfq(TxStatus::Idle)]);
        assert_eq!(!rig.stored().is_empty(), kept, "{end}");
    }
}

#[test]
fn a_fatal_error_is_noted_so_the_close_that_follows_is_expected() {
    let mut rig = Rig::logged_in();
    rig.engine.pipeline.push(Inflight::default());
    let mut fatal = BytesMut::new();
    messages::error_response(&mut fatal, "FATAL", "57P01", "terminating");
    assert!(!rig.engine.backend_fatal());
    rig.backend(&[fatal.to_vec()]);
    assert!(rig.engine.backend_fatal());
}

#[test]
fn the_backends_cancel_key_is_replaced_by_one_of_pgcaches() {
    let mut rig = Rig::new();
    let key = key_data(4242);
    let sent = rig.backend(&[key.clone(), rfq(TxStatus::Idle)]);
    assert_eq!(sent.len(), key.len() + 6);
    assert_ne!(
        &sent[..key.len()],
        &key[..],
        "the backend's secret never reaches the client"
    );
    let target = rig
        .engine
        .backend_key
        .as_ref()
        .expect("the backend's key is kept");
    assert_eq!(target.backend_pid, 4242);
    assert!(rig.engine.cancel.is_some(), "pgcache's key is registered");
    let pid = u32::from_be_bytes(sent[5..9].try_into().unwrap());
    let found = rig.app.cancel.lookup(pid, &sent[9..key.len()]);
    assert_eq!(found.map(|t| t.backend_pid), Some(4242));
}

#[test]
fn a_partial_frame_waits_for_the_rest() {
    let mut rig = Rig::logged_in();
    rig.miss(7);
    let whole = [row("a"), complete("SELECT 1"), rfq(TxStatus::Idle)].concat();
    let cut = whole.len() - 3;
    let mut buf = BytesMut::from(&whole[..cut]);
    let ctx = ctx(&rig.app, &rig.entry);
    let relayed = rig.engine.on_backend(&ctx, &mut buf).expect("frames");
    assert_eq!(
        relayed.end,
        whole.len() - 6,
        "the ReadyForQuery is incomplete"
    );
    assert!(rig.stored().is_empty());
}

#[test]
fn parameter_statuses_are_kept_only_where_a_connection_is_handed_back() {
    let status = frame(be::PARAMETER_STATUS, b"DateStyle\0ISO, DMY\0");
    for (mut rig, kept) in [(Rig::caching(), true), (Rig::pooled(), false)] {
        rig.client(&query("SET datestyle = 'dmy'"));
        rig.backend(&[status.clone(), complete("SET"), rfq(TxStatus::Idle)]);
        assert_eq!(rig.engine.server.statuses.has("DateStyle"), kept);
    }
}

#[test]
fn answers_given_in_the_servers_place_go_after_its_complete_frames() {
    let mut rig = Rig::pooled();
    let whole = complete("SELECT 1");
    let partial = &rfq(TxStatus::Idle)[..3];
    let mut buf = BytesMut::from(&[&whole[..], partial].concat()[..]);
    let answers = [parse_complete(), bind_complete()].concat();
    rig.engine.splice(&mut buf, &answers);
    assert_eq!(&buf[..], &[&whole[..], &answers[..], partial].concat()[..]);
    match &rig.engine.link {
        Link::Pooled(link) => assert_eq!(link.spliced, whole.len()..whole.len() + answers.len()),
        Link::Session(_) => panic!("transaction mode"),
    }
}

#[test]
fn a_connection_is_parked_only_handed_back_clean_and_trusted_or_checked() {
    let parked = |trusted: bool, checked_by_pgcache: bool, unread: bool| {
        let mut rig = Rig::new();
        rig.engine.server = crate::session::reuse::ServerBook::new(true);
        rig.backend(&[key_data(4242), rfq(TxStatus::Idle)]);
        rig.engine.server.trust = match trusted {
            true => crate::session::reuse::Trust::Trusted,
            false => crate::session::reuse::Trust::Challenged,
        };
        assert_eq!(rig.client(&frame(fe::TERMINATE, &[])), Flow::Close);
        let key = crate::pool::PoolKey::of(&rig.engine.startup).expect("poolable");
        rig.engine.link = Link::Session(crate::session::link::SessionLink {
            parks_under: Some(key),
            checked_by_pgcache,
            ..Default::default()
        });
        let parting = rig.engine.part_at_end(&*rig.app, unread);
        matches!(parting, Some(crate::session::engine::Parting::Park(_)))
    };
    assert!(parked(true, false, false), "PostgreSQL asked no password");
    assert!(
        parked(false, true, false),
        "pgcache checks its clients itself"
    );
    assert!(
        !parked(false, false, false),
        "a password was asked, checked by no one"
    );
    assert!(
        !parked(true, false, true),
        "the server sent more than was read"
    );
}

#[test]
fn a_client_that_leaves_mid_request_has_its_backend_cancelled() {
    let mut rig = Rig::new();
    rig.backend(&[key_data(4242), rfq(TxStatus::Idle)]);
    assert!(
        rig.engine.cancel_on_leaving().is_none(),
        "nothing in flight"
    );
    rig.client(&query("SELECT pg_sleep(60)"));
    let target = rig.engine.cancel_on_leaving().expect("a query in flight");
    assert_eq!(target.backend_pid, 4242);
}

/// The backend's BackendKeyData: its process id `pid` and a secret.
fn key_data(pid: u32) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_u32(pid);
    body.put_u32(0xdead_beef);
    frame(be::BACKEND_KEY_DATA, &body)
}

#[test]
fn the_client_gets_untouched_bytes_from_the_servers_buffer_and_rewritten_ones_from_the_engine() {
    let mut rig = Rig::new();
    let ctx = ctx(&rig.app, &rig.entry);
    let mut buf = BytesMut::from(&[auth_ok(), status("a", "b")].concat()[..]);
    let relayed = rig.engine.on_backend(&ctx, &mut buf).expect("frames");
    assert_eq!(relayed.from, 0, "nothing rewritten");
    let sent = rig.engine.for_client(&buf, &relayed);
    assert_eq!(sent.as_ptr(), buf.as_ptr(), "no copy");

    let mut buf = BytesMut::from(&[key_data(7), rfq(TxStatus::Idle)].concat()[..]);
    let relayed = rig.engine.on_backend(&ctx, &mut buf).expect("frames");
    let sent = rig.engine.for_client(&buf, &relayed).to_vec();
    assert!(sent.ends_with(&rfq(TxStatus::Idle)));
    assert_eq!(
        sent.len(),
        buf.len(),
        "a key of pgcache's, in the backend's place"
    );
    assert_ne!(sent[..key_data(7).len()], key_data(7)[..]);
    rig.engine.client_sent();
    assert!(rig.engine.out().is_empty());
}

fn auth_ok() -> Vec<u8> {
    frame(be::AUTHENTICATION, &0i32.to_be_bytes())
}

fn status(name: &str, value: &str) -> Vec<u8> {
    frame(
        be::PARAMETER_STATUS,
        format!("{name}\0{value}\0").as_bytes(),
    )
}
