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
use super::engine::{
    Action, Greeting, Held, Io, Leg, Need, Parting, Relayed, ReplicaReturn, ReplicaStep,
};
use super::instance::ctx;
use super::offload;
use super::pipeline::Flow;
use super::relay::Session;
use crate::backend::BackendStream;
use crate::protocol::messages;
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

    /// Hands the engine every complete frame buffered from a server leg:
    /// what the client is sent of them waits for [`Io::Relay`].
    pub(super) fn feed(&mut self, leg: Leg) -> Result<(), SessionError> {
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
        let sent = self.client.write_all(bytes).await;
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
                let paused = self.app.meet_prerequisites(&db, &needs).await;
                self.engine.prerequisites_met(paused);
            }
            // Asked of the driver next ([`Io::Own`]).
            Need::Own => {}
            Need::Fetched { rels, funcs } => {
                let wait = self.engine.first_read_wait();
                let facts = (&rels[..], &funcs[..]);
                self.app.wait_for_facts(self.engine.db(), facts, wait).await;
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
            match self.engine.poll_io(&*self.app, held) {
                Io::Idle => break,
                Io::TakeClient => {
                    let ctx = ctx(&self.app, &self.entry);
                    let (max_frame, buf) = (self.client.max_frame(), self.client.buffer_mut());
                    let taken = self.engine.on_client_data(&ctx, buf, max_frame);
                    self.client.shrink_if_empty();
                    match taken {
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
                Io::Own => Box::pin(self.own()).await?,
                Io::Drop(error) => {
                    self.drop_backend();
                    if let Some(e) = error {
                        return Err(e);
                    }
                }
                Io::ToClient => {
                    let r = self.client.write_all(self.engine.out()).await;
                    self.engine.client_sent();
                    r.map_err(SessionError::ClientIo)?;
                }
                Io::Staged => self.write_staged().await?,
                Io::Replica => Box::pin(self.replica_step()).await,
                Io::ReplicaDone(back) => self.replica_read_done(back),
                Io::Part(parting) => self.let_go(parting),
            }
        }
        // The pool's lesson in how to log in is this login's no more.
        self.learning.take_if(|_| !self.engine.relaying_login());
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
            Action::Judge(check, answer, done) => check.judge(&self.app.cache, &answer, done),
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

    /// Reads the primary's answer to pgcache's own query, as any other.
    async fn own(&mut self) -> Result<(), SessionError> {
        match self.server()?.fill().await {
            Ok(0) => Err(SessionError::BackendIo(
                std::io::ErrorKind::UnexpectedEof.into(),
            )),
            Ok(_) => self.feed(Leg::Primary),
            Err(e) => Err(SessionError::BackendIo(e)),
        }
    }

    /// Writes the requests staged for the primary; the answers pgcache
    /// gave in its place are read after what the primary sent before.
    async fn write_staged(&mut self) -> Result<(), SessionError> {
        let (staged, answers) = self.engine.staged(&*self.app);
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
        let Some((pool, wait)) = self.engine.checkout(&*self.app)? else {
            return Err(SessionError::BackendIo(
                std::io::ErrorKind::NotConnected.into(),
            ));
        };
        let (pools, upstream) = (&self.app.pool.pooled, &self.app.upstream);
        let taken = pools.checkout_for(&pool, upstream, wait, &self.entry.client);
        let (mut lease, stream) = taken.await.map_err(SessionError::Pool)?;
        let server = lease.server();
        self.backend = Some(stream);
        // One address for the whole pool: copied once, not per checkout.
        self.engine.attach_server(&server.addr, server.key.clone());
        self.engine.granted(lease.lend(), queued);
        self.lease = Some(lease);
        Ok(())
    }
}

/// The server connection held: where it comes from and goes back to. In
/// transaction mode, a connection taken from the pool when a request has
/// to go to PostgreSQL and given back once the session is idle; in
/// session mode, the connection parked for the next client at a clean
/// Terminate.
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

    /// Closes the held connection: it is in a state no other client may
    /// see.
    pub(super) fn drop_backend(&mut self) {
        self.engine.drop_server();
        (self.backend, self.lease) = (None, None);
        self.engine.detach_server();
        self.entry.client.hold(0, 0);
    }

    /// The held connection let go of: back to its pool, parked, or closed
    /// with a Terminate written off the session's path.
    pub(super) fn let_go(&mut self, parting: Parting) {
        let (Some(mut stream), lease) = (self.backend.take(), self.lease.take()) else {
            return;
        };
        match (parting, lease) {
            (Parting::Back(lent, lifetime), Some(lease)) => {
                lease.give_back_lent(lent, stream, lifetime)
            }
            (Parting::Park(parked), _) => {
                let server = parked.book.park(stream, &parked.target, parked.addr);
                let config = &self.app.config().pool;
                self.app.pool.give_back(config, parked.key, server);
            }
            (parting, lease) => {
                // A lease dropped is a connection closed, counted as broken.
                if let (Parting::Close { listening: true }, Some(lease)) = (parting, lease) {
                    lease.close_listening();
                }
                tokio::spawn(async move {
                    let _ = stream.write_all(&messages::TERMINATE).await;
                });
            }
        }
        self.engine.detach_server();
        self.entry.client.hold(0, 0);
    }

    /// Transaction mode, for a client pgcache can log in for: the
    /// greeting, as the engine has it ([`super::engine::Greeting`]), with
    /// no connection taken unless it needs one.
    pub(super) async fn greet(&mut self) -> Result<Flow, SessionError> {
        loop {
            let ctx = ctx(&self.app, &self.entry);
            if self.engine.greet(&ctx, self.attached()) == Greeting::Greeted {
                return self.pump().await;
            }
            self.check_out(false).await?;
            self.pump().await?;
        }
    }
}

/// Reads routed to a replica ([`super::replica`]).
impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// One step of the read the engine routed to a replica
    /// ([`ReplicaStep`]): `Session::pump` polls again for the next. A
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
    /// the replica's pool with the books the leg kept of it (`back`); the
    /// session's own is kept.
    fn replica_read_done(&mut self, back: Option<ReplicaReturn>) {
        let Some(conn) = self.replica.take() else {
            return;
        };
        conn.set_active(false);
        match back {
            Some((applied, prepared, lifetime)) if !conn.is_own() => {
                conn.give_back(applied, prepared, lifetime)
            }
            _ => self.replica = Some(conn),
        }
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
