//! A session's login to PostgreSQL: relayed for the client (passthrough),
//! through the session's loop as the engine decides frame by frame
//! ([`super::engine::AuthStep`]), or made by pgcache for a client it
//! authenticated itself (terminate). See [`crate::auth`].

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::info;

use super::SessionError;
use super::pipeline::Flow;
use super::relay::{Session, ctx};
use crate::auth::{self, LoginError};
use crate::protocol::sqlstate;
use crate::scram::ClientSecret;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Starts the login to PostgreSQL. Passthrough: the StartupMessage is
    /// sent and the exchange that follows is the session loop's. Terminate:
    /// pgcache logs in; `Flow::Continue` leaves PostgreSQL's
    /// AuthenticationOk and what follows in the backend's buffer.
    pub(super) async fn log_in(
        &mut self,
        startup_raw: &[u8],
        secret: Option<Box<ClientSecret>>,
    ) -> Result<Flow, SessionError> {
        let app = std::sync::Arc::clone(&self.app);
        let startup_raw = &*app.upstream.origin.client_startup(startup_raw);
        let Some(secret) = secret else {
            self.engine.relay_login();
            self.server()?
                .write_all(startup_raw)
                .await
                .map_err(SessionError::BackendIo)?;
            return Ok(Flow::Continue);
        };
        let user = self.engine.startup().user().to_owned();
        let connect_timeout = self.app.upstream.connect_timeout;
        let login = auth::login_backend(self.server()?, startup_raw, &user, &secret);
        let result = tokio::time::timeout(connect_timeout, login).await;
        let message = match result {
            Ok(Ok(())) => {
                self.engine.login_over(&ctx(&self.app, &self.entry));
                return Ok(Flow::Continue);
            }
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

    /// While a login is relayed: the client's frames go to PostgreSQL,
    /// unless the engine refuses one.
    pub(super) async fn relay_client_auth(&mut self) -> Result<(), SessionError> {
        let mut pos = 0;
        let ctx = ctx(&self.app, &self.entry);
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
