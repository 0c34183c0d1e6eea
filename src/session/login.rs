//! A session's login to PostgreSQL, up to AuthenticationOk: relayed for
//! the client (passthrough), or made by pgcache for a client it
//! authenticated itself (terminate). See [`crate::auth`].

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::info;

use super::SessionError;
use super::engine::AuthStep;
use super::pipeline::Flow;
use super::relay::Session;
use crate::auth::{self, LoginError};
use crate::protocol::sqlstate;
use crate::scram::ClientSecret;

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

    /// Passthrough: relays the exchange both ways, as the engine decides
    /// frame by frame ([`super::engine::AuthStep`]). Stops at
    /// AuthenticationOk, left unread.
    async fn relay_authentication(&mut self) -> Result<Flow, SessionError> {
        let force = self.app.force.clone();
        loop {
            if self.relay_backend_auth().await? {
                return Ok(Flow::Continue);
            }
            self.relay_client_auth().await?;
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
    async fn relay_backend_auth(&mut self) -> Result<bool, SessionError> {
        let mut pos = 0;
        let mut done = false;
        let not_connected = || SessionError::BackendIo(std::io::ErrorKind::NotConnected.into());
        let backend = self.backend.as_mut().ok_or_else(not_connected)?;
        while let Some(len) = backend
            .frame_len_at(pos)
            .map_err(|e| SessionError::BackendFrame(e.into()))?
        {
            let frame = &backend.buffered()[pos..pos + len];
            if self.engine.on_auth_backend_frame(frame) == AuthStep::Done {
                done = true;
                break;
            }
            pos += len;
        }
        backend.consume(pos);
        self.flush_out().await?;
        Ok(done)
    }

    /// Relays the client's authentication frames to PostgreSQL, unless the
    /// engine refuses one.
    async fn relay_client_auth(&mut self) -> Result<(), SessionError> {
        let mut pos = 0;
        let ctx = super::relay::ctx(&self.app, &self.entry);
        while let Some(len) = self.client.frame_len_at(pos)? {
            let frame = &self.client.buffered()[pos..pos + len];
            self.engine.on_auth_client_frame(&ctx, frame)?;
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
