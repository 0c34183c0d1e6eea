//! pgcache's own queries: their answers read frame by frame, and taken
//! as their purposes say.

use bytes::{Bytes, BytesMut};

use super::{Rig, complete, description, error, frame, query, rfq, row};
use crate::protocol::answer::Answer;
use crate::protocol::{TxStatus, backend as be, messages};
use crate::session::engine::hidden::HiddenStep;
use crate::session::engine::{Need, OwnStep, Verdict};
use crate::session::link::{ClientState, Link};

fn feed(rig: &mut Rig, answer: &mut Answer, frame: &[u8]) -> HiddenStep {
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
    let mut answer = Answer::default();
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
    let mut answer = Answer::default();
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
    let mut answer = Answer::default();
    assert!(matches!(
        feed(&mut rig, &mut answer, &status("TimeZone", "UTC")),
        HiddenStep::More
    ));
}

/// The text of an own query's request (a simple Query, or Parse..Sync).
fn request_text(rig: &mut Rig) -> String {
    let request = rig.engine.own_request().expect("an own query to send");
    String::from_utf8_lossy(&request).into_owned()
}

/// Feeds an answer to the own query in flight; true once it is answered.
fn answer(rig: &mut Rig, frames: &[Vec<u8>]) -> bool {
    let ctx = super::ctx(&rig.app, &rig.entry);
    let mut answered = false;
    for f in frames {
        assert!(!answered, "frames after the answer's ReadyForQuery");
        answered = matches!(
            rig.engine.on_own_frame(&ctx, BytesMut::from(&f[..])),
            OwnStep::Answered
        );
    }
    answered
}

fn pair(name: &str, value: &str) -> Vec<u8> {
    let mut out = BytesMut::new();
    let values = [Some(name.to_owned()), Some(value.to_owned())];
    crate::session::fuzz::data_row(&mut out, &values);
    out.to_vec()
}

/// Transaction mode, the client having logged in with `search_path`.
fn pooled_with_search_path() -> Rig {
    let mut rig = Rig::new();
    rig.engine
        .startup
        .params
        .push(("search_path".into(), "s".into()));
    let pool = rig.app.pool.pooled.pool("shop", "alice");
    let state = ClientState::from_startup(&rig.engine.startup).expect("startup");
    rig.engine.link = Link::pooled(pool, state);
    rig.backend(&[rfq(TxStatus::Idle)]);
    rig
}

fn link(rig: &Rig) -> &crate::session::link::PooledLink {
    match &rig.engine.link {
        Link::Pooled(link) => link,
        Link::Session(_) => panic!("transaction mode"),
    }
}

#[test]
fn a_startup_parameter_the_client_reset_is_set_again_before_the_state_is_kept() {
    let mut rig = pooled_with_search_path();
    rig.engine.read_back();
    assert!(request_text(&mut rig).contains("pg_settings"));
    assert!(rig.engine.own_request().is_none(), "one query in flight");
    // RESET search_path: the pooled connection went back to the server's
    // default, where the client's own would go back to its login's value.
    let read = [pair("session_authorization", "alice"), pair("role", "none")];
    assert!(!answer(&mut rig, &read));
    assert!(answer(
        &mut rig,
        &[complete("SELECT 2"), rfq(TxStatus::Idle)]
    ));
    let again = request_text(&mut rig);
    assert!(again.contains("search_path"), "{again}");
    assert!(answer(
        &mut rig,
        &[complete("SELECT 1"), rfq(TxStatus::Idle)]
    ));
    assert!(!rig.engine.own_pending());
    assert!(rig.engine.take_verdict().is_none());
    let settings = &link(&rig).state.settings;
    assert!(
        settings.contains(&("search_path".into(), "s".into())),
        "{settings:?}"
    );
}

#[test]
fn a_read_back_that_fails_closes_the_connection() {
    let mut rig = pooled_with_search_path();
    rig.engine.read_back();
    request_text(&mut rig);
    assert!(answer(&mut rig, &[error("57014"), rfq(TxStatus::Idle)]));
    assert!(matches!(rig.engine.take_verdict(), Some(Verdict::Close)));
}

#[test]
fn refused_settings_on_a_new_connection_fail_with_the_servers_error_and_nothing_waits() {
    let mut rig = pooled_with_search_path();
    // A table's name asked for a statement's prerequisites waits behind.
    rig.engine.found.needs = Some(Box::default());
    let qualify = crate::session::engine::hidden::qualify_sql("t");
    rig.engine
        .ask(crate::session::engine::Purpose::Qualify, &qualify);
    rig.engine
        .apply_first(messages::hidden_query("SET search_path = s"));
    assert!(
        request_text(&mut rig).contains("SET search_path"),
        "applied first"
    );
    assert!(answer(&mut rig, &[error("22023"), rfq(TxStatus::Idle)]));
    assert!(!rig.engine.own_pending(), "what waited is given up");
    let needs = rig
        .engine
        .found
        .needs
        .as_ref()
        .expect("still the statement's");
    assert!(needs.unpublish.is_empty(), "no name came");
    match rig.engine.take_verdict() {
        Some(Verdict::Fail(e)) => assert_eq!(e.sqlstate(), "22023"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn with_the_fetcher_down_the_facts_are_looked_up_on_the_idle_backend() {
    let mut rig = Rig::logged_in();
    rig.engine.db.catalog.set_fetcher_down(true);
    let ctx = super::ctx(&rig.app, &rig.entry);
    let select = Bytes::from(query("SELECT * FROM items"));
    assert!(matches!(
        rig.engine.on_client_frame(&ctx, &select),
        Err(Need::Own)
    ));
    assert!(request_text(&mut rig).contains("pg_class"));
    let cell = |v: &str| Some(v.to_owned());
    let facts = [cell("r"), cell("items"), cell("true"), cell("false")];
    let facts: Vec<_> = facts
        .into_iter()
        .chain([None, cell("true"), cell("true")])
        .collect();
    let mut found = BytesMut::new();
    crate::session::fuzz::data_row(&mut found, &facts);
    assert!(answer(&mut rig, &[found.to_vec(), rfq(TxStatus::Idle)]));
    let (known, _) = rig.engine.db.catalog.facts(["items"], []);
    assert!(known.complete(), "installed from the session's own lookup");
}

#[test]
fn a_table_set_unlogged_is_named_as_the_clients_session_resolves_it_before_it_leaves_the_publication()
 {
    let mut rig = Rig::logged_in();
    rig.app.cache.set_replication(true);
    let ctx = super::ctx(&rig.app, &rig.entry);
    let alter = query("ALTER TABLE t SET UNLOGGED");
    assert!(matches!(
        rig.engine
            .on_client_frame(&ctx, &Bytes::from(alter.clone())),
        Err(Need::Own)
    ));
    assert!(request_text(&mut rig).contains("to_regclass('t')"));
    let name = {
        let mut out = BytesMut::new();
        crate::session::fuzz::data_row(&mut out, &[Some("s.t".to_owned())]);
        out.to_vec()
    };
    let answered = answer(
        &mut rig,
        &[
            description(),
            name,
            complete("SELECT 1"),
            rfq(TxStatus::Idle),
        ],
    );
    assert!(answered);
    let ctx = super::ctx(&rig.app, &rig.entry);
    match rig
        .engine
        .on_client_frame(&ctx, &Bytes::from(alter.clone()))
    {
        Err(Need::Prerequisites(needs)) => assert_eq!(needs.unpublish, ["s.t"]),
        _ => panic!("the prerequisites, named"),
    }
    rig.engine.prerequisites_met(Vec::new());
    let ctx = super::ctx(&rig.app, &rig.entry);
    assert!(
        rig.engine
            .on_client_frame(&ctx, &Bytes::from(alter))
            .is_ok()
    );
    assert!(
        String::from_utf8_lossy(&rig.engine.pipeline.to_backend).contains("SET UNLOGGED"),
        "then it goes out"
    );
}

#[test]
fn an_own_answer_is_read_with_the_backends_frames_and_only_what_is_the_clients_reaches_it() {
    let mut rig = Rig::logged_in();
    let qualify = crate::session::engine::hidden::qualify_sql("t");
    rig.engine.found.needs = Some(Box::default());
    rig.engine
        .ask(crate::session::engine::Purpose::Qualify, &qualify);
    request_text(&mut rig);
    let change = status("TimeZone", "UTC");
    let name = pair("s.t", "x");
    let sent = rig.backend(&[
        description(),
        name,
        change.clone(),
        complete("SELECT 1"),
        rfq(TxStatus::Idle),
    ]);
    assert_eq!(sent, change, "the parameter change alone is the client's");
    assert!(!rig.engine.own_pending(), "answered");
    let needs = rig.engine.found.needs.as_ref().expect("the statement's");
    assert_eq!(needs.unpublish, ["s.t"]);
    // The frames after it are the client's again.
    rig.client(&query("SELECT 1"));
    let answer = [complete("SELECT 1"), rfq(TxStatus::Idle)];
    assert_eq!(rig.backend(&answer), answer.concat());
}
