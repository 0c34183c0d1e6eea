//! Invalidation by name, from any PostgreSQL session:
//! `NOTIFY pgcache_invalidate, 'tag:pricing'` (or `'table:name'`, several
//! separated by commas). For what replication cannot see: views, foreign
//! tables, functions' inputs, data outside PostgreSQL. Each stream keeps a
//! listening connection to its database; the bumps go out as any other
//! invalidation does, so every instance applies them.

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

use super::ReplicationError;
use crate::upstream::Upstream;

/// The channel pgcache listens on.
pub const CHANNEL: &str = "pgcache_invalidate";

/// A connection listening on [`CHANNEL`] in one database, and the payloads
/// it hears. The receiver ends when the connection does.
pub struct Listener {
    _client: tokio_postgres::Client,
    pub payloads: mpsc::Receiver<String>,
}

pub async fn listen(upstream: &Upstream, database: &str) -> Result<Listener, ReplicationError> {
    let (client, mut connection) = upstream
        .control_config(database)
        .connect(upstream.tls.make_tls())
        .await?;
    let (tx, payloads) = mpsc::channel(1024);
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message
                && tx.send(n.payload().to_owned()).await.is_err()
            {
                return;
            }
        }
    });
    client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
    Ok(Listener {
        _client: client,
        payloads,
    })
}
