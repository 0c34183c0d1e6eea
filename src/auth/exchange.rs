//! pgcache as the SCRAM-SHA-256 server: the client's SASL messages in,
//! pgcache's answers out, decided without I/O. The admin console runs it
//! on its connection ([`super::sasl_server`]); a session's admission feeds
//! it the frames its client sends ([`crate::session`]).

use std::sync::Arc;

use bytes::BytesMut;
use pgwire::messages::startup::Authentication;
use tracing::debug;

use super::{ExchangeError, initial_response};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::frontend as fe;
use crate::protocol::messages::encode;
use crate::scram::{
    self, MECHANISM, MECHANISM_PLUS, ScramError, ServerBinding, ServerExchange, Verifier,
};

/// One SASL exchange with a client, from AuthenticationSASL to the
/// verdict on its proof.
pub struct SaslServer {
    stage: Stage,
    /// `tls-server-end-point` data, when the client's leg is TLS
    /// (SCRAM-SHA-256-PLUS is offered then).
    end_point: Option<Arc<[u8]>>,
}

enum Stage {
    /// Waiting for the SASLInitialResponse.
    Initial(Verifier),
    /// Waiting for the SASLResponse with the proof.
    Final(ServerExchange),
    Over,
}

/// What a client's message leads to.
#[derive(Debug)]
pub enum Turn {
    /// This goes to the client, whose next message is awaited.
    Continue(BytesMut),
    /// The proof was right: this (SASLFinal) goes to the client, and the
    /// client's key is known.
    Proven(BytesMut, [u8; 32]),
    /// The proof was wrong.
    Refused,
}

impl SaslServer {
    /// An exchange against `verifier`, offering SCRAM-SHA-256-PLUS when
    /// `end_point` is known; returns it with the AuthenticationSASL to
    /// send.
    pub fn start(verifier: Verifier, end_point: Option<Arc<[u8]>>) -> (Self, BytesMut) {
        let mut mechanisms = vec![MECHANISM.to_owned()];
        if end_point.is_some() {
            mechanisms.insert(0, MECHANISM_PLUS.to_owned());
        }
        let mut out = BytesMut::new();
        encode(&mut out, Authentication::SASL(mechanisms));
        let stage = Stage::Initial(verifier);
        (Self { stage, end_point }, out)
    }

    /// The client's next whole message, which must be a `p`.
    pub fn on_frame(&mut self, frame: &[u8]) -> Result<Turn, ExchangeError> {
        let body = &frame[HEADER_LEN.min(frame.len())..];
        match std::mem::replace(&mut self.stage, Stage::Over) {
            Stage::Initial(verifier) => {
                expect_password(frame, "SASLInitialResponse")?;
                let (mechanism, data) =
                    initial_response(body).ok_or(ScramError::Malformed("SASLInitialResponse"))?;
                let binding = ServerBinding {
                    offered: self.end_point.is_some(),
                    data: self.end_point.as_deref(),
                };
                let (exchange, server_first) = scram::server_first(
                    verifier,
                    &String::from_utf8_lossy(mechanism),
                    &String::from_utf8_lossy(data),
                    binding,
                )?;
                self.stage = Stage::Final(exchange);
                let mut out = BytesMut::new();
                let server_first = server_first.into_bytes().into();
                encode(&mut out, Authentication::SASLContinue(server_first));
                Ok(Turn::Continue(out))
            }
            Stage::Final(exchange) => {
                expect_password(frame, "SASLResponse")?;
                match exchange.finish(&String::from_utf8_lossy(body)) {
                    Ok(proven) => {
                        let mut out = BytesMut::new();
                        let last = proven.server_final.into_bytes().into();
                        encode(&mut out, Authentication::SASLFinal(last));
                        Ok(Turn::Proven(out, proven.client_key))
                    }
                    Err(e) => {
                        debug!(error = %e, "SCRAM proof refused");
                        Ok(Turn::Refused)
                    }
                }
            }
            Stage::Over => Err(ExchangeError::Unexpected("nothing after the exchange")),
        }
    }
}

fn expect_password(frame: &[u8], what: &'static str) -> Result<(), ExchangeError> {
    match frame.first() {
        Some(&fe::PASSWORD) => Ok(()),
        _ => Err(ExchangeError::Unexpected(what)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scram::{ClientExchange, ClientSecret};
    use pgwire::messages::startup::{SASLInitialResponse, SASLResponse};

    /// The client's side of an exchange, as frames.
    fn initial(first: &str) -> BytesMut {
        let mut out = BytesMut::new();
        let message = SASLInitialResponse::new(MECHANISM.to_owned(), Some(first.to_owned().into()));
        encode(&mut out, message);
        out
    }

    fn response(text: &str) -> BytesMut {
        let mut out = BytesMut::new();
        encode(&mut out, SASLResponse::new(text.to_owned().into()));
        out
    }

    /// The server's message's SASL data (after the code).
    fn data(frame: &[u8]) -> String {
        String::from_utf8_lossy(&frame[HEADER_LEN + 4..]).into_owned()
    }

    fn run(verifier: Verifier, password: &str) -> Turn {
        let (mut server, hello) = SaslServer::start(verifier, None);
        assert!(!String::from_utf8_lossy(&hello).contains(MECHANISM_PLUS));
        let (mut client, first) = ClientExchange::start(ClientSecret::Password(password.into()));
        let Turn::Continue(server_first) = server.on_frame(&initial(&first)).unwrap() else {
            panic!("the exchange goes on");
        };
        let last = client.respond(&data(&server_first)).unwrap();
        server.on_frame(&response(&last)).unwrap()
    }

    #[test]
    fn the_right_password_is_proven_with_its_key_and_a_wrong_one_refused() {
        let verifier = Verifier::random("pencil");
        assert!(matches!(run(verifier.clone(), "pencil"), Turn::Proven(..)));
        assert!(matches!(run(verifier, "crayon"), Turn::Refused));
    }

    #[test]
    fn plus_is_offered_over_tls_and_anything_but_a_password_message_breaks_off() {
        let end_point: Arc<[u8]> = Arc::from(&b"hash"[..]);
        let (mut server, hello) = SaslServer::start(Verifier::random("x"), Some(end_point));
        assert!(String::from_utf8_lossy(&hello).contains(MECHANISM_PLUS));
        let query = b"Q\0\0\0\x0bSELECT\0";
        assert!(matches!(
            server.on_frame(query),
            Err(ExchangeError::Unexpected("SASLInitialResponse"))
        ));
        assert!(server.on_frame(&initial("n,,r=abc")).is_err(), "over");
    }
}
