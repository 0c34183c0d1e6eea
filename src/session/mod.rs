//! One client session: startup, then the relay loop.
//!
//! ```text
//! client ──startup──▶ negotiate (SSL/GSS 'N', cancel, limits)
//!        ──────────▶ connect backend, forward StartupMessage verbatim
//! loop select!:
//!   backend bytes → complete frames → note Z/S/K/E → write to client
//!   client  bytes → complete frames → check size, note Q/S/X → write to backend
//!   drain         → close once idle (57P01)
//! ```
//!
//! Frames are relayed as raw bytes in batches (all complete frames of one
//! read go out in one write); a frame is decoded only when the session needs
//! something from it. Reads go into `BytesMut` with `read_buf`, which is
//! cancel-safe, so the `select!` never loses bytes.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{Instrument, debug, info, warn};

mod login;
mod query;

use crate::App;
use crate::auth::{self, scram::ClientSecret, scram::ServerBinding};
use crate::backend::{self, BackendStream};
use crate::cancel::{CancelGuard, CancelTarget};
use crate::config::UpstreamAddr;
use crate::config::{AuthMode, SslMode};
use crate::protocol::codec::{self, FrameError, HEADER_LEN, parse_frame, read_i32};
use crate::protocol::messages::{self, error_field};
use crate::protocol::startup::{self, Startup, StartupPacket};
use crate::protocol::{TxStatus, backend as be, frontend as fe, sqlstate};
use crate::tls::ClientStream;
use tokio_rustls::TlsAcceptor;

/// The backend is trusted; this only stops a corrupt length from allocating
/// without bound. PostgreSQL's own rows are at most 1 GiB.
const MAX_BACKEND_FRAME: usize = (1 << 30) + (1 << 20);
/// Read granularity; large frames reserve their whole length at once.
const READ_CHUNK: usize = 16 * 1024;
/// Buffers that grew for a large frame are given back past this size.
const SHRINK_ABOVE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("client i/o: {0}")]
    ClientIo(std::io::Error),
    #[error("backend i/o: {0}")]
    BackendIo(std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("client startup timed out")]
    StartupTimeout,
}

impl SessionError {
    /// Client hang-ups are routine, not worth a warning.
    pub fn is_disconnect(&self) -> bool {
        matches!(self, SessionError::ClientIo(e) if matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        ))
    }
}

/// Refuses a connection at once: too many from its address are starting.
pub async fn refuse<C>(mut client: C)
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    let msg = messages::fatal(
        sqlstate::TOO_MANY_CONNECTIONS,
        "sorry, too many connections from this address are starting up",
    );
    let _ = tokio::time::timeout(LINGER, client.write_all(&msg)).await;
}

/// Serves one accepted connection to its end. A place under `limit` (the
/// connection limit) is taken only once startup is done, so connections
/// that never finish it cost nothing but their `starting` slot; without a
/// place the client gets 53300.
pub async fn serve(
    app: Arc<App>,
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    limit: Arc<tokio::sync::Semaphore>,
    starting: crate::server::Starting,
) {
    let mut buf = BytesMut::with_capacity(1024);
    let mut client = ClientStream::Plain(socket);
    let startup = match tokio::time::timeout(
        app.config.startup_timeout(),
        negotiate_with_tls(&app, &mut client, &mut buf),
    )
    .await
    {
        Ok(Ok(Some(startup))) => startup,
        Ok(Ok(None)) => return, // cancel request or client went away
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "startup failed");
            return;
        }
        Err(_) => {
            let msg = messages::fatal(
                sqlstate::CONNECTION_EXCEPTION,
                "timeout expired while waiting for startup packet",
            );
            let _ = client.write_all(&msg).await;
            return;
        }
    };
    drop(starting);
    if app.tls.mode == SslMode::Require && !client.is_tls() {
        let msg = messages::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            "pgcache requires TLS: connect with sslmode=require (or stronger)",
        );
        let _ = client.write_all(&msg).await;
        info!(%peer, "refused a plain-text connection: tls.ssl_mode = require");
        return;
    }
    let Ok(_permit) = limit.try_acquire_owned() else {
        let msg = messages::fatal(
            sqlstate::TOO_MANY_CONNECTIONS,
            "sorry, too many clients already",
        );
        let _ = client.write_all(&msg).await;
        info!(%peer, "refused connection: server.max_client_connections reached");
        return;
    };

    let admin = app.live_config().admin.clone();
    if !admin.password.is_empty() && startup.startup.database() == admin.database {
        crate::admin::serve(Arc::clone(&app), client, buf, &startup.startup).await;
        return;
    }

    // Terminate mode: pgcache checks the password before PostgreSQL is
    // asked for anything.
    let secret = if app.config.auth.mode == AuthMode::Terminate {
        let end_point = client.is_tls().then(|| app.tls.end_point()).flatten();
        let binding = ServerBinding {
            offered: end_point.is_some(),
            data: end_point.as_deref(),
        };
        let user = startup.startup.user().to_owned();
        let checked = tokio::time::timeout(
            app.config.startup_timeout(),
            auth::authenticate_client(&app, &mut client, &mut buf, &user, binding),
        )
        .await;
        match checked {
            Ok(Ok(secret)) => Some(secret),
            Ok(Err(refusal)) => {
                app.metrics.auth_failures.client.inc();
                info!(%peer, user, reason = %refusal.message, "authentication failed");
                let msg = messages::fatal(refusal.code, &refusal.message);
                let _ = client.write_all(&msg).await;
                return;
            }
            Err(_) => {
                let msg = messages::fatal(
                    sqlstate::CONNECTION_EXCEPTION,
                    "timeout expired during authentication",
                );
                let _ = client.write_all(&msg).await;
                return;
            }
        }
    } else {
        None
    };

    let (backend, addr) = match backend::connect(
        &app.upstream,
        app.config.connect_timeout(),
        &app.upstream_tls,
    )
    .await
    {
        Ok(b) => b,
        Err(e) => {
            warn!(%peer, error = %e, "backend unreachable");
            let msg = messages::fatal(sqlstate::CONNECTION_FAILURE, &e.to_string());
            let _ = client.write_all(&msg).await;
            return;
        }
    };

    app.metrics.client_connections.inc();
    app.metrics.backend_connections.inc();
    let _connected = ConnectionGauge(&app);
    let span = tracing::debug_span!("session", %peer, user = startup.startup.user(), db = startup.startup.database());
    let mut session = Session {
        caching: app.config.cache.enabled,
        app: Arc::clone(&app),
        client,
        client_buf: buf,
        backend,
        backend_addr: addr,
        backend_buf: BytesMut::with_capacity(READ_CHUNK),
        out: BytesMut::new(),
        to_backend: BytesMut::new(),
        startup: startup.startup,
        tx_status: TxStatus::Idle,
        ready: false,
        inflight: VecDeque::new(),
        unsynced: false,
        backend_fatal: false,
        draining: false,
        backend_key: None,
        cancel: None,
        cache: query::CacheSession::new(Arc::default(), app.policy()),
        copy: CopyTracker::default(),
    };
    match session.run(&startup.raw, secret).instrument(span).await {
        Ok(()) => debug!("session closed"),
        Err(e) if e.is_disconnect() => debug!(error = %e, "client disconnected"),
        Err(e) => info!(error = %e, "session ended"),
    }
}

/// Decrements the client-connection gauge when the session ends.
struct ConnectionGauge<'a>(&'a App);

impl Drop for ConnectionGauge<'_> {
    fn drop(&mut self) {
        self.0.metrics.client_connections.dec();
        self.0.metrics.backend_connections.dec();
    }
}

struct Negotiated {
    raw: BytesMut,
    startup: Startup,
}

/// What one round of startup negotiation ended with.
enum Negotiation {
    Startup(Negotiated),
    /// The client asked for TLS and was told 'S': handshake next.
    StartTls,
    /// A cancel request was handled, or the client went away.
    Done,
}

/// Negotiates the startup, switching to TLS when the client asks (after an
/// SSLRequest) or starts with a TLS handshake (direct TLS).
async fn negotiate_with_tls(
    app: &App,
    client: &mut ClientStream,
    buf: &mut BytesMut,
) -> Result<Option<Negotiated>, SessionError> {
    let acceptor = app.tls.acceptor();
    if let (Some(acceptor), ClientStream::Plain(socket)) = (&acceptor, &*client) {
        // Direct TLS: the first byte is a TLS handshake record, not the
        // length of a startup packet. Then ALPN must be "postgresql".
        let mut first = [0u8; 1];
        if socket
            .peek(&mut first)
            .await
            .map_err(SessionError::ClientIo)?
            == 1
            && first[0] == TLS_HANDSHAKE
        {
            upgrade(client, acceptor).await?;
            let alpn_ok = match &*client {
                ClientStream::Tls(tls) => {
                    tls.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_POSTGRESQL)
                }
                _ => false,
            };
            if !alpn_ok {
                return Err(SessionError::Protocol(
                    "direct TLS without ALPN \"postgresql\"".into(),
                ));
            }
        }
    }
    loop {
        let offer = acceptor.as_ref().filter(|_| !client.is_tls());
        match negotiate(app, client, buf, offer.is_some()).await? {
            Negotiation::Startup(s) => return Ok(Some(s)),
            Negotiation::Done => return Ok(None),
            Negotiation::StartTls => {
                let acceptor = offer.expect("TLS is offered only with an acceptor");
                upgrade(client, acceptor).await?;
            }
        }
    }
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

async fn upgrade(client: &mut ClientStream, acceptor: &TlsAcceptor) -> Result<(), SessionError> {
    let ClientStream::Plain(socket) = std::mem::replace(client, ClientStream::Detached) else {
        return Err(SessionError::Protocol("TLS requested twice".into()));
    };
    let tls = acceptor
        .accept(socket)
        .await
        .map_err(SessionError::ClientIo)?;
    *client = ClientStream::Tls(Box::new(tls));
    Ok(())
}

/// Reads first packets until a StartupMessage, answering SSLRequest and
/// GSSENCRequest with 'N' and routing a CancelRequest. Returns `None` when
/// the connection has nothing more to do.
async fn negotiate<C>(
    app: &App,
    client: &mut C,
    buf: &mut BytesMut,
    offer_tls: bool,
) -> Result<Negotiation, SessionError>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let len = loop {
            match startup::packet_len(buf) {
                Ok(Some(len)) => break len,
                Ok(None) => {}
                Err(e) => {
                    let msg = messages::fatal(sqlstate::PROTOCOL_VIOLATION, &e.to_string());
                    let _ = client.write_all(&msg).await;
                    return Err(SessionError::Protocol(e.to_string()));
                }
            }
            if client.read_buf(buf).await.map_err(SessionError::ClientIo)? == 0 {
                return Ok(Negotiation::Done);
            }
        };
        let raw = buf.split_to(len);
        match startup::parse(&raw) {
            Ok(packet @ (StartupPacket::SslRequest | StartupPacket::GssEncRequest)) => {
                // GSS encryption is never offered, TLS when configured;
                // declined, libpq goes on in plain text if its sslmode allows.
                if !buf.is_empty() {
                    // Bytes after an SSLRequest before our answer would be a
                    // TLS ClientHello sent blind: refuse rather than misread.
                    return Err(SessionError::Protocol(
                        "data sent before the SSLRequest answer".into(),
                    ));
                }
                let tls = offer_tls && packet == StartupPacket::SslRequest;
                client
                    .write_all(if tls { b"S" } else { b"N" })
                    .await
                    .map_err(SessionError::ClientIo)?;
                if tls {
                    return Ok(Negotiation::StartTls);
                }
            }
            Ok(StartupPacket::Cancel { pid, secret }) => {
                if let Some(target) = app.cancel.lookup(pid, &secret) {
                    let CancelTarget {
                        addr,
                        backend_pid,
                        backend_secret,
                    } = target;
                    if let Err(e) = backend::send_cancel(
                        &addr,
                        app.config.connect_timeout(),
                        &app.upstream_tls,
                        backend_pid,
                        &backend_secret,
                    )
                    .await
                    {
                        warn!(error = %e, "could not forward cancel request");
                    }
                } else {
                    debug!(pid, "cancel request with an unknown key ignored");
                }
                return Ok(Negotiation::Done);
            }
            Ok(StartupPacket::Startup(startup)) => {
                return Ok(Negotiation::Startup(Negotiated { raw, startup }));
            }
            Err(e) => {
                let msg = messages::fatal(sqlstate::PROTOCOL_VIOLATION, &e.to_string());
                let _ = client.write_all(&msg).await;
                return Err(SessionError::Protocol(e.to_string()));
            }
        }
    }
}

struct Session<C> {
    app: Arc<App>,
    /// Cache lookups and fills are on (`cache.enabled`).
    caching: bool,
    client: C,
    client_buf: BytesMut,
    backend: BackendStream,
    backend_addr: UpstreamAddr,
    backend_buf: BytesMut,
    /// Staging for client writes that pgcache assembles or rewrites.
    out: BytesMut,
    /// Client frames waiting to be written to the backend in one go.
    to_backend: BytesMut,
    startup: Startup,
    tx_status: TxStatus,
    /// The first ReadyForQuery has been seen (authentication is over).
    ready: bool,
    /// Requests sent to the backend and still owed a ReadyForQuery, oldest first.
    inflight: VecDeque<query::Inflight>,
    /// Extended-protocol messages sent since the last Sync.
    unsynced: bool,
    /// The backend reported a FATAL error: its close is expected.
    backend_fatal: bool,
    draining: bool,
    /// The backend's own cancel key, and the registration of ours.
    backend_key: Option<CancelTarget>,
    cancel: Option<CancelGuard>,
    /// Cache state of this session: settings, plans, statements, transaction.
    cache: query::CacheSession,
    copy: CopyTracker,
}

/// Tracks the one protocol rule that breaks "one ReadyForQuery per Sync":
/// PostgreSQL ignores Sync messages received in copy-in mode. Drivers such
/// as tokio-postgres send `Bind, Execute, Sync` before the COPY data, then
/// `CopyDone, Sync`; only the second Sync is answered.
#[derive(Default)]
struct CopyTracker {
    /// A CopyDone/CopyFail was sent since the last Execute or Query.
    ended_since_execute: bool,
    /// The backend is in copy-in mode and the client has not ended it yet.
    active: bool,
    /// Bookkeeping of ignored Syncs, for the next one that is answered.
    carry: Option<query::Inflight>,
}

impl CopyTracker {
    fn executed(&mut self) {
        self.ended_since_execute = false;
    }

    fn ended(&mut self) {
        self.ended_since_execute = true;
        self.active = false;
    }

    fn sync_may_be_ignored(&self) -> bool {
        !self.ended_since_execute
    }
}

enum Flow {
    Continue,
    Close,
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    async fn run(
        &mut self,
        startup_raw: &[u8],
        secret: Option<ClientSecret>,
    ) -> Result<(), SessionError> {
        if let Flow::Close = self.log_in(startup_raw, secret).await? {
            return Ok(());
        }
        // What came with PostgreSQL's AuthenticationOk (and anything the
        // client sent early) is handled before waiting for more.
        if !self.backend_buf.is_empty() && matches!(self.on_backend_data().await?, Flow::Close) {
            return Ok(());
        }
        if !self.client_buf.is_empty() && matches!(self.on_client_data().await?, Flow::Close) {
            return Ok(());
        }
        let drain = self.app.drain.clone();
        let force = self.app.force.clone();
        let server = &self.app.config.server;
        let idle_limit = duration_or_none(server.client_idle_timeout_secs);
        let idle_in_tx_limit = duration_or_none(server.idle_in_transaction_timeout_secs);
        let timeouts = idle_limit.is_some() || idle_in_tx_limit.is_some();
        let mut last_activity = tokio::time::Instant::now();
        loop {
            // Idle: logged in and nothing asked of the backend.
            let idle = self.ready && self.inflight.is_empty() && self.to_backend.is_empty();
            let (limit, code, message) = if self.tx_status == TxStatus::Idle {
                (
                    idle_limit,
                    IDLE_SESSION_TIMEOUT,
                    "terminating connection due to idle-session timeout",
                )
            } else {
                (
                    idle_in_tx_limit,
                    IDLE_IN_TRANSACTION_TIMEOUT,
                    "terminating connection due to idle-in-transaction timeout",
                )
            };
            let deadline = limit
                .filter(|_| timeouts && idle)
                .map(|l| last_activity + l);
            reserve_for_next(&mut self.backend_buf, MAX_BACKEND_FRAME);
            reserve_for_next(
                &mut self.client_buf,
                self.app.config.server.max_message_bytes,
            );
            let result = tokio::select! {
                biased;
                _ = force.cancelled() => {
                    self.shutdown_client("terminating connection: pgcache shutdown timeout reached").await;
                    Ok(Flow::Close)
                }
                r = self.backend.read_buf(&mut self.backend_buf) => match r {
                    Ok(0) | Err(_) => { self.backend_lost(r.err()).await; Ok(Flow::Close) }
                    Ok(_) => self.on_backend_data().await,
                },
                r = self.client.read_buf(&mut self.client_buf) => match r {
                    Ok(0) => { self.client_gone().await; Ok(Flow::Close) }
                    Ok(n) => {
                        self.app.metrics.client_bytes_in.inc_by(n as u64);
                        self.on_client_data().await
                    }
                    Err(e) => { self.client_gone().await; Err(SessionError::ClientIo(e)) }
                },
                _ = drain.cancelled(), if !self.draining => {
                    self.draining = true;
                    Ok(self.close_if_drained().await)
                }
                _ = sleep_until_or_never(deadline) => {
                    info!(code, "{message}");
                    self.close_with(code, message).await;
                    Ok(Flow::Close)
                }
            };
            if timeouts {
                last_activity = tokio::time::Instant::now();
            }
            match result {
                Ok(Flow::Continue) => {}
                Ok(Flow::Close) => return Ok(()),
                Err(SessionError::BackendIo(e)) => {
                    self.backend_lost(Some(e)).await;
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Relays every complete backend frame now buffered to the client,
    /// teeing result frames into cache captures and swallowing the answers
    /// to pgcache's own injected messages.
    async fn on_backend_data(&mut self) -> Result<Flow, SessionError> {
        let mut pos = 0;
        let mut copied = 0; // bytes of backend_buf before this are in `out` or dropped
        loop {
            let len = match parse_frame(&self.backend_buf[pos..], MAX_BACKEND_FRAME) {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => return Err(SessionError::Protocol(format!("from backend: {e}"))),
            };
            let tag = self.backend_buf[pos];
            let keep = match tag {
                be::BACKEND_KEY_DATA if len >= HEADER_LEN + 8 => {
                    let body = self.backend_buf[pos + HEADER_LEN..pos + len].to_vec();
                    let replacement = self.register_cancel_key(&body);
                    self.out.extend_from_slice(&self.backend_buf[copied..pos]);
                    self.out.extend_from_slice(&replacement);
                    copied = pos + len;
                    true
                }
                be::ERROR_RESPONSE => {
                    let body = &self.backend_buf[pos + HEADER_LEN..pos + len];
                    if matches!(error_field(body, b'S'), Some("FATAL" | "PANIC")) {
                        self.backend_fatal = true;
                    }
                    self.on_response_frame(pos, len)
                }
                be::COPY_IN_RESPONSE => {
                    self.on_copy_in_started();
                    self.on_response_frame(pos, len)
                }
                be::READY_FOR_QUERY => {
                    let status = self
                        .backend_buf
                        .get(pos + HEADER_LEN)
                        .and_then(|b| TxStatus::from_byte(*b));
                    let keep = self.inflight.front().is_none_or(|f| f.to_client);
                    self.on_ready_for_query(status.unwrap_or(TxStatus::Idle));
                    keep
                }
                _ => self.on_response_frame(pos, len),
            };
            if !keep {
                self.out.extend_from_slice(&self.backend_buf[copied..pos]);
                copied = pos + len;
            }
            pos += len;
        }
        if pos > 0 {
            self.publish_invalidations().await;
            self.app
                .metrics
                .client_bytes_out
                .inc_by((pos - copied + self.out.len()) as u64);
            let result = if self.out.is_empty() && copied == 0 {
                self.client.write_all(&self.backend_buf[..pos]).await
            } else {
                self.out.extend_from_slice(&self.backend_buf[copied..pos]);
                let r = if self.out.is_empty() {
                    Ok(())
                } else {
                    self.client.write_all(&self.out).await
                };
                self.out.clear();
                r
            };
            self.backend_buf.advance(pos);
            if let Err(e) = result {
                self.client_gone().await;
                return Err(SessionError::ClientIo(e));
            }
        }
        shrink_if_idle(&mut self.backend_buf);
        if self.draining {
            return Ok(self.close_if_drained().await);
        }
        Ok(Flow::Continue)
    }

    /// Hands the client pgcache's own cancel key for the backend's.
    fn register_cancel_key(&mut self, body: &[u8]) -> Vec<u8> {
        let mut p = 0;
        let backend_pid = read_i32(body, &mut p).unwrap_or(0) as u32;
        let target = CancelTarget {
            addr: self.backend_addr.clone(),
            backend_pid,
            backend_secret: body[4..].to_vec(),
        };
        self.backend_key = Some(target.clone());
        let (pid, secret, guard) = self.app.cancel.register(target);
        self.cancel = Some(guard);
        let mut frame = Vec::with_capacity(HEADER_LEN + 4 + secret.len());
        frame.push(be::BACKEND_KEY_DATA);
        frame.extend_from_slice(&((8 + secret.len()) as u32).to_be_bytes());
        frame.extend_from_slice(&pid.to_be_bytes());
        frame.extend_from_slice(&secret);
        frame
    }

    /// Relays every complete client frame now buffered to the backend.
    async fn on_client_data(&mut self) -> Result<Flow, SessionError> {
        let max = self.app.config.server.max_message_bytes;
        let mut flow = Flow::Continue;
        let mut violation = None;
        if !self.caching {
            // Pure pass-through: forward whole runs of frames without copying.
            let mut pos = 0;
            while let Flow::Continue = flow {
                match parse_frame(&self.client_buf[pos..], max) {
                    Ok(Some(len)) => {
                        flow = self.note_client_frame(self.client_buf[pos]);
                        pos += len;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        violation = Some(e);
                        break;
                    }
                }
            }
            if pos > 0 {
                let r = self.backend.write_all(&self.client_buf[..pos]).await;
                self.client_buf.advance(pos);
                r.map_err(SessionError::BackendIo)?;
            }
        } else {
            while let Flow::Continue = flow {
                match parse_frame(&self.client_buf, max) {
                    Ok(Some(len)) => {
                        let frame = self.client_buf.split_to(len).freeze();
                        flow = self.on_client_frame(frame).await?;
                    }
                    Ok(None) => break,
                    Err(e) => {
                        violation = Some(e);
                        break;
                    }
                }
            }
            self.flush_backend().await?;
        }
        shrink_if_idle(&mut self.client_buf);
        if let Some(e) = violation {
            let code = match e {
                FrameError::BadLength { .. } | FrameError::TooLarge { .. } => {
                    sqlstate::PROTOCOL_VIOLATION
                }
            };
            warn!(error = %e, "closing client connection");
            self.close_with(code, &e.to_string()).await;
            return Err(SessionError::Protocol(e.to_string()));
        }
        Ok(flow)
    }

    /// Bookkeeping for a client frame forwarded as is: requests that will be
    /// answered with ReadyForQuery, and the extended-protocol sync state.
    fn note_client_frame(&mut self, tag: u8) -> Flow {
        match tag {
            fe::QUERY | fe::FUNCTION_CALL => {
                self.copy.executed();
                self.push_request(query::Inflight::default());
            }
            fe::SYNC => {
                let mut request = query::Inflight::default();
                request.may_be_ignored = self.copy.sync_may_be_ignored();
                self.push_request(request);
                self.unsynced = false;
            }
            fe::EXECUTE => {
                self.copy.executed();
                self.unsynced = true;
            }
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::CLOSE | fe::FLUSH => self.unsynced = true,
            fe::COPY_DONE | fe::COPY_FAIL => self.copy.ended(),
            fe::TERMINATE => return Flow::Close,
            _ => {}
        }
        Flow::Continue
    }

    /// Queues a request that expects a ReadyForQuery, unless PostgreSQL
    /// will ignore it (a Sync in copy-in mode): then its bookkeeping waits
    /// for the next request that is answered.
    fn push_request(&mut self, mut request: query::Inflight) {
        if self.copy.active && request.may_be_ignored {
            match &mut self.copy.carry {
                Some(carry) => carry.absorb(request),
                None => self.copy.carry = Some(request),
            }
            return;
        }
        if let Some(ignored) = self.copy.carry.take() {
            request.absorb(ignored);
        }
        self.inflight.push_back(request);
    }

    /// CopyInResponse: the backend entered copy-in mode. Syncs the client
    /// sent since the COPY's Execute (and before CopyDone/CopyFail) will
    /// never be answered: take them out of the queue.
    fn on_copy_in_started(&mut self) {
        self.copy.active = !self.copy.ended_since_execute;
        while self
            .inflight
            .front()
            .is_some_and(|f| f.may_be_ignored && f.to_client)
        {
            let ignored = self.inflight.pop_front().expect("checked above");
            match &mut self.copy.carry {
                Some(carry) => carry.absorb(ignored),
                None => self.copy.carry = Some(ignored),
            }
        }
        if let Some(carry) = self.copy.carry.take() {
            // The Sync after CopyDone may already be queued: it inherits.
            match self.inflight.front_mut() {
                Some(next) => next.absorb(carry),
                None => self.copy.carry = Some(carry),
            }
        }
    }

    /// Writes the queued client frames to the backend.
    /// Writes what pgcache staged in `out` to the client.
    async fn flush_out(&mut self) -> Result<(), SessionError> {
        if self.out.is_empty() {
            return Ok(());
        }
        let r = self.client.write_all(&self.out).await;
        self.out.clear();
        r.map_err(SessionError::ClientIo)
    }

    async fn flush_backend(&mut self) -> Result<(), SessionError> {
        if !self.to_backend.is_empty() {
            let r = self.backend.write_all(&self.to_backend).await;
            self.to_backend.clear();
            if self.to_backend.capacity() > SHRINK_ABOVE {
                self.to_backend = BytesMut::new();
            }
            r.map_err(SessionError::BackendIo)?;
        }
        Ok(())
    }

    fn is_idle(&self) -> bool {
        self.ready
            && self.tx_status == TxStatus::Idle
            && self.inflight.is_empty()
            && !self.unsynced
            && !self.cache.holds_batch()
    }

    async fn close_if_drained(&mut self) -> Flow {
        if !self.is_idle() {
            return Flow::Continue;
        }
        self.shutdown_client("terminating connection due to pgcache shutdown")
            .await;
        Flow::Close
    }

    async fn shutdown_client(&mut self, message: &str) {
        self.close_with(sqlstate::ADMIN_SHUTDOWN, message).await;
    }

    /// Ends the session on pgcache's side: a FATAL error for the client, a
    /// Terminate for the backend, and a lingering close so that the client
    /// reads the error instead of a connection reset.
    async fn close_with(&mut self, code: &str, message: &str) {
        let _ = self.backend.write_all(&TERMINATE_FRAME).await;
        let msg = messages::fatal(code, message);
        if self.client.write_all(&msg).await.is_err() || self.client.shutdown().await.is_err() {
            return;
        }
        // Unread input at close() makes the kernel send RST, which can
        // destroy the error before the client reads it: drain briefly.
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(LINGER, async {
            while let Ok(n) = self.client.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }

    /// The backend closed or failed: tell the client, unless the backend's
    /// own FATAL error already did.
    async fn backend_lost(&mut self, error: Option<std::io::Error>) {
        if self.backend_fatal {
            return;
        }
        let detail = error.map_or_else(
            || "server closed the connection unexpectedly".to_owned(),
            |e| e.to_string(),
        );
        info!(%detail, "backend connection lost");
        let msg = messages::fatal(
            sqlstate::CONNECTION_FAILURE,
            &format!("connection to upstream server lost: {detail}"),
        );
        let _ = self.client.write_all(&msg).await;
    }

    /// The client went away: stop whatever the backend is still doing for it,
    /// then close the backend connection.
    async fn client_gone(&mut self) {
        if !self.inflight.is_empty() {
            // A backend busy with a long query would not notice the closed
            // socket until it writes; cancel it so it is freed now.
            if let Some(target) = self.backend_key.clone() {
                let timeout = self.app.config.connect_timeout();
                let app = Arc::clone(&self.app);
                tokio::spawn(async move {
                    let _ = backend::send_cancel(
                        &target.addr,
                        timeout,
                        &app.upstream_tls,
                        target.backend_pid,
                        &target.backend_secret,
                    )
                    .await;
                });
            }
        }
        let _ = self.backend.write_all(&TERMINATE_FRAME).await;
    }
}

/// How long a closing session waits for the client to hang up.
const LINGER: std::time::Duration = std::time::Duration::from_millis(500);

const TERMINATE_FRAME: [u8; 5] = [fe::TERMINATE, 0, 0, 0, 4];

/// Makes room for the rest of the frame being read (capped at `limit`, so a
/// lying length cannot allocate) or at least one read chunk.
/// SQLSTATEs PostgreSQL uses for its own idle timeouts.
const IDLE_SESSION_TIMEOUT: &str = "57P05";
const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";

fn duration_or_none(secs: u64) -> Option<std::time::Duration> {
    (secs > 0).then(|| std::time::Duration::from_secs(secs))
}

async fn sleep_until_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn reserve_for_next(buf: &mut BytesMut, limit: usize) {
    buf.reserve(codec::missing_bytes(buf).min(limit).max(READ_CHUNK));
}

fn shrink_if_idle(buf: &mut BytesMut) {
    if buf.is_empty() && buf.capacity() > SHRINK_ABOVE {
        *buf = BytesMut::with_capacity(READ_CHUNK);
    }
}
