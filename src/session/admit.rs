//! Admitting a client: from its StartupMessage (its connection's opening
//! is the server's, [`crate::server`]) to its session running as a task of
//! its own, and what becomes of its server connection at its end. What is
//! decided is [`admission`](super::admission)'s; this is its I/O.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, warn};

use super::SessionError;
use super::admission::{Admission, Admitted, Login, Negotiated, Refused, Step};
use super::relay::Session;
use crate::App;
use crate::auth;
use crate::protocol::stream::FramedStream;
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
        Ok(Some(ready)) => {
            sessions.spawn(Box::new(ready).live());
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
    match &e {
        SessionError::Refused { message, .. } => info!(%peer, "{message}"),
        SessionError::Connect(e) => warn!(%peer, error = %e, "backend unreachable"),
        e => debug!(%peer, error = %e, "startup failed"),
    }
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
) -> Result<Option<Ready>, Refused> {
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
                match tokio::time::timeout_at(deadline, app.auth.lookup(query, user)).await {
                    Ok(found) => admission.found(app, found),
                    Err(_) => Admission::timed_out(),
                }
            }
            Step::Send { out, read } => {
                let exchange = async {
                    client.write_all(&out).await?;
                    match read {
                        true => auth::read_auth_frame(&mut client).await.map(Some),
                        false => Ok(None),
                    }
                };
                match tokio::time::timeout_at(deadline, exchange).await {
                    Ok(read) => admission.answered(app, read),
                    Err(_) => Admission::timed_out(),
                }
            }
            Step::Register => {
                entry = Some(app.clients.register(admission.arrival(peer)));
                admission.registered(app)
            }
            Step::Learn(pool) => {
                learning = Some(Arc::clone(&pool.learning).lock_owned().await);
                admission.learned()
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
    let session = Session::new(Arc::clone(app), client, parts, (learning, entry));
    Ok(Some(Ready {
        session,
        login: Some(login),
        _permit: permit,
    }))
}

/// A session ready to run, with what its login still needs (the
/// StartupMessage as the client sent it, and the client's secret when
/// pgcache checked it and logs in with it).
struct Ready {
    session: Session<ClientStream>,
    login: Option<Box<Login>>,
    /// Its place under `server.max_client_connections`.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Ready {
    /// Runs the session to its end, in a span naming its user and
    /// database, then lets its connection go.
    async fn live(mut self: Box<Self>) {
        let startup = self.session.engine.startup();
        let span = tracing::debug_span!("session", user = startup.user(), db = startup.database());
        let login = self.login.take();
        match self.session.run(login).instrument(span).await {
            Ok(()) => debug!("session closed"),
            Err(e) if e.is_disconnect() => debug!(error = %e, "client disconnected"),
            Err(e) => info!(error = %e, "session ended"),
        }
        let Ready { mut session, .. } = *self;
        session.let_go_at_end();
    }
}
