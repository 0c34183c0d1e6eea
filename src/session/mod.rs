//! One client session, from the first packet to the last.
//!
//! ```text
//! client ──startup──▶ negotiate (SSL/GSS, cancel)              negotiate.rs
//!        ──────────▶ the door (TLS, limits), admin console,   admission.rs
//!                     terminate-mode auth, the session's mode
//!        ──────────▶ connect backend, log in                  engine/auth.rs
//! loop select!:                                               relay.rs
//!   backend frames → note Z/K/E/G, tee captures → client      engine/answers.rs
//!   client frames  → Query, Parse/Bind/Describe/Execute/Sync  engine/requests.rs
//!                    (caching off: forwarded)                 engine/passthrough.rs
//!                    what a decision waits for, met           needs.rs
//!   drain          → close once idle (57P01)
//! ```
//!
//! Decisions are made in synchronous code: the first packets
//! (`negotiate.rs`), admission (`admission.rs`) and the session itself,
//! the [`engine::Engine`], split by concern: the requests in flight
//! (`pipeline.rs`), the extended batch held until Sync (`batch.rs`), the
//! transaction's books (`transaction.rs`), what a statement means for the
//! cache (`plan.rs`), and what the session knows of itself (`known.rs`,
//! read by pgcache's own queries, `engine/hidden.rs`). The driver (this
//! file, `relay.rs`, `traffic.rs`, `checkout.rs`, `needs.rs`) does the
//! I/O. The cache itself is behind [`crate::cache::Cache`].

mod admission;
mod batch;
mod capture;
mod checkout;
mod engine;
mod error;
mod explain;
#[doc(hidden)]
pub mod fuzz;
mod keyed;
mod known;
mod link;
mod logins;
mod needs;
mod negotiate;
mod offload;
mod pipeline;
mod plan;
mod relay;
mod replica;
mod reuse;
mod row_limit;
mod traffic;
mod transaction;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, warn};

use crate::App;
use crate::auth;
use crate::config::AuthMode;
use crate::pool::PoolKey;
use crate::pool::clients::Arrival;
use crate::pool::transaction::Pool;
use crate::protocol::codec::MAX_BACKEND_FRAME;
use crate::protocol::sqlstate;
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::scram::{ClientSecret, ServerBinding};
use crate::tls::ClientStream;
use admission::{Admitted, Door, End, Login, Mode, Ready, Refused};
pub use error::SessionError;
use link::{ClientState, Link, SessionLink};
pub use logins::SharedLogins;
use negotiate::{Negotiated, Opening};
pub use plan::SharedPlans;
use relay::Session;
use reuse::ServerBook;

/// How long a closing session waits for the client to hang up.
const LINGER: std::time::Duration = std::time::Duration::from_millis(500);

/// Refuses a connection at once: too many from its address are starting.
pub async fn refuse<C>(client: C)
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut client = FramedStream::new(client, BytesMut::new(), 0);
    let e = SessionError::refused(
        sqlstate::TOO_MANY_CONNECTIONS,
        "sorry, too many connections from this address are starting up",
    );
    if let Some(msg) = e.to_fatal() {
        let _ = tokio::time::timeout(LINGER, client.write_all(&msg)).await;
    }
}

/// Serves one accepted connection to its end. `starting` is released once
/// startup is done; a place under `limit` (the connection limit) is taken
/// only then, so connections that never finish startup cost nothing but
/// their `starting` slot; without a place the client gets 53300.
pub async fn serve(
    app: Arc<App>,
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    (limit, sessions): (Arc<tokio::sync::Semaphore>, TaskTracker),
    starting: impl Send,
) {
    let config = app.config();
    // A chunk from the start: the first read reserves one anyway, and a
    // smaller buffer was reallocated on it.
    let mut client = FramedStream::new(
        ClientStream::Plain(socket),
        BytesMut::with_capacity(READ_CHUNK),
        config.server.max_message_bytes,
    );
    // The steps of a login, and each mode's session, are boxed: each is a
    // large future that lives once, and the task's own future is what
    // every idle client keeps.
    let negotiated = tokio::time::timeout(
        config.startup_timeout(),
        Box::pin(negotiate(&app, &mut client)),
    )
    .await
    .unwrap_or_else(|_| {
        Err(SessionError::refused(
            sqlstate::CONNECTION_EXCEPTION,
            "timeout expired while waiting for startup packet",
        ))
    });
    drop(starting);
    let result = match negotiated {
        Ok(Some(negotiated)) => Box::pin(admit(&app, client, negotiated, &limit, peer)).await,
        Ok(None) => return, // a cancel request, or the client went away
        Err(e) => Err((client, e)),
    };
    match result {
        // A task of its own, whose future is the session's run alone: an
        // idle client keeps nothing of how it logged in.
        Ok(Some(ready)) => {
            sessions.spawn(Box::new(ready).live(app));
        }
        Ok(None) => {}
        Err((client, e)) => refused(client, e, peer).await,
    }
}

/// The connection's first packets, as [`negotiate::next_packet`] says:
/// switching to TLS when the client asks (after an SSLRequest) or starts
/// with a TLS handshake (direct TLS). `Ok(None)`: the connection has
/// nothing more to do (a cancel request, or the client went away).
async fn negotiate(
    app: &App,
    client: &mut FramedStream<ClientStream>,
) -> Result<Option<Negotiated>, SessionError> {
    let acceptor = app.tls.acceptor();
    if let (Some(acceptor), ClientStream::Plain(socket)) = (&acceptor, client.get_ref()) {
        let mut first = [0u8; 1];
        let peeked = socket.peek(&mut first).await;
        if peeked.map_err(SessionError::ClientIo)? == 1 && first[0] == negotiate::TLS_HANDSHAKE {
            upgrade(client, acceptor).await?;
            negotiate::direct_tls_agreed(client.get_ref().alpn_protocol())?;
        }
    }
    loop {
        let offer = acceptor.as_ref().filter(|_| !client.get_ref().is_tls());
        match negotiate::next_packet(client.buffer_mut(), offer.is_some())? {
            Opening::More => {
                if client.fill().await.map_err(SessionError::ClientIo)? == 0 {
                    return Ok(None);
                }
            }
            Opening::Answer { tls } => {
                let answer = if tls { b"S" } else { b"N" };
                client
                    .write_all(answer)
                    .await
                    .map_err(SessionError::ClientIo)?;
                if let (true, Some(acceptor)) = (tls, offer) {
                    upgrade(client, acceptor).await?;
                }
            }
            Opening::Cancel { pid, secret } => {
                forward_cancel(app, pid, &secret).await;
                return Ok(None);
            }
            Opening::Startup(negotiated) => return Ok(Some(negotiated)),
        }
    }
}

/// The TLS handshake, on a connection in plain text so far.
async fn upgrade(
    client: &mut FramedStream<ClientStream>,
    acceptor: &tokio_rustls::TlsAcceptor,
) -> Result<(), SessionError> {
    let stream = client.get_mut();
    let ClientStream::Plain(socket) = std::mem::replace(stream, ClientStream::Detached) else {
        return Err(SessionError::Dropped("TLS requested twice"));
    };
    let tls = acceptor.accept(socket).await;
    *stream = ClientStream::Tls(Box::new(tls.map_err(SessionError::ClientIo)?));
    Ok(())
}

/// Sends a client's CancelRequest on to the backend its key names, if the
/// key is one pgcache handed out.
async fn forward_cancel(app: &App, pid: u32, secret: &[u8]) {
    let Some(target) = app.cancel.lookup(pid, secret) else {
        debug!(pid, "cancel request with an unknown key ignored");
        return;
    };
    let (addr, backend_pid, secret) = (&target.addr, target.backend_pid, &target.backend_secret);
    if let Err(e) = crate::backend::send_cancel(&app.upstream, addr, backend_pid, secret).await {
        warn!(error = %e, "could not forward cancel request");
    }
}

/// Tells a client it was turned away, and why.
async fn refused(mut client: FramedStream<ClientStream>, e: SessionError, peer: SocketAddr) {
    {
        match &e {
            SessionError::Refused { message, .. } => info!(%peer, "{message}"),
            SessionError::Connect(e) => warn!(%peer, error = %e, "backend unreachable"),
            e => debug!(%peer, error = %e, "startup failed"),
        }
        if let Some(msg) = e.to_fatal() {
            let _ = client.write_all(&msg).await;
        }
    }
}

/// From a StartupMessage to a session ready to run, as
/// [`admission`] decides: the checks, the admin console (served here:
/// `None`), authentication and the backend connection. An error comes
/// back with the client, to be told.
async fn admit(
    app: &Arc<App>,
    mut client: FramedStream<ClientStream>,
    negotiated: Negotiated,
    limit: &Arc<tokio::sync::Semaphore>,
    peer: SocketAddr,
) -> Result<Option<Ready>, Refused> {
    let permit = Arc::clone(limit).try_acquire_owned().ok();
    let startup = &negotiated.startup;
    let on_tls = client.get_ref().is_tls();
    match admission::door(app, on_tls, permit.is_some(), startup) {
        Err(e) => return Err((client, e)),
        Ok(Door::Admin) => {
            Box::pin(crate::admin::serve(Arc::clone(app), client, startup)).await;
            return Ok(None);
        }
        Ok(Door::Session) => {}
    }
    let secret = match Box::pin(authenticate(app, &mut client, startup.user())).await {
        Ok(secret) => secret,
        Err(e) => return Err((client, e)),
    };
    let mode = match admission::mode(app, startup, secret.as_deref()) {
        Ok(mode) => mode,
        Err(e) => return Err((client, e)),
    };
    let entry = app.clients.register(Arrival {
        user: startup.user(),
        database: startup.database(),
        addr: peer,
        tls: on_tls,
        application_name: startup.param("application_name").unwrap_or_default(),
    });
    let admitted = Admitted {
        client,
        negotiated,
        secret,
        entry,
    };
    let ready = match mode {
        Mode::Pooled { pool, state } => Box::pin(admit_pooled(app, admitted, pool, state)).await,
        Mode::Session { key, checks } => Box::pin(admit_session(app, admitted, key, checks)).await,
    }?;
    Ok(Some(Ready {
        _permit: permit,
        ..ready
    }))
}

impl Ready {
    /// Runs the session to its end, in a span naming its user and
    /// database, then settles its connection.
    async fn live(mut self: Box<Self>, app: Arc<App>) {
        let startup = self.session.engine.startup();
        let span = tracing::debug_span!("session", user = startup.user(), db = startup.database());
        let login = self.login.take();
        match self.session.run(login).instrument(span).await {
            Ok(()) => debug!("session closed"),
            Err(e) if e.is_disconnect() => debug!(error = %e, "client disconnected"),
            Err(e) => info!(error = %e, "session ended"),
        }
        let Ready {
            mut session, end, ..
        } = *self;
        match end {
            End::Session {
                key: Some(key),
                checked_by_pgcache,
            } => {
                if let Some(server) = session.into_server(checked_by_pgcache) {
                    app.pool.give_back(&app.config().pool, key, server);
                }
            }
            End::Session { key: None, .. } => {}
            End::Pooled => session.release_at_end(),
        }
    }
}

/// Session mode: the session's own backend connection (a parked one under
/// `key` when there is one it may have), and the pool its hits' own
/// requests run on (`checks`).
async fn admit_session(
    app: &Arc<App>,
    admitted: Admitted,
    key: Option<PoolKey>,
    checks: Option<Arc<Pool>>,
) -> Result<Ready, Refused> {
    let Admitted {
        client,
        negotiated,
        secret,
        entry,
    } = admitted;
    let pool = &app.config().pool;
    let checked_by_pgcache = secret.is_some();
    let parked = match &key {
        // A client pgcache did not authenticate may only have a connection
        // PostgreSQL would have let it open without a password.
        Some(key) => Box::pin(app.pool.take(pool, key, !checked_by_pgcache)).await,
        None => None,
    };
    let (backend, addr, book) = match parked {
        Some(server) => {
            let book = ServerBook::reused(&server);
            let (stream, addr) = server.replay_login();
            (stream, addr, book)
        }
        None => match Box::pin(crate::backend::connect(&app.upstream)).await {
            Ok((stream, addr)) => {
                app.metrics.pool.fresh.inc();
                let buf = BytesMut::with_capacity(READ_CHUNK);
                let stream = FramedStream::new(stream, buf, MAX_BACKEND_FRAME);
                (stream, addr, ServerBook::new(pool.max_idle_servers > 0))
            }
            Err(e) => return Err((client, e.into())),
        },
    };
    let link = Link::Session(SessionLink {
        checks,
        ..SessionLink::default()
    });
    let session = Session::new(
        Arc::clone(app),
        client,
        (Some(backend), addr),
        book,
        (link, None),
        negotiated.startup,
        entry,
    );
    let end = End::Session {
        key,
        checked_by_pgcache,
    };
    Ok(Ready {
        session,
        login: Some(Box::new(Login {
            raw: negotiated.raw,
            secret,
        })),
        end,
        _permit: None,
    })
}

/// Transaction mode: the session takes server connections from `pool`.
/// A client pgcache can log in for (it checked its password, or
/// PostgreSQL trusts the pool's clients) takes none to log in; any other
/// logs in on a connection of its own first, relayed, which teaches the
/// pool whether PostgreSQL trusts its clients.
async fn admit_pooled(
    app: &Arc<App>,
    admitted: Admitted,
    pool: Arc<Pool>,
    state: ClientState,
) -> Result<Ready, Refused> {
    // The client's secret was taught to the pool, which logs in with it.
    let Admitted {
        client,
        negotiated: Negotiated { raw, startup },
        entry,
        ..
    } = admitted;
    let mut learning = match pool.can_log_in() {
        true => None,
        false => Some(Arc::clone(&pool.learning).lock_owned().await),
    };
    let (backend, addr) = if pool.can_log_in() {
        learning = None;
        (None, app.upstream.addrs[0].clone())
    } else {
        match Box::pin(crate::backend::connect(&app.upstream)).await {
            Ok((stream, addr)) => {
                let buf = BytesMut::with_capacity(READ_CHUNK);
                (
                    Some(FramedStream::new(stream, buf, MAX_BACKEND_FRAME)),
                    addr,
                )
            }
            Err(e) => return Err((client, e.into())),
        }
    };
    let session = Session::new(
        Arc::clone(app),
        client,
        (backend, addr),
        ServerBook::new(false),
        (Link::pooled(pool, state), learning),
        startup,
        entry,
    );
    Ok(Ready {
        session,
        login: Some(Box::new(Login { raw, secret: None })),
        end: End::Pooled,
        _permit: None,
    })
}

/// Terminate mode: pgcache checks the password before PostgreSQL is asked
/// for anything, and returns what logs in on the client's behalf.
async fn authenticate(
    app: &App,
    client: &mut FramedStream<ClientStream>,
    user: &str,
) -> Result<Option<Box<ClientSecret>>, SessionError> {
    let config = app.config();
    if config.auth.mode != AuthMode::Terminate {
        return Ok(None);
    }
    let end_point = client
        .get_ref()
        .is_tls()
        .then(|| app.tls.end_point())
        .flatten();
    let binding = ServerBinding {
        offered: end_point.is_some(),
        data: end_point.as_deref(),
    };
    let checked = tokio::time::timeout(
        config.startup_timeout(),
        auth::authenticate_client(&app.auth, &config.auth.auth_query, client, user, binding),
    )
    .await;
    match checked {
        Ok(Ok(secret)) => Ok(Some(Box::new(secret))),
        Ok(Err(refusal)) => {
            app.metrics.auth_failures.client.inc();
            info!(user, reason = %refusal.message, "authentication failed");
            Err(SessionError::refused(refusal.code, refusal.message))
        }
        Err(_) => Err(SessionError::refused(
            sqlstate::CONNECTION_EXCEPTION,
            "timeout expired during authentication",
        )),
    }
}
