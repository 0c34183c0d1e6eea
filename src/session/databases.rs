//! Statements on whole databases: pgcache lets go of a database a client's
//! statement needs free (see [`crate::cache::hold`]) before the statement
//! goes out.

use tokio::io::{AsyncRead, AsyncWrite};

use super::relay::Session;
use crate::classify::databases::needing_free;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::frontend as fe;

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// For a Query or Parse frame whose text names a database.
    pub(super) async fn free_databases(&mut self, frame: &[u8]) {
        if !self.app.cache.replication_on() {
            return;
        }
        let mut body = &frame[HEADER_LEN..];
        if frame[0] == fe::PARSE {
            // The statement's name comes first.
            let Some(end) = body.iter().position(|b| *b == 0) else {
                return;
            };
            body = &body[end + 1..];
        }
        let text = body.split(|b| *b == 0).next().unwrap_or_default();
        let Ok(sql) = std::str::from_utf8(text) else {
            return;
        };
        for name in needing_free(sql) {
            let via = self.startup.database();
            if let Some(paused) = self.app.streams.release(&name, via).await {
                self.paused.push(paused);
            }
        }
    }
}
