//! The driver's connection to a replica ([`super::replica`]): opened as
//! the client's user with its pool's credentials when the engine first
//! routes a read there, and given the client's settings (again whenever
//! they change) before a read is written to it.

use std::sync::Arc;

use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::pool::transaction::Pool;
use crate::protocol::stream::FramedStream;
use crate::protocol::{TxStatus, backend as be, messages};
use crate::replica::{Connection, Replica};

/// A session's connection to a replica.
pub(super) struct ReplicaConn {
    pub server: Arc<Replica>,
    pub stream: FramedStream<BackendStream>,
    /// Its cancel key: a CancelRequest goes there while a read is.
    pub key: Arc<CancelTarget>,
    /// What `SHOW SERVERS` tells of it.
    pub shown: Arc<Connection>,
    /// Whether its replica is in rotation: out, the connection is closed.
    rotation: tokio::sync::watch::Receiver<bool>,
}

impl ReplicaConn {
    /// Logs in to `server` as the pool's user, with its credentials, for
    /// client `client`; `id` names it in `SHOW SERVERS`.
    pub async fn open(
        pool: &Pool,
        server: &Arc<Replica>,
        id: u64,
        client: u64,
    ) -> Result<Self, String> {
        let (key, stream) = pool
            .log_in_at(&server.upstream)
            .await
            .map_err(|e| e.to_string())?;
        let shown = Arc::new(Connection::new(
            id,
            &pool.id.user,
            &pool.id.database,
            client,
            key.backend_pid,
        ));
        server.connections.opened(Arc::clone(&shown));
        Ok(Self {
            rotation: server.watch_rotation(),
            server: Arc::clone(server),
            stream,
            key: Arc::new(key),
            shown,
        })
    }

    /// Runs the SQL that gives the connection the client's settings.
    pub async fn apply(&mut self, sql: &str) -> Result<(), String> {
        self.stream
            .write_all(&messages::query(sql))
            .await
            .map_err(|e| e.to_string())?;
        applied(&mut self.stream).await
    }

    /// Ready once its replica is out of rotation (at once if it is now).
    pub async fn retired(&mut self) {
        loop {
            if !*self.rotation.borrow_and_update() {
                return;
            }
            if self.rotation.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Ends the session on the replica, as a client would.
    pub async fn close(mut self: Box<Self>) {
        let _ = self.stream.write_all(&messages::TERMINATE).await;
    }
}

impl Drop for ReplicaConn {
    fn drop(&mut self) {
        self.server.connections.closed(self.shown.id);
    }
}

/// Reads the answer to the settings pgcache applied on a replica
/// connection, to its ReadyForQuery.
async fn applied(stream: &mut FramedStream<BackendStream>) -> Result<(), String> {
    let mut failed = None;
    loop {
        let frame = match stream.read_frame().await {
            Ok(Some(frame)) => frame,
            Ok(None) => return Err("the replica closed the connection".into()),
            Err(e) => return Err(e.to_string()),
        };
        match frame[0] {
            be::ERROR_RESPONSE => {
                let (code, message) = messages::error_parts(&frame, ("", ""));
                failed = Some(format!(
                    "the client's settings failed there: {code} {message}"
                ));
            }
            be::READY_FOR_QUERY => {
                let idle =
                    frame.get(5).and_then(|b| TxStatus::from_byte(*b)) == Some(TxStatus::Idle);
                return match failed {
                    Some(why) => Err(why),
                    None if idle => Ok(()),
                    None => Err("the settings left a transaction open".into()),
                };
            }
            _ => {}
        }
    }
}
