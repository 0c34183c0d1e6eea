//! The driver's traffic: client frames through the engine to the backend
//! (or answered by it), the backend's answers through the engine to the
//! client, and what the engine asked for carried out in between.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{debug, info};

use super::SessionError;
use super::engine::{Action, LinkStep, ReadyBatch, ReplicaStep};
use super::offload;
use super::pipeline::Flow;
use super::relay::{Session, ctx};
use crate::backend::BackendStream;
use crate::protocol::stream::FramedStream;
use crate::replica::ReplicaConn;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Relays every complete backend frame now buffered to the client,
    /// as the engine has it.
    pub(super) async fn on_backend_data(&mut self) -> Result<Flow, SessionError> {
        if self.backend.is_none() {
            return Ok(Flow::Continue);
        }
        let answering = self.engine.answering_login();
        self.relay_from(Leg::Primary).await?;
        if self.learning.is_some() && !self.engine.relaying_login() {
            // The pool's lesson in how to log in is this login's no more.
            self.learning = None;
        }
        if let Some(backend) = &mut self.backend {
            backend.shrink_if_empty();
        }
        if self.engine.draining() {
            return Ok(self.close_if_drained().await);
        }
        if self.engine.link().is_pooled() {
            self.detach_if_idle().await?;
        }
        if answering && !self.engine.answering_login() && !self.client.buffered().is_empty() {
            // What the client sent while pgcache logged in for it.
            return Box::pin(self.on_client_data()).await;
        }
        Ok(Flow::Continue)
    }

    /// Every complete frame buffered from a server leg, through the
    /// engine: what the server is owed written to it first, then the
    /// engine's actions, then the client's bytes.
    pub(super) async fn relay_from(&mut self, leg: Leg) -> Result<(), SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        let Some(stream) = leg.of(&mut self.backend, &mut self.replica) else {
            return Ok(());
        };
        let relayed = self.engine.on_backend(&ctx, stream.buffer_mut())?;
        if leg == Leg::Primary {
            // A login's answer, a retry: the server is waiting for it.
            self.flush_server().await?;
        }
        if self.engine.has_actions() {
            self.carry_out().await;
        }
        let Some(stream) = leg.of(&mut self.backend, &mut self.replica) else {
            return Ok(());
        };
        if relayed.end == 0 {
            return Ok(());
        }
        let bytes = self.engine.for_client(stream.buffered(), &relayed);
        self.app.metrics.client_bytes_out.inc_by(bytes.len() as u64);
        let sent = match bytes.is_empty() {
            true => Ok(()),
            false => self.client.write_all(bytes).await,
        };
        self.engine.client_sent();
        stream.consume(relayed.end);
        if let Err(e) = sent {
            self.client_gone().await;
            return Err(SessionError::ClientIo(e));
        }
        Ok(())
    }

    /// Does what the engine asked for, in order.
    pub(super) async fn carry_out(&mut self) {
        for action in self.engine.take_actions() {
            match action {
                // Boxed: a Redis round trip is a large future, and rare.
                Action::Publish(publication) => Box::pin(publication.send()).await,
                Action::Mirror(table) => {
                    Box::pin(self.app.cache.mirror_rows(self.engine.db(), &table)).await
                }
                Action::Store(fill, bytes) => self.app.cache.store(*fill, &bytes),
                Action::Watch => self.app.streams.ensure(self.engine.db()),
                Action::Fetch => self.app.fetch_catalog(self.engine.db()),
                Action::Offload(errand, mut capture) => {
                    let app = Arc::clone(&self.app);
                    tokio::spawn(async move {
                        let max_entry = app.cache.local.max_entry_bytes();
                        let config = app.config();
                        let on = (&*app.pool.pooled, &*app.upstream, &config.pool);
                        let sink = |frame: &[u8]| capture.add(frame, max_entry);
                        let result = errand.run(on, sink).await;
                        offload::finish(&app, capture, result);
                    });
                }
            }
        }
    }

    /// Relays every complete client frame now buffered to the backend.
    pub(super) async fn on_client_data(&mut self) -> Result<Flow, SessionError> {
        let flow = if self.engine.answering_login() {
            // It waits until pgcache has logged in for it.
            return Ok(Flow::Continue);
        } else if self.engine.relaying_login() || !self.engine.caching() {
            self.pass_through().await?
        } else {
            self.decide_client_frames().await?
        };
        self.client.shrink_if_empty();
        if flow == Flow::Continue && self.engine.link().is_pooled() {
            // Only pgcache's own queries may have needed a connection.
            self.detach_if_idle().await?;
        }
        Ok(flow)
    }

    /// Caching off, or a login's exchange relayed: the run of frames
    /// buffered, staged untouched as the engine allows, then written.
    async fn pass_through(&mut self) -> Result<Flow, SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        let max_frame = self.client.max_frame();
        let run = self
            .engine
            .relay_client(&ctx, self.client.buffered(), max_frame)?;
        self.client.consume(run.taken);
        // What came before a bad frame still goes out.
        self.flush_backend().await?;
        match run.violation {
            Some(e) => Err(SessionError::ClientFrame(e)),
            None => Ok(run.flow),
        }
    }

    /// Caching on: each frame (or a whole batch at once) decided by the
    /// engine.
    async fn decide_client_frames(&mut self) -> Result<Flow, SessionError> {
        let mut flow = Flow::Continue;
        // A read on a replica holds the client's next frames until it
        // is answered.
        while flow == Flow::Continue && !self.engine.replica_busy() {
            let ctx = ctx(&self.app, &self.entry);
            let max_frame = self.client.max_frame();
            if let Some(ready) = self
                .engine
                .whole_batch(&ctx, self.client.buffered(), max_frame)
            {
                self.on_whole_batch(ready).await?;
                continue;
            }
            match self.client.next_frame() {
                Ok(Some(frame)) => flow = self.on_client_frame(frame.freeze()).await?,
                Ok(None) => break,
                Err(e) => {
                    // What came before the bad frame still goes out.
                    self.flush_backend().await?;
                    return Err(e.into());
                }
            }
        }
        self.flush_backend().await?;
        self.flush_replica().await?;
        Ok(flow)
    }

    /// One complete client frame, with caching on: decided by the engine,
    /// once it has what it needs.
    async fn on_client_frame(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        let flow = loop {
            let ctx = ctx(&self.app, &self.entry);
            match self.engine.on_client_frame(&ctx, &frame) {
                Ok(flow) => break flow,
                Err(need) => Box::pin(self.meet(need)).await?,
            }
        };
        if self.engine.has_actions() {
            self.carry_out().await;
        }
        self.flush_out().await?;
        Ok(flow)
    }

    /// A batch the engine found whole at the start of the client's buffer.
    async fn on_whole_batch(&mut self, ready: ReadyBatch) -> Result<(), SessionError> {
        loop {
            let ctx = ctx(&self.app, &self.entry);
            let request = &self.client.buffered()[..ready.len];
            match self.engine.on_whole_batch(&ctx, &ready, request) {
                Ok(()) => break,
                Err(need) => Box::pin(self.meet(need)).await?,
            }
        }
        self.client.consume(ready.len);
        if self.engine.has_actions() {
            self.carry_out().await;
        }
        self.flush_out().await
    }

    /// Writes what the server connection is owed as it is.
    pub(super) async fn flush_server(&mut self) -> Result<(), SessionError> {
        if let Some(bytes) = self.engine.take_to_server() {
            let r = self.server()?.write_all(&bytes).await;
            r.map_err(SessionError::BackendIo)?;
        }
        Ok(())
    }

    /// Writes what pgcache staged in `out` to the client.
    pub(super) async fn flush_out(&mut self) -> Result<(), SessionError> {
        if self.engine.out().is_empty() {
            return Ok(());
        }
        let r = self.client.write_all(self.engine.out()).await;
        self.engine.client_sent();
        r.map_err(SessionError::ClientIo)
    }

    /// Writes the queued client frames to the backend, taking a pooled
    /// connection first if the session holds none.
    pub(super) async fn flush_backend(&mut self) -> Result<(), SessionError> {
        // What the server is owed as it is goes first (a login's frames).
        self.flush_server().await?;
        if self.engine.link_step(self.attached(), self.unread()) == Some(LinkStep::CheckOut) {
            // Boxed: taking a connection is a large future, and the
            // session waits on its client far more often.
            if let Err(e) = Box::pin(self.attach(true)).await {
                self.engine.checkout_failed(e)?;
                return self.flush_out().await;
            }
        }
        if !self.engine.pipeline().to_backend.is_empty() {
            let (staged, answers) = self.engine.staged(&self.app);
            let r = match &mut self.backend {
                Some(backend) => backend.write_all(staged).await,
                None => Err(std::io::ErrorKind::NotConnected.into()),
            };
            staged.clear();
            if staged.capacity() > 1 << 20 {
                *staged = BytesMut::new();
            }
            r.map_err(SessionError::BackendIo)?;
            if !answers.is_empty() {
                let not_connected = || std::io::ErrorKind::NotConnected.into();
                let backend = self.backend.as_mut().ok_or_else(not_connected);
                let backend = backend.map_err(SessionError::BackendIo)?;
                self.engine.splice(backend.buffer_mut(), &answers);
                Box::pin(self.on_backend_data()).await?;
            }
        }
        Ok(())
    }
}

/// Reads routed to a replica ([`super::replica`]).
impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Writes the read the engine routed to a replica, with what it needs
    /// first ([`ReplicaStep`]). A replica that cannot take it leaves the
    /// read to the primary.
    pub(super) async fn flush_replica(&mut self) -> Result<(), SessionError> {
        if !self.engine.replica_chosen() {
            // Most reads: nothing routed, and no boxed future made for it.
            return Ok(());
        }
        match Box::pin(self.send_replica()).await {
            Ok(false) => Ok(()),
            Ok(true) => {
                let key = self.replica.as_ref().map(|c| Arc::clone(&c.key));
                self.engine.cancel_towards(key);
                Ok(())
            }
            Err(why) => {
                let name = self.engine.replica().map(|leg| leg.server.name.clone());
                debug!(replica = ?name, "read sent to the primary: {why}");
                self.replica = None;
                if !self.engine.on_replica_lost() {
                    return self.flush_out().await;
                }
                Box::pin(self.flush_backend()).await
            }
        }
    }

    /// Carries out the steps of a read routed to a replica, to its write:
    /// true once written, false if none waited.
    async fn send_replica(&mut self) -> Result<bool, String> {
        loop {
            let held = self.replica.as_ref().map(|conn| &conn.server);
            let Some(step) = self.engine.replica_step(held, Instant::now()) else {
                return Ok(false);
            };
            match step {
                ReplicaStep::Fail(why) => return Err(why.into()),
                ReplicaStep::Connect {
                    server,
                    pool,
                    pooled,
                } => {
                    if let Some(old) = self.replica.take() {
                        old.close().await;
                    }
                    let (client, ids) = (self.entry.client.id, &self.app.pool.pooled);
                    let (conn, applied, prepared) = match pooled {
                        false => {
                            let conn = ReplicaConn::open(&pool, &server, ids.server_id(), client);
                            (conn.await?, 0, Default::default())
                        }
                        true => ReplicaConn::lease(&pool, &server, ids, client)
                            .await
                            .map_err(|e| e.to_string())?,
                    };
                    self.engine
                        .replica_connected(applied, prepared, conn.opened);
                    self.replica = Some(Box::new(conn));
                }
                ReplicaStep::Apply(sql) => {
                    let conn = self.replica.as_mut().ok_or("no replica connection")?;
                    conn.apply(&sql).await?;
                    self.engine.replica_settings_applied();
                }
                ReplicaStep::Write(read) => {
                    let conn = self.replica.as_mut().ok_or("no replica connection")?;
                    conn.set_active(true);
                    let written = conn.stream.write_all(&read).await;
                    return written.map(|()| true).map_err(|e| e.to_string());
                }
            }
        }
    }

    /// A read on the replica is answered: a pooled connection goes back to
    /// the replica's pool with the books the leg kept of it.
    fn replica_read_done(&mut self) {
        let Some(conn) = self.replica.take() else {
            return;
        };
        conn.set_active(false);
        if conn.is_own() {
            self.replica = Some(conn);
            return;
        }
        let Some(lifetime) = self.engine.pooled_lifetime(&self.app) else {
            return;
        };
        if let Some((applied, prepared)) = self.engine.replica_books() {
            (*conn).give_back(applied, prepared, lifetime);
        }
    }

    /// The replica's answer, as the engine has it, to the client; once
    /// the read is answered, the cancel key is the primary's again and
    /// what waited goes on: a retry to the primary, the client's next
    /// frames.
    pub(super) async fn on_replica_data(&mut self) -> Result<Flow, SessionError> {
        self.relay_from(Leg::Replica).await?;
        if self.engine.replica_busy() {
            return Ok(Flow::Continue);
        }
        self.replica_read_done();
        self.engine.retarget_cancel();
        self.flush_backend().await?;
        if !self.client.buffered().is_empty() {
            return Box::pin(self.on_client_data()).await;
        }
        Ok(Flow::Continue)
    }

    /// The replica's connection ended or failed while a read was there:
    /// the read goes to the primary if none of its answer reached the
    /// client, else the client is told it failed.
    pub(super) async fn replica_lost(
        &mut self,
        error: Option<std::io::Error>,
    ) -> Result<Flow, SessionError> {
        let name = self.replica.take().map(|c| c.server.name.clone());
        info!(replica = ?name, error = ?error, "replica connection lost");
        match self.engine.on_replica_lost() {
            true => self.flush_backend().await?,
            false => self.flush_out().await?,
        }
        if !self.client.buffered().is_empty() {
            return Box::pin(self.on_client_data()).await;
        }
        Ok(Flow::Continue)
    }
}

/// A server leg of the session: the primary's connection, or a replica's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leg {
    Primary,
    Replica,
}

impl Leg {
    /// The leg's connection, if the session holds one.
    fn of<'a>(
        self,
        backend: &'a mut Option<FramedStream<BackendStream>>,
        replica: &'a mut Option<Box<ReplicaConn>>,
    ) -> Option<&'a mut FramedStream<BackendStream>> {
        match self {
            Leg::Primary => backend.as_mut(),
            Leg::Replica => replica.as_mut().map(|conn| &mut conn.stream),
        }
    }
}
