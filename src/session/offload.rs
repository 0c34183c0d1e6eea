//! pgcache's own requests for a served hit (a refresh-ahead, a check of
//! the correctness sampler) run off the client's path, on a connection of
//! the pool of the client's database and user put in the client's
//! settings, so that the client's next statement neither waits for them
//! nor bypasses the cache because of them. The request is the client's own
//! frames, translated with its statements: in transaction mode a copy of
//! its translator's, in session mode those it prepared on its own
//! connection.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tracing::debug;

use super::capture::{Capture, Captured};
use super::known::Known;
use super::link::{ClientState, Link, SessionLink};
use crate::App;
use crate::cache::DbState;
use crate::pool::prepared::{Reply, Translator};
use crate::pool::transaction::Pool;
use crate::protocol::answer::read_answer;
use crate::protocol::codec::{HEADER_LEN, frames};
use crate::protocol::{backend as be, extended, frontend as fe, messages};

/// Why a job ends without its answer, most often.
const LOST: &str = "the server connection was lost";

/// pgcache's own request for a served hit, to run on a connection of the
/// session's pool.
pub(super) struct Job {
    pool: Arc<Pool>,
    translator: Translator,
    state: ClientState,
    request: Vec<u8>,
}

impl Job {
    /// `request` (frames ending in Sync, or a Query) as a job of its own;
    /// `None` when that cannot be done: pgcache does not know the client's
    /// settings or a statement the request names, or cannot log in for the
    /// client (passthrough authentication with a password).
    pub fn for_request(link: &Link, known: &Known, db: &DbState, request: &[u8]) -> Option<Job> {
        let (pool, translator) = match link {
            Link::Pooled(link) if !link.state_dirty => {
                (Arc::clone(&link.pool), link.translator.for_request())
            }
            // Session mode: the settings were read with the hit's key.
            Link::Session(SessionLink {
                checks: Some(pool), ..
            }) if known.prefix.is_some() && pool.can_log_in() => {
                (Arc::clone(pool), statements_for(known, db, request)?)
            }
            _ => return None,
        };
        Some(Job {
            pool,
            translator,
            state: link.state().clone(),
            request: request.to_vec(),
        })
    }

    /// Runs the job for `capture`, and stores or judges what it captured.
    pub async fn run_into(self, app: Arc<App>, mut capture: Capture) {
        let is_check = capture.is_check();
        let answered = match self.run(&app, &mut capture).await {
            Ok(done) => capture.finish().map(|captured| (captured, done)),
            Err(why) => {
                debug!(why, "request for a served hit dropped");
                None
            }
        };
        match answered {
            Some((Captured::Store(fill, bytes), _)) => app.cache.store(*fill, &bytes),
            Some((Captured::Verified(check, answer), done)) => {
                check.judge(&app.cache, &answer, done)
            }
            Some((Captured::Compared { .. }, _)) => {}
            // Every drawn check gets a verdict.
            None if is_check => app.metrics.verify.skipped.inc(),
            None => {}
        }
    }

    /// Copies the answer into `capture`; returns when it was complete.
    async fn run(mut self, app: &App, capture: &mut Capture) -> Result<Instant, &'static str> {
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
            let answered = read_answer(&mut stream, &apply, drop).await;
            let answered = answered.ok().flatten().ok_or(LOST)?;
            if answered.result.is_err() {
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
            false,
            &mut out,
        );
        frames(&now).for_each(|f| capture.add(f, max_entry));
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
                capture.add(&frame, max_entry);
            }
            frames(&answer.to_client).for_each(|f| capture.add(f, max_entry));
        };
        let done = Instant::now();
        if idle && self.translator.is_idle() {
            lease.give_back(stream, config.pool.server_lifetime());
        }
        Ok(done)
    }
}

/// Session mode: a translator that knows the statements `request`
/// names but does not prepare, as the client prepared them on its own
/// connection; `None` if one is unknown to pgcache.
fn statements_for(known: &Known, db: &DbState, request: &[u8]) -> Option<Translator> {
    let mut translator = Translator::following(Arc::clone(&db.versions.schema));
    let mut seen: Vec<&[u8]> = Vec::new();
    for frame in frames(request) {
        let body = &frame[HEADER_LEN..];
        let name = match frame[0] {
            fe::PARSE => {
                seen.push(extended::parse(body)?.name);
                continue;
            }
            fe::BIND => extended::bind_names(body)?.1,
            fe::DESCRIBE => match extended::target(body)? {
                (fe::TARGET_STATEMENT, name) => name,
                _ => continue,
            },
            _ => continue,
        };
        if seen.contains(&name) {
            continue;
        }
        let statement = known.statements.get(name)?;
        translator.define(name, &statement.sql, &statement.param_types);
        seen.push(name);
    }
    Some(translator)
}
