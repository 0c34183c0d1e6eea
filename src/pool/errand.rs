//! A request of pgcache's own on a connection of a transaction pool, off
//! any client's path (a refresh of a served hit, a check of the
//! correctness sampler): a connection taken, put in the settings the
//! request runs in, the request translated to that connection's statement
//! names, the answer's frames as the client would see them handed to the
//! caller, and the connection given back if it is idle.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;

use super::Pools;
use super::prepared::{Reply, Translator};
use super::transaction::Pool;
use crate::config::PoolConfig;
use crate::protocol::answer::read_answer;
use crate::protocol::codec::{HEADER_LEN, frames};
use crate::protocol::{backend as be, messages};
use crate::upstream::Upstream;

/// Why an errand ends without its answer, most often.
const LOST: &str = "the server connection was lost";

/// A request to run on a connection of `pool`.
pub struct Errand {
    pub pool: Arc<Pool>,
    /// The request's statements, as the pool's connections name them.
    pub translator: Translator,
    /// The settings it runs in: their id in the pool's books, and the SQL
    /// that applies them.
    pub settings: (u64, String),
    /// Frames ending in Sync, or a Query.
    pub request: Vec<u8>,
}

impl Errand {
    /// Runs the request; each frame of its answer a client would see goes
    /// to `sink`. Returns when the answer was complete.
    pub async fn run(
        mut self,
        (pools, upstream, config): (&Pools, &Upstream, &PoolConfig),
        mut sink: impl FnMut(&[u8]),
    ) -> Result<Instant, &'static str> {
        let wait = config.query_wait_timeout();
        let (mut lease, mut stream) = pools
            .checkout(&self.pool, upstream, wait, 0)
            .await
            .map_err(|_| "no server connection")?;
        let (state, apply) = &self.settings;
        if lease.server().state != *state {
            lease.server_mut().prepared.forget_unnamed();
            let answered = read_answer(&mut stream, &messages::query(apply), drop).await;
            let answered = answered.ok().flatten().ok_or(LOST)?;
            if answered.result.is_err() {
                return Err("the client's settings were refused");
            }
            lease.server_mut().state = *state;
        }
        let mut out = BytesMut::with_capacity(self.request.len() + 64);
        let now = self.translator.translate(
            &self.request,
            &mut lease.server_mut().prepared,
            config.max_prepared_statements,
            false,
            &mut out,
        );
        frames(&now).for_each(&mut sink);
        stream.write_all(&out).await.map_err(|_| "write")?;
        let idle = loop {
            let frame = match stream.read_frame().await {
                Ok(Some(frame)) => frame,
                _ => return Err(LOST),
            };
            // Not the first statement of a transaction: never sent again.
            let answer = self
                .translator
                .on_frame(&frame, &mut lease.server_mut().prepared);
            if frame[0] == be::READY_FOR_QUERY {
                break frame.get(HEADER_LEN) == Some(&b'I');
            }
            if answer.reply == Reply::Pass {
                sink(&frame);
            }
            frames(&answer.to_client).for_each(&mut sink);
        };
        let done = Instant::now();
        if idle && self.translator.is_idle() {
            lease.give_back(stream, config.server_lifetime());
        }
        Ok(done)
    }
}
