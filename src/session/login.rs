//! A session's login to PostgreSQL, up to AuthenticationOk: relayed for
//! the client (passthrough), or made by pgcache for a client it
//! authenticated itself (terminate). See [`crate::auth`].

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::info;

use super::SessionError;
use super::pipeline::Flow;
use super::relay::Session;
use crate::auth::{self, AUTH_OK, AUTH_SASL, LoginError};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{backend as be, frontend as fe, messages, sqlstate};
use crate::scram::{ClientSecret, MECHANISM};

/// The refusal when SCRAM cannot be relayed because both legs are TLS.
const BINDING_CANNOT_PASS: &str = "SCRAM channel binding cannot pass through pgcache: the client's \
     connection and PostgreSQL's both use TLS, so PostgreSQL would take the client's \
     channel_binding=prefer for a downgrade attack. Set auth.mode = \"terminate\" in pgcache, or \
     connect with channel_binding=disable";

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Logs in to PostgreSQL. `Flow::Continue`: PostgreSQL's
    /// AuthenticationOk and what follows are in `backend_buf`.
    pub(super) async fn log_in(
        &mut self,
        startup_raw: &[u8],
        secret: Option<Box<ClientSecret>>,
    ) -> Result<Flow, SessionError> {
        let app = std::sync::Arc::clone(&self.app);
        let startup_raw = &*app.upstream.origin.client_startup(startup_raw);
        let Some(secret) = secret else {
            self.server()?
                .write_all(startup_raw)
                .await
                .map_err(SessionError::BackendIo)?;
            return self.relay_authentication().await;
        };
        let user = self.engine.startup().user().to_owned();
        let connect_timeout = self.app.upstream.connect_timeout;
        let login = auth::login_backend(self.server()?, startup_raw, &user, &secret);
        let result = tokio::time::timeout(connect_timeout, login).await;
        let message = match result {
            Ok(Ok(())) => return Ok(Flow::Continue),
            Ok(Err(LoginError::Server(frame))) => {
                self.app.metrics.auth_failures.backend.inc();
                // PostgreSQL's own FATAL (no such database, too many
                // connections, ...): the client gets it as is.
                let _ = self.client.write_all(&frame).await;
                return Ok(Flow::Close);
            }
            Ok(Err(LoginError::Failed(reason))) => reason,
            Err(_) => "PostgreSQL did not finish authentication in time".to_owned(),
        };
        self.app.metrics.auth_failures.backend.inc();
        info!(user, reason = %message, "could not log in to PostgreSQL for a client");
        Err(SessionError::refused(
            sqlstate::INVALID_AUTHORIZATION,
            format!("pgcache could not log in to PostgreSQL as \"{user}\": {message}"),
        ))
    }

    /// Passthrough: relays the exchange both ways, without
    /// SCRAM-SHA-256-PLUS in PostgreSQL's offer (pgcache ends both TLS legs,
    /// so no binding can match). Stops at AuthenticationOk, left unread.
    async fn relay_authentication(&mut self) -> Result<Flow, SessionError> {
        let force = self.app.force.clone();
        // PLUS was taken out of PostgreSQL's offer, and the client's first
        // SASL message is still to come.
        let mut plus_hidden = false;
        loop {
            if self.relay_backend_auth(&mut plus_hidden).await? {
                return Ok(Flow::Continue);
            }
            self.relay_client_auth(&mut plus_hidden).await?;
            tokio::select! {
                _ = force.cancelled() => return Ok(Flow::Close),
                r = super::relay::fill(&mut self.backend) => match r {
                    Ok(0) | Err(_) => {
                        self.backend_lost(r.err()).await;
                        return Ok(Flow::Close);
                    }
                    Ok(_) => {}
                },
                r = self.client.fill() => match r {
                    Ok(0) | Err(_) => return Ok(Flow::Close),
                    Ok(n) => self.app.metrics.client_bytes_in.inc_by(n as u64),
                },
            }
        }
    }

    /// Relays PostgreSQL's authentication frames to the client; true at
    /// AuthenticationOk, which is left unread.
    async fn relay_backend_auth(&mut self, plus_hidden: &mut bool) -> Result<bool, SessionError> {
        let mut pos = 0;
        let mut done = false;
        let not_connected = || SessionError::BackendIo(std::io::ErrorKind::NotConnected.into());
        let backend = self.backend.as_mut().ok_or_else(not_connected)?;
        while let Some(len) = backend
            .frame_len_at(pos)
            .map_err(|e| SessionError::BackendFrame(e.into()))?
        {
            let frame = &backend.buffered()[pos..pos + len];
            let code = (frame[0] == be::AUTHENTICATION && len >= HEADER_LEN + 4)
                .then(|| i32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]));
            if code == Some(AUTH_OK) {
                self.engine.note_authenticated();
                done = true;
                break;
            }
            // Anything before AuthenticationOk asked the client to prove
            // itself: this connection is not one any client may have.
            self.engine.note_challenge();
            let offer = match code {
                Some(AUTH_SASL) => auth::without_plus(&frame[HEADER_LEN + 4..]),
                _ => None,
            };
            match offer {
                Some(offer) => {
                    *plus_hidden = true;
                    self.engine.out_mut().extend_from_slice(&offer);
                }
                None => {
                    if frame[0] == be::ERROR_RESPONSE && messages::is_fatal(&frame[HEADER_LEN..]) {
                        self.engine.note_backend_fatal(true);
                    }
                    self.engine.out_mut().extend_from_slice(frame);
                }
            }
            pos += len;
        }
        backend.consume(pos);
        self.flush_out().await?;
        Ok(done)
    }

    /// Relays the client's authentication frames to PostgreSQL, refusing a
    /// SCRAM exchange that would fail on channel binding.
    async fn relay_client_auth(&mut self, plus_hidden: &mut bool) -> Result<(), SessionError> {
        let mut pos = 0;
        while let Some(len) = self.client.frame_len_at(pos)? {
            let frame = &self.client.buffered()[pos..pos + len];
            // A client that hangs up while logging in (node-postgres ended
            // while connecting): PostgreSQL closes without a word.
            self.engine.note_login_frame(frame[0]);
            if frame[0] == fe::PASSWORD && *plus_hidden {
                *plus_hidden = false;
                // 'y': "I can bind, the server cannot". PostgreSQL on TLS
                // knows it can, and refuses with a puzzling message.
                let downgrade = auth::initial_response(&frame[HEADER_LEN..]).is_some_and(
                    |(mechanism, data)| {
                        mechanism == MECHANISM.as_bytes() && data.first() == Some(&b'y')
                    },
                );
                if downgrade {
                    self.app.metrics.auth_failures.relay.inc();
                    info!("refused SCRAM relay with channel binding on both TLS legs");
                    return Err(SessionError::refused(
                        sqlstate::INVALID_AUTHORIZATION,
                        BINDING_CANNOT_PASS,
                    ));
                }
            }
            pos += len;
        }
        if pos > 0 {
            let r = match &mut self.backend {
                Some(backend) => backend.write_all(&self.client.buffered()[..pos]).await,
                None => Err(std::io::ErrorKind::NotConnected.into()),
            };
            self.client.consume(pos);
            r.map_err(SessionError::BackendIo)?;
        }
        Ok(())
    }
}
