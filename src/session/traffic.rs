//! The driver's traffic: what arrived from each leg handed to the engine,
//! and what the engine asks for carried out in its order
//! ([`Engine::poll_io`](super::engine::Engine::poll_io)): the only awaits
//! here are writes, reads, and the waits a decision needs met.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{debug, info};

use super::SessionError;
use super::engine::{Action, Held, Io, Leg, Need, Relayed, ReplicaStep};
use super::offload;
use super::pipeline::Flow;
use super::relay::{Session, ctx};
use crate::backend::BackendStream;
use crate::invalidation::take_out_for_unlogged;
use crate::pool::clients::Activity;
use crate::protocol::stream::FramedStream;
use crate::replica::ReplicaConn;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Hands the engine every complete backend frame now buffered, and
    /// carries out what it asks; draining, the session ends as soon as the
    /// engine says it may.
    pub(super) async fn on_backend_data(&mut self) -> Result<Flow, SessionError> {
        self.feed(Leg::Primary)?;
        let flow = self.pump().await?;
        if let Some(backend) = &mut self.backend {
            backend.shrink_if_empty();
        }
        match self.engine.draining() {
            true => self.drained(),
            false => Ok(flow),
        }
    }

    /// The client sent bytes: they are the engine's to take.
    pub(super) async fn on_client_data(&mut self) -> Result<Flow, SessionError> {
        self.engine.client_arrived();
        self.pump().await
    }

    /// Hands the engine every complete frame buffered from a server leg:
    /// what the client is sent of them waits for [`Io::Relay`].
    fn feed(&mut self, leg: Leg) -> Result<(), SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        match leg.of(&mut self.backend, &mut self.replica) {
            Some(stream) => self.engine.on_server_data(&ctx, leg, stream.buffer_mut()),
            None => Ok(()),
        }
    }

    /// Writes to the client what it is sent of the bytes the engine
    /// handled from a server leg, and drops them from the leg's buffer.
    async fn relay_out(&mut self, leg: Leg, relayed: Relayed) -> Result<(), SessionError> {
        let Some(stream) = leg.of(&mut self.backend, &mut self.replica) else {
            return Ok(());
        };
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

    /// Gets what the engine needs to decide on a frame, and tells it:
    /// the cache's waits, pgcache's own queries, catalog facts being
    /// fetched, and what a statement needs of pgcache before it goes out
    /// (see [`crate::classify::prerequisites`]): databases pgcache lets go
    /// of, tables taken out of its publication.
    async fn meet(&mut self, need: Need) -> Result<(), SessionError> {
        match need {
            Need::Prerequisites(needs) => {
                let db = self.engine.startup().database().to_owned();
                for name in &needs.free_databases {
                    if let Some(paused) = self.app.streams.release(name, &db).await {
                        self.engine.hold_paused(paused);
                    }
                }
                if let Some(publication) = self.app.publication() {
                    for table in &needs.unpublish {
                        take_out_for_unlogged(&self.app.upstream, &db, &publication, table).await;
                    }
                }
                self.engine.prerequisites_met();
            }
            // Asked of the driver next ([`Io::Own`]).
            Need::Own => {}
            Need::Fetched { rels, funcs } => {
                let rels: Vec<&str> = rels.iter().map(String::as_str).collect();
                let funcs: Vec<&str> = funcs.iter().map(String::as_str).collect();
                let wait = self.engine.first_read_wait();
                let db = self.engine.db();
                // Asked for with the statement's other actions, which run
                // once it is decided: the fetch must start now.
                self.app.fetch_catalog(db);
                let facts = (&rels[..], &funcs[..]);
                self.app.cache.wait_for_facts(db, facts, wait).await;
                self.engine.facts_met();
            }
            Need::Cache(wait) => self.app.cache.wait(wait, self.engine.lookup_waited()).await,
        }
        Ok(())
    }

    /// Carries out what the engine asks, in its order, until it asks
    /// nothing: the session's flow then, or the error of a bad frame from
    /// the client once what came before it is written.
    pub(super) async fn pump(&mut self) -> Result<Flow, SessionError> {
        let mut bad_frame = None;
        loop {
            let held = Held {
                attached: self.attached(),
                unread: self.unread(),
                client: !self.client.buffered().is_empty(),
            };
            match self.engine.poll_io(&self.app, held) {
                Io::Idle => break,
                Io::TakeClient => {
                    let ctx = ctx(&self.app, &self.entry);
                    let (max_frame, buf) = (self.client.max_frame(), self.client.buffer_mut());
                    match self.engine.on_client_data(&ctx, buf, max_frame) {
                        Ok(None) => {}
                        Ok(Some(need)) => Box::pin(self.meet(need)).await?,
                        Err(e @ SessionError::ClientFrame(_)) => bad_frame = Some(e),
                        Err(e) => return Err(e),
                    }
                }
                Io::ToServer(bytes) => {
                    let r = self.server()?.write_all(&bytes).await;
                    r.map_err(SessionError::BackendIo)?;
                }
                Io::Act(action) => self.act(action).await,
                Io::Relay(leg, relayed) => self.relay_out(leg, relayed).await?,
                Io::CheckOut { queued } => {
                    // Boxed: taking a connection is a large future, and rare.
                    if let Err(e) = Box::pin(self.check_out(queued)).await {
                        let ctx = ctx(&self.app, &self.entry);
                        self.engine.checkout_failed(&ctx, e)?;
                    }
                }
                Io::Own(request) => Box::pin(self.own(request)).await?,
                Io::Drop(error) => {
                    self.drop_backend();
                    if let Some(e) = error {
                        return Err(e);
                    }
                }
                Io::ToClient => self.flush_out().await?,
                Io::Staged => self.write_staged().await?,
                Io::Replica => Box::pin(self.replica_step()).await,
                Io::ReplicaDone => self.replica_read_done(),
                Io::Part(parting) => self.let_go(parting),
            }
        }
        if self.learning.is_some() && !self.engine.relaying_login() {
            // The pool's lesson in how to log in is this login's no more.
            self.learning = None;
        }
        self.client.shrink_if_empty();
        bad_frame.map_or(Ok(self.engine.flow()), Err)
    }

    /// Does one thing the engine asked for.
    async fn act(&mut self, action: Action) {
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

    /// Sends one of pgcache's own queries, if one is to be sent, and reads
    /// the primary's answer as any other ([`Self::relay_from`]).
    async fn own(&mut self, request: Option<BytesMut>) -> Result<(), SessionError> {
        if let Some(request) = request {
            let r = self.server()?.write_all(&request).await;
            r.map_err(SessionError::BackendIo)?;
        }
        match self.server()?.fill().await {
            Ok(0) => Err(SessionError::BackendIo(
                std::io::ErrorKind::UnexpectedEof.into(),
            )),
            Ok(_) => self.feed(Leg::Primary),
            Err(e) => Err(SessionError::BackendIo(e)),
        }
    }

    /// Writes what pgcache staged to the client.
    pub(super) async fn flush_out(&mut self) -> Result<(), SessionError> {
        let r = self.client.write_all(self.engine.out()).await;
        self.engine.client_sent();
        r.map_err(SessionError::ClientIo)
    }

    /// Writes the requests staged for the primary; the answers pgcache
    /// gave in its place are read after what the primary sent before.
    async fn write_staged(&mut self) -> Result<(), SessionError> {
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
        if let (false, Some(backend)) = (answers.is_empty(), &mut self.backend) {
            self.engine.splice(backend.buffer_mut(), &answers);
            self.feed(Leg::Primary)?;
        }
        Ok(())
    }

    /// Transaction mode: takes a connection from the pool, if the session
    /// holds none (`queued`: for the client's requests, which the pool's
    /// queue may hold). The engine puts the client's settings on it first.
    pub(super) async fn check_out(&mut self, queued: bool) -> Result<(), SessionError> {
        if self.attached() {
            return Ok(());
        }
        let Some((pool, wait)) = self.engine.checkout(&self.app)? else {
            return Err(SessionError::BackendIo(
                std::io::ErrorKind::NotConnected.into(),
            ));
        };
        tracing::trace!(status = ?self.engine.tx_status(), "taking a server connection");
        let client = Arc::clone(&self.entry.client);
        client.set(Activity::Waiting);
        let taken = self
            .app
            .pool
            .pooled
            .checkout(&pool, &self.app.upstream, wait, client.id);
        let (lease, stream) = match taken.await {
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
}

/// Reads routed to a replica ([`super::replica`]).
impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// One step of the read the engine routed to a replica
    /// ([`ReplicaStep`]): the settle loop polls again for the next. A
    /// replica that cannot take the read leaves it to the primary.
    async fn replica_step(&mut self) {
        let held = self.replica.as_ref().map(|conn| &conn.server);
        let step = self.engine.replica_step(held, Instant::now());
        if let Err(why) = self.take_replica_step(step).await {
            let name = self.engine.replica().map(|leg| leg.server.name.clone());
            debug!(replica = ?name, "read sent to the primary: {why}");
            self.replica = None;
            self.engine.on_replica_lost();
        }
    }

    async fn take_replica_step(&mut self, step: Option<ReplicaStep>) -> Result<(), String> {
        match step.ok_or("no read to send")? {
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
                let connected = ReplicaConn::connect(&pool, &server, pooled, ids, client);
                let (conn, applied, prepared) = connected.await?;
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
                written.map_err(|e| e.to_string())?;
                // Until the read is answered, a cancel goes to the replica.
                self.engine.cancel_towards(Some(Arc::clone(&conn.key)));
            }
        }
        Ok(())
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
    /// the read is answered, its connection is let go of and what waited
    /// goes on: a retry to the primary, the client's next frames.
    pub(super) async fn on_replica_data(&mut self) -> Result<Flow, SessionError> {
        self.feed(Leg::Replica)?;
        self.pump().await
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
        self.engine.on_replica_lost();
        self.pump().await
    }
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
