//! The extended protocol's batches: Parse, Bind, Describe, Execute and
//! Close, to Sync.
//!
//! A batch of the shape drivers send for one query, `[Parse] Bind
//! [Describe] Execute Sync` on the unnamed portal, may be answered from the
//! cache, Sync and all. Its frames are held as they come
//! ([`Batch`](crate::session::batch::Batch)) while the batch could still be
//! so answered, and forwarded otherwise; or the whole batch is found in
//! one read of the client's, and the read buffer holds it
//! ([`Engine::whole_batch`]). Either way its query is decided in one place
//! ([`Engine::query_key`]: served, or why not) and answered in one place
//! ([`Engine::answer_query`]).

use std::sync::Arc;

use bytes::Bytes;

use super::lookup::Answer;
use super::{Ctx, Engine, Need, ReadyBatch};
use crate::cache::key::{self, RequestKey};
use crate::cache::lookup::Lookup;
use crate::cache::{Bumps, Reads};
use crate::classify::BypassReason;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, extended, frontend as fe};
use crate::session::batch::{OneQuery, WholeBatch, binds_time_literal, extended_key};
use crate::session::known::Statement;
use crate::session::pipeline::{Flow, Inflight};
use crate::session::plan::Plan;
use crate::session::row_limit::{RowCut, set_row_limit};

/// A batch's one query decided ([`Engine::query_key`]): its cache key,
/// plan and statement, and the rows it reads by key.
pub(in crate::session) struct DecidedQuery {
    pub key: RequestKey,
    pub plan: Arc<Plan>,
    pub statement: Arc<Statement>,
    pub by_row: Option<Reads>,
}

/// Why the cache may not serve a batch's query, and the plan that said so
/// if it was its plan.
type Refusal = (BypassReason, Option<Arc<Plan>>);

impl Engine {
    /// Parse, Bind, Describe, Execute or Close: held while the batch could
    /// still be answered from the cache, forwarded otherwise.
    pub(super) fn on_extended(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let body = frame.slice(HEADER_LEN..);
        let holdable = self.pipeline.is_quiet()
            && self.tx.status == TxStatus::Idle
            && self.batch.has_room(frame.len())
            && !self.batch.holds_tag(frame[0]);
        let held = match frame[0] {
            fe::PARSE => self.on_parse(frame, &body, holdable),
            fe::BIND => self.on_bind(frame, &body, holdable),
            fe::EXECUTE => self.on_execute(ctx, frame, &body, holdable)?,
            fe::DESCRIBE => match extended::target(&body) {
                Some((kind, name)) if holdable => {
                    self.batch.hold_describe(kind, body.slice_ref(name), frame);
                    true
                }
                _ => false,
            },
            _ => {
                // Close
                if let Some((kind, name)) = extended::target(&body) {
                    if kind == fe::TARGET_STATEMENT {
                        self.known.close_statement(name);
                    } else {
                        self.known.close_portal(name);
                    }
                }
                false
            }
        };
        if !held {
            self.release_batch();
            self.forward(frame);
            self.pipeline.unsynced = true;
        }
        Ok(Flow::Continue)
    }

    fn on_parse(&mut self, frame: &Bytes, body: &Bytes, holdable: bool) -> bool {
        let Some(p) = extended::parse(body) else {
            return false;
        };
        // Copies, not views of the frame: a view would keep the whole read
        // buffer it came in alive for as long as the statement lives.
        let name = Bytes::copy_from_slice(p.name);
        let statement = Statement {
            hash: key::sql_hash(p.query),
            sql: Bytes::copy_from_slice(p.query),
            param_types: Bytes::copy_from_slice(p.param_types),
        };
        self.known.define(name.clone(), statement);
        self.batch.parsed.push(name.clone());
        if holdable {
            self.batch.hold_parse(name, frame);
        }
        holdable
    }

    /// Parameters are decoded once, at Sync, if the batch may be cached.
    fn on_bind(&mut self, frame: &Bytes, body: &Bytes, holdable: bool) -> bool {
        let Some((portal, statement)) = extended::bind_names(body) else {
            return false;
        };
        let Some(stmt) = self.known.statements.get(statement).cloned() else {
            self.known.close_portal(portal);
            return false;
        };
        self.batch.bound = self
            .bound_effects(&stmt, body)
            .map(|(plan, effects)| (Bytes::copy_from_slice(portal), plan, effects));
        self.known.bind_portal(body.slice_ref(portal), stmt);
        if holdable {
            self.batch.hold_bind(frame);
        }
        holdable
    }

    /// Plans the portal's statement (its effects count whether or not the
    /// batch is held) and holds the Execute of a read ([`Self::may_hold`]).
    fn on_execute(
        &mut self,
        ctx: &Ctx,
        frame: &Bytes,
        body: &Bytes,
        holdable: bool,
    ) -> Result<bool, Need> {
        let parsed = extended::execute(body).map(|(p, rows)| (body.slice_ref(p), rows));
        let stmt = parsed
            .as_ref()
            .and_then(|(p, _)| self.known.portal(p).cloned());
        let (Some((portal, max_rows)), Some(stmt)) = (parsed, stmt) else {
            self.pipeline.executed();
            self.batch.effects.merge(&Bumps::opaque());
            self.settings_may_have_changed();
            self.tx.wrote();
            return Ok(false);
        };
        let plan = self.plan(ctx, stmt.hash, &stmt.sql)?;
        self.before_begin(ctx, &plan)?;
        let hold = holdable && self.may_hold(ctx, &plan)?;
        self.pipeline.executed();
        plan.stats.call();
        self.batch.executed(&portal, &plan);
        self.note_effects(&plan);
        if hold {
            self.batch.hold_execute(portal, max_rows, plan, frame);
        }
        Ok(hold)
    }

    /// Forwards the held part of the batch; the rest of it goes straight
    /// through until Sync.
    pub fn release_batch(&mut self) {
        if let Some(raw) = self.batch.release() {
            self.forward(&raw);
            self.batch.give_back(raw);
            self.pipeline.unsynced = true;
        }
    }

    pub(super) fn on_sync(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let mut inflight = Inflight::default();
        if self.batch.holds() && !self.batch.forwarded {
            match self.batch_key(ctx)? {
                Ok((query, row_limit)) => {
                    let looked =
                        self.look_up(ctx, Ok(query.key), &query.plan, query.by_row.as_ref())?;
                    // The held frames and this Sync: what a refresh sends.
                    let execute_at = self.batch.execute_at();
                    let mut request = self.batch.release().unwrap_or_default();
                    request.extend_from_slice(frame);
                    // A row-limited Execute goes out with one row more, so
                    // that a result that fits is whole and can be stored.
                    let mut row_cut = None;
                    if let Some(at) =
                        execute_at.filter(|_| row_limit > 0 && row_limit < i32::MAX as u32)
                    {
                        set_row_limit(&mut request[at], row_limit + 1);
                        row_cut = Some(RowCut::new(row_limit));
                    }
                    let limit = (row_limit, row_cut);
                    let forwarded = self.answer_query(ctx, looked, &query, &request, limit);
                    self.batch.give_back(request);
                    let (effects, parsed) = self.batch.reset();
                    if let Some(mut inflight) = forwarded {
                        (inflight.effects, inflight.parsed) = (effects, parsed);
                        self.pipeline.push_sync(inflight);
                    }
                    return Ok(Flow::Continue);
                }
                Err(reason) => {
                    ctx.instance.cache().bypassed(&self.db, reason);
                    if self.route_held(ctx, reason, frame, &mut inflight) {
                        (inflight.effects, inflight.parsed) = self.batch.reset();
                        self.pipeline.push_sync(inflight);
                        return Ok(Flow::Continue);
                    }
                }
            }
        }
        self.release_batch();
        self.forward(frame);
        (inflight.effects, inflight.parsed) = self.batch.reset();
        self.pipeline.push_sync(inflight);
        Ok(Flow::Continue)
    }

    /// The key of a held batch's one query ([`Self::query_key`]), with its
    /// row limit; a refusal under its plan is counted in its statement's
    /// stats.
    fn batch_key(&mut self, ctx: &Ctx) -> Result<Result<(DecidedQuery, u32), BypassReason>, Need> {
        let query = match self.batch.single_query() {
            Ok(q) => q,
            Err(reason) => return Ok(Err(reason)),
        };
        let view = query.view();
        Ok(match self.query_key(ctx, &view, Some(&query.plan))? {
            Ok(key) => Ok((key, view.row_limit())),
            Err((reason, plan)) => {
                if let Some(plan) = plan {
                    plan.stats.bypassed(reason);
                }
                Err(reason)
            }
        })
    }

    /// The key of a batch's one query, made in this one place whether its
    /// frames were held until Sync or found whole in the read buffer: the
    /// statement its Bind names, its plan (`planned`, the one its Execute
    /// found, if still current), whether the session may be served it now,
    /// and its parameters hashed, where a time literal refuses it. A
    /// refusal carries the plan when the plan refused.
    fn query_key(
        &mut self,
        ctx: &Ctx,
        query: &OneQuery,
        planned: Option<&Arc<Plan>>,
    ) -> Result<Result<DecidedQuery, Refusal>, Need> {
        let refused = |reason| Ok(Err((reason, None)));
        let stmt = match query
            .statement()
            .map(|name| self.known.statements.get(name))
        {
            Ok(Some(stmt)) => Arc::clone(stmt),
            Ok(None) | Err(_) => return refused(BypassReason::UnsupportedShape),
        };
        let (generation, policy) = (
            self.db.catalog.generation(),
            ctx.instance.policy_generation(),
        );
        // The catalog or the policy may have changed since the Execute.
        let plan =
            match planned.filter(|p| p.generation == generation && p.policy_generation == policy) {
                Some(plan) => Arc::clone(plan),
                None => self.plan(ctx, stmt.hash, &stmt.sql)?,
            };
        let prefix = match self.may_serve(ctx, &plan, false)? {
            Ok(prefix) => prefix,
            // A parameter's reason comes first (the key finds it too).
            Err(reason) => match binds_time_literal(query.bind_body) {
                Some(false) => return Ok(Err((reason, Some(plan)))),
                Some(true) => return refused(BypassReason::TimeLiteral),
                None => return refused(BypassReason::UnsupportedShape),
            },
        };
        let (key, bound) = match extended_key(
            (prefix, key::keyed_text(plan.explain, stmt.hash, &stmt.sql)),
            &stmt,
            query.shape,
            (query.bind_body, plan.keyed.is_some()),
        ) {
            Ok(found) => found,
            Err(reason) => return refused(reason),
        };
        Ok(Ok(DecidedQuery {
            key,
            by_row: self.bound_reads(&plan, &stmt, &bound),
            plan,
            statement: stmt,
        }))
    }

    /// A whole one-query batch at the start of the client's buffer `buf`,
    /// if the engine can decide on it now ([`Self::query_key`], as at a
    /// held batch's Sync) and the cache may serve it. `None` leaves the
    /// batch to the frame-by-frame path, which makes the same decision
    /// (and meets what it needs, and counts a refusal).
    pub(super) fn whole_batch(
        &mut self,
        ctx: &Ctx,
        buf: &[u8],
        max_frame: usize,
    ) -> Option<ReadyBatch> {
        if !(self.caching
            && self.pipeline.is_quiet()
            && self.tx.status == TxStatus::Idle
            && !self.batch.holds())
        {
            return None;
        }
        let at = WholeBatch::at_start(buf, max_frame)?;
        let mut tags = [0; 4];
        // A row limit needs the Execute rewritten ([`Self::on_sync`]).
        let query = at.query(buf, &mut tags).filter(|q| q.execute.1 <= 0)?;
        let asked = self.asked();
        match self.query_key(ctx, &query, None) {
            Ok(Ok(query)) => Some(ReadyBatch { len: at.len, query }),
            Ok(Err(_)) | Err(_) => {
                self.withdraw_asked(asked);
                None
            }
        }
    }

    /// Answers or forwards a batch [`Self::whole_batch`] found (its frames
    /// are `request`), having noted what its Bind and Execute would have.
    pub(super) fn on_whole_batch(
        &mut self,
        ctx: &Ctx,
        ready: &ReadyBatch,
        request: &[u8],
    ) -> Result<(), Need> {
        self.db.hold.touch_at(ctx.now);
        let query = &ready.query;
        let looked = self.look_up(ctx, Ok(query.key), &query.plan, query.by_row.as_ref())?;
        self.known
            .bind_portal(Bytes::new(), Arc::clone(&query.statement));
        self.pipeline.executed();
        query.plan.stats.call();
        self.note_effects(&query.plan);
        if let Some(mut inflight) = self.answer_query(ctx, looked, query, request, (0, None)) {
            inflight.effects = query.plan.effects.clone();
            self.pipeline.push_sync(inflight);
        }
        self.found.clear();
        Ok(())
    }

    /// A batch's query, looked up, answered the one way whether it was
    /// held or came whole: a hit staged for the client (a Parse the batch
    /// held kept for the primary, unless a refresh just sent it), or
    /// `request` (its frames to Sync) forwarded, to a replica when routing
    /// takes it. What goes in flight if it was forwarded, for the batch's
    /// effects to be added. `row_limit`: the Execute's, and the cut of an
    /// answer the request asks one row more of.
    fn answer_query(
        &mut self,
        ctx: &Ctx,
        looked: Result<Lookup, BypassReason>,
        query: &DecidedQuery,
        request: &[u8],
        (row_limit, row_cut): (u32, Option<RowCut>),
    ) -> Option<Inflight> {
        let (plan, by_row) = (&query.plan, query.by_row.as_ref());
        match self.answer(ctx, looked, by_row, plan, request, row_limit) {
            Answer::Served { refreshed } => {
                self.defer_parse(refreshed);
                None
            }
            Answer::Forward(capture, explain) => {
                let mut inflight = Inflight {
                    row_cut,
                    explain,
                    ..Inflight::default()
                };
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), ctx.now));
                }
                inflight.capture = capture;
                if !self.route_batch(ctx, plan, &query.statement, &mut inflight, request) {
                    self.forward(request);
                }
                Some(inflight)
            }
        }
    }
}
