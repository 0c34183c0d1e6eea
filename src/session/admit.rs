//! Admitting a client: from its StartupMessage (its connection's opening
//! is the server's, [`crate::server`]) to its session running as a task of
//! its own, and what becomes of its server connection at its end. What is
//! decided is [`admission`](super::admission)'s; this is its I/O.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, warn};

use super::SessionError;
use super::admission::{self, Door, End, Login, Mode, Negotiated, Refused};
use super::relay::Session;
use super::reuse::ServerBook;
use crate::App;
use crate::auth;
use crate::backend::BackendStream;
use crate::config::AuthMode;
use crate::pool::clients::Arrival;
use crate::protocol::codec::MAX_BACKEND_FRAME;
use crate::protocol::sqlstate;
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::scram::{ClientSecret, ServerBinding};
use crate::tls::ClientStream;
use crate::upstream::UpstreamAddr;

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
        Ok(Some(ready)) => {
            sessions.spawn(Box::new(ready).live(app));
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
/// [`admission`](super::admission) decides: the checks, the admin console
/// (served here: `None`), authentication, the session's mode and its
/// first server connection. An error comes back with the client, to be
/// told.
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
    // Listed in `SHOW CLIENTS` while it waits for its first connection.
    let entry = app.clients.register(Arrival {
        user: startup.user(),
        database: startup.database(),
        addr: peer,
        tls: on_tls,
        application_name: startup.param("application_name").unwrap_or_default(),
    });
    let checked_by_pgcache = secret.is_some();
    let first = Box::pin(first_server(app, &mode, checked_by_pgcache)).await;
    let (backend, addr, book, learning) = match first {
        Ok(first) => first,
        Err(e) => return Err((client, e)),
    };
    // The client's secret was taught to a pool, which logs in with it.
    let secret = secret.filter(|_| matches!(mode, Mode::Session { .. }));
    let (link, end) = mode.into_parts(checked_by_pgcache);
    let Negotiated { raw, startup } = negotiated;
    let session = Session::new(
        Arc::clone(app),
        client,
        (backend, addr),
        book,
        (link, learning),
        startup,
        entry,
    );
    Ok(Some(Ready {
        session,
        login: Some(Box::new(Login { raw, secret })),
        end,
        _permit: permit,
    }))
}

/// The session's first server connection, as its mode has it: in session
/// mode, a parked one it may have (one PostgreSQL would have let it open
/// without a password, unless pgcache checked it), else a new one; in
/// transaction mode none for a client the pool can log in for, else a new
/// one to log in on, relayed, holding the pool's lesson in how to log in.
async fn first_server(
    app: &App,
    mode: &Mode,
    checked_by_pgcache: bool,
) -> Result<First, SessionError> {
    let config = &app.config().pool;
    let learning = match mode {
        Mode::Pooled { pool, .. } if !pool.can_log_in() => {
            Some(Arc::clone(&pool.learning).lock_owned().await)
        }
        _ => None,
    };
    let parked = match mode {
        Mode::Session { key: Some(key), .. } => {
            app.pool.take(config, key, !checked_by_pgcache).await
        }
        _ => None,
    };
    if let Some(server) = parked {
        let book = ServerBook::reused(&server);
        let (stream, addr) = server.replay_login();
        return Ok((Some(stream), addr, book, None));
    }
    let parks = match mode {
        Mode::Pooled { pool, .. } if pool.can_log_in() => {
            return Ok((
                None,
                app.upstream.addrs[0].clone(),
                ServerBook::new(false),
                None,
            ));
        }
        Mode::Pooled { .. } => false,
        Mode::Session { .. } => {
            app.metrics.pool.fresh.inc();
            config.max_idle_servers > 0
        }
    };
    let (stream, addr) = crate::backend::connect(&app.upstream).await?;
    let stream = FramedStream::new(
        stream,
        BytesMut::with_capacity(READ_CHUNK),
        MAX_BACKEND_FRAME,
    );
    Ok((Some(stream), addr, ServerBook::new(parks), learning))
}

/// A session's first server connection ([`first_server`]): the stream,
/// where it is, what the session keeps of it, and the pool's lesson in how
/// to log in while this client's login teaches it.
type First = (
    Option<FramedStream<BackendStream>>,
    UpstreamAddr,
    ServerBook,
    Option<tokio::sync::OwnedMutexGuard<()>>,
);

/// A session ready to run, with what its login still needs (the
/// StartupMessage as the client sent it, and the client's secret when
/// pgcache checked it and logs in with it), and what becomes of its
/// connection at its end.
struct Ready {
    session: Session<ClientStream>,
    login: Option<Box<Login>>,
    end: End,
    /// Its place under `server.max_client_connections`.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
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
