//! Where a session's server connections come from and go back to: in
//! transaction mode, a connection taken from the pool when a request has
//! to go to PostgreSQL and given back once the session is idle (its
//! settings read back first if they may have changed); in session mode,
//! the connection parked for the next client at a clean Terminate.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::engine::{Greeting, LinkStep, Parting};
use super::relay::Session;
use super::reuse::Fate;
use crate::backend::BackendStream;
use crate::pool::Server;
use crate::pool::clients::Activity;
use crate::protocol::messages;
use crate::protocol::stream::FramedStream;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    pub(super) fn attached(&self) -> bool {
        self.backend.is_some()
    }

    /// The held connection; writing to none fails as a closed one would.
    pub(super) fn server(&mut self) -> Result<&mut FramedStream<BackendStream>, SessionError> {
        self.backend
            .as_mut()
            .ok_or_else(|| SessionError::BackendIo(std::io::ErrorKind::NotConnected.into()))
    }

    /// The held connection sent bytes not read yet.
    pub(super) fn unread(&self) -> bool {
        self.backend
            .as_ref()
            .is_some_and(|b| !b.buffered().is_empty())
    }

    /// Transaction mode, with no connection: takes one from the pool and
    /// gives it the client's settings
    /// ([`super::link::PooledLink::granted`]).
    pub(super) async fn attach(&mut self, queued: bool) -> Result<(), SessionError> {
        self.take_connection(queued).await?;
        self.converse().await
    }

    /// Takes a connection from the pool, if the session holds none; the
    /// client's settings are the first own query asked on it.
    pub(super) async fn take_connection(&mut self, queued: bool) -> Result<(), SessionError> {
        if self.attached() {
            return Ok(());
        }
        let Some((pool, wait)) = self.engine.checkout(&self.app)? else {
            return Ok(());
        };
        tracing::trace!(status = ?self.engine.tx_status(), "taking a server connection");
        let client = Arc::clone(&self.entry.client);
        client.set(Activity::Waiting);
        let taken = self
            .app
            .pool
            .pooled
            .checkout(&pool, &self.app.upstream, wait, client.id)
            .await;
        let (lease, stream) = match taken {
            Ok(taken) => taken,
            Err(e) => {
                client.set(Activity::Idle);
                return Err(SessionError::Pool(e));
            }
        };
        let server = lease.server();
        client.hold(server.id, server.key.backend_pid);
        self.backend = Some(stream);
        // One address for the whole pool: copied once, not per checkout.
        self.engine.attach_server(&server.addr, server.key.clone());
        self.engine.granted(lease, queued);
        Ok(())
    }

    /// Transaction mode: gives the connection back once the session is
    /// idle, reading its settings first if they may have changed, as
    /// [`Engine::link_step`](super::engine::Engine::link_step) says.
    pub(super) async fn detach_if_idle(&mut self) -> Result<(), SessionError> {
        loop {
            match self.engine.link_step(self.attached(), self.unread()) {
                Some(LinkStep::ReadBack) => {
                    // Unreadable, the connection is closed, not given back.
                    self.engine.read_back();
                    Box::pin(self.converse()).await?;
                }
                Some(LinkStep::GiveBack) => return self.give_back(false).await,
                Some(LinkStep::Close) => return self.give_back(true).await,
                Some(LinkStep::CheckOut) | None => return Ok(()),
            }
        }
    }

    /// Hands the held connection back to its pool, or closes it: with
    /// `close` (see [`LinkStep::Close`]), and the one the client logged in
    /// on, which no pool owns.
    async fn give_back(&mut self, close: bool) -> Result<(), SessionError> {
        tracing::trace!(status = ?self.engine.tx_status(), "giving the server connection back");
        if !self.engine.link().is_pooled() {
            return Ok(());
        }
        let Some(mut stream) = self.backend.take() else {
            return Ok(());
        };
        match self.engine.part(&self.app, close) {
            Some(Parting::Back(lease, lifetime)) => lease.give_back(stream, lifetime),
            _ => {
                let _ = stream.write_all(&messages::TERMINATE).await;
            }
        }
        self.detached_now();
        Ok(())
    }

    /// The session holds no connection any more.
    fn detached_now(&mut self) {
        self.engine.detach_server();
        self.entry.client.hold(0, 0);
    }

    /// Closes the held connection: it is in a state no other client may
    /// see.
    pub(super) fn drop_backend(&mut self) {
        self.engine.drop_server();
        self.backend = None;
        self.detached_now();
    }

    /// At the session's end: an idle pooled connection goes back to the
    /// pool; any other is closed.
    pub(super) fn release_at_end(&mut self) {
        if !self.attached() || !self.engine.link().is_pooled() {
            return;
        }
        let unread = self.unread();
        let Some(mut stream) = self.backend.take() else {
            return;
        };
        match self.engine.part_at_end(&self.app, unread) {
            Some(Parting::Back(lease, lifetime)) => lease.give_back(stream, lifetime),
            _ => {
                tokio::spawn(async move {
                    let _ = stream.write_all(&messages::TERMINATE).await;
                });
                self.drop_backend();
            }
        }
    }

    /// Transaction mode, for a client pgcache can log in for: the
    /// greeting, as the engine has it ([`super::engine::Greeting`]), with
    /// no connection taken unless it needs one.
    pub(super) async fn greet(&mut self) -> Result<(), SessionError> {
        loop {
            let ctx = super::relay::ctx(&self.app, &self.entry);
            if self.engine.greet(&ctx, self.attached()) == Greeting::Greeted {
                break;
            }
            self.attach(false).await?;
        }
        self.carry_out().await;
        self.flush_out().await?;
        self.detach_if_idle().await
    }

    /// The backend connection, if this session handed it back clean.
    pub fn into_server(self, checked_by_pgcache: bool) -> Option<Server> {
        if self.engine.server().fate == Fate::Tainted {
            self.app.metrics.pool.closed_tainted.inc();
        }
        let unread = self.unread();
        let (key, addr, book) = self.engine.into_server_book(unread, checked_by_pgcache)?;
        Some(book.park(self.backend?, &key, addr))
    }
}
