//! The extended protocol's batches: held until Sync or found whole in the
//! read buffer, their one query decided the same way either way.

use super::client::answer;
use super::*;
use crate::classify::BypassReason;

/// `Parse Bind Describe Execute Sync` of a read by key, with a parameter.
fn batch(max_rows: i32) -> Vec<Vec<u8>> {
    vec![
        parse("", "SELECT v FROM items WHERE k = $1"),
        bind("", &["1"]),
        describe_portal(),
        execute(max_rows),
        sync(),
    ]
}

fn batch_answer() -> Vec<u8> {
    [parse_complete(), bind_complete(), answer()].concat()
}

#[test]
fn an_extended_batch_is_held_until_sync_then_answered_whole_from_the_cache() {
    let mut rig = Rig::caching();
    let frames = batch(0);
    rig.frames(&frames[..4]);
    assert!(rig.sent_to_backend().is_empty(), "held until Sync");
    rig.client(&frames[4]);
    assert_eq!(rig.sent_to_backend(), frames.concat());
    rig.backend(&[batch_answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 1);
    rig.frames(&frames);
    assert!(rig.sent_to_backend().is_empty());
    assert_eq!(
        rig.sent_to_client(),
        [batch_answer(), rfq(TxStatus::Idle)].concat()
    );
    // The backend never saw that Parse: it goes before the next request.
    rig.client(&query("SELECT 2"));
    let sent = rig.sent_to_backend();
    assert!(sent.starts_with(&[frames[0].clone(), sync()].concat()));
    assert!(sent.ends_with(&query("SELECT 2")));
}

/// A session that defined a statement (Parse, Sync, answered); the
/// frames of its batch, the Parse first.
fn statement_defined() -> (Rig, Vec<Vec<u8>>) {
    let mut rig = Rig::caching();
    let frames = batch(0);
    rig.frames(&[frames[0].clone(), sync()]);
    rig.sent_to_backend();
    rig.backend(&[parse_complete(), rfq(TxStatus::Idle)]);
    (rig, frames)
}

#[test]
fn a_whole_batch_in_the_read_buffer_gets_the_answer_the_frames_get() {
    let (mut rig, frames) = statement_defined();
    // A run of the statement: Bind Describe Execute Sync, in one read.
    rig.frames(&frames[1..]);
    assert_eq!(rig.sent_to_backend(), frames[1..].concat());
    rig.backend(&[bind_complete(), answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 1);
    let run = frames[1..].concat();
    let ctx = ctx(&rig.app, &rig.entry);
    let ready = rig
        .engine
        .whole_batch(&ctx, &run, 1 << 20)
        .expect("a batch decided at once");
    assert_eq!(ready.len, run.len());
    if rig.engine.on_whole_batch(&ctx, &ready, &run).is_err() {
        panic!("nothing to wait for");
    }
    let whole = rig.sent_to_client();
    rig.frames(&frames[1..]);
    assert_eq!(whole, rig.sent_to_client());
    assert_eq!(
        whole,
        [bind_complete(), answer(), rfq(TxStatus::Idle)].concat()
    );
}

#[test]
fn a_whole_batch_that_needs_the_settings_leaves_them_to_the_frames_which_ask_once() {
    let (mut rig, frames) = statement_defined();
    let before = rig.settings_reads;
    let run = frames[1..].concat();
    let ctx = ctx(&rig.app, &rig.entry);
    assert!(rig.engine.whole_batch(&ctx, &run, 1 << 20).is_none());
    assert!(!rig.engine.own_pending(), "the query it asked is withdrawn");
    rig.frames(&frames[1..]);
    assert_eq!(rig.settings_reads, before + 1, "asked once, by the frames");
    assert_eq!(rig.sent_to_backend(), run);
}

#[test]
fn a_row_limited_execute_goes_out_with_one_row_more_and_is_cut_when_served() {
    let mut rig = Rig::caching();
    let frames = batch(1);
    rig.frames(&frames);
    let sent = rig.sent_to_backend();
    let mut asked = frames.clone();
    asked[3] = execute(2);
    assert_eq!(sent, asked.concat());
    // Two rows would not fit: the portal is suspended, nothing stored.
    rig.backend(&[
        parse_complete(),
        bind_complete(),
        description(),
        row("a"),
        row("b"),
        frame(b's', &[]),
        rfq(TxStatus::Idle),
    ]);
    assert_eq!(rig.store(), 0);
    // One row fits: stored whole, served cut to the client's limit.
    let mut rig = Rig::caching();
    rig.frames(&batch(5));
    rig.sent_to_backend();
    rig.backend(&[batch_answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 1);
    rig.frames(&batch(1));
    let served = rig.sent_to_client();
    assert!(served.ends_with(&[row("a"), frame(b's', &[]), rfq(TxStatus::Idle)].concat()));
}

#[test]
fn a_time_literal_parameter_is_never_served() {
    let mut rig = Rig::caching();
    let mut frames = batch(0);
    frames[1] = bind("", &["now"]);
    for _ in 0..2 {
        rig.frames(&frames);
        assert_eq!(rig.sent_to_backend(), frames.concat());
        rig.backend(&[batch_answer(), rfq(TxStatus::Idle)]);
        assert_eq!(rig.store(), 0);
    }
}

#[test]
fn an_error_in_the_middle_of_a_batch_stores_nothing_and_ends_at_sync() {
    let mut rig = Rig::caching();
    rig.frames(&batch(0));
    rig.sent_to_backend();
    let sent = rig.backend(&[parse_complete(), error("22P02"), rfq(TxStatus::Idle)]);
    assert!(sent.ends_with(&rfq(TxStatus::Idle)));
    assert_eq!(rig.store(), 0);
    assert!(rig.engine.pipeline.is_quiet());
}

#[test]
fn a_refusal_is_decided_alike_held_or_whole_and_counted_once() {
    let (mut rig, frames) = statement_defined();
    rig.client(&query("CREATE TEMP TABLE scratch (a int)"));
    rig.sent_to_backend();
    rig.backend(&[complete("CREATE TABLE"), rfq(TxStatus::Idle)]);
    let counted = |rig: &Rig| rig.app.metrics.bypasses(BypassReason::TempObjects);
    let before = counted(&rig);
    let run = frames[1..].concat();
    let ctx = ctx(&rig.app, &rig.entry);
    assert!(
        rig.engine.whole_batch(&ctx, &run, 1 << 20).is_none(),
        "a session with temporary objects is not served"
    );
    assert_eq!(
        counted(&rig),
        before,
        "the whole way leaves the count to the frames"
    );
    rig.frames(&frames[1..]);
    assert_eq!(rig.sent_to_backend(), run, "forwarded whole at Sync");
    assert_eq!(counted(&rig), before + 1);
}

#[test]
fn a_whole_batch_with_a_row_limit_is_left_to_the_frames() {
    let (mut rig, frames) = statement_defined();
    // Run once frame by frame: the settings are known, the answer stored.
    rig.frames(&frames[1..]);
    rig.sent_to_backend();
    rig.backend(&[bind_complete(), answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 1);
    let mut limited = frames.clone();
    limited[3] = execute(1);
    let ctx = ctx(&rig.app, &rig.entry);
    let whole = |frames: &[Vec<u8>]| frames[1..].concat();
    assert!(
        rig.engine
            .whole_batch(&ctx, &whole(&limited), 1 << 20)
            .is_none(),
        "its Execute is rewritten at Sync"
    );
    assert!(
        rig.engine
            .whole_batch(&ctx, &whole(&frames), 1 << 20)
            .is_some()
    );
}
