//! Transaction mode: pgcache's own requests for a served hit (a
//! refresh-ahead, a check of the correctness sampler) run off the client's
//! path, on a connection of the client's pool put in the client's state,
//! so that the client's next statement neither waits for them nor
//! bypasses the cache because of them. The request is the client's own
//! frames, translated with a copy of its statements.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::debug;

use super::capture::{Capture, Captured};
use super::link::ClientState;
use super::relay::Session;
use crate::App;
use crate::backend::BackendStream;
use crate::pool::prepared::{Reply, Translator};
use crate::pool::transaction::Pool;
use crate::protocol::codec::{HEADER_LEN, frames};
use crate::protocol::stream::FramedStream;
use crate::protocol::{backend as be, messages};

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Whether a request for a served hit can run off the client's path:
    /// in transaction mode, while pgcache knows the client's settings.
    pub(super) fn can_offload(&self) -> bool {
        self.link.is_pooled() && !self.link.state_dirty
    }

    /// Runs `request` (frames ending in Sync, or a Query) for `capture` on
    /// a connection of the session's pool, in a task of its own.
    pub(super) fn offload(&self, request: &[u8], capture: Capture) {
        let Some(pool) = self.link.pool.clone() else {
            return;
        };
        let job = Job {
            app: Arc::clone(&self.app),
            pool,
            translator: self.link.translator.for_request(),
            state: self.link.state.clone(),
            request: request.to_vec(),
        };
        tokio::spawn(async move {
            if let Err(why) = job.run(capture).await {
                debug!(why, "request for a served hit dropped");
            }
        });
    }
}

struct Job {
    app: Arc<App>,
    pool: Arc<Pool>,
    translator: Translator,
    state: ClientState,
    request: Vec<u8>,
}

impl Job {
    async fn run(mut self, mut capture: Capture) -> Result<(), &'static str> {
        let app = Arc::clone(&self.app);
        let config = app.config();
        let (mut lease, mut stream) = app
            .pool
            .pooled
            .checkout(
                &self.pool,
                &app.upstream,
                config.pool.query_wait_timeout(),
                0,
            )
            .await
            .map_err(|_| "no server connection")?;
        if lease.server().state != self.state.id {
            lease.server_mut().prepared.forget_unnamed();
            let apply = messages::query(&self.state.apply_sql());
            stream.write_all(&apply).await.map_err(|_| "write")?;
            if !read_to_ready(&mut stream).await? {
                return Err("the client's settings were refused");
            }
            lease.server_mut().state = self.state.id;
        }
        let max_entry = app.cache.local.max_entry_bytes();
        let mut out = BytesMut::with_capacity(self.request.len() + 64);
        let now = self.translator.translate(
            &self.request,
            &mut lease.server_mut().prepared,
            config.pool.max_prepared_statements,
            &mut out,
        );
        frames(&now).for_each(|f| capture.add(f, max_entry));
        stream.write_all(&out).await.map_err(|_| "write")?;
        let idle = loop {
            let frame = match stream.read_frame().await {
                Ok(Some(frame)) => frame,
                _ => return Err("the server connection was lost"),
            };
            let (reply, after) = self
                .translator
                .on_frame(frame[0], &mut lease.server_mut().prepared);
            if frame[0] == be::READY_FOR_QUERY {
                break frame.get(HEADER_LEN) == Some(&b'I');
            }
            if reply == Reply::Pass {
                capture.add(&frame, max_entry);
            }
            frames(&after).for_each(|f| capture.add(f, max_entry));
        };
        let done = Instant::now();
        if idle && self.translator.is_idle() {
            lease.give_back(stream, config.pool.server_lifetime());
        }
        match capture.finish() {
            Some(Captured::Store(fill, bytes)) => app.cache.store(fill, &bytes),
            Some(Captured::Verified(check, answer)) => check.judge(&app.cache, &answer, done),
            Some(Captured::Compared { .. }) | None => {}
        }
        Ok(())
    }
}

/// Reads up to ReadyForQuery; true if nothing failed.
async fn read_to_ready(stream: &mut FramedStream<BackendStream>) -> Result<bool, &'static str> {
    let mut ok = true;
    loop {
        match stream.read_frame().await {
            Ok(Some(frame)) => match frame[0] {
                be::ERROR_RESPONSE => ok = false,
                be::READY_FOR_QUERY => return Ok(ok),
                _ => {}
            },
            _ => return Err("the server connection was lost"),
        }
    }
}
