//! The answer to pgcache's own query, read frame by frame.

use bytes::BytesMut;

use super::{Rig, complete, description, error, frame, rfq, row};
use crate::protocol::{TxStatus, backend as be};
use crate::session::engine::{HiddenAnswer, HiddenStep};

fn feed(rig: &mut Rig, answer: &mut HiddenAnswer, frame: &[u8]) -> HiddenStep {
    rig.engine.on_hidden_frame(answer, BytesMut::from(frame))
}

fn status(name: &str, value: &str) -> Vec<u8> {
    frame(
        be::PARAMETER_STATUS,
        format!("{name}\0{value}\0").as_bytes(),
    )
}

#[test]
fn the_rows_come_back_at_ready_for_query_and_the_clients_frames_go_on() {
    let mut rig = Rig::logged_in();
    let mut answer = HiddenAnswer::default();
    for f in [description(), row("on"), row("off")] {
        assert!(matches!(feed(&mut rig, &mut answer, &f), HiddenStep::More));
    }
    // A parameter change meanwhile is the client's (logged in).
    let change = status("TimeZone", "UTC");
    match feed(&mut rig, &mut answer, &change) {
        HiddenStep::ToClient(f) => assert_eq!(&f[..], &change[..]),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        feed(&mut rig, &mut answer, &complete("SELECT 2")),
        HiddenStep::More
    ));
    match feed(&mut rig, &mut answer, &rfq(TxStatus::Idle)) {
        HiddenStep::Done(Ok(rows)) => assert_eq!(
            rows,
            vec![vec![Some("on".to_owned())], vec![Some("off".to_owned())]]
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_error_is_the_answer_and_the_transaction_status_is_taken() {
    let mut rig = Rig::logged_in();
    let mut answer = HiddenAnswer::default();
    let refused = error("42501");
    assert!(matches!(
        feed(&mut rig, &mut answer, &refused),
        HiddenStep::More
    ));
    match feed(&mut rig, &mut answer, &rfq(TxStatus::Failed)) {
        HiddenStep::Done(Err(Some(f))) => assert_eq!(&f[..], &refused[..]),
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.engine.tx_status(), TxStatus::Failed);
    assert!(!rig.engine.close_expected(), "an ERROR, not a FATAL");
}

#[test]
fn before_the_login_is_over_a_parameter_change_is_not_the_clients() {
    let mut rig = Rig::new();
    let mut answer = HiddenAnswer::default();
    assert!(matches!(
        feed(&mut rig, &mut answer, &status("TimeZone", "UTC")),
        HiddenStep::More
    ));
}
