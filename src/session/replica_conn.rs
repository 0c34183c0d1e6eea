//! The driver's connection to a replica ([`super::replica`]): opened as
//! the client's user with its pool's credentials when the engine first
//! routes a read there, given the client's settings (again whenever they
//! change), written what the engine staged, read until the read is
//! answered; a replica that fails before its answer starts leaves the
//! read to the primary.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::info;

use super::SessionError;
use super::link::Link;
use super::pipeline::Flow;
use super::relay::{Session, ctx};
use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::protocol::stream::FramedStream;
use crate::protocol::{TxStatus, backend as be, messages, sqlstate};
use crate::replica::Replica;

/// A session's connection to a replica.
pub(super) struct ReplicaConn {
    pub server: Arc<Replica>,
    pub stream: FramedStream<BackendStream>,
    /// Its cancel key: a CancelRequest goes there while a read is.
    pub key: Arc<CancelTarget>,
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Writes what the engine staged for its replica, connecting (and
    /// applying the client's settings) first where needed. A replica that
    /// cannot take it leaves the read to the primary.
    pub(super) async fn flush_replica(&mut self) -> Result<(), SessionError> {
        let Some(leg) = &self.engine.replica else {
            return Ok(());
        };
        if leg.staged.is_empty() {
            return Ok(());
        }
        let server = Arc::clone(&leg.server);
        match Box::pin(self.send_replica(&server)).await {
            Ok(()) => {
                let key = self.replica.as_ref().map(|c| Arc::clone(&c.key));
                if let Some(cancel) = &self.engine.cancel {
                    cancel.retarget(key);
                }
                Ok(())
            }
            Err(why) => {
                info!(replica = %server.name, "read sent to the primary: {why}");
                self.replica = None;
                server.metrics.retries.inc();
                self.engine.replica_failed();
                Box::pin(self.flush_backend()).await
            }
        }
    }

    /// Connects if needed, applies the client's settings if they are not
    /// those of the connection, and writes the staged frames.
    async fn send_replica(&mut self, server: &Arc<Replica>) -> Result<(), String> {
        let Link::Session(own) = &self.engine.link else {
            return Err("not in session mode".into());
        };
        let state = own.state.clone();
        let Some(pool) = own.checks.clone() else {
            return Err("no credentials to log in with".into());
        };
        if self
            .replica
            .as_ref()
            .is_none_or(|c| !Arc::ptr_eq(&c.server, server))
        {
            let (key, stream) = pool
                .log_in_at(&server.upstream)
                .await
                .map_err(|e| e.to_string())?;
            self.replica = Some(Box::new(ReplicaConn {
                server: Arc::clone(server),
                stream,
                key: Arc::new(key),
            }));
            if let Some(leg) = &mut self.engine.replica {
                leg.applied = None;
            }
        }
        let (Some(conn), Some(leg)) = (&mut self.replica, &mut self.engine.replica) else {
            return Err("no replica".into());
        };
        if leg.applied != Some(state.id) {
            let apply = messages::query(&state.apply_sql());
            conn.stream
                .write_all(&apply)
                .await
                .map_err(|e| e.to_string())?;
            applied(&mut conn.stream).await?;
            leg.applied = Some(state.id);
        }
        let staged = std::mem::take(&mut leg.staged);
        conn.stream
            .write_all(&staged)
            .await
            .map_err(|e| e.to_string())
    }

    /// The replica's answer, as the engine has it, to the client; once
    /// the read is answered, the cancel key is the primary's again and
    /// what waited goes on: a retry to the primary, the client's next
    /// frames.
    pub(super) async fn on_replica_data(&mut self) -> Result<Flow, SessionError> {
        let ctx = ctx(&self.app, &self.entry);
        let Some(conn) = &mut self.replica else {
            return Ok(Flow::Continue);
        };
        let relayed = self.engine.on_backend(&ctx, conn.stream.buffer_mut())?;
        self.carry_out().await;
        if relayed.end > 0 {
            let Some(conn) = &mut self.replica else {
                return Ok(Flow::Continue);
            };
            let bytes = super::traffic::to_client(
                &mut self.engine.out,
                conn.stream.buffered(),
                relayed.end,
                relayed.from,
            );
            self.app.metrics.client_bytes_out.inc_by(bytes.len() as u64);
            let sent = match bytes.is_empty() {
                true => Ok(()),
                false => self.client.write_all(bytes).await,
            };
            self.engine.out.clear();
            conn.stream.consume(relayed.end);
            if let Err(e) = sent {
                self.client_gone().await;
                return Err(SessionError::ClientIo(e));
            }
        }
        if self.engine.replica_busy() {
            return Ok(Flow::Continue);
        }
        if let Some(cancel) = &self.engine.cancel {
            cancel.retarget(self.engine.backend_key.clone());
        }
        self.flush_backend().await?;
        if !self.client.buffered().is_empty() {
            return Box::pin(self.on_client_data()).await;
        }
        Ok(Flow::Continue)
    }

    /// The replica's connection ended or failed while a read was there:
    /// the read goes to the primary if none of its answer reached the
    /// client, else the client is told it failed.
    pub(super) async fn replica_lost(
        &mut self,
        error: Option<std::io::Error>,
    ) -> Result<Flow, SessionError> {
        let name = self.replica.take().map(|c| c.server.name.clone());
        info!(replica = ?name, error = ?error, "replica connection lost");
        if let Some(cancel) = &self.engine.cancel {
            cancel.retarget(self.engine.backend_key.clone());
        }
        if self.engine.replica_failed() {
            if let Some(leg) = &self.engine.replica {
                leg.server.metrics.retries.inc();
            }
            self.flush_backend().await?;
        } else {
            let mut out = bytes::BytesMut::new();
            messages::error_response(
                &mut out,
                "ERROR",
                sqlstate::CONNECTION_FAILURE,
                "the replica's connection was lost while it answered",
            );
            out.extend_from_slice(&messages::ready_for_query(self.engine.tx.status));
            self.client
                .write_all(&out)
                .await
                .map_err(SessionError::ClientIo)?;
        }
        if !self.client.buffered().is_empty() {
            return Box::pin(self.on_client_data()).await;
        }
        Ok(Flow::Continue)
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
