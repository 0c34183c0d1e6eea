//! pgcache's own queries on a client's backend connection ("hidden
//! queries"): the session's settings, which only its own backend can tell,
//! and catalog facts when pgcache has no connection of its own. They run
//! only while the backend is idle ([`Session::backend_idle`]), so they can
//! never interleave with the client's work.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::engine::{HiddenAnswer, HiddenStep};
use super::link::Link;
use super::relay::Session;
use crate::cache::catalog::fetch::{Lookup, Rows};
use crate::protocol::messages;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Looks up the catalog facts the database's sessions asked for on
    /// this session's idle backend: pgcache cannot open a connection of
    /// its own ([`Need::Facts`](super::engine::Need::Facts)).
    pub(super) async fn look_up_facts(&mut self) -> Result<(), SessionError> {
        let db = Arc::clone(self.engine.db());
        if !self.backend_idle() {
            return Ok(());
        }
        let wanted = db.catalog.take_wanted();
        if wanted.is_empty() {
            return Ok(());
        }
        let publication = self.app.publication();
        let mut lookup = Lookup::new(&wanted, publication.as_deref());
        while let Some(sql) = lookup.next_query() {
            match Box::pin(self.hidden_query(&sql)).await {
                Ok(Some(rows)) => lookup.add(&rows),
                Ok(None) => {
                    db.catalog.abandon(&wanted);
                    return Ok(());
                }
                Err(e) => {
                    db.catalog.abandon(&wanted);
                    return Err(e);
                }
            }
        }
        db.catalog.install(&wanted, lookup.finish());
        Ok(())
    }

    /// Runs pgcache's own query on the idle backend (taking one from the
    /// pool in transaction mode) and returns its rows as text, or `None` if
    /// it failed. It leaves the client's unnamed statement and portal alone
    /// ([`messages::hidden_query`]).
    pub(super) async fn hidden_query(&mut self, sql: &str) -> Result<Option<Rows>, SessionError> {
        match self.attach(false).await {
            Ok(()) => {}
            Err(SessionError::Pool(e)) => {
                // No connection: the statement goes on without the
                // answer, and fails at once with the same error.
                if let Link::Pooled(link) = self.engine.link_mut() {
                    link.no_connection = Some(Box::new(e));
                }
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
        Ok(self.run_hidden(&messages::hidden_query(sql)).await?.ok())
    }

    /// Sends `request` (ending in one Sync or one simple Query) on the idle
    /// backend and reads its answer, as the engine takes it
    /// ([`super::engine::HiddenStep`]): the rows as text, or PostgreSQL's
    /// ErrorResponse (`None` when the rows could not be read).
    pub(super) async fn run_hidden(
        &mut self,
        request: &[u8],
    ) -> Result<Result<Rows, Option<bytes::BytesMut>>, SessionError> {
        self.server()?
            .write_all(request)
            .await
            .map_err(SessionError::BackendIo)?;
        let mut answer = HiddenAnswer::default();
        loop {
            let frame = match self.server()?.read_frame().await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(SessionError::BackendIo(eof));
                }
                Err(crate::protocol::stream::ReadError::Io(e)) => {
                    return Err(SessionError::BackendIo(e));
                }
                Err(e) => return Err(SessionError::BackendFrame(e)),
            };
            match self.engine.on_hidden_frame(&mut answer, frame) {
                HiddenStep::More => {}
                HiddenStep::ToClient(frame) => self
                    .client
                    .write_all(&frame)
                    .await
                    .map_err(SessionError::ClientIo)?,
                HiddenStep::Done(result) => return Ok(result),
            }
        }
    }
}
