//! Connections to the PostgreSQL server: TCP or Unix socket.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::config::UpstreamAddr;
use crate::protocol::startup::encode_cancel;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("could not connect to upstream server {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("timed out after {0:?} connecting to upstream server {1}")]
    Timeout(Duration, String),
}

/// A byte stream to the backend.
#[derive(Debug)]
pub enum BackendStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl std::fmt::Display for UpstreamAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamAddr::Tcp { host, port } => write!(f, "{host}:{port}"),
            UpstreamAddr::Unix { path } => write!(f, "{}", path.display()),
        }
    }
}

/// Opens a connection to the first of `addrs` that answers in time.
pub async fn connect(
    addrs: &[UpstreamAddr],
    timeout: Duration,
) -> Result<(BackendStream, UpstreamAddr), BackendError> {
    let mut last = None;
    for addr in addrs {
        match connect_one(addr, timeout).await {
            Ok(stream) => return Ok((stream, addr.clone())),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("config validation guarantees at least one upstream address"))
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
                s.set_nodelay(true)?;
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
    addr: &UpstreamAddr,
    timeout: Duration,
    pid: u32,
    secret: &[u8],
) -> Result<(), BackendError> {
    let mut stream = connect_one(addr, timeout).await?;
    let packet = encode_cancel(pid, secret);
    stream
        .write_all(&packet)
        .await
        .map_err(|source| BackendError::Connect {
            addr: addr.to_string(),
            source,
        })?;
    let _ = stream.shutdown().await;
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
            BackendStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
