//! A login's exchange with PostgreSQL, frame by frame up to
//! AuthenticationOk. Relayed (passthrough): what of PostgreSQL's exchange
//! the client sees, what of the client's is refused, whether the
//! connection was trusted, and what the login teaches the pool. Answered
//! for the client (terminate): pgcache's answers, by a deadline, and a
//! failure told as the client's login failing. PostgreSQL's frames come
//! through [`Engine::on_backend`] like any other; the driver moves the
//! bytes.

use std::time::{Duration, Instant};

use bytes::BytesMut;
use tracing::info;

use super::life::{Ending, Exchange};
use super::{Ctx, Engine, Lesson};
use crate::auth::{self, AUTH_OK, AUTH_SASL, BackendLogin, LoginError, LoginStep};
use crate::pool::marks::Pin;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{backend as be, frontend as fe, messages, sqlstate};
use crate::scram::{ClientSecret, MECHANISM};
use crate::session::SessionError;
use crate::session::admission::Login;
use crate::session::link::Link;
use crate::session::reuse::{Source, Trust};

/// The refusal when SCRAM cannot be relayed because both legs are TLS.
const BINDING_CANNOT_PASS: &str = "SCRAM channel binding cannot pass through pgcache: the client's \
     connection and PostgreSQL's both use TLS, so PostgreSQL would take the client's \
     channel_binding=prefer for a downgrade attack. Set auth.mode = \"terminate\" in pgcache, or \
     connect with channel_binding=disable";

/// What a frame of PostgreSQL's before the login ends is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthStep {
    /// AuthenticationOk: the relayed exchange is over (the frame is not
    /// the relay's: the session reads it as its first answer).
    Done,
    /// Staged for the client, as it came or without the PLUS offer.
    Relayed,
}

/// How a session's login begins ([`Engine::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Start {
    /// Under way: a parked connection's login is replayed from its read
    /// buffer, or PostgreSQL is owed the StartupMessage
    /// ([`Engine::take_to_server`]).
    Begun,
    /// Transaction mode, holding no connection: pgcache greets the client
    /// ([`Engine::greeting`]).
    Greet,
    /// Nothing to log in with: the session ends.
    Close,
}

impl Engine {
    /// Begins the session's login (`attached`: it holds a server
    /// connection): replayed for a parked connection, greeted by pgcache
    /// on pooled connections, else with PostgreSQL: relayed for the
    /// client (passthrough), or answered by pgcache with the secret of a
    /// client it authenticated (terminate) within `upstream.connect_timeout`.
    pub fn start(&mut self, ctx: &Ctx, attached: bool, login: Option<Box<Login>>) -> Start {
        if self.server.source == Source::Parked {
            self.login_over(ctx);
            return Start::Begun;
        }
        if self.link.is_pooled() && !attached {
            return Start::Greet;
        }
        let Some(login) = login else {
            return Start::Close;
        };
        let upstream = &ctx.instance.upstream();
        match login.secret {
            Some(secret) => self.answer_login(*secret, ctx.now, upstream.connect_timeout),
            None => self.relay_login(),
        }
        let startup = upstream.origin.client_startup(&login.raw);
        self.to_server.extend_from_slice(&startup);
        Start::Begun
    }

    /// Passthrough: PostgreSQL's login exchange is relayed from now on.
    pub fn relay_login(&mut self) {
        self.set_exchange(Exchange::Relayed);
    }

    /// Terminate mode: pgcache answers PostgreSQL's exchange for the
    /// client it authenticated, with its secret, within `timeout` of
    /// `now`.
    pub fn answer_login(&mut self, secret: ClientSecret, now: Instant, timeout: Duration) {
        let login = BackendLogin::new(self.startup.user(), secret);
        self.set_exchange(Exchange::Answered {
            login: Box::new(login),
            deadline: now + timeout,
        });
    }

    /// A login's exchange is going on: PostgreSQL's frames are the
    /// exchange's. Relayed, the client's go to PostgreSQL as
    /// [`Engine::on_auth_client_frame`] allows; answered by pgcache, they
    /// wait ([`Engine::answering_login`]).
    pub fn relaying_login(&self) -> bool {
        !matches!(self.exchange(), Exchange::Over)
    }

    /// Whether the client's next frames are to be read now: not while a
    /// read on a replica is answered (it comes before anything else), nor
    /// while pgcache logs in for the client.
    pub fn reads_client(&self) -> bool {
        !self.replica_busy() && !self.answering_login()
    }

    /// pgcache answers the exchange: the client's frames wait.
    pub fn answering_login(&self) -> bool {
        matches!(self.exchange(), Exchange::Answered { .. })
    }

    /// When an exchange pgcache answers is to be over.
    pub(super) fn login_deadline(&self) -> Option<Instant> {
        match self.exchange() {
            Exchange::Answered { deadline, .. } => Some(*deadline),
            _ => None,
        }
    }

    /// A frame of PostgreSQL's during a login's exchange: true if it was
    /// the exchange's (staged for the client, or answered into `resend`);
    /// false at AuthenticationOk, which ends the exchange and is the
    /// session's first answer to read.
    pub(super) fn on_login_frame(
        &mut self,
        ctx: &Ctx,
        frame: &[u8],
        resend: &mut BytesMut,
    ) -> Result<bool, SessionError> {
        let Some(Exchange::Answered { login, .. }) = self.exchange_mut() else {
            if self.on_auth_backend_frame(frame) == AuthStep::Relayed {
                return Ok(true);
            }
            self.login_over(ctx);
            return Ok(false);
        };
        match login.on_frame(frame) {
            Ok(LoginStep::Answer(reply)) => resend.extend_from_slice(&reply),
            Ok(LoginStep::Wait) => {}
            Ok(LoginStep::Done) => {
                self.set_exchange(Exchange::Over);
                self.login_over(ctx);
                return Ok(false);
            }
            Err(LoginError::Server(frame)) => {
                // PostgreSQL's own FATAL (no such database, too many
                // connections, ...): the client gets it as is.
                ctx.instance.metrics().auth_failures.backend.inc();
                self.end_with(Ending::BackendFatal);
                self.out.extend_from_slice(&frame);
            }
            Err(LoginError::Failed(reason)) => return Err(self.login_failed(ctx, &reason)),
        }
        Ok(true)
    }

    /// pgcache could not log in for the client, for `reason`: the client
    /// is told its login failed.
    pub(super) fn login_failed(&self, ctx: &Ctx, reason: &str) -> SessionError {
        ctx.instance.metrics().auth_failures.backend.inc();
        let user = self.startup.user();
        info!(user, reason, "could not log in to PostgreSQL for a client");
        SessionError::refused(
            sqlstate::INVALID_AUTHORIZATION,
            format!("pgcache could not log in to PostgreSQL as \"{user}\": {reason}"),
        )
    }

    /// The login is over (AuthenticationOk): a pool learns whether
    /// PostgreSQL trusts its clients, and in transaction mode a session
    /// PostgreSQL asked a password of keeps its connection.
    pub fn login_over(&mut self, ctx: &Ctx) {
        match &self.link {
            Link::Pooled(link) if self.server.trusted() => {
                ctx.instance.teach_pool(&link.pool, Lesson::Trusted);
            }
            Link::Pooled(_) => self.pin(ctx, Pin::Password),
            Link::Session(own) => {
                if let Some(checks) = &own.checks
                    && self.server.trusted()
                {
                    ctx.instance.teach_pool(checks, Lesson::Trusted);
                }
            }
        }
    }

    /// A frame PostgreSQL sent while the login is relayed.
    pub(super) fn on_auth_backend_frame(&mut self, frame: &[u8]) -> AuthStep {
        let code = (frame[0] == be::AUTHENTICATION && frame.len() >= HEADER_LEN + 4)
            .then(|| i32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]));
        if code == Some(AUTH_OK) {
            if self.server.trust != Trust::Challenged {
                self.server.trust = Trust::Trusted;
            }
            self.set_exchange(Exchange::Over);
            return AuthStep::Done;
        }
        // Anything before AuthenticationOk asked the client to prove
        // itself: this connection is not one any client may have.
        self.server.trust = Trust::Challenged;
        let offer = match code {
            Some(AUTH_SASL) => auth::without_plus(&frame[HEADER_LEN + 4..]),
            _ => None,
        };
        match offer {
            Some(offer) => {
                self.set_exchange(Exchange::PlusHidden);
                self.out.extend_from_slice(&offer);
            }
            None => {
                if frame[0] == be::ERROR_RESPONSE && messages::is_fatal(&frame[HEADER_LEN..]) {
                    self.end_with(Ending::BackendFatal);
                }
                self.out.extend_from_slice(frame);
            }
        }
        AuthStep::Relayed
    }

    /// A frame the client sent while the login is relayed: to go on to
    /// PostgreSQL, or the session ends with the error.
    pub(super) fn on_auth_client_frame(
        &mut self,
        ctx: &Ctx,
        frame: &[u8],
    ) -> Result<(), SessionError> {
        // A client that hangs up while logging in (node-postgres ended
        // while connecting): PostgreSQL closes without a word.
        if frame[0] == fe::TERMINATE {
            self.end_with(Ending::ClientEnded);
        }
        if frame[0] != fe::PASSWORD || !matches!(self.exchange(), Exchange::PlusHidden) {
            return Ok(());
        }
        self.set_exchange(Exchange::Relayed);
        // 'y': "I can bind, the server cannot". PostgreSQL on TLS knows it
        // can, and refuses with a puzzling message.
        let downgrade =
            auth::initial_response(&frame[HEADER_LEN..]).is_some_and(|(mechanism, data)| {
                mechanism == MECHANISM.as_bytes() && data.first() == Some(&b'y')
            });
        if downgrade {
            ctx.instance.metrics().auth_failures.relay.inc();
            info!("refused SCRAM relay with channel binding on both TLS legs");
            return Err(SessionError::refused(
                sqlstate::INVALID_AUTHORIZATION,
                BINDING_CANNOT_PASS,
            ));
        }
        Ok(())
    }
}
