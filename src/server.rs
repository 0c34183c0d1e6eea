//! The listener: accepts clients, enforces the connection limit and drives
//! graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::{App, Config, session};

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
        tokio::spawn(crate::metrics::serve(Arc::clone(&app), listener));
    }
    let limit = Arc::new(Semaphore::new(app.config.server.max_client_connections));
    let sessions = TaskTracker::new();
    tokio::pin!(shutdown);
    info!(addr = ?listener.local_addr().ok(), "pgcache listening");
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    if let Err(e) = socket.set_nodelay(true) {
                        warn!(%peer, error = %e, "could not set TCP_NODELAY");
                    }
                    let permit = Arc::clone(&limit).try_acquire_owned().ok();
                    sessions.spawn(session::serve(Arc::clone(&app), socket, peer, permit));
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
    sessions.close();
    if tokio::time::timeout(app.config.shutdown_timeout(), sessions.wait())
        .await
        .is_err()
    {
        warn!(
            sessions = sessions.len(),
            "shutdown timeout reached: closing remaining sessions"
        );
        app.force.cancel();
        sessions.wait().await;
    }
    info!("pgcache stopped");
}
