//! A restart no client notices: the listening socket handed from one
//! pgcache to the next on the same host.
//!
//! Two listeners on one address (`SO_REUSEPORT`) would let the new process
//! bind while the old one runs, but the kernel spreads connections over
//! both, and those still queued on the old listener when it closes are
//! reset. So there is one socket, not two: each pgcache offers its
//! listening socket on a Unix socket beside it ([`path`]), and a new
//! pgcache that finds the address taken asks for it there and receives
//! the descriptor itself (`SCM_RIGHTS`). From then on the new process
//! accepts; the old one stops accepting and serves its sessions until it
//! is told to stop (SIGTERM), then drains as it always does. Closing its
//! copy of the descriptor leaves the socket, and every connection queued
//! on it, to the new process.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// What a new pgcache asks, and the old one answers with the descriptor.
const ASK: &[u8] = b"pgcache: hand over\n";
const GIVE: &[u8] = b"pgcache: here\n";

/// Where the pgcache listening on `addr` offers its socket: in the
/// directory for temporary files, named after the address.
pub fn path(addr: SocketAddr) -> PathBuf {
    std::env::temp_dir().join(format!(".s.pgcache.{}.{}", addr.ip(), addr.port()))
}

/// Binds `addr`, or takes its socket over from the pgcache listening on
/// it. True when it was taken over.
pub async fn listen(addr: SocketAddr) -> io::Result<(tokio::net::TcpListener, bool)> {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => Ok((listener, false)),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let fd = take(&path(addr)).await.map_err(|why| {
                io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{e}, and no pgcache there handed it over ({why})"),
                )
            })?;
            let listener = std::net::TcpListener::from(fd);
            listener.set_nonblocking(true)?;
            if listener.local_addr()? != addr && addr.port() != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "the socket handed over listens on another address",
                ));
            }
            info!(%addr, "took the listening socket over from the pgcache that had it");
            Ok((tokio::net::TcpListener::from_std(listener)?, true))
        }
        Err(e) => Err(e),
    }
}

/// Asks the pgcache offering at `path` for its listening socket.
async fn take(path: &Path) -> io::Result<OwnedFd> {
    let stream = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let stream = UnixStream::connect(path).await?;
        stream.writable().await?;
        stream.try_write(ASK)?;
        loop {
            stream.readable().await?;
            match stream.try_io(Interest::READABLE, || receive(&stream)) {
                Ok((answer, Some(fd))) if answer == GIVE => return Ok(fd),
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the answer was not a socket",
                    ));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    });
    stream
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer within 5 s"))?
}

/// Offers `listener`'s socket at `path` until a new pgcache takes it
/// (then `handed` is cancelled) or this one drains. This pgcache listens
/// on the address, so a socket file already at `path` is a stale one (or
/// that of the pgcache it took the socket over from, which offers no
/// more): it is replaced.
pub fn offer(
    listener: &tokio::net::TcpListener,
    path: PathBuf,
    handed: CancellationToken,
    drain: CancellationToken,
) {
    let fd = match listener.as_fd().try_clone_to_owned() {
        Ok(fd) => fd,
        Err(e) => {
            warn!(error = %e, "cannot offer the listening socket for a restart");
            return;
        }
    };
    let offered = match bind(&path) {
        Ok(offered) => offered,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot offer the listening socket for a restart");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let asked = tokio::select! {
                _ = drain.cancelled() => break,
                asked = offered.accept() => asked,
            };
            let Ok((stream, _)) = asked else { continue };
            match give(&stream, &fd).await {
                Ok(()) => {
                    info!("handed the listening socket to a new pgcache: no longer accepting");
                    handed.cancel();
                    // The new one offers it from now on, at this path.
                    return;
                }
                Err(e) => warn!(error = %e, "a handover failed"),
            }
        }
        let _ = std::fs::remove_file(&path);
    });
}

/// Binds `path`, replacing a stale socket file.
fn bind(path: &Path) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            std::fs::remove_file(path)?;
            UnixListener::bind(path)
        }
        other => other,
    }
}

/// One message, and the descriptor that came with it.
fn receive(stream: &UnixStream) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut buf = [0u8; 64];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = rustix::net::recvmsg(
        stream,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let fd = control.drain().find_map(|m| match m {
        RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
        _ => None,
    });
    Ok((buf[..msg.bytes].to_vec(), fd))
}

async fn give(stream: &UnixStream, fd: &OwnedFd) -> io::Result<()> {
    let mut buf = [0u8; 64];
    let mut read = 0;
    while !buf[..read].ends_with(b"\n") {
        stream.readable().await?;
        match stream.try_read(&mut buf[read..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if read == buf.len() {
            break;
        }
    }
    if &buf[..read] != ASK {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a handover request",
        ));
    }
    let send = || {
        let fds = [fd.as_fd()];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&fds));
        rustix::net::sendmsg(
            stream,
            &[IoSlice::new(GIVE)],
            &mut control,
            SendFlags::empty(),
        )
        .map_err(io::Error::from)
    };
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, send) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}
