//! A session's login to PostgreSQL: relayed for the client (passthrough),
//! or answered by pgcache for a client it authenticated itself
//! (terminate), through the session's loop as the engine decides frame by
//! frame ([`super::engine::AuthStep`]). See [`crate::auth`].

use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::pipeline::Flow;
use super::relay::Session;
use crate::scram::ClientSecret;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Starts the login to PostgreSQL: the StartupMessage is sent, and
    /// the exchange that follows is the session loop's, relayed for the
    /// client (passthrough) or answered by pgcache with the secret of a
    /// client it authenticated (terminate).
    pub(super) async fn log_in(
        &mut self,
        startup_raw: &[u8],
        secret: Option<Box<ClientSecret>>,
    ) -> Result<Flow, SessionError> {
        let app = std::sync::Arc::clone(&self.app);
        match secret {
            Some(secret) => {
                let timeout = app.upstream.connect_timeout;
                self.engine.answer_login(*secret, Instant::now(), timeout);
            }
            None => self.engine.relay_login(),
        }
        self.server()?
            .write_all(&app.upstream.origin.client_startup(startup_raw))
            .await
            .map_err(SessionError::BackendIo)?;
        Ok(Flow::Continue)
    }
}
