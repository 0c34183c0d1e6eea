//! A login's exchange, relayed or answered by pgcache, decided frame by
//! frame.

use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::{Rig, ctx, frame, rfq};
use crate::pool::marks::Pin;
use crate::protocol::{TxStatus, backend as be, frontend as fe, messages, sqlstate};
use crate::scram::ClientSecret;
use crate::session::SessionError;
use crate::session::engine::auth::AuthStep;
use crate::session::link::{ClientState, Link};

fn authentication(code: i32, payload: &[u8]) -> Vec<u8> {
    let mut body = code.to_be_bytes().to_vec();
    body.extend_from_slice(payload);
    frame(be::AUTHENTICATION, &body)
}

/// SASLInitialResponse: the mechanism, then its data.
fn initial_response(mechanism: &str, data: &[u8]) -> Vec<u8> {
    let mut body = mechanism.as_bytes().to_vec();
    body.push(0);
    body.extend_from_slice(&(data.len() as i32).to_be_bytes());
    body.extend_from_slice(data);
    frame(fe::PASSWORD, &body)
}

/// A client frame of the relayed login, fed as the driver feeds it.
fn client(rig: &mut Rig, frame: &[u8]) -> Result<(), SessionError> {
    let ctx = ctx(&rig.app, &rig.entry);
    let run = rig.engine.forward_run(&ctx, frame, 1 << 20)?;
    assert_eq!(run.taken, frame.len(), "one whole frame");
    Ok(())
}

#[test]
fn a_login_never_challenged_is_trusted_and_a_challenged_one_is_not() {
    let mut rig = Rig::new();
    assert_eq!(
        rig.engine.on_auth_backend_frame(&authentication(0, b"")),
        AuthStep::Done
    );
    assert!(rig.engine.server.trusted());
    assert!(
        rig.sent_to_client().is_empty(),
        "AuthenticationOk is not the relay's"
    );

    let mut rig = Rig::new();
    let cleartext = authentication(3, b"");
    assert_eq!(
        rig.engine.on_auth_backend_frame(&cleartext),
        AuthStep::Relayed
    );
    assert_eq!(rig.sent_to_client(), cleartext);
    assert_eq!(
        rig.engine.on_auth_backend_frame(&authentication(0, b"")),
        AuthStep::Done
    );
    assert!(!rig.engine.server.trusted(), "asked for a password first");
}

#[test]
fn scram_plus_is_hidden_and_a_client_that_would_bind_is_refused() {
    let offer = authentication(10, b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0");
    for (data, refused) in [(&b"y,,n=,r=abc"[..], true), (&b"n,,n=,r=abc"[..], false)] {
        let mut rig = Rig::new();
        assert_eq!(rig.engine.on_auth_backend_frame(&offer), AuthStep::Relayed);
        assert_eq!(
            rig.sent_to_client(),
            authentication(10, b"SCRAM-SHA-256\0\0"),
            "only what pgcache can relay is offered"
        );
        let before = rig.app.metrics.auth_failures.relay.get();
        let answer = client(&mut rig, &initial_response("SCRAM-SHA-256", data));
        match answer {
            Err(e) => {
                assert!(refused, "{e}");
                assert_eq!(e.sqlstate(), sqlstate::INVALID_AUTHORIZATION);
                assert_eq!(rig.app.metrics.auth_failures.relay.get(), before + 1);
            }
            Ok(()) => assert!(!refused, "a client that would bind goes on"),
        }
    }
}

#[test]
fn a_fatal_error_or_a_terminate_during_login_makes_the_close_expected() {
    let mut rig = Rig::new();
    let mut fatal = BytesMut::new();
    messages::error_response(
        &mut fatal,
        "FATAL",
        "28P01",
        "password authentication failed",
    );
    let fatal = fatal.to_vec();
    assert_eq!(rig.engine.on_auth_backend_frame(&fatal), AuthStep::Relayed);
    assert_eq!(rig.sent_to_client(), fatal);
    assert!(rig.engine.close_expected());

    let mut rig = Rig::new();
    assert!(!rig.engine.close_expected());
    client(&mut rig, &frame(fe::TERMINATE, b"")).expect("relayed");
    assert!(rig.engine.close_expected());
}

/// Transaction mode, before the client logged in.
fn pooled_unlogged() -> (Rig, std::sync::Arc<crate::pool::transaction::Pool>) {
    let mut rig = Rig::new();
    let pool = rig.app.pool.pooled.pool("shop", "alice");
    let state = ClientState::from_startup(&rig.engine.startup).expect("startup");
    rig.engine.link = Link::pooled(std::sync::Arc::clone(&pool), state);
    (rig, pool)
}

#[test]
fn a_relayed_login_reaches_the_client_and_the_session_reads_on_from_authentication_ok() {
    let mut rig = Rig::new();
    rig.engine.relay_login();
    let md5 = authentication(5, b"salt");
    assert_eq!(rig.backend(std::slice::from_ref(&md5)), md5);
    assert!(rig.engine.relaying_login());
    assert!(!rig.engine.backend_idle());
    client(&mut rig, &frame(fe::PASSWORD, b"md5abc\0")).expect("relayed");
    // AuthenticationOk and the rest of the login's answer, in one read.
    let ok = authentication(0, b"");
    let sent = rig.backend(&[ok.clone(), rfq(TxStatus::Idle)]);
    assert_eq!(sent, [ok, rfq(TxStatus::Idle)].concat());
    assert!(!rig.engine.relaying_login());
    assert!(!rig.engine.server.trusted(), "asked for a password");
    assert!(rig.engine.backend_idle(), "logged in");
}

#[test]
fn in_transaction_mode_a_login_asked_for_a_password_keeps_its_connection() {
    let (mut rig, pool) = pooled_unlogged();
    rig.engine.relay_login();
    rig.backend(&[authentication(3, b"")]);
    rig.backend(&[authentication(0, b""), rfq(TxStatus::Idle)]);
    match &rig.engine.link {
        Link::Pooled(link) => assert_eq!(link.pinned, Some(Pin::Password)),
        Link::Session(_) => panic!("transaction mode"),
    }
    assert!(
        !pool.can_log_in(),
        "the pool learned nothing it can log in with"
    );

    let (mut rig, pool) = pooled_unlogged();
    rig.engine.relay_login();
    rig.backend(&[authentication(0, b""), rfq(TxStatus::Idle)]);
    assert!(pool.can_log_in(), "PostgreSQL trusts the pool's clients");
    match &rig.engine.link {
        Link::Pooled(link) => assert_eq!(link.pinned, None),
        Link::Session(_) => panic!("transaction mode"),
    }
}

/// Terminate mode: the frames PostgreSQL sends, fed as the driver feeds
/// them; returns what goes back to PostgreSQL and what to the client.
fn answered(rig: &mut Rig, frames: &[Vec<u8>]) -> Result<(Vec<u8>, Vec<u8>), SessionError> {
    let mut buf = BytesMut::from(&frames.concat()[..]);
    let ctx = ctx(&rig.app, &rig.entry);
    let relayed = rig.engine.on_backend(&ctx, &mut buf)?;
    let mut sent = std::mem::take(&mut rig.engine.out).to_vec();
    sent.extend_from_slice(&buf[relayed.from..relayed.end]);
    let to_server = rig.engine.take_to_server().unwrap_or_default();
    Ok((to_server.to_vec(), sent))
}

#[test]
fn pgcache_answers_the_exchange_for_a_client_it_authenticated_and_the_client_sees_only_its_end() {
    let mut rig = Rig::new();
    let t0 = Instant::now();
    let secret = ClientSecret::Password("hunter2".into());
    rig.engine.answer_login(secret, t0, Duration::from_secs(5));
    assert!(rig.engine.answering_login());
    assert!(!rig.engine.reads_client(), "the client waits");
    assert_eq!(rig.engine.poll_timeout(), Some(t0 + Duration::from_secs(5)));

    let (to_server, to_client) = answered(&mut rig, &[authentication(3, b"")]).expect("asked");
    assert_eq!(to_server, frame(fe::PASSWORD, b"hunter2\0"));
    assert!(to_client.is_empty(), "the exchange is pgcache's");

    // AuthenticationOk and the rest of the login reach the client.
    let ok = authentication(0, b"");
    let (to_server, to_client) =
        answered(&mut rig, &[ok.clone(), rfq(TxStatus::Idle)]).expect("logged in");
    assert!(to_server.is_empty());
    assert_eq!(to_client, [ok, rfq(TxStatus::Idle)].concat());
    assert!(!rig.engine.answering_login());
    assert!(rig.engine.reads_client());
    assert_eq!(
        rig.engine.poll_timeout(),
        None,
        "no deadline once logged in"
    );
}

#[test]
fn a_login_pgcache_cannot_answer_or_finish_in_time_fails_as_the_clients_login() {
    let before = |rig: &Rig| rig.app.metrics.auth_failures.backend.get();
    // Only a SCRAM key, and PostgreSQL asks for an MD5 password.
    let mut rig = Rig::new();
    let key = ClientSecret::Key {
        client_key: [7; 32],
        verifier: crate::scram::Verifier::impossible("alice", &[9; 32]),
    };
    rig.engine
        .answer_login(key, Instant::now(), Duration::from_secs(5));
    let failures = before(&rig);
    let e = answered(&mut rig, &[authentication(5, b"salt")]).expect_err("cannot answer");
    assert_eq!(e.sqlstate(), sqlstate::INVALID_AUTHORIZATION);
    assert!(
        e.to_string().contains("holds only its SCRAM verifier"),
        "{e}"
    );
    assert_eq!(before(&rig), failures + 1);

    // PostgreSQL never finishes.
    let mut rig = Rig::new();
    let secret = ClientSecret::Password("hunter2".into());
    rig.engine
        .answer_login(secret, Instant::now(), Duration::from_secs(5));
    let e = rig.engine.on_timeout(&ctx(&rig.app, &rig.entry));
    assert_eq!(e.sqlstate(), sqlstate::INVALID_AUTHORIZATION);
    assert!(
        e.to_string()
            .contains("did not finish authentication in time"),
        "{e}"
    );

    // PostgreSQL's own refusal reaches the client as it is.
    let mut rig = Rig::new();
    let secret = ClientSecret::Password("hunter2".into());
    rig.engine
        .answer_login(secret, Instant::now(), Duration::from_secs(5));
    let mut fatal = BytesMut::new();
    messages::error_response(
        &mut fatal,
        "FATAL",
        "3D000",
        "database \"shop\" does not exist",
    );
    let (to_server, to_client) = answered(&mut rig, &[fatal.to_vec()]).expect("relayed");
    assert!(to_server.is_empty());
    assert_eq!(to_client, fatal.to_vec());
    assert!(rig.engine.close_expected());
}

#[test]
fn a_login_begins_replayed_greeted_or_with_the_startup_message_owed_to_postgresql() {
    use crate::session::admission::Login;
    use crate::session::engine::Start;
    use crate::session::reuse::Source;
    let raw = || BytesMut::from(&b"\0\0\0\x08\0\x03\0\0"[..]);
    let login = |secret: Option<ClientSecret>| {
        Some(Box::new(Login {
            raw: raw(),
            secret: secret.map(Box::new),
        }))
    };

    let mut rig = Rig::new();
    let now = ctx(&rig.app, &rig.entry);
    assert_eq!(rig.engine.start(&now, true, login(None)), Start::Begun);
    assert!(
        rig.engine.relaying_login(),
        "passthrough relays the exchange"
    );
    assert_eq!(rig.engine.take_to_server().as_deref(), Some(&raw()[..]));
    assert_eq!(rig.engine.take_to_server(), None, "owed once");

    let mut rig = Rig::new();
    let now = ctx(&rig.app, &rig.entry);
    let secret = ClientSecret::Password("hunter2".into());
    assert_eq!(
        rig.engine.start(&now, true, login(Some(secret))),
        Start::Begun
    );
    assert!(rig.engine.answering_login(), "terminate answers it");
    assert!(rig.engine.poll_timeout().is_some(), "by a deadline");
    assert_eq!(rig.engine.take_to_server().as_deref(), Some(&raw()[..]));

    let mut rig = Rig::new();
    rig.engine.server.source = Source::Parked;
    let now = ctx(&rig.app, &rig.entry);
    assert_eq!(rig.engine.start(&now, true, login(None)), Start::Begun);
    assert!(!rig.engine.relaying_login(), "a parked login is replayed");
    assert_eq!(rig.engine.take_to_server(), None);

    let (mut rig, _pool) = pooled_unlogged();
    let now = ctx(&rig.app, &rig.entry);
    assert_eq!(rig.engine.start(&now, false, login(None)), Start::Greet);
    assert_eq!(rig.engine.take_to_server(), None);
    assert_eq!(rig.engine.start(&now, true, None), Start::Close);
}

#[test]
fn a_logins_relayed_frames_are_staged_for_the_server_as_they_are_up_to_a_bad_one() {
    let max = 1 << 20;
    let mut rig = Rig::new();
    rig.engine.relay_login();
    let password = frame(fe::PASSWORD, b"hunter2\0");
    let mut buf = [password.clone(), password.clone()].concat();
    buf.extend_from_slice(&[fe::PASSWORD, 0, 0, 0, 1]);
    let now = ctx(&rig.app, &rig.entry);
    let run = rig.engine.forward_run(&now, &buf, max).expect("relayed");
    assert_eq!(run.taken, 2 * password.len());
    assert!(
        run.violation.is_some(),
        "a length shorter than its own field"
    );
    assert_eq!(
        rig.engine.take_to_server().as_deref(),
        Some(&[password.clone(), password][..].concat()[..])
    );
    assert!(rig.engine.pipeline.to_backend.is_empty());

    // Fed as the driver feeds it, the bad frame ends the session.
    let mut rig = Rig::new();
    rig.engine.relay_login();
    rig.engine.client_arrived();
    let mut bytes = BytesMut::from(&[fe::PASSWORD, 0, 0, 0, 1][..]);
    let now = ctx(&rig.app, &rig.entry);
    assert!(matches!(
        rig.engine.on_client_data(&now, &mut bytes, max),
        Err(SessionError::ClientFrame(_))
    ));
    assert_eq!(rig.engine.flow(), crate::session::pipeline::Flow::Close);
}
