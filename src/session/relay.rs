//! A client's session, from its StartupMessage to its end: admitted one
//! step of [`Admission`] at a time (the door, terminate mode's
//! authentication, its first server connection), then run as a task of
//! its own: logged in, then relaying frames from each leg to the other as
//! raw bytes in batches, until it ends. What is decided is admission's
//! and the [`Engine`]'s; this is their I/O. Reads use
//! [`FramedStream::fill`], which is cancel-safe, so the `select!` never
//! loses bytes.
//!
//! A session is either serving (a request in flight, or a connection
//! held) or parked: in transaction mode, between transactions, holding no
//! connection. Serving is a boxed future that lives until the session
//! parks (in session mode, for the whole session); parked, the session
//! waits on its client, the shutdown word and its idle timeout in a small
//! future of its own, so an idle client costs its state and little more.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info};

use super::SessionError;
use super::admission::{Admission, Admitted, Login, Negotiated, Refused, Step};
use super::engine::IdleTimeouts;
use super::engine::{Engine, Leg, Start};
use super::instance::ctx;
use super::pipeline::Flow;
use crate::App;
use crate::auth;
use crate::backend::BackendStream;
use crate::metrics::SessionGauge;
use crate::pool::clients::ClientEntry;
use crate::pool::transaction::Lease;
use crate::protocol::messages;
use crate::protocol::stream::FramedStream;
use crate::replica::ReplicaConn;
use crate::shutdown::Stage;
use crate::tls::ClientStream;

/// Serves a connection whose opening is over, from its StartupMessage
/// (`negotiated`) to its end: admitted (a place under `limit` taken, the
/// admin console served, the client authenticated, a session built), the
/// session runs as a task of its own, whose future is the session's run
/// alone: an idle client keeps nothing of how it logged in.
pub async fn serve(
    app: Arc<App>,
    client: FramedStream<ClientStream>,
    negotiated: Negotiated,
    peer: SocketAddr,
    (limit, sessions): (Arc<tokio::sync::Semaphore>, TaskTracker),
) {
    match Box::pin(admit(&app, client, negotiated, &limit, peer)).await {
        Ok(Some((session, login))) => {
            sessions.spawn(Box::new(session).live(login));
        }
        Ok(None) => {}
        Err((client, e)) => refused(client, e, peer).await,
    }
}

/// Tells a client it was turned away, and why.
pub(crate) async fn refused(
    mut client: FramedStream<ClientStream>,
    e: SessionError,
    peer: SocketAddr,
) {
    e.log_refusal(peer);
    if let Some(msg) = e.to_fatal() {
        client.close_with(&msg, super::LINGER).await;
    }
}

/// From a StartupMessage to a session ready to run, one step of
/// [`Admission`] at a time: the checks, the admin console (served here:
/// `None`), authentication, the session's mode and its first server
/// connection. An error comes back with the client, to be told.
async fn admit(
    app: &Arc<App>,
    mut client: FramedStream<ClientStream>,
    negotiated: Negotiated,
    limit: &Arc<tokio::sync::Semaphore>,
    peer: SocketAddr,
) -> Result<Option<(Session<ClientStream>, Box<Login>)>, Refused> {
    let permit = Arc::clone(limit).try_acquire_owned().ok();
    let mut admission = Admission::new(negotiated, client.get_ref().is_tls());
    let deadline = tokio::time::Instant::now() + app.config().startup_timeout();
    let (mut entry, mut learning) = (None, None);
    let mut step = admission.begin(app, permit.is_some());
    loop {
        step = match step {
            Step::Refuse(e) => return Err((client, e)),
            Step::Admin => {
                Box::pin(crate::admin::serve(
                    Arc::clone(app),
                    client,
                    admission.startup(),
                ))
                .await;
                return Ok(None);
            }
            Step::Lookup => {
                let (query, user) = (&app.config().auth.auth_query, admission.startup().user());
                let found = tokio::time::timeout_at(deadline, app.auth.lookup(query, user));
                admission.found(app, found.await.ok())
            }
            Step::Send { out, read } => {
                let exchange = async {
                    client.write_all(&out).await?;
                    match read {
                        true => auth::read_auth_frame(&mut client).await.map(Some),
                        false => Ok(None),
                    }
                };
                let read = tokio::time::timeout_at(deadline, exchange).await;
                admission.answered(app, read.ok())
            }
            Step::Register => {
                entry = Some(app.clients.register(admission.arrival(peer)));
                admission.registered(app)
            }
            Step::Learn(pool) => {
                learning = Some(Arc::clone(&pool.learning).lock_owned().await);
                Step::Connect
            }
            Step::TakeParked { key, trusted_only } => {
                let parked = app.pool.take(&app.config().pool, &key, trusted_only).await;
                admission.parked(app, parked)
            }
            Step::Connect => {
                let connected = crate::backend::connect(&app.upstream).await;
                admission.connected(app, connected)
            }
            Step::Ready => break,
        };
    }
    let entry = entry.unwrap_or_else(|| app.clients.register(admission.arrival(peer)));
    let Admitted { login, parts } = admission.into_admitted(app);
    // On its first server connection: a new one to log in, a parked one
    // whose login frames are in its read buffer, or none (transaction
    // mode, the pool logs in).
    let (engine, backend) = parts.into_engine(app);
    let session = Session {
        engine,
        learning,
        replica: None,
        _gauge: SessionGauge::new(&app.metrics),
        app: Arc::clone(app),
        client,
        backend,
        lease: None,
        entry,
        _permit: permit,
    };
    Ok(Some((session, login)))
}

pub(super) struct Session<C> {
    pub app: Arc<App>,
    pub client: FramedStream<C>,
    /// The server connection held now: in transaction mode, none between
    /// transactions.
    pub backend: Option<FramedStream<BackendStream>>,
    /// Transaction mode: the held connection's place in its pool (its
    /// books are lent to the engine, [`Lease::lend`]).
    pub(super) lease: Option<Lease>,
    /// The connection to a replica, once a read was routed to one.
    pub(super) replica: Option<Box<ReplicaConn>>,
    /// Everything the session knows and decides.
    pub(super) engine: Engine,
    /// Transaction mode: the pool's lesson in how to log in, held until
    /// this client's own login is over.
    pub(super) learning: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The session's line in `SHOW CLIENTS`.
    pub(super) entry: ClientEntry,
    _gauge: SessionGauge,
    /// Its place under `server.max_client_connections`.
    _permit: Option<OwnedSemaphorePermit>,
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Runs the session to its end, in a span naming its user and
    /// database, then lets its connection go (back to its pool, parked,
    /// or closed, as the engine says).
    pub async fn live(mut self: Box<Self>, login: Box<Login>) {
        let startup = self.engine.startup();
        let span = tracing::debug_span!("session", user = startup.user(), db = startup.database());
        match self.run(login).instrument(span).await {
            Ok(()) => debug!("session closed"),
            Err(e) if e.is_disconnect() => debug!(error = %e, "client disconnected"),
            Err(e) => info!(error = %e, "session ended"),
        }
        let unread = self.unread();
        if let Some(parting) = self.engine.part_at_end(&*self.app, unread) {
            self.let_go(parting);
        }
    }

    /// The session from its login to its end. Only the relay's future is
    /// kept whole while the session lives: the login and the ending are
    /// boxed, large and live once.
    async fn run(&mut self, login: Box<Login>) -> Result<(), SessionError> {
        let result = match Box::pin(self.start(login)).await {
            Ok(Flow::Continue) => self.relay().await,
            other => other.map(|_| ()),
        };
        Box::pin(self.end(result)).await
    }

    /// Logs the client in, as the engine begins it: greeted by pgcache
    /// on pooled connections, else the StartupMessage sent (a relayed
    /// login goes on in the session's loop).
    async fn start(&mut self, login: Box<Login>) -> Result<Flow, SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        match self.engine.start(&ctx, self.attached(), Some(login)) {
            Start::Begun => self.pump().await,
            Start::Greet => self.greet().await,
            Start::Close => Ok(Flow::Close),
        }
    }

    /// The session's end, as its result says: a lost backend or an error
    /// told to the client.
    async fn end(&mut self, result: Result<(), SessionError>) -> Result<(), SessionError> {
        match result {
            Ok(()) => Ok(()),
            Err(SessionError::BackendIo(e)) => {
                self.backend_lost(Some(e)).await;
                Ok(())
            }
            Err(e @ SessionError::ClientIo(_)) => Err(e),
            Err(e) => {
                if let SessionError::ClientFrame(_) = e {
                    tracing::warn!(error = %e, "closing client connection");
                }
                self.close_with(&e).await;
                Err(e)
            }
        }
    }

    async fn relay(&mut self) -> Result<(), SessionError> {
        // Shutting down reaches a registered session through its entry
        // ([`crate::shutdown`]); one that registered after it began sees
        // the app's tokens here.
        let client = Arc::clone(&self.entry.client);
        let shutdown = &client.shutdown;
        shutdown.catch_up(&self.app.force, &self.app.drain);
        self.engine.set_idle_timeouts(
            IdleTimeouts::new(&self.app.config().server),
            std::time::Instant::now(),
        );
        let mut woke = Woke::Started;
        loop {
            let serving = self.serve(shutdown, woke);
            // Boxed: parked, the session keeps none of it.
            if Box::pin(serving).await? == Flow::Close {
                return Ok(());
            }
            self.client.release_if_empty();
            self.engine.release_buffers();
            // Parked: only the client, shutdown and the idle timeout wake
            // the session, and its wait keeps no room for the legs it
            // does not hold.
            let deadline = self.engine.poll_timeout();
            let parked = tokio::select! {
                biased;
                _ = shutdown.wait(Stage::Force) => Woke::Force,
                r = self.client.fill_lazily() => Woke::Client(r),
                _ = shutdown.wait(Stage::Drain), if !self.engine.draining() => Woke::Drain,
                _ = sleep_until_or_never(deadline), if deadline.is_some() => Woke::Timeout,
            };
            woke = self.noted(parked);
        }
    }

    /// Serves the session until it parks (`Flow::Continue`: in transaction
    /// mode, waiting on its client and holding no connection) or ends.
    /// `woke`: what ended the last parked wait (or began the loop).
    async fn serve(
        &mut self,
        shutdown: &crate::shutdown::Shutdown,
        mut woke: Woke,
    ) -> Result<Flow, SessionError> {
        loop {
            // Bytes from the client or the primary, inline; the rest is
            // rare, boxed.
            let flow = match woke {
                Woke::Client(Ok(n)) if n > 0 => {
                    self.app.metrics.client_bytes_in.inc_by(n as u64);
                    self.engine.client_arrived();
                    self.pump().await?
                }
                Woke::Backend(Ok(n)) if n > 0 => self.on_backend_data().await?,
                other => Box::pin(self.on_woke(other)).await?,
            };
            if flow == Flow::Close {
                return Ok(Flow::Close);
            }
            // Waiting on the client: logged in and nothing asked of the backend.
            if self.engine.waits_on_client() && !self.attached() {
                return Ok(Flow::Continue);
            }
            woke = self.wait(shutdown).await;
        }
    }

    /// Waits for what the engine waits on while serving: bytes from a leg
    /// it reads, a shutdown stage, its next deadline; between reads, a
    /// replica leaving the rotation takes the session's connection to it
    /// along.
    async fn wait(&mut self, shutdown: &crate::shutdown::Shutdown) -> Woke {
        let deadline = self.engine.poll_timeout();
        let on_replica = self.engine.replica_busy();
        let hold_client = !self.engine.reads_client();
        let woke = tokio::select! {
            biased;
            _ = shutdown.wait(Stage::Force) => Woke::Force,
            w = replica_leg(&mut self.replica, on_replica), if on_replica || self.replica.is_some() => w,
            r = FramedStream::fill_held(&mut self.backend), if !on_replica => Woke::Backend(r),
            r = self.client.fill_lazily(), if !hold_client => Woke::Client(r),
            _ = shutdown.wait(Stage::Drain), if !self.engine.draining() => Woke::Drain,
            _ = sleep_until_or_never(deadline), if deadline.is_some() => Woke::Timeout,
        };
        self.noted(woke)
    }

    /// What woke the session, noted as activity where the engine keeps
    /// time.
    fn noted(&mut self, woke: Woke) -> Woke {
        if self.engine.tracks_activity() {
            self.engine.note_activity(std::time::Instant::now());
        }
        woke
    }

    /// What woke the session, besides bytes from the client or the
    /// primary: the loop's start, the replica's answer, an end or failure
    /// of a leg, a shutdown stage, a timeout. An error ends the session as
    /// [`Self::end`] says.
    async fn on_woke(&mut self, woke: Woke) -> Result<Flow, SessionError> {
        match woke {
            // What came with PostgreSQL's AuthenticationOk, then anything
            // the client sent early, before waiting for more.
            Woke::Started => {
                self.feed(Leg::Primary)?;
                self.engine.client_arrived();
                self.pump().await
            }
            Woke::Force => Err(Engine::forced()),
            Woke::Retired => {
                if let Some(conn) = self.replica.take() {
                    info!(replica = %conn.server.name, "out of rotation: the session's connection to it is closed");
                    conn.close().await;
                }
                Ok(Flow::Continue)
            }
            // The replica's answer; once the read is answered, its
            // connection is let go of and what waited goes on.
            Woke::Replica(Ok(n)) if n > 0 => {
                self.feed(Leg::Replica)?;
                self.pump().await
            }
            Woke::Replica(r) => self.replica_lost(r.err()).await,
            Woke::Backend(r) => {
                self.backend_lost(r.err()).await;
                Ok(Flow::Close)
            }
            Woke::Client(r) => {
                self.client_gone().await;
                r.map(|_| Flow::Close).map_err(SessionError::ClientIo)
            }
            Woke::Drain => {
                self.engine.drain();
                self.drained()
            }
            Woke::Timeout => Err(self.engine.on_timeout(&ctx(&self.app, &self.entry))),
        }
    }

    /// Draining, the session ends as soon as the engine says it may.
    pub(super) fn drained(&self) -> Result<Flow, SessionError> {
        match self.engine.drained() {
            Some(e) => Err(e),
            None => Ok(Flow::Continue),
        }
    }

    /// Ends the session on pgcache's side: a FATAL error for the client, a
    /// Terminate for the backend, and a lingering close so that the client
    /// reads the error instead of a connection reset.
    async fn close_with(&mut self, error: &SessionError) {
        self.end_backend().await;
        if let Some(msg) = error.to_fatal() {
            self.client.close_with(&msg, super::LINGER).await;
        }
    }

    /// The backend closed or failed: tell the client, unless the backend's
    /// own FATAL error already did.
    pub(super) async fn backend_lost(&mut self, error: Option<std::io::Error>) {
        let Some(e) = self.engine.on_backend_lost(error) else {
            return;
        };
        info!(detail = %e, "backend connection lost");
        if let Some(msg) = e.to_fatal() {
            let _ = self.client.write_all(&msg).await;
        }
    }

    /// The client went away: stop whatever the backend is still doing for
    /// it, then close the backend connection.
    pub(super) async fn client_gone(&mut self) {
        if let Some(target) = self.engine.cancel_on_leaving() {
            let app = Arc::clone(&self.app);
            tokio::spawn(async move { crate::backend::send_cancel(&app.upstream, &target).await });
        }
        self.end_backend().await;
    }

    /// The session ends: its backend is told, unless it is a pooled
    /// connection that goes back to its pool at the end
    /// ([`Engine::part_at_end`]).
    async fn end_backend(&mut self) {
        if let Some(replica) = self.replica.take() {
            replica.close().await;
        }
        if self.engine.backend_outlives_session() {
            return;
        }
        if let Some(backend) = &mut self.backend {
            let _ = backend.write_all(&messages::TERMINATE).await;
        }
        self.drop_backend();
    }
}

/// What ended a wait of the relay loop (or began it).
enum Woke {
    Started,
    Force,
    Replica(std::io::Result<usize>),
    Retired,
    Backend(std::io::Result<usize>),
    Client(std::io::Result<usize>),
    Drain,
    Timeout,
}

/// The replica connection: its answer while a read is there (an error
/// without a connection), else the moment its server leaves the rotation.
async fn replica_leg(replica: &mut Option<Box<ReplicaConn>>, busy: bool) -> Woke {
    match replica {
        Some(conn) if busy => Woke::Replica(conn.stream.fill().await),
        Some(conn) => {
            conn.retired().await;
            Woke::Retired
        }
        // Never polled without a connection unless a read is there.
        None => Woke::Replica(Err(std::io::ErrorKind::NotConnected.into())),
    }
}

/// Ready at the engine's next deadline (on tokio's clock), never without
/// one. The timer is boxed: the relay loop's waits keep its room, and most
/// sessions have no deadline.
async fn sleep_until_or_never(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(d) => Box::pin(tokio::time::sleep_until(d.into())).await,
        None => std::future::pending().await,
    }
}
