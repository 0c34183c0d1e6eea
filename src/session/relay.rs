//! The relay loop of a logged-in session: frames from each leg to the
//! other, as raw bytes in batches (all complete frames of one read go out
//! in one write); a frame is decoded only when the session needs something
//! from it. Reads use [`FramedStream::fill`], which is cancel-safe, so the
//! `select!` never loses bytes.
//!
//! A session is either serving (a request in flight, or a connection
//! held) or parked: in transaction mode, between transactions, holding no
//! connection. Serving is a boxed future that lives until the session
//! parks (in session mode, for the whole session); parked, the session
//! waits on its client, the shutdown word and its idle timeout in a small
//! future of its own, so an idle client costs its state and little more.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::info;

use super::SessionError;
use super::admission::Parts;
use super::engine::IdleTimeouts;
use super::engine::{Ctx, Engine, Greeting, Parting, Start};
use super::known::Known;
use super::pipeline::Flow;
use crate::App;
use crate::backend::BackendStream;
use crate::metrics::SessionGauge;
use crate::pool::clients::ClientEntry;
use crate::protocol::messages;
use crate::protocol::stream::FramedStream;
use crate::replica::ReplicaConn;
use crate::shutdown::Stage;

pub(super) struct Session<C> {
    pub app: Arc<App>,
    pub client: FramedStream<C>,
    /// The server connection held now: in transaction mode, none between
    /// transactions.
    pub backend: Option<FramedStream<BackendStream>>,
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
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// A session on its first server connection: a new one to log in,
    /// a parked one whose login frames are in its read buffer, or none
    /// (transaction mode, the pool logs in), with the pool's lesson in
    /// how to log in while its login teaches it, and its line in `SHOW
    /// CLIENTS`.
    pub fn new(
        app: Arc<App>,
        client: FramedStream<C>,
        parts: Parts,
        (learning, entry): (Option<tokio::sync::OwnedMutexGuard<()>>, ClientEntry),
    ) -> Self {
        let Parts {
            startup,
            link,
            first,
        } = parts;
        Self {
            engine: Engine::new(
                app.config().cache.enabled,
                startup,
                Known::new(app.policy()),
                (link, first.book),
                first.addr,
            ),
            learning,
            replica: None,
            _gauge: SessionGauge::new(&app.metrics),
            app,
            client,
            backend: first.stream,
            entry,
        }
    }

    /// The session from its login to its end. Only the relay's future is
    /// kept whole while the session lives: the login and the ending are
    /// boxed, large and live once.
    pub async fn run(
        &mut self,
        login: Option<Box<super::admission::Login>>,
    ) -> Result<(), SessionError> {
        let result = match Box::pin(self.start(login)).await {
            Ok(Flow::Continue) => self.relay().await,
            other => other.map(|_| ()),
        };
        Box::pin(self.end(result)).await
    }

    /// Logs the client in, as the engine begins it: greeted by pgcache
    /// on pooled connections, else the StartupMessage sent (a relayed
    /// login goes on in the session's loop).
    async fn start(
        &mut self,
        login: Option<Box<super::admission::Login>>,
    ) -> Result<Flow, SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        match self.engine.start(&ctx, self.attached(), login) {
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
        if self.app.force.is_cancelled() {
            shutdown.raise(Stage::Force);
        } else if self.app.drain.is_cancelled() {
            shutdown.raise(Stage::Drain);
        }
        self.engine.set_idle_timeouts(
            IdleTimeouts::new(&self.app.config().server),
            std::time::Instant::now(),
        );
        let mut woke = None;
        loop {
            let serving = self.serve(shutdown, woke.take());
            // Boxed: parked, the session keeps none of it.
            if Box::pin(serving).await? == Flow::Close {
                return Ok(());
            }
            self.client.release_if_empty();
            self.engine.release_buffers();
            // Parked: only the client, shutdown and the idle timeout wake
            // the session, and its wait keeps no room for the legs it
            // does not hold.
            let deadline = self.deadline();
            let parked = tokio::select! {
                biased;
                _ = shutdown.wait(Stage::Force) => Woke::Force,
                r = self.client.fill_lazily() => Woke::Client(r),
                _ = shutdown.wait(Stage::Drain), if !self.engine.draining() => Woke::Drain,
                _ = sleep_until_or_never(deadline), if deadline.is_some() => Woke::Timeout,
            };
            woke = Some(self.noted(parked));
        }
    }

    /// Serves the session until it parks (`Flow::Continue`: in transaction
    /// mode, waiting on its client and holding no connection) or ends.
    /// `woke`: what ended the last parked wait.
    async fn serve(
        &mut self,
        shutdown: &crate::shutdown::Shutdown,
        mut woke: Option<Woke>,
    ) -> Result<Flow, SessionError> {
        if woke.is_none() {
            // What came with PostgreSQL's AuthenticationOk (and anything
            // the client sent early) is handled before waiting for more.
            if self.unread() && self.on_backend_data().await? == Flow::Close {
                return Ok(Flow::Close);
            }
            if !self.client.buffered().is_empty() && self.on_client_data().await? == Flow::Close {
                return Ok(Flow::Close);
            }
        }
        loop {
            if let Some(w) = woke.take()
                && self.on_woke(w).await? == Flow::Close
            {
                return Ok(Flow::Close);
            }
            // Waiting on the client: logged in and nothing asked of the backend.
            if self.engine.waits_on_client() && !self.attached() {
                return Ok(Flow::Continue);
            }
            woke = Some(self.wait(shutdown).await);
        }
    }

    /// Waits for what the engine waits on while serving: bytes from a leg
    /// it reads, a shutdown stage, its next deadline; between reads, a
    /// replica leaving the rotation takes the session's connection to it
    /// along.
    async fn wait(&mut self, shutdown: &crate::shutdown::Shutdown) -> Woke {
        let deadline = self.deadline();
        let on_replica = self.engine.replica_busy();
        let hold_client = !self.engine.reads_client();
        let woke = tokio::select! {
            biased;
            _ = shutdown.wait(Stage::Force) => Woke::Force,
            w = replica_leg(&mut self.replica, on_replica), if on_replica || self.replica.is_some() => w,
            r = fill(&mut self.backend), if !on_replica => Woke::Backend(r),
            r = self.client.fill_lazily(), if !hold_client => Woke::Client(r),
            _ = shutdown.wait(Stage::Drain), if !self.engine.draining() => Woke::Drain,
            _ = sleep_until_or_never(deadline), if deadline.is_some() => Woke::Timeout,
        };
        self.noted(woke)
    }

    /// The engine's next deadline, on tokio's clock.
    fn deadline(&self) -> Option<tokio::time::Instant> {
        self.engine
            .poll_timeout()
            .map(tokio::time::Instant::from_std)
    }

    /// What woke the session, noted as activity where the engine keeps
    /// time.
    fn noted(&mut self, woke: Woke) -> Woke {
        if self.engine.tracks_activity() {
            self.engine.note_activity(std::time::Instant::now());
        }
        woke
    }

    /// What woke the session, handled: bytes from a leg, an end or
    /// failure of one, a shutdown stage, a timeout. An error ends the
    /// session as [`Self::end`] says. Bytes from the client or the primary
    /// are handled inline; the rest is rare, boxed.
    async fn on_woke(&mut self, woke: Woke) -> Result<Flow, SessionError> {
        match woke {
            Woke::Client(Ok(n)) if n > 0 => {
                self.app.metrics.client_bytes_in.inc_by(n as u64);
                self.on_client_data().await
            }
            Woke::Backend(Ok(n)) if n > 0 => self.on_backend_data().await,
            Woke::Force => Err(Engine::forced()),
            Woke::Retired => {
                if let Some(conn) = self.replica.take() {
                    info!(replica = %conn.server.name, "out of rotation: the session's connection to it is closed");
                    Box::pin(conn.close()).await;
                }
                Ok(Flow::Continue)
            }
            Woke::Replica(Ok(n)) if n > 0 => Box::pin(self.on_replica_data()).await,
            Woke::Replica(r) => Box::pin(self.replica_lost(r.err())).await,
            Woke::Backend(r) => {
                Box::pin(self.backend_lost(r.err())).await;
                Ok(Flow::Close)
            }
            Woke::Client(r) => {
                Box::pin(self.client_gone()).await;
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
    /// connection that goes back to its pool ([`Self::release_at_end`]).
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

    /// The session holds no connection any more.
    pub(super) fn detached_now(&mut self) {
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

    /// At the session's end, its connection goes back to its pool or is
    /// parked, as the engine says; any other is closed.
    pub(super) fn let_go_at_end(&mut self) {
        let unread = self.unread();
        if let Some(parting) = self.engine.part_at_end(&self.app, unread) {
            self.let_go(parting);
        }
    }

    /// The held connection let go of: back to its pool, parked, or closed
    /// with a Terminate written off the session's path.
    pub(super) fn let_go(&mut self, parting: Parting) {
        let Some(mut stream) = self.backend.take() else {
            return;
        };
        match parting {
            Parting::Back(lease, lifetime) => lease.give_back(stream, lifetime),
            Parting::Park(parked) => {
                let server = parked.book.park(stream, &parked.target, parked.addr);
                let config = &self.app.config().pool;
                self.app.pool.give_back(config, parked.key, server);
            }
            Parting::Close => {
                tokio::spawn(async move {
                    let _ = stream.write_all(&messages::TERMINATE).await;
                });
            }
        }
        self.detached_now();
    }

    /// Transaction mode, for a client pgcache can log in for: the
    /// greeting, as the engine has it ([`super::engine::Greeting`]), with
    /// no connection taken unless it needs one.
    pub(super) async fn greet(&mut self) -> Result<Flow, SessionError> {
        loop {
            let ctx = super::relay::ctx(&self.app, &self.entry);
            if self.engine.greet(&ctx, self.attached()) == Greeting::Greeted {
                return self.pump().await;
            }
            self.check_out(false).await?;
            self.pump().await?;
        }
    }
}

/// What ended a wait of the relay loop.
enum Woke {
    Force,
    Replica(std::io::Result<usize>),
    Retired,
    Backend(std::io::Result<usize>),
    Client(std::io::Result<usize>),
    Drain,
    Timeout,
}

/// Reads more of the held connection; never ready while none is held.
pub(super) fn fill(
    backend: &mut Option<FramedStream<BackendStream>>,
) -> impl Future<Output = std::io::Result<usize>> + '_ {
    std::future::poll_fn(move |cx| match backend {
        Some(backend) => backend.poll_fill(cx),
        None => std::task::Poll::Pending,
    })
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
        None if busy => Woke::Replica(Err(std::io::ErrorKind::NotConnected.into())),
        None => std::future::pending().await,
    }
}

/// What the engine reads with an event, now.
pub(super) fn ctx<'a>(app: &'a App, entry: &'a ClientEntry) -> Ctx<'a> {
    Ctx {
        app,
        client: &entry.client,
        now: std::time::Instant::now(),
        draw: rand::random,
    }
}

/// Ready at `deadline`, never without one. The timer is boxed: the relay
/// loop's waits keep its room, and most sessions have no deadline.
async fn sleep_until_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => Box::pin(tokio::time::sleep_until(d)).await,
        None => std::future::pending().await,
    }
}
