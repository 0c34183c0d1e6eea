//! A session's login to PostgreSQL, up to AuthenticationOk: relayed for
//! the client (passthrough), or made by pgcache for a client it
//! authenticated itself (terminate). See [`crate::auth`].

use bytes::Buf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::info;

use super::{Flow, MAX_BACKEND_FRAME, Session, SessionError};
use crate::auth::scram::{ClientSecret, MECHANISM};
use crate::auth::{self, AUTH_OK, AUTH_SASL, LoginError};
use crate::protocol::codec::{HEADER_LEN, parse_frame};
use crate::protocol::messages::{self, error_field};
use crate::protocol::{frontend as fe, sqlstate};

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
        secret: Option<ClientSecret>,
    ) -> Result<Flow, SessionError> {
        let Some(secret) = secret else {
            self.backend
                .write_all(startup_raw)
                .await
                .map_err(SessionError::BackendIo)?;
            return self.relay_authentication().await;
        };
        let user = self.startup.user().to_owned();
        let login = auth::login_backend(
            &mut self.backend,
            &mut self.backend_buf,
            startup_raw,
            &user,
            &secret,
        );
        let result = tokio::time::timeout(self.app.config.connect_timeout(), login).await;
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
        let msg = messages::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            &format!("pgcache could not log in to PostgreSQL as \"{user}\": {message}"),
        );
        let _ = self.client.write_all(&msg).await;
        Ok(Flow::Close)
    }

    /// Passthrough: relays the exchange both ways, without
    /// SCRAM-SHA-256-PLUS in PostgreSQL's offer (pgcache ends both TLS legs,
    /// so no binding can match). Stops at AuthenticationOk, left unread.
    async fn relay_authentication(&mut self) -> Result<Flow, SessionError> {
        let max = self.app.config.server.max_message_bytes;
        let force = self.app.force.clone();
        // PLUS was taken out of PostgreSQL's offer, and the client's first
        // SASL message is still to come.
        let mut plus_hidden = false;
        loop {
            let mut pos = 0;
            while let Some(len) = parse_frame(&self.backend_buf[pos..], MAX_BACKEND_FRAME)
                .map_err(|e| SessionError::Protocol(format!("from backend: {e}")))?
            {
                let frame = &self.backend_buf[pos..pos + len];
                let code = (frame[0] == b'R' && len >= HEADER_LEN + 4).then(|| {
                    i32::from_be_bytes(frame[HEADER_LEN..HEADER_LEN + 4].try_into().unwrap())
                });
                if code == Some(AUTH_OK) {
                    self.backend_buf.advance(pos);
                    self.flush_out().await?;
                    return Ok(Flow::Continue);
                }
                let offer = match code {
                    Some(AUTH_SASL) => auth::without_plus(&frame[HEADER_LEN + 4..]),
                    _ => None,
                };
                match offer {
                    Some(offer) => {
                        plus_hidden = true;
                        self.out.extend_from_slice(&offer);
                    }
                    None => {
                        if frame[0] == b'E'
                            && matches!(
                                error_field(&frame[HEADER_LEN..], b'S'),
                                Some("FATAL" | "PANIC")
                            )
                        {
                            self.backend_fatal = true;
                        }
                        self.out.extend_from_slice(frame);
                    }
                }
                pos += len;
            }
            self.backend_buf.advance(pos);
            self.flush_out().await?;

            let mut pos = 0;
            while let Some(len) = parse_frame(&self.client_buf[pos..], max)
                .map_err(|e| SessionError::Protocol(e.to_string()))?
            {
                let frame = &self.client_buf[pos..pos + len];
                if frame[0] == fe::PASSWORD && plus_hidden {
                    plus_hidden = false;
                    // 'y': "I can bind, the server cannot". PostgreSQL on
                    // TLS knows it can, and refuses with a puzzling message.
                    let downgrade = auth::initial_response(&frame[HEADER_LEN..]).is_some_and(
                        |(mechanism, data)| {
                            mechanism == MECHANISM.as_bytes() && data.first() == Some(&b'y')
                        },
                    );
                    if downgrade {
                        self.app.metrics.auth_failures.relay.inc();
                        info!("refused SCRAM relay with channel binding on both TLS legs");
                        let msg =
                            messages::fatal(sqlstate::INVALID_AUTHORIZATION, BINDING_CANNOT_PASS);
                        let _ = self.client.write_all(&msg).await;
                        return Ok(Flow::Close);
                    }
                }
                pos += len;
            }
            if pos > 0 {
                let r = self.backend.write_all(&self.client_buf[..pos]).await;
                self.client_buf.advance(pos);
                r.map_err(SessionError::BackendIo)?;
            }

            tokio::select! {
                _ = force.cancelled() => return Ok(Flow::Close),
                r = self.backend.read_buf(&mut self.backend_buf) => match r {
                    Ok(0) | Err(_) => {
                        self.backend_lost(r.err()).await;
                        return Ok(Flow::Close);
                    }
                    Ok(_) => {}
                },
                r = self.client.read_buf(&mut self.client_buf) => match r {
                    Ok(0) | Err(_) => return Ok(Flow::Close),
                    Ok(n) => self.app.metrics.client_bytes_in.inc_by(n as u64),
                },
            }
        }
    }
}
