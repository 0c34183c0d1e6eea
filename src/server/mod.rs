//! The listener: accepts clients, enforces the connection limit and drives
//! graceful shutdown.

mod opening;

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::shutdown::Stage;
use crate::{App, Config};

/// Serves clients on `listener` until `shutdown` completes, then stops
/// accepting, closes idle sessions, lets busy ones finish their transaction
/// for up to `server.shutdown_timeout_secs`, and closes the rest.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), crate::StartError> {
    serve(App::start(config).await?, listener, shutdown).await;
    Ok(())
}

/// [`run`] with an [`App`] the caller keeps a handle to (tests read its
/// counters).
pub async fn serve(app: Arc<App>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    if let Some(listener) = app.take_metrics_listener() {
        tokio::spawn(crate::http::serve(Arc::clone(&app), listener));
    }
    let config = app.config();
    let limit = Arc::new(Semaphore::new(config.server.max_client_connections));
    let startups = StartupLimiter::new(config.server.max_startups_per_ip);
    let sessions = TaskTracker::new();
    tokio::pin!(shutdown);
    match listener.local_addr() {
        Ok(addr) => info!(%addr, "pgcache listening"),
        Err(_) => info!("pgcache listening"),
    }
    let mut listener = Some(listener);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            () = app.handed_over.cancelled(), if listener.is_some() => {
                // The new pgcache accepts on the same socket now, and
                // waits for the disk tier.
                listener = None;
                tokio::spawn({
                    let app = Arc::clone(&app);
                    async move { app.hand_disk_over().await }
                });
            }
            accepted = accept(listener.as_ref()) => match accepted {
                Ok((socket, peer)) => {
                    tune(&socket, peer);
                    match startups.enter(peer.ip()) {
                        Some(starting) => {
                            // A session's future is kilobytes; boxed, the
                            // task moves a pointer, not the future, each
                            // time tokio moves its stage.
                            sessions.spawn(Box::pin(opening::serve(
                                Arc::clone(&app),
                                socket,
                                peer,
                                (Arc::clone(&limit), sessions.clone()),
                                starting,
                            )));
                        }
                        None => {
                            warn!(%peer, "refused connection: server.max_startups_per_ip reached");
                            sessions.spawn(opening::refuse(socket));
                        }
                    }
                }
                Err(e) => {
                    // Out of file descriptors or similar: back off briefly
                    // instead of spinning; existing sessions keep running.
                    error!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    drop(listener);
    info!(
        sessions = sessions.len(),
        "shutting down: closing idle sessions, waiting for busy ones"
    );
    app.drain.cancel();
    app.clients.raise(Stage::Drain);
    sessions.close();
    if tokio::time::timeout(config.shutdown_timeout(), sessions.wait())
        .await
        .is_err()
    {
        warn!(
            sessions = sessions.len(),
            "shutdown timeout reached: closing remaining sessions"
        );
        app.force.cancel();
        app.clients.raise(Stage::Force);
        sessions.wait().await;
    }
    app.carry_disk();
    info!("pgcache stopped");
}

/// Sets a client's socket up for relaying.
fn tune(socket: &tokio::net::TcpStream, peer: std::net::SocketAddr) {
    let tuned = socket.set_nodelay(true).and_then(|()| {
        socket2::SockRef::from(socket).set_recv_buffer_size(crate::backend::RELAY_SOCKET_BUFFER)
    });
    if let Err(e) = tuned {
        warn!(%peer, error = %e, "could not tune the client's socket");
    }
}

/// The next connection on `listener`; never, once there is none.
async fn accept(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// Counts connections per address that have not finished their startup, so
/// that clients holding sockets half-open cannot exhaust pgcache.
#[derive(Clone)]
pub struct StartupLimiter {
    max: usize,
    starting: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
}

/// One connection in startup; dropped when its startup ends.
pub struct Starting {
    limiter: StartupLimiter,
    ip: IpAddr,
}

impl StartupLimiter {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            starting: Arc::default(),
        }
    }

    pub fn enter(&self, ip: IpAddr) -> Option<Starting> {
        let mut map = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(Starting {
            limiter: self.clone(),
            ip,
        })
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        let mut map = self
            .limiter
            .starting
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startups_are_limited_per_address_and_released() {
        let limiter = StartupLimiter::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = limiter.enter(a).unwrap();
        let _second = limiter.enter(a).unwrap();
        assert!(limiter.enter(a).is_none());
        assert!(
            limiter.enter(b).is_some(),
            "another address is not affected"
        );
        drop(first);
        assert!(limiter.enter(a).is_some());
    }
}
