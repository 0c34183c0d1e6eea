//! The relayed login, decided frame by frame.

use bytes::BytesMut;

use super::{Rig, ctx, frame};
use crate::protocol::{backend as be, frontend as fe, messages, sqlstate};
use crate::session::SessionError;
use crate::session::engine::AuthStep;

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
    rig.engine.on_auth_client_frame(&ctx, frame)
}

#[test]
fn a_login_never_challenged_is_trusted_and_a_challenged_one_is_not() {
    let mut rig = Rig::new();
    assert_eq!(
        rig.engine.on_auth_backend_frame(&authentication(0, b"")),
        AuthStep::Done
    );
    assert!(rig.engine.server.trusted);
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
    assert!(!rig.engine.server.trusted, "asked for a password first");
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
