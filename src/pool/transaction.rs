//! Transaction pooling: server connections shared by the clients of one
//! database and user, each held by a client only while it needs one (a
//! transaction, an unfinished extended-protocol batch, a COPY, a pinned
//! session); a cache hit needs none.
//!
//! A pool has `default_pool_size` slots (a semaphore): a client takes a
//! slot, then the most recently used idle connection, or opens a new one
//! in that slot. A client that finds no free slot waits up to
//! `query_wait_timeout`. Connections log in with only `user` and
//! `database` in their startup packet: everything else a client asked for
//! is its own session state, applied when it takes a connection
//! ([`crate::session`]'s `link.rs`).
//!
//! pgcache logs in to pool connections itself, so a pool needs to know
//! how: with a password-derived secret of a client pgcache authenticated
//! (terminate mode), or without one, once PostgreSQL let a client of the
//! same user and database in without a password (trust; it sees every
//! pgcache connection from the same address).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::PoolError;
use super::Statuses;
use super::login::{self, Credentials, LoggedIn};
use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::config::PoolConfig;
use crate::metrics::TransactionPoolMetrics;
use crate::protocol::stream::FramedStream;
use crate::scram::ClientSecret;
use crate::upstream::{Upstream, UpstreamAddr};

mod rows;
pub use rows::{PoolRow, ServerRow};

/// Which clients share a pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolId {
    pub database: Box<str>,
    pub user: Box<str>,
}

/// A server connection of a pool, apart from its stream (which the
/// session holding it reads and writes).
pub struct Pooled {
    /// Numbered per instance, for `SHOW SERVERS`.
    pub id: u64,
    pub addr: UpstreamAddr,
    /// `addr` as `SHOW SERVERS` shows it, made once.
    shown: Arc<str>,
    /// The backend's own cancel key, shared with the session holding it
    /// (taken at every checkout: not copied).
    pub key: Arc<CancelTarget>,
    pub born: Instant,
    /// When it last went back to the pool.
    pub idle_since: Instant,
    /// The client session state it was last given (the session's
    /// `ClientState` id); 0: as it logged in.
    pub state: u64,
    /// The pool generation it logged in under.
    pub generation: u64,
    /// Statements prepared on it, under pgcache's names.
    pub prepared: super::prepared::ServerStatements,
}

/// The server's books are boxed: a connection changes hands on every
/// transaction, and moving them whole was 200 bytes copied each way.
struct Idle {
    server: Box<Pooled>,
    stream: FramedStream<BackendStream>,
}

/// A connection held by a client, as `SHOW SERVERS` shows it.
struct Held {
    pid: u32,
    addr: Arc<str>,
    born: Instant,
    since: Instant,
    client: u64,
    prepared: usize,
}

impl Held {
    fn new(server: &Pooled, client: u64) -> Self {
        Self {
            pid: server.key.backend_pid,
            addr: Arc::clone(&server.shown),
            born: server.born,
            since: Instant::now(),
            client,
            prepared: server.prepared.len(),
        }
    }
}

/// One pool's books, under its lock.
#[derive(Default)]
struct Books {
    /// Idle connections, most recently used last.
    idle: Vec<Idle>,
    /// Connections held by clients, by id (an entry in and out at every
    /// checkout: a fast hash).
    held: HashMap<u64, Held, foldhash::fast::RandomState>,
    /// Connections open: idle, held by a client, or logging in.
    open: usize,
    credentials: Credentials,
    /// The ParameterStatus frames of the latest login: what a client
    /// admitted without a login of its own is told.
    statuses: Option<Arc<Statuses>>,
    /// The answer of [`super::CHECK`] (role and database settings, the
    /// configuration's load time) at the latest login, and how many
    /// times it changed: connections that logged in under another answer
    /// start in other settings, and are closed rather than reused.
    seen: Option<Box<str>>,
    /// Session settings read on this pool's connections, by the client
    /// state applied and the policy generation they were read under, for
    /// the pool generation they were read in: clients in the same state
    /// have the same settings.
    settings: HashMap<(u64, u64), (u64, Arc<SettingsRow>)>,
}

/// A settings query's answer, as text. It spells out every setting (kilobytes), so
/// it is shared by the clients that log in in a known state, and digested
/// once for their cache keys.
#[derive(Debug)]
pub struct SettingsRow {
    pub cells: Vec<Option<String>>,
    /// [`crate::cache::key::settings_digest`] of the cells that go into
    /// the cache key.
    pub digest: u128,
}

/// Settings rows kept per pool at most.
const MAX_SETTINGS: usize = 1024;

pub struct Pool {
    pub id: PoolId,
    /// How many times the login settings changed ([`Books::seen`]);
    /// written under the books' lock, read without it on every
    /// cacheable read.
    generation: AtomicU64,
    /// Held by the client whose relayed login teaches the pool how to log
    /// in: the clients arriving meanwhile wait for the lesson instead of
    /// each opening a connection of its own.
    pub learning: Arc<tokio::sync::Mutex<()>>,
    slots: Arc<Semaphore>,
    books: Mutex<Books>,
    waiting: AtomicUsize,
    checkouts: AtomicU64,
    wait_us: AtomicU64,
    metrics: TransactionPoolMetrics,
    /// How the server reports the startup values clients gave.
    pub reported: super::reported::Reported,
}

/// The books of a pooled connection a session holds ([`Lease::lend`]),
/// as in [`Pooled`]: plain data, kept in the session's own state.
#[derive(Default)]
pub struct Lent {
    pub state: u64,
    pub generation: u64,
    pub prepared: super::prepared::ServerStatements,
}

/// A server connection held by a session; back with [`Lease::give_back`],
/// closed if dropped.
pub struct Lease {
    server: Option<Box<Pooled>>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl Lease {
    pub fn server(&self) -> &Pooled {
        self.server.as_ref().expect("present until given back")
    }

    pub fn server_mut(&mut self) -> &mut Pooled {
        self.server.as_mut().expect("present until given back")
    }

    /// Lends the connection's books to the session holding it, which
    /// keeps them with the rest of its state while the lease (and its
    /// place in the pool) stays with the session's driver.
    pub fn lend(&mut self) -> Lent {
        let server = self.server_mut();
        Lent {
            state: server.state,
            generation: server.generation,
            prepared: std::mem::take(&mut server.prepared),
        }
    }

    /// [`Self::give_back`], with the books it lent (`lent`).
    pub fn give_back_lent(
        mut self,
        lent: Lent,
        stream: FramedStream<BackendStream>,
        lifetime: Duration,
    ) {
        let server = self.server_mut();
        server.state = lent.state;
        server.prepared = lent.prepared;
        self.give_back(stream, lifetime);
    }

    /// Returns the connection, idle and clean, to its pool; one past its
    /// lifetime is closed instead.
    pub fn give_back(mut self, stream: FramedStream<BackendStream>, lifetime: Duration) {
        let mut server = self.server.take().expect("given back once");
        let pool = Arc::clone(&self.pool);
        let now = Instant::now();
        if now.saturating_duration_since(server.born) > lifetime {
            pool.lock().held.remove(&server.id);
            pool.metrics.active.dec();
            pool.metrics.closed_lifetime.inc();
            pool.closed();
            return;
        }
        server.idle_since = now;
        pool.metrics.active.dec();
        let mut books = pool.lock();
        books.held.remove(&server.id);
        if server.generation != pool.generation() {
            // Logged in under settings that changed since.
            drop(books);
            pool.metrics.closed_stale.inc();
            pool.closed();
            return;
        }
        pool.metrics.idle.inc();
        books.idle.push(Idle { server, stream });
    }
}

impl Lease {
    /// Closes the connection: it listens on a channel for a client that
    /// no longer holds it ([`super::listens`]).
    pub fn close_listening(mut self) {
        if let Some(server) = self.server.take() {
            self.pool.lock().held.remove(&server.id);
            self.pool.metrics.active.dec();
            self.pool.metrics.closed_listening.inc();
            self.pool.closed();
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            self.pool.lock().held.remove(&server.id);
            self.pool.metrics.active.dec();
            self.pool.metrics.closed_broken.inc();
            self.pool.closed();
        }
    }
}

impl Pool {
    pub(super) fn new(id: PoolId, size: usize, metrics: TransactionPoolMetrics) -> Self {
        Self {
            id,
            learning: Arc::default(),
            generation: AtomicU64::new(0),
            slots: Arc::new(Semaphore::new(size)),
            books: Mutex::default(),
            waiting: AtomicUsize::new(0),
            checkouts: AtomicU64::new(0),
            wait_us: AtomicU64::new(0),
            metrics,
            reported: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Books> {
        // Every critical section leaves the books whole.
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn closed(&self) {
        let mut books = self.lock();
        books.open = books.open.saturating_sub(1);
        self.metrics.open.dec();
    }

    /// pgcache checked a client's password: its secret logs in for the pool.
    pub fn learn_secret(&self, secret: ClientSecret) {
        self.lock().credentials = Credentials::Secret(secret);
    }

    /// Logs in as `other` does, unless it knows how already: a replica's
    /// pool learns from the primary's.
    pub fn learn_from(&self, other: &Pool) {
        let credentials = other.lock().credentials.clone();
        let mut books = self.lock();
        if matches!(books.credentials, Credentials::Unknown) {
            books.credentials = credentials;
        }
    }

    /// PostgreSQL let a client of this pool in without a password.
    pub fn learn_trusted(&self) {
        let mut books = self.lock();
        if matches!(books.credentials, Credentials::Unknown) {
            books.credentials = Credentials::Trusted;
        }
    }

    /// pgcache can log in for this pool's clients: a client needs no
    /// login of its own.
    pub fn can_log_in(&self) -> bool {
        !matches!(self.lock().credentials, Credentials::Unknown)
    }

    /// The parameters of the latest login, if any connection logged in.
    pub fn statuses(&self) -> Option<Arc<Statuses>> {
        self.lock().statuses.clone()
    }

    /// Changes each time a new connection logs in under other role or
    /// database settings (or a reloaded configuration).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The settings read before for clients in `state`, under policy
    /// generation `policy`, if read in the current pool generation.
    pub fn settings(&self, state: u64, policy: u64) -> Option<Arc<SettingsRow>> {
        let books = self.lock();
        match books.settings.get(&(state, policy)) {
            Some((generation, row)) if *generation == self.generation() => Some(Arc::clone(row)),
            _ => None,
        }
    }

    pub fn remember_settings(
        &self,
        state: u64,
        policy: u64,
        generation: u64,
        row: Arc<SettingsRow>,
    ) {
        let mut books = self.lock();
        if books.settings.len() >= MAX_SETTINGS {
            books.settings.clear();
        }
        books.settings.insert((state, policy), (generation, row));
    }

    /// Records the check's answer at a login; returns the generation the
    /// connection belongs to.
    fn saw(&self, answer: Box<str>) -> u64 {
        let mut books = self.lock();
        if books.seen.as_deref() != Some(&*answer) {
            if books.seen.is_some() {
                self.generation.fetch_add(1, Ordering::AcqRel);
                books.settings.clear();
                let n = books.idle.len();
                books.idle.clear();
                books.open -= n;
                self.metrics.open.sub(n as i64);
                self.metrics.idle.sub(n as i64);
                self.metrics.closed_stale.inc_by(n as u64);
            }
            books.seen = Some(answer);
        }
        self.generation()
    }

    /// A server connection for a client: an idle one, or a new one, once a
    /// slot is free (waiting up to `wait`; `Some(ZERO)`: not at all, it
    /// fails with [`PoolError::Full`]).
    pub async fn checkout(
        self: &Arc<Self>,
        upstream: &Upstream,
        wait: Option<Duration>,
        next_id: &AtomicU64,
        client: u64,
    ) -> Result<(Lease, FramedStream<BackendStream>), PoolError> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) if wait == Some(Duration::ZERO) => return Err(PoolError::Full),
            Err(_) => self.wait_for_slot(wait).await?,
        };
        self.checkouts.fetch_add(1, Ordering::Relaxed);
        self.metrics.checkouts.inc();
        loop {
            let mut books = self.lock();
            let Some(mut idle) = books.idle.pop() else {
                break;
            };
            self.metrics.idle.dec();
            // A poll that does not wait: it may be made under the lock.
            if alive(&mut idle.stream) {
                books
                    .held
                    .insert(idle.server.id, Held::new(&idle.server, client));
                drop(books);
                self.metrics.active.inc();
                let lease = Lease {
                    server: Some(idle.server),
                    pool: Arc::clone(self),
                    _permit: permit,
                };
                return Ok((lease, idle.stream));
            }
            drop(books);
            // Closed while idle (a restart, pg_terminate_backend).
            self.metrics.closed_broken.inc();
            self.closed();
        }
        {
            self.lock().open += 1;
            self.metrics.open.inc();
        }
        // Boxed: a login's future is kilobytes, and every checkout of an
        // idle connection (nearly all of them) would copy it.
        match Box::pin(self.open(upstream, next_id)).await {
            Ok((server, stream)) => {
                self.metrics.active.inc();
                self.metrics.logins.inc();
                self.held(&server, client);
                let lease = Lease {
                    server: Some(server),
                    pool: Arc::clone(self),
                    _permit: permit,
                };
                Ok((lease, stream))
            }
            Err(e) => {
                self.metrics.login_failures.inc();
                self.closed();
                Err(e)
            }
        }
    }

    fn held(&self, server: &Pooled, client: u64) {
        self.lock()
            .held
            .insert(server.id, Held::new(server, client));
    }

    async fn wait_for_slot(
        &self,
        wait: Option<Duration>,
    ) -> Result<OwnedSemaphorePermit, PoolError> {
        let started = Instant::now();
        self.waiting.fetch_add(1, Ordering::Relaxed);
        self.metrics.waiting.inc();
        let acquire = Arc::clone(&self.slots).acquire_owned();
        let result = match wait {
            Some(limit) => tokio::time::timeout(limit, acquire).await.ok(),
            None => Some(acquire.await),
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.metrics.waiting.dec();
        let waited = started.elapsed();
        let us = waited.as_micros() as u64;
        self.wait_us.fetch_add(us, Ordering::Relaxed);
        self.metrics.wait.observe(waited.as_secs_f64());
        match result {
            // The semaphore is never closed.
            Some(permit) => Ok(permit.expect("pool semaphores stay open")),
            None => {
                self.metrics.wait_timeouts.inc();
                Err(PoolError::WaitTimeout(wait.unwrap_or_default().as_secs()))
            }
        }
    }

    /// Logs in to another server of the cluster (a replica) as the
    /// pool's user, with the pool's credentials: a connection of the
    /// caller's, not the pool's.
    pub async fn log_in_at(
        &self,
        upstream: &Upstream,
    ) -> Result<(CancelTarget, FramedStream<BackendStream>), PoolError> {
        let credentials = self.lock().credentials.clone();
        let login = login::log_in(upstream, &self.id.user, &self.id.database, &credentials);
        match tokio::time::timeout(upstream.connect_timeout, login).await {
            Ok(Ok(done)) => Ok((done.key, done.stream)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PoolError::Login(
                "the server did not finish the login in time".into(),
            )),
        }
    }

    /// Opens and logs in a new connection.
    async fn open(
        &self,
        upstream: &Upstream,
        next_id: &AtomicU64,
    ) -> Result<(Box<Pooled>, FramedStream<BackendStream>), PoolError> {
        let credentials = self.lock().credentials.clone();
        let login = login::log_in(upstream, &self.id.user, &self.id.database, &credentials);
        let LoggedIn {
            addr,
            key,
            statuses,
            check: answer,
            stream,
        } = match tokio::time::timeout(upstream.connect_timeout, login).await {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                if matches!(e, PoolError::Login(_)) {
                    // Trust was withdrawn (pg_hba.conf changed), or the
                    // secret no longer works: learn again.
                    self.lock().credentials = Credentials::Unknown;
                }
                return Err(e);
            }
            Err(_) => {
                return Err(PoolError::Login(
                    "PostgreSQL did not finish the login in time".into(),
                ));
            }
        };
        let generation = self.saw(answer);
        self.lock().statuses = Some(Arc::new(statuses));
        let now = Instant::now();
        let server = Box::new(Pooled {
            id: next_id.fetch_add(1, Ordering::Relaxed) + 1,
            shown: addr.to_string().into(),
            addr,
            key: Arc::new(key),
            born: now,
            idle_since: now,
            state: 0,
            generation,
            prepared: Default::default(),
        });
        Ok((server, stream))
    }

    /// Closes idle connections past their idle time or lifetime, keeping
    /// `min` open.
    pub(super) fn reap(&self, config: &PoolConfig, min: usize) {
        let idle_timeout = config.server_idle_timeout();
        let lifetime = config.server_lifetime();
        let mut books = self.lock();
        let mut closed = 0;
        let open = books.open;
        books.idle.retain(|i| {
            let old = i.server.born.elapsed() > lifetime;
            let unused = i.server.idle_since.elapsed() > idle_timeout && open - closed > min;
            let keep = !(old || unused);
            if !keep {
                closed += 1;
            }
            keep
        });
        books.open -= closed;
        self.metrics.open.sub(closed as i64);
        self.metrics.idle.sub(closed as i64);
        self.metrics.closed_idle.inc_by(closed as u64);
    }

    /// Connections to open now to keep `min` open.
    pub(super) fn missing(&self, min: usize) -> usize {
        let books = self.lock();
        if matches!(books.credentials, Credentials::Unknown) {
            return 0;
        }
        min.saturating_sub(books.open)
    }

    /// Closes every idle connection.
    pub(super) fn evict(&self) -> usize {
        let mut books = self.lock();
        let n = books.idle.len();
        books.idle.clear();
        books.open -= n;
        self.metrics.open.sub(n as i64);
        self.metrics.idle.sub(n as i64);
        n
    }
}

/// An idle connection with nothing to read is alive: a closed one reads
/// end-of-file, and one ended by `pg_terminate_backend` or a shutdown has
/// its FATAL error waiting.
fn alive(stream: &mut FramedStream<BackendStream>) -> bool {
    if !stream.buffered().is_empty() {
        return false;
    }
    // `fill` is cancel-safe: polled once, it reads what is there or nothing.
    stream.fill().now_or_never().is_none()
}
