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

use bytes::BytesMut;
use futures_util::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Statuses;
use crate::auth::{self, AUTH_OK, LoginError};
use crate::backend::{BackendError, BackendStream};
use crate::cancel::CancelTarget;
use crate::config::{PoolConfig, PoolMode};
use crate::metrics::TransactionPoolMetrics;
use crate::protocol::codec::{HEADER_LEN, read_i32};
use crate::protocol::startup::encode_startup;
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::protocol::{backend as be, extended, messages, sqlstate};
use crate::scram::ClientSecret;
use crate::upstream::{Upstream, UpstreamAddr};

/// The backend is trusted; this only stops a corrupt length from allocating
/// without bound.
const MAX_BACKEND_FRAME: usize = (1 << 30) + (1 << 20);

/// Which clients share a pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolId {
    pub database: Box<str>,
    pub user: Box<str>,
}

/// How pgcache logs in for a pool's connections.
#[derive(Clone, Default)]
enum Credentials {
    #[default]
    Unknown,
    /// PostgreSQL let a client of this pool in without a password.
    Trusted,
    /// A secret of a client pgcache authenticated itself.
    Secret(ClientSecret),
}

/// Why no server connection could be had.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "canceling statement: no server connection became free within pool.query_wait_timeout_secs ({0}s)"
    )]
    WaitTimeout(u64),
    #[error(transparent)]
    Connect(#[from] BackendError),
    /// PostgreSQL refused the login (its own message).
    #[error("{message}")]
    Server { code: String, message: String },
    #[error("pgcache could not log in to PostgreSQL for the pool: {0}")]
    Login(String),
}

impl PoolError {
    pub fn sqlstate(&self) -> &str {
        match self {
            PoolError::WaitTimeout(_) => sqlstate::QUERY_CANCELED,
            PoolError::Connect(_) => sqlstate::CONNECTION_FAILURE,
            PoolError::Server { code, .. } => code,
            PoolError::Login(_) => sqlstate::INVALID_AUTHORIZATION,
        }
    }
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
    statuses: Option<Statuses>,
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

/// What `SHOW SERVERS` tells of a connection.
pub struct ServerRow {
    pub id: u64,
    pub pid: u32,
    pub addr: String,
    pub active: bool,
    pub age: Duration,
    /// Since it was taken (active) or given back (idle).
    pub since: Duration,
    /// The client holding it (0: none).
    pub client: u64,
    pub prepared: usize,
}

/// What `SHOW POOLS` tells of a pool.
pub struct PoolRow {
    pub database: String,
    pub user: String,
    pub waiting: usize,
    pub active: usize,
    pub idle: usize,
    pub open: usize,
    pub checkouts: u64,
    pub wait_us: u64,
}

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
    pub fn statuses(&self) -> Option<Statuses> {
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
    /// slot is free (waiting up to `wait`).
    pub async fn checkout(
        self: &Arc<Self>,
        upstream: &Upstream,
        wait: Option<Duration>,
        next_id: &AtomicU64,
        client: u64,
    ) -> Result<(Lease, FramedStream<BackendStream>), PoolError> {
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => permit,
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

    /// Opens and logs in a new connection.
    async fn open(
        &self,
        upstream: &Upstream,
        next_id: &AtomicU64,
    ) -> Result<(Box<Pooled>, FramedStream<BackendStream>), PoolError> {
        let credentials = self.lock().credentials.clone();
        let login = async {
            let (stream, addr) = crate::backend::connect(upstream).await?;
            let buf = BytesMut::with_capacity(READ_CHUNK);
            let mut stream = FramedStream::new(stream, buf, MAX_BACKEND_FRAME);
            let startup =
                encode_startup(&[("user", &self.id.user), ("database", &self.id.database)]);
            match &credentials {
                Credentials::Secret(secret) => {
                    auth::login_backend(&mut stream, &startup, &self.id.user, secret)
                        .await
                        .map_err(|e| match e {
                            LoginError::Server(frame) => server_error(&frame),
                            LoginError::Failed(reason) => PoolError::Login(reason),
                        })?;
                }
                Credentials::Trusted => {
                    stream.write_all(&startup).await.map_err(io_error)?;
                }
                Credentials::Unknown => {
                    return Err(PoolError::Login(
                        "no client of this user and database has logged in yet".into(),
                    ));
                }
            }
            let (key, statuses) = read_login(&mut stream, &addr).await?;
            let answer = check(&mut stream).await?;
            Ok::<_, PoolError>((addr, key, statuses, answer, stream))
        };
        let (addr, key, statuses, answer, stream) =
            match tokio::time::timeout(upstream.connect_timeout, login).await {
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
        self.lock().statuses = Some(statuses);
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
    fn reap(&self, config: &PoolConfig) {
        let idle_timeout = config.server_idle_timeout();
        let lifetime = config.server_lifetime();
        let mut books = self.lock();
        let mut closed = 0;
        let min = config.min_pool_size;
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
    fn missing(&self, min: usize) -> usize {
        let books = self.lock();
        if matches!(books.credentials, Credentials::Unknown) {
            return 0;
        }
        min.saturating_sub(books.open)
    }

    /// Closes every idle connection.
    fn evict(&self) -> usize {
        let mut books = self.lock();
        let n = books.idle.len();
        books.idle.clear();
        books.open -= n;
        self.metrics.open.sub(n as i64);
        self.metrics.idle.sub(n as i64);
        n
    }

    pub fn row(&self) -> PoolRow {
        let books = self.lock();
        PoolRow {
            database: self.id.database.to_string(),
            user: self.id.user.to_string(),
            waiting: self.waiting.load(Ordering::Relaxed),
            active: books.held.len(),
            idle: books.idle.len(),
            open: books.open,
            checkouts: self.checkouts.load(Ordering::Relaxed),
            wait_us: self.wait_us.load(Ordering::Relaxed),
        }
    }

    /// `SHOW SERVERS` rows: held connections, then idle ones.
    pub fn servers(&self) -> Vec<ServerRow> {
        let books = self.lock();
        let mut rows: Vec<ServerRow> = books
            .held
            .iter()
            .map(|(id, h)| ServerRow {
                id: *id,
                pid: h.pid,
                addr: h.addr.to_string(),
                active: true,
                age: h.born.elapsed(),
                since: h.since.elapsed(),
                client: h.client,
                prepared: h.prepared,
            })
            .collect();
        rows.sort_by_key(|r| r.id);
        rows.extend(books.idle.iter().map(|i| {
            let s = &i.server;
            ServerRow {
                id: s.id,
                pid: s.key.backend_pid,
                addr: s.shown.to_string(),
                active: false,
                age: s.born.elapsed(),
                since: s.idle_since.elapsed(),
                client: 0,
                prepared: s.prepared.len(),
            }
        }));
        rows
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

fn io_error(e: std::io::Error) -> PoolError {
    PoolError::Login(format!("connection to PostgreSQL: {e}"))
}

fn server_error(frame: &[u8]) -> PoolError {
    let fallback = (sqlstate::CONNECTION_FAILURE, "PostgreSQL refused the login");
    let (code, message) = messages::error_parts(frame, fallback);
    PoolError::Server { code, message }
}

/// Reads a login from AuthenticationOk to the first ReadyForQuery: the
/// backend's key and the parameters it reported.
/// The next frame of a connection logging in.
async fn login_frame(stream: &mut FramedStream<BackendStream>) -> Result<BytesMut, PoolError> {
    match stream.read_frame().await {
        Ok(Some(frame)) => Ok(frame),
        Ok(None) => Err(PoolError::Login("PostgreSQL closed the connection".into())),
        Err(e) => Err(PoolError::Login(e.to_string())),
    }
}

async fn read_login(
    stream: &mut FramedStream<BackendStream>,
    addr: &UpstreamAddr,
) -> Result<(CancelTarget, Statuses), PoolError> {
    let mut statuses = Statuses::default();
    let mut key = None;
    loop {
        let frame = login_frame(stream).await?;
        let body = &frame[HEADER_LEN..];
        match frame[0] {
            be::AUTHENTICATION => {
                let mut p = 0;
                if read_i32(body, &mut p) != Some(AUTH_OK) {
                    return Err(PoolError::Login(
                        "PostgreSQL asked for a password: set auth.mode = \"terminate\" to pool \
                         connections of users that need one"
                            .into(),
                    ));
                }
            }
            be::PARAMETER_STATUS => statuses.note(&frame),
            be::BACKEND_KEY_DATA if body.len() >= 8 => {
                let mut p = 0;
                key = Some(CancelTarget {
                    addr: addr.clone(),
                    backend_pid: read_i32(body, &mut p).unwrap_or(0) as u32,
                    backend_secret: body[4..].to_vec(),
                });
            }
            be::ERROR_RESPONSE => return Err(server_error(&frame)),
            be::READY_FOR_QUERY => {
                let key = key
                    .ok_or_else(|| PoolError::Login("PostgreSQL sent no BackendKeyData".into()))?;
                return Ok((key, statuses));
            }
            _ => {}
        }
    }
}

/// Runs [`super::CHECK`] on a new connection: its answer as one text.
async fn check(stream: &mut FramedStream<BackendStream>) -> Result<Box<str>, PoolError> {
    stream
        .write_all(&messages::query(super::CHECK))
        .await
        .map_err(io_error)?;
    let mut answer = String::new();
    let mut failed = None;
    loop {
        let frame = login_frame(stream).await?;
        match frame[0] {
            be::DATA_ROW => {
                for value in extended::data_row(&frame[HEADER_LEN..]).unwrap_or_default() {
                    answer.push_str(value.as_deref().unwrap_or("\\N"));
                    answer.push('\n');
                }
            }
            be::ERROR_RESPONSE => failed = Some(server_error(&frame)),
            be::READY_FOR_QUERY => {
                return match failed {
                    Some(e) => Err(e),
                    None => Ok(answer.into()),
                };
            }
            _ => {}
        }
    }
}

/// Every pool of the instance.
pub struct Pools {
    pools: Mutex<HashMap<PoolId, Arc<Pool>>>,
    size: usize,
    next_server_id: AtomicU64,
    metrics: TransactionPoolMetrics,
}

impl Pools {
    pub fn new(size: usize, metrics: TransactionPoolMetrics) -> Self {
        Self {
            pools: Mutex::default(),
            size,
            next_server_id: AtomicU64::new(0),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PoolId, Arc<Pool>>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pool of a database and user, made on first use.
    pub fn pool(&self, database: &str, user: &str) -> Arc<Pool> {
        let id = PoolId {
            database: database.into(),
            user: user.into(),
        };
        let mut pools = self.lock();
        let pool = pools.entry(id.clone()).or_insert_with(|| {
            Arc::new(Pool {
                id,
                learning: Arc::default(),
                generation: AtomicU64::new(0),
                slots: Arc::new(Semaphore::new(self.size)),
                books: Mutex::default(),
                waiting: AtomicUsize::new(0),
                checkouts: AtomicU64::new(0),
                wait_us: AtomicU64::new(0),
                metrics: self.metrics.clone(),
            })
        });
        Arc::clone(pool)
    }

    /// A connection of `pool` for client `client` (0: pgcache itself).
    pub async fn checkout(
        &self,
        pool: &Arc<Pool>,
        upstream: &Upstream,
        wait: Option<Duration>,
        client: u64,
    ) -> Result<(Lease, FramedStream<BackendStream>), PoolError> {
        pool.checkout(upstream, wait, &self.next_server_id, client)
            .await
    }

    pub fn all(&self) -> Vec<Arc<Pool>> {
        let mut pools: Vec<_> = self.lock().values().cloned().collect();
        pools.sort_by(|a, b| (&a.id.database, &a.id.user).cmp(&(&b.id.database, &b.id.user)));
        pools
    }

    /// Closes idle connections past their time, and in transaction mode
    /// opens connections up to `min_pool_size` where pgcache can log in.
    pub fn maintain(self: &Arc<Self>, config: &PoolConfig, upstream: &Arc<Upstream>) {
        let min = match config.mode {
            PoolMode::Transaction => config.min_pool_size,
            PoolMode::Session => 0,
        };
        for pool in self.all() {
            pool.reap(config);
            for _ in 0..pool.missing(min) {
                let pools = Arc::clone(self);
                let pool = Arc::clone(&pool);
                let upstream = Arc::clone(upstream);
                let lifetime = config.server_lifetime();
                tokio::spawn(async move {
                    if let Ok((lease, stream)) = pools.checkout(&pool, &upstream, None, 0).await {
                        lease.give_back(stream, lifetime);
                    }
                });
            }
        }
    }

    /// Closes the idle connections to `database` (all if `None`): a
    /// statement needs the databases free.
    pub fn evict(&self, database: Option<&str>) -> usize {
        self.all()
            .iter()
            .filter(|p| database.is_none_or(|d| *p.id.database == *d))
            .map(|p| p.evict())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_errors_know_their_sqlstate() {
        assert_eq!(PoolError::WaitTimeout(5).sqlstate(), "57014");
        assert!(PoolError::WaitTimeout(5).to_string().contains("(5s)"));
        let refused = server_error(&{
            let mut f = BytesMut::new();
            messages::error_response(&mut f, "FATAL", "53300", "too many");
            f
        });
        assert_eq!(refused.sqlstate(), "53300");
        assert_eq!(refused.to_string(), "too many");
    }
}
