//! pgcache's own queries on a client's server connection, carried out:
//! the engine asks them and takes their answers
//! ([`super::engine::OwnStep`]); the driver takes a connection for them
//! in transaction mode, sends them, and reads their answers.

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::engine::{OwnStep, Verdict};
use super::link::Link;
use super::relay::{Session, ctx};
use crate::protocol::stream::ReadError;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Runs the own queries the engine asked, to the last answer; then the
    /// connection is closed if the engine could not take an answer.
    pub(super) async fn converse(&mut self) -> Result<(), SessionError> {
        while self.engine.own_pending() {
            if !self.attached() {
                match Box::pin(self.take_connection(false)).await {
                    Ok(()) => {}
                    Err(SessionError::Pool(e)) => {
                        // No connection: what waited goes on without the
                        // answer, and the statement fails at once with
                        // the same error.
                        if let Link::Pooled(link) = self.engine.link_mut() {
                            link.no_connection = Some(Box::new(e));
                        }
                        self.engine.own_unanswered(&ctx(&self.app, &self.entry));
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let Some(request) = self.engine.own_request() else {
                break;
            };
            self.server()?
                .write_all(&request)
                .await
                .map_err(SessionError::BackendIo)?;
            loop {
                let frame = match self.server()?.read_frame().await {
                    Ok(Some(frame)) => frame,
                    Ok(None) => {
                        let eof = std::io::ErrorKind::UnexpectedEof.into();
                        return Err(SessionError::BackendIo(eof));
                    }
                    Err(ReadError::Io(e)) => return Err(SessionError::BackendIo(e)),
                    Err(e) => return Err(SessionError::BackendFrame(e)),
                };
                match self
                    .engine
                    .on_own_frame(&ctx(&self.app, &self.entry), frame)
                {
                    OwnStep::Read => {}
                    OwnStep::ToClient(frame) => self
                        .client
                        .write_all(&frame)
                        .await
                        .map_err(SessionError::ClientIo)?,
                    OwnStep::Answered => break,
                }
            }
        }
        match self.engine.take_verdict() {
            None => Ok(()),
            Some(Verdict::Close) => {
                self.drop_backend();
                Ok(())
            }
            Some(Verdict::Fail(e)) => {
                self.drop_backend();
                Err(e)
            }
        }
    }
}
