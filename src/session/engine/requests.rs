//! The client's side of the engine, with caching on: each frame decided
//! in one synchronous pass.
//!
//! ```text
//! Query / Parse..Sync
//!   → plan (analysis × facts of the names it uses → read? effects)
//!   → may it be served? (single SELECT, no temp objects, nothing in flight,
//!      not after a write in this transaction, not REPEATABLE READ, settings known)
//!   → key (session prefix, statement, parameters)
//!   → cache.lookup: hit → stage the stored frames + ReadyForQuery for the client
//!                   miss → forward, tee the response into a capture
//!                   bypass → forward
//! every forwarded request carries its effects (table versions to bump,
//! epoch, schema change), applied when its ReadyForQuery arrives and again
//! when its transaction ends (answers.rs).
//! ```
//!
//! A pass that needs what only a wait can give (Redis, the session's
//! settings, catalog facts, a statement's prerequisites) stops before it
//! changes anything that matters and returns a [`Need`]. The driver meets
//! it, notes what it found in [`Found`](super::Found), and feeds the same
//! frame again: each decision is written once.
//!
//! Parse, Bind, Describe, Execute and Close are held while the batch could
//! still be answered from the cache ([`Batch`](crate::session::batch::Batch))
//! and forwarded otherwise; at Sync the held batch is looked up once, and
//! answered or forwarded whole.

use std::sync::Arc;

use bytes::Bytes;

use super::hidden::qualify_sql;
use super::life::Ending;
use super::lookup::Answer;
use super::{Ctx, Engine, Need, Purpose, ReadyBatch};
use crate::cache::key::{self, KeyBuilder, RequestKey};
use crate::cache::{Bumps, Reads};
use crate::classify::BypassReason;
use crate::classify::prerequisites::prerequisites;
use crate::pool::marks::{Marks, marks};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, extended, frontend as fe};
use crate::session::batch::{OneQuery, WholeBatch, binds_time_literal, extended_key};
use crate::session::known::Statement;
use crate::session::pipeline::{Flow, Inflight};
use crate::session::plan::Plan;
use crate::session::row_limit::{RowCut, set_row_limit};

/// A batch's one query decided: its cache key, plan, statement and the
/// rows it reads by key.
type QueryKey = (RequestKey, Arc<Plan>, Arc<Statement>, Option<Reads>);

/// Why the cache may not serve a batch's query, and the plan that said so
/// if it was its plan.
type Refusal = (BypassReason, Option<Arc<Plan>>);

impl Engine {
    /// One complete client frame, with caching on.
    pub(super) fn on_client_frame(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let flow = match frame[0] {
            fe::QUERY => self.on_query(ctx, frame)?,
            fe::PARSE => {
                let marks = self.known.frame_marks(frame);
                self.prerequisites(ctx, marks, frame)?;
                self.on_extended(ctx, frame)?
            }
            fe::BIND | fe::DESCRIBE | fe::CLOSE | fe::EXECUTE => self.on_extended(ctx, frame)?,
            fe::SYNC => {
                self.db.hold.touch_at(ctx.now);
                self.on_sync(ctx, frame)?
            }
            fe::FUNCTION_CALL => {
                self.release_batch();
                self.forward(frame);
                self.settings_may_have_changed();
                self.tx.wrote();
                self.pipeline.push(Inflight {
                    effects: Bumps::opaque(),
                    ..Inflight::default()
                });
                Flow::Continue
            }
            fe::TERMINATE if self.hand_back(ctx) => Flow::Close,
            fe::TERMINATE if self.link.is_pooled() => {
                // The connection, if any, goes back to the pool.
                self.end_with(Ending::ClientEnded);
                Flow::Close
            }
            tag => {
                if tag == fe::FLUSH {
                    self.release_batch();
                    self.pipeline.unsynced = true;
                }
                if tag == fe::COPY_DONE || tag == fe::COPY_FAIL {
                    self.pipeline.copy_ended();
                }
                self.forward(frame);
                if tag == fe::TERMINATE {
                    self.end_with(Ending::ClientEnded);
                    Flow::Close
                } else {
                    Flow::Continue
                }
            }
        };
        self.found.clear();
        Ok(flow)
    }

    /// Notes a Query's or Parse's marks; asks for its prerequisites (a
    /// database let go of, a table out of the publication) to be met once.
    fn prerequisites(&mut self, ctx: &Ctx, marks: Marks, frame: &[u8]) -> Result<(), Need> {
        if marks.frees {
            self.known.forget_freed(frame);
        }
        if self.server.parks() || self.link.is_pooled() {
            self.note_marks(ctx, marks, frame);
        }
        if (marks.evicts || marks.unlogged)
            && !self.found.prerequisites
            && ctx.instance.cache().replication_on()
        {
            return Err(self.needs_of(frame));
        }
        Ok(())
    }

    /// What the statement in `frame` needs of pgcache before it goes out
    /// ([`crate::classify::prerequisites`]). The tables it takes out of the
    /// publication are first named as the client's session resolves them
    /// (its search_path), when its connection is idle to ask.
    pub(super) fn needs_of(&mut self, frame: &[u8]) -> Need {
        let needs = match self.found.needs.take() {
            Some(needs) => needs,
            None => {
                let text = extended::statement_text(frame);
                let sql = std::str::from_utf8(text).unwrap_or_default();
                let mut needs = Box::new(prerequisites(sql));
                if !needs.unpublish.is_empty() && self.backend_idle() {
                    for table in needs.unpublish.drain(..) {
                        self.ask(Purpose::Qualify, &qualify_sql(&table));
                    }
                    self.found.needs = Some(needs);
                    return Need::Own;
                }
                needs
            }
        };
        Need::Prerequisites(needs)
    }

    fn on_query(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let body = &frame[HEADER_LEN..];
        // `SELECT 1;` answers as `SELECT 1` does (psql sends the one from
        // a file, the other from -c): one text, one entry.
        let sql = statement_text(body.strip_suffix(&[0]).unwrap_or(body));
        let hash = key::sql_hash(sql);
        // One lookup gives a known text's plan and marks.
        let generation = self.db.catalog.generation();
        let (mut memo, known_marks) =
            self.known
                .text(hash, generation, ctx.instance.policy_generation());
        let marks = known_marks.unwrap_or_else(|| marks(sql));
        self.prerequisites(ctx, marks, frame)?;
        if self.found.prerequisites {
            // Meeting them may have changed the catalog.
            memo = None;
        }
        self.db.hold.touch_at(ctx.now);
        self.release_batch();
        let plan = match memo {
            Some(plan) => plan,
            None => self.plan(ctx, hash, sql)?,
        };
        if known_marks.is_none() {
            self.known.remember_marks(hash, marks);
        }
        self.before_begin(ctx, &plan)?;
        let key = self.may_serve(ctx, &plan, true)?.map(|prefix| {
            KeyBuilder::new(prefix, key::SIMPLE, key_text(&plan, hash, sql)).finish()
        });
        self.settings_for_replica(ctx, &plan)?;
        let reads = self.keyed_reads(&plan, |known| known.keyed_reads(hash, &plan, sql));
        let looked = self.look_up(ctx, key, &plan, reads.as_ref())?;
        // Decided: nothing below waits.
        plan.stats.call();
        let mut inflight = Inflight {
            effects: plan.text_effects(&self.db.versions, sql),
            ..Inflight::default()
        };
        match self.answer(ctx, looked, reads.as_ref(), &plan, frame, 0) {
            Answer::Served { .. } => return Ok(Flow::Continue),
            Answer::Forward(capture, explain) => {
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), ctx.now));
                }
                inflight.capture = capture;
                inflight.explain = explain;
            }
        }
        self.note_effects(&plan);
        self.pipeline.executed();
        if !self.route(ctx, &plan, &mut inflight, frame, None) {
            self.forward(frame);
        }
        self.pipeline.push(inflight);
        Ok(Flow::Continue)
    }

    /// Parse, Bind, Describe, Execute or Close: held while the batch could
    /// still be answered from the cache, forwarded otherwise.
    fn on_extended(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
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

    fn on_sync(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let mut inflight = Inflight::default();
        if self.batch.holds() && !self.batch.forwarded {
            match self.batch_key(ctx)? {
                Ok(((key, plan, stmt, by_row), row_limit)) => {
                    let looked = self.look_up(ctx, Ok(key), &plan, by_row.as_ref())?;
                    // The held frames and this Sync: what a refresh sends.
                    let execute_at = self.batch.execute_at();
                    let mut request = self.batch.release().unwrap_or_default();
                    request.extend_from_slice(frame);
                    // A row-limited Execute goes out with one row more, so
                    // that a result that fits is whole and can be stored.
                    if let Some(at) =
                        execute_at.filter(|_| row_limit > 0 && row_limit < i32::MAX as u32)
                    {
                        set_row_limit(&mut request[at], row_limit + 1);
                        inflight.row_cut = Some(RowCut::new(row_limit));
                    }
                    match self.answer(ctx, looked, by_row.as_ref(), &plan, &request, row_limit) {
                        Answer::Served { refreshed } => {
                            // Unless the refresh just sent it.
                            self.defer_parse(refreshed);
                            self.batch.give_back(request);
                            self.batch.reset();
                            return Ok(Flow::Continue);
                        }
                        Answer::Forward(capture, explain) => {
                            if capture.is_some() {
                                inflight.timing = Some((Arc::clone(&plan.stats), ctx.now));
                            }
                            inflight.capture = capture;
                            inflight.explain = explain;
                            if self.route_batch(ctx, &plan, &stmt, &mut inflight, &request) {
                                self.batch.give_back(request);
                                (inflight.effects, inflight.parsed) = self.batch.reset();
                                self.pipeline.push_sync(inflight);
                                return Ok(Flow::Continue);
                            }
                            request.truncate(request.len() - frame.len());
                            self.forward(&request);
                            self.batch.give_back(request);
                        }
                    }
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
    fn batch_key(&mut self, ctx: &Ctx) -> Result<Result<(QueryKey, u32), BypassReason>, Need> {
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
    /// statement its Bind names, no time literal in its parameters, its
    /// plan (`planned`, the one its Execute found, if still current),
    /// whether the session may be served it now, and its parameters
    /// hashed. A refusal carries the plan when the plan refused.
    fn query_key(
        &mut self,
        ctx: &Ctx,
        query: &OneQuery,
        planned: Option<&Arc<Plan>>,
    ) -> Result<Result<QueryKey, Refusal>, Need> {
        let refused = |reason| Ok(Err((reason, None)));
        let stmt = match query
            .statement()
            .map(|name| self.known.statements.get(name))
        {
            Ok(Some(stmt)) => Arc::clone(stmt),
            Ok(None) | Err(_) => return refused(BypassReason::UnsupportedShape),
        };
        match binds_time_literal(query.bind_body) {
            None => return refused(BypassReason::UnsupportedShape),
            Some(true) => return refused(BypassReason::TimeLiteral),
            Some(false) => {}
        }
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
            Err(reason) => return Ok(Err((reason, Some(plan)))),
        };
        let (key, bound) = match extended_key(
            (prefix, key_text(&plan, stmt.hash, &stmt.sql)),
            &stmt,
            query.shape,
            (query.bind_body, plan.keyed.is_some()),
        ) {
            Ok(found) => found,
            Err(reason) => return refused(reason),
        };
        let by_row = self.bound_reads(&plan, &stmt, &bound);
        Ok(Ok((key, plan, stmt, by_row)))
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
        if !(self.pipeline.is_quiet() && self.tx.status == TxStatus::Idle && !self.batch.holds()) {
            return None;
        }
        let at = WholeBatch::at_start(buf, max_frame)?;
        let mut tags = [0; 4];
        // A row limit needs the Execute rewritten ([`Self::on_sync`]).
        let query = at.query(buf, &mut tags).filter(|q| q.execute.1 <= 0)?;
        let asked = self.asked();
        match self.query_key(ctx, &query, None) {
            Ok(Ok((key, plan, statement, by_row))) => Some(ReadyBatch {
                len: at.len,
                key,
                by_row,
                statement,
                plan,
            }),
            Ok(Err(_)) | Err(_) => {
                self.withdraw_asked(asked);
                None
            }
        }
    }

    /// Answers or forwards a batch [`Self::whole_batch`] found (its frames
    /// are `request`): what Bind, Describe, Execute and Sync would each
    /// have done in turn.
    pub(super) fn on_whole_batch(
        &mut self,
        ctx: &Ctx,
        ready: &ReadyBatch,
        request: &[u8],
    ) -> Result<(), Need> {
        self.db.hold.touch_at(ctx.now);
        let plan = &ready.plan;
        let looked = self.look_up(ctx, Ok(ready.key), plan, ready.by_row.as_ref())?;
        self.known
            .bind_portal(Bytes::new(), Arc::clone(&ready.statement));
        self.pipeline.executed();
        plan.stats.call();
        self.note_effects(plan);
        match self.answer(ctx, looked, ready.by_row.as_ref(), plan, request, 0) {
            Answer::Served { .. } => {}
            Answer::Forward(capture, explain) => {
                let mut inflight = Inflight {
                    effects: plan.effects.clone(),
                    explain,
                    ..Inflight::default()
                };
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), ctx.now));
                }
                inflight.capture = capture;
                if !self.route(ctx, plan, &mut inflight, request, Some(&ready.statement)) {
                    self.forward(request);
                }
                self.pipeline.push_sync(inflight);
            }
        }
        self.found.clear();
        Ok(())
    }
}

/// The hash of the text a statement's key is made of (`hash`, its
/// text's): an explained statement reads the entry of the same text
/// without its hint.
fn key_text(plan: &Plan, hash: u128, sql: &[u8]) -> u128 {
    if !plan.explain {
        return hash;
    }
    std::str::from_utf8(sql)
        .ok()
        .and_then(crate::hints::unexplained)
        .map_or(hash, |text| key::sql_hash(text.as_bytes()))
}

/// A simple query's text without the semicolons and white space that end
/// it.
fn statement_text(sql: &[u8]) -> &[u8] {
    let end = sql
        .iter()
        .rposition(|&b| b != b';' && !b.is_ascii_whitespace())
        .map_or(0, |p| p + 1);
    &sql[..end]
}

#[cfg(test)]
mod tests {
    use super::statement_text;

    #[test]
    fn a_text_ends_at_its_last_statement() {
        assert_eq!(statement_text(b"SELECT 1;"), b"SELECT 1");
        assert_eq!(statement_text(b"SELECT 1 ; ;\n"), b"SELECT 1");
        assert_eq!(statement_text(b"SELECT ';'"), b"SELECT ';'");
        assert_eq!(statement_text(b" ;"), b"");
        assert_eq!(statement_text(b"SELECT 1; SELECT 2"), b"SELECT 1; SELECT 2");
    }
}
