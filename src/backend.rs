//! Connections to the PostgreSQL server: TCP (with TLS as `sslmode` says)
//! or Unix socket.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::protocol::startup::{encode_cancel, encode_ssl_request};
use crate::upstream::{Upstream, UpstreamAddr, UpstreamTls};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("could not connect to upstream server {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("timed out after {0:?} connecting to upstream server {1}")]
    Timeout(Duration, String),
    #[error("upstream server {addr} does not accept TLS, but upstream.url has sslmode={mode}")]
    TlsRefused { addr: String, mode: &'static str },
    #[error("TLS to upstream server {addr} failed: {source}")]
    Tls { addr: String, source: io::Error },
}

/// A byte stream to the backend.
#[derive(Debug)]
pub enum BackendStream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Unix(UnixStream),
}

/// Opens a connection to the first upstream address that answers in time,
/// with TLS negotiated as `sslmode` says.
pub async fn connect(upstream: &Upstream) -> Result<(BackendStream, UpstreamAddr), BackendError> {
    let mut last = None;
    for addr in &upstream.addrs {
        match connect_secured(addr, upstream.connect_timeout, &upstream.tls).await {
            Ok(stream) => return Ok((stream, addr.clone())),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("config validation guarantees at least one upstream address"))
}

/// Whether one upstream address accepts a connection (no TLS, no startup).
pub async fn reachable(upstream: &Upstream, timeout: Duration) -> Result<(), BackendError> {
    let mut last = None;
    for addr in &upstream.addrs {
        match connect_one(addr, timeout).await {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("config validation guarantees at least one upstream address"))
}

async fn connect_secured(
    addr: &UpstreamAddr,
    timeout: Duration,
    tls: &UpstreamTls,
) -> Result<BackendStream, BackendError> {
    // Unix sockets never use TLS, as in libpq.
    let (UpstreamAddr::Tcp { host, port }, Some(connector)) = (addr, tls.connector()) else {
        return connect_one(addr, timeout).await;
    };
    let name = addr.to_string();
    let attempt = async {
        let tcp = TcpStream::connect((host.as_str(), *port))
            .await
            .map_err(StartTls::Connect)?;
        tune(&tcp).map_err(StartTls::Connect)?;
        start_tls(tcp, host, &connector, tls).await
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(StartTls::Connect(source))) => Err(BackendError::Connect { addr: name, source }),
        Ok(Err(StartTls::Refused)) => Err(BackendError::TlsRefused {
            addr: name,
            mode: tls.mode.as_str(),
        }),
        Ok(Err(StartTls::Handshake(source))) => Err(BackendError::Tls { addr: name, source }),
        Err(_) => Err(BackendError::Timeout(timeout, name)),
    }
}

enum StartTls {
    Connect(io::Error),
    /// The server answered 'N' and `sslmode` requires TLS.
    Refused,
    Handshake(io::Error),
}

/// Sends an SSLRequest and, on 'S', does the handshake. On 'N' the plain
/// connection goes on if `sslmode` allows it (prefer).
async fn start_tls(
    mut tcp: TcpStream,
    host: &str,
    connector: &tokio_rustls::TlsConnector,
    tls: &UpstreamTls,
) -> Result<BackendStream, StartTls> {
    tcp.write_all(&encode_ssl_request())
        .await
        .map_err(StartTls::Handshake)?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer)
        .await
        .map_err(StartTls::Handshake)?;
    match answer[0] {
        b'S' => {
            let name = ServerName::try_from(host.to_owned())
                .map_err(|e| StartTls::Handshake(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
            let stream = connector
                .connect(name, tcp)
                .await
                .map_err(StartTls::Handshake)?;
            Ok(BackendStream::Tls(Box::new(stream)))
        }
        b'N' if !tls.mode.requires_tls() => Ok(BackendStream::Tcp(tcp)),
        b'N' => Err(StartTls::Refused),
        other => Err(StartTls::Handshake(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected answer {other:#04x} to SSLRequest"),
        ))),
    }
}

/// The kernel buffer pgcache asks for on each leg of a relay: what it has
/// read from a client and not yet passed on, and what it has written to
/// PostgreSQL and PostgreSQL has not read. Left to autotuning, loopback
/// buffers grow to megabytes, and a client pipelining a batch that
/// failed early keeps writing that much more before the error reaches it
/// than it would directly. The kernel doubles the figure.
pub const RELAY_SOCKET_BUFFER: usize = 128 * 1024;

/// A backend TCP connection, tuned for relaying: no Nagle delay, and a
/// bounded send buffer (see [`RELAY_SOCKET_BUFFER`]).
fn tune(tcp: &TcpStream) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    socket2::SockRef::from(tcp).set_send_buffer_size(RELAY_SOCKET_BUFFER)
}

async fn connect_one(
    addr: &UpstreamAddr,
    timeout: Duration,
) -> Result<BackendStream, BackendError> {
    let name = addr.to_string();
    let attempt = async {
        match addr {
            UpstreamAddr::Tcp { host, port } => {
                let s = TcpStream::connect((host.as_str(), *port)).await?;
                tune(&s)?;
                Ok(BackendStream::Tcp(s))
            }
            UpstreamAddr::Unix { path } => {
                Ok(BackendStream::Unix(UnixStream::connect(path).await?))
            }
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(source)) => Err(BackendError::Connect { addr: name, source }),
        Err(_) => Err(BackendError::Timeout(timeout, name)),
    }
}

/// Sends a CancelRequest for a backend process, as PostgreSQL expects: on a
/// fresh connection, which the server closes without a reply.
pub async fn send_cancel(
    upstream: &Upstream,
    target: &crate::cancel::CancelTarget,
) -> Result<(), BackendError> {
    let addr = &target.addr;
    let mut stream = connect_secured(addr, upstream.connect_timeout, &upstream.tls).await?;
    let packet = encode_cancel(target.backend_pid, &target.backend_secret);
    stream
        .write_all(&packet)
        .await
        .map_err(|source| BackendError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    // PostgreSQL closes the connection once it has signalled the backend:
    // only then may the client's own be closed, or its next statement
    // could be the one cancelled. Nothing is sent on it but the close.
    let mut rest = [0u8; 64];
    let closed = async { while stream.read(&mut rest).await.is_ok_and(|n| n > 0) {} };
    if tokio::time::timeout(upstream.connect_timeout, closed)
        .await
        .is_err()
    {
        tracing::warn!(%addr, "PostgreSQL did not close the cancel connection in time");
    }
    Ok(())
}

impl AsyncRead for BackendStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            BackendStream::Tls(s) => Pin::new(s).poll_read(cx, buf),
            BackendStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for BackendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            BackendStream::Tls(s) => Pin::new(s).poll_write(cx, buf),
            BackendStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            BackendStream::Tls(s) => Pin::new(s).poll_flush(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            BackendStream::Tls(s) => Pin::new(s).poll_shutdown(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
