//! The cache path of a session, for every client frame (caching on).
//!
//! ```text
//! Query / Parse..Sync
//!   → plan (memoised per shape: analysis × facts of the names it uses → read? effects)
//!   → may it be served? (single SELECT, no temp objects, nothing in flight,
//!      not after a write in this transaction, not REPEATABLE READ, settings known)
//!   → key (session prefix, statement, parameters)
//!   → cache.lookup: hit → write the stored frames + ReadyForQuery
//!                   miss → forward, tee the response into a capture
//!                   bypass → forward
//! every forwarded request carries its effects (table versions to bump,
//! epoch, schema change), applied when its ReadyForQuery arrives and again
//! when its transaction ends (engine/answers.rs).
//! ```

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::capture::Capture;
use super::pipeline::{Flow, Inflight};
use super::plan::Plan;
use super::relay::Session;
use super::row_limit::cut_stored;
use crate::cache::key::{self, KeyBuilder, RequestKey};
use crate::cache::sampler::Check;
use crate::cache::{Bumps, Lookup, Request};
use crate::classify::BypassReason;
use crate::config::CacheMode;
use crate::pool::marks::{Marks, marks};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, frontend as fe, messages, sqlstate};

/// What became of a read the cache was asked for.
pub(super) enum Answer {
    /// Answered from the cache; the backend never sees it (unless a
    /// refresh of the entry was sent).
    Served { refreshed: bool },
    /// To forward, with a capture if its result is to be stored.
    Forward(Option<Capture>),
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// One complete client frame, with caching on.
    pub(super) async fn on_client_frame(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        if frame[0] == fe::PARSE {
            let marks = self.engine.known.body_marks(&frame[HEADER_LEN..]);
            if self.note_text_marks(marks) {
                // Boxed, as are pgcache's other rare round trips: inline,
                // their futures made every statement's several kilobytes
                // larger, and each await copied them.
                Box::pin(self.meet_prerequisites(&frame)).await?;
            }
        }
        match frame[0] {
            fe::QUERY => self.on_query(frame).await,
            fe::EXECUTE => self.on_execute_frame(frame).await,
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::CLOSE => Ok(self.on_extended_now(&frame)),
            fe::SYNC => {
                let started = Instant::now();
                self.engine.db.hold.touch_at(started);
                self.on_sync(frame, started).await
            }
            fe::FUNCTION_CALL => {
                self.release_batch();
                self.forward(&frame);
                self.engine.settings_may_have_changed();
                self.engine.tx.wrote();
                self.engine.pipeline.push(Inflight {
                    effects: Bumps::opaque(),
                    ..Inflight::default()
                });
                Ok(Flow::Continue)
            }
            fe::TERMINATE
                if self
                    .engine
                    .hand_back(&super::relay::ctx(&self.app, &self.entry)) =>
            {
                Ok(Flow::Close)
            }
            fe::TERMINATE if self.engine.link.is_pooled() => {
                // The connection, if any, goes back to the pool.
                self.engine.client_ended = true;
                Ok(Flow::Close)
            }
            tag => {
                if tag == fe::FLUSH {
                    self.release_batch();
                    self.engine.pipeline.unsynced = true;
                }
                if tag == fe::COPY_DONE || tag == fe::COPY_FAIL {
                    self.engine.pipeline.copy_ended();
                }
                self.forward(&frame);
                Ok(if tag == fe::TERMINATE {
                    self.engine.client_ended = true;
                    Flow::Close
                } else {
                    Flow::Continue
                })
            }
        }
    }

    /// Queues a frame for the backend, first replaying any Parse the
    /// backend has not seen because the cache answered it.
    pub(super) fn forward(&mut self, frame: &[u8]) {
        if self.engine.pipeline.to_backend.is_empty() && !self.engine.known.unsent_parses.is_empty()
        {
            for (_, raw) in self.engine.known.unsent_parses.drain(..) {
                self.engine.pipeline.to_backend.extend_from_slice(&raw);
            }
            self.engine
                .pipeline
                .to_backend
                .extend_from_slice(&messages::SYNC);
            self.engine.pipeline.push_hidden(Inflight::hidden(None));
        }
        self.engine.pipeline.to_backend.extend_from_slice(frame);
    }

    /// What a Query or Parse text's marks ask of the session now; true if
    /// it has prerequisites to meet before it goes out.
    fn note_text_marks(&mut self, marks: Marks) -> bool {
        if self.engine.server.pooling || self.engine.link.is_pooled() {
            self.engine
                .note_marks(&super::relay::ctx(&self.app, &self.entry), marks);
        }
        marks.evicts || marks.unlogged
    }

    async fn on_query(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        let body = &frame[HEADER_LEN..];
        let sql = body.strip_suffix(&[0]).unwrap_or(body);
        let hash = key::sql_hash(sql);
        // One lookup gives a known text's plan and marks.
        let generation = self.engine.db.catalog.generation();
        let (mut memo, known_marks) =
            self.engine
                .known
                .text(hash, generation, self.app.policy_generation());
        let marks = known_marks.unwrap_or_else(|| marks(body));
        if self.note_text_marks(marks) {
            Box::pin(self.meet_prerequisites(&frame)).await?;
            // Meeting them may have changed the catalog.
            memo = None;
        }
        let started = Instant::now();
        self.engine.db.hold.touch_at(started);
        self.release_batch();
        let plan = match memo {
            Some(plan) => plan,
            None => self.plan(hash, sql).await?,
        };
        if known_marks.is_none() {
            self.engine.known.remember_marks(hash, marks);
        }
        plan.stats.call();
        if plan.begin_strict.is_some() {
            self.before_begin(&plan).await?;
        }
        let mut inflight = Inflight {
            effects: plan.effects.clone(),
            ..Inflight::default()
        };
        let prefix = match self.may_serve_now(&plan, true) {
            Some(decided) => decided,
            None => self.may_serve(&plan, true).await?,
        };
        let key = prefix.map(|prefix| KeyBuilder::new(prefix, key::SIMPLE, hash).finish());
        match self.ask_cache(key, &plan, started, &frame, 0).await? {
            Answer::Served { .. } => return Ok(Flow::Continue),
            Answer::Forward(capture) => {
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), started));
                }
                inflight.capture = capture;
            }
        }
        self.note_effects(&plan);
        self.forward(&frame);
        self.engine.pipeline.executed();
        self.engine.pipeline.push(inflight);
        Ok(Flow::Continue)
    }

    /// Asks the cache for a read (`key`, or why it may not be served).
    /// A hit is written to the client here, with a background refresh sent
    /// as `request` (the frames that ask for it again) when one is due.
    pub(super) async fn ask_cache(
        &mut self,
        key: Result<RequestKey, BypassReason>,
        plan: &Plan,
        started: Instant,
        request: &[u8],
        row_limit: u32,
    ) -> Result<Answer, SessionError> {
        // A key is only made for a cacheable read, which has its reads.
        let (key, reads) = match (key, plan.read.as_ref().map_err(|r| *r)) {
            (Ok(key), Ok(reads)) => (key, reads),
            (Err(reason), _) | (_, Err(reason)) => {
                self.app.cache.bypassed(&self.engine.db, reason);
                plan.stats.bypassed(reason);
                return Ok(Answer::Forward(None));
            }
        };
        let req = Request {
            db: &self.engine.db,
            key,
            reads,
            tier: plan.tier,
            lifetime: plan.lifetime,
            stats: &plan.stats,
            in_transaction: self.engine.tx.status != TxStatus::Idle,
            coalesce_wait: self.engine.known.policy.coalesce_wait,
            started,
            shadow: self.engine.known.policy.mode == CacheMode::Shadow,
        };
        match self.app.cache.lookup(&req).await {
            Lookup::Hit { bytes, refresh } => {
                match (row_limit > 0)
                    .then(|| cut_stored(&bytes, row_limit))
                    .flatten()
                {
                    Some(cut) => self.write_hit(&cut).await?,
                    None => self.write_hit(&bytes).await?,
                }
                // A refresh, or a check of the correctness sampler: the
                // request again, as pgcache's own.
                let hidden = match refresh {
                    Some(fill) => Some(Capture::new(fill)),
                    None if self.engine.tx.status == TxStatus::Idle
                        && self.app.cache.sampler.draw(
                            self.engine.known.policy.verify_rate,
                            self.engine.known.policy.verify_max_per_sec,
                            &self.app.metrics.verify,
                        ) =>
                    {
                        let check =
                            Check::new(&self.engine.db, &plan.stats, bytes, reads, plan.unwatched);
                        Some(Capture::verify(check))
                    }
                    None => None,
                };
                // Off the client's path where pgcache can; else on its
                // connection, answered to nobody.
                let refreshed = match hidden.and_then(|c| self.offload(request, c)) {
                    Some(capture) => {
                        self.forward(request);
                        self.engine
                            .pipeline
                            .push_hidden(Inflight::hidden(Some(capture)));
                        true
                    }
                    None => false,
                };
                Ok(Answer::Served { refreshed })
            }
            Lookup::Miss(fill) => Ok(Answer::Forward(Some(Capture::new(fill)))),
            Lookup::Bypass(reason) => {
                if reason == BypassReason::ReplicationDown {
                    // pgcache may have let go of the database: take hold again.
                    self.app.streams.ensure(&self.engine.db);
                }
                plan.stats.bypassed(reason);
                Ok(Answer::Forward(None))
            }
            // Checked against PostgreSQL's frames as they arrive, before
            // any row-limit cut for the client.
            Lookup::WouldHit(stored) => Ok(Answer::Forward(Some(Capture::compare(stored)))),
        }
    }

    /// The session's memoised plan for a statement text, if current: what
    /// [`Self::plan`] finds first, without a future.
    pub(super) fn memo_plan(&self, hash: u128) -> Option<Arc<Plan>> {
        let generation = self.engine.db.catalog.generation();
        self.engine
            .known
            .plan(hash, generation, self.app.policy_generation())
    }

    /// The plan for a statement text.
    pub(super) async fn plan(&mut self, hash: u128, sql: &[u8]) -> Result<Arc<Plan>, SessionError> {
        let generation = self.engine.db.catalog.generation();
        let policy_generation = self.app.policy_generation();
        if let Some(plan) = self.engine.known.plan(hash, generation, policy_generation) {
            return Ok(plan);
        }
        if self.engine.known.policy.generation != policy_generation {
            self.engine.known.policy = self.app.policy();
        }
        let scanned = self.app.cache.scan(hash, sql);
        if !scanned.scan().hints.problems.is_empty() {
            self.warn_hints(hash, &scanned.scan().hints.problems)
                .await?;
        }
        // Another text of this shape, planned by this session or by
        // another session of the database.
        let plan_key = scanned.plan_key();
        let known = self
            .engine
            .known
            .shape_plan(plan_key, generation, policy_generation)
            .or_else(|| {
                self.app
                    .plans
                    .get(&self.engine.db, plan_key, generation, policy_generation)
            });
        if let Some(plan) = known {
            self.engine.known.remember_plan(hash, plan_key, &plan);
            return Ok(plan);
        }
        let analysis = self.app.cache.analyzed(scanned, sql);
        let (rels, funcs) = Plan::names(&analysis);
        let facts = self.facts(&rels, &funcs).await?;
        let plan = Arc::new(Plan::new(
            &analysis,
            &facts,
            &self.engine.db.versions,
            generation,
            &self.engine.known.policy,
        ));
        if let Ok(families) = &plan.read {
            plan.stats.set_reads(&self.engine.db, families);
        }
        // A plan made while facts were being fetched is made again once
        // they are known.
        if facts.complete() {
            self.engine
                .known
                .remember_plan(hash, analysis.plan_key, &plan);
            self.app
                .plans
                .put(&self.engine.db, analysis.plan_key, &plan);
        }
        Ok(plan)
    }

    /// Tells the client, once per statement text, which of its hints were
    /// malformed or unknown (the statement runs under the policy).
    async fn warn_hints(&mut self, hash: u128, problems: &[String]) -> Result<(), SessionError> {
        if !self.engine.known.first_warning(hash) {
            return Ok(());
        }
        let mut out = BytesMut::new();
        for problem in problems {
            self.app.metrics.hint_problems.inc();
            messages::notice_response(
                &mut out,
                "WARNING",
                sqlstate::WARNING,
                &format!("pgcache: hint ignored: {problem}"),
            );
        }
        self.client
            .write_all(&out)
            .await
            .map_err(SessionError::ClientIo)
    }

    /// Writes a stored response and the ReadyForQuery that ends it, in one write.
    async fn write_hit(&mut self, frames: &[u8]) -> Result<(), SessionError> {
        self.engine.out.clear();
        self.engine.out.extend_from_slice(frames);
        self.engine
            .out
            .extend_from_slice(&messages::ready_for_query(self.engine.tx.status));
        self.flush_out().await
    }

    /// Reads inside a transaction can only use the cache if the session's
    /// settings are known, and they can only be read while it is idle: so
    /// read them just before a BEGIN goes out, if they are not known.
    /// Callers test `plan.begin_strict` first, so that only a BEGIN sets up
    /// this future.
    pub(super) async fn before_begin(&mut self, plan: &Plan) -> Result<(), SessionError> {
        if plan.begin_strict == Some(false)
            && self.engine.known.prefix.is_none()
            && self.backend_idle()
        {
            let _ = self.session_prefix().await?;
        }
        Ok(())
    }

    /// State changes a forwarded statement causes at once.
    pub(super) fn note_effects(&mut self, plan: &Plan) {
        if plan.settings {
            self.engine.settings_may_have_changed();
        }
        if plan.creates_temp {
            self.engine.known.temp = true;
        }
        if let Some(strict) = plan.begin_strict {
            self.engine.tx.begin(strict);
        }
        if plan.writes {
            self.engine.tx.wrote();
        }
    }

    /// Whether a read may be served from (and stored in) the cache now, and
    /// under which session prefix.
    pub(super) async fn may_serve(
        &mut self,
        plan: &Plan,
        in_transaction_ok: bool,
    ) -> Result<Result<u128, BypassReason>, SessionError> {
        if let Some(decided) = self.may_serve_now(plan, in_transaction_ok) {
            return Ok(decided);
        }
        let prefix = self.session_prefix().await?;
        Ok(prefix.and_then(|prefix| self.role_may_serve(prefix)))
    }

    /// [`Self::may_serve`] when it needs no round trip (the session's
    /// settings are known, or the read is refused anyway); `None` when they
    /// must be read first. Called without a future on the hot path, whose
    /// setting up and moving cost more than these checks.
    pub(super) fn may_serve_now(
        &self,
        plan: &Plan,
        in_transaction_ok: bool,
    ) -> Option<Result<u128, BypassReason>> {
        if let Err(reason) = &plan.read {
            // With no stream, no table is published yet: say why.
            if *reason == BypassReason::NotPublished
                && let Err(down) = self.app.cache.freshness(&self.engine.db)
            {
                return Some(Err(down));
            }
            return Some(Err(*reason));
        }
        if !self
            .engine
            .known
            .policy
            .database_allowed(self.engine.startup.database())
        {
            return Some(Err(BypassReason::DatabaseRule));
        }
        if self.engine.known.temp {
            return Some(Err(BypassReason::TempObjects));
        }
        // The stream's freshness is checked by the lookup, just before an
        // answer could be served: checked here too, it cost every
        // statement a second clock read.
        if !self.engine.pipeline.is_quiet() {
            return Some(Err(BypassReason::Pipelined));
        }
        if self.engine.tx.status == TxStatus::InTransaction && !in_transaction_ok {
            return Some(Err(BypassReason::UnsupportedShape));
        }
        if let Err(reason) = self.engine.tx.reads_may_use_cache() {
            return Some(Err(reason));
        }
        let prefix = self.known_prefix()?;
        Some(self.role_may_serve(prefix))
    }

    fn role_may_serve(&self, prefix: u128) -> Result<u128, BypassReason> {
        match &self.engine.known.role {
            Some(role) if !self.engine.known.policy.role_allowed(role) => {
                Err(BypassReason::RoleRule)
            }
            _ => Ok(prefix),
        }
    }
}
