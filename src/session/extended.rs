//! The extended protocol with caching on: Parse, Bind, Describe, Execute
//! and Close are held while the batch could still be answered from the
//! cache ([`Batch`](super::batch::Batch)) and forwarded otherwise; at Sync
//! the held batch is looked up once, and answered or forwarded whole.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::batch::{WholeBatch, describes_the_bound};
use super::known::Statement;
use super::pipeline::{Flow, Inflight};
use super::plan::Plan;
use super::query::Answer;
use super::relay::Session;
use super::row_limit::{RowCut, set_row_limit};
use crate::cache::Bumps;
use crate::cache::key::{self, KeyBuilder, RequestKey};
use crate::classify::{BypassReason, is_time_literal_text};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::extended;
use crate::protocol::{TxStatus, frontend as fe};

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Parse, Bind, Describe, Execute and Close are held while the batch
    /// could still be answered from the cache, forwarded otherwise. Only an
    /// Execute may wait (to plan its statement): the others are handled
    /// in [`Self::on_extended_now`], without a future, whose setting up
    /// cost a Bind more than handling it.
    pub(super) async fn on_execute_frame(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        let body = frame.slice(HEADER_LEN..);
        let holdable = self.holdable(&frame);
        self.engine.pipeline.executed();
        let held = self.on_execute(&frame, &body, holdable).await?;
        Ok(self.held_or_forwarded(&frame, held))
    }

    /// Parse, Bind, Describe or Close.
    pub(super) fn on_extended_now(&mut self, frame: &Bytes) -> Flow {
        let tag = frame[0];
        let body = frame.slice(HEADER_LEN..);
        let holdable = self.holdable(frame);
        let held = match tag {
            fe::PARSE => self.on_parse(frame, &body, holdable),
            fe::BIND => self.on_bind(frame, &body, holdable),
            fe::DESCRIBE => match extended::target(&body) {
                Some((kind, name)) if holdable => {
                    self.engine
                        .batch
                        .hold_describe(kind, body.slice_ref(name), frame);
                    true
                }
                _ => false,
            },
            _ => {
                // Close
                if let Some((kind, name)) = extended::target(&body) {
                    if kind == fe::TARGET_STATEMENT {
                        self.engine.known.close_statement(name);
                    } else {
                        self.engine.known.close_portal(name);
                    }
                }
                false
            }
        };
        self.held_or_forwarded(frame, held)
    }

    fn holdable(&self, frame: &[u8]) -> bool {
        self.engine.pipeline.is_quiet()
            && self.engine.tx.status == TxStatus::Idle
            && self.engine.batch.has_room(frame.len())
            && !self.engine.batch.holds_tag(frame[0])
    }

    fn held_or_forwarded(&mut self, frame: &[u8], held: bool) -> Flow {
        if !held {
            self.release_batch();
            self.forward(frame);
            self.engine.pipeline.unsynced = true;
        }
        Flow::Continue
    }

    fn on_parse(&mut self, frame: &Bytes, body: &Bytes, holdable: bool) -> bool {
        let Some(p) = extended::parse(body) else {
            return false;
        };
        let name = body.slice_ref(p.name);
        let statement = Statement {
            hash: key::sql_hash(p.query),
            sql: body.slice_ref(p.query),
            param_types: body.slice_ref(p.param_types),
        };
        self.engine.known.define(name.clone(), statement);
        self.engine.batch.parsed.push(name.clone());
        if holdable {
            self.engine.batch.hold_parse(name, frame);
        }
        holdable
    }

    /// Parameters are decoded once, at Sync, if the batch may be cached.
    fn on_bind(&mut self, frame: &Bytes, body: &Bytes, holdable: bool) -> bool {
        let Some((portal, statement)) = extended::bind_names(body) else {
            return false;
        };
        let Some(stmt) = self.engine.known.statements.get(statement).cloned() else {
            self.engine.known.close_portal(portal);
            return false;
        };
        self.engine.known.bind_portal(body.slice_ref(portal), stmt);
        if holdable {
            self.engine.batch.hold_bind(frame);
        }
        holdable
    }

    /// Plans the portal's statement (its effects count whether or not the
    /// batch is held) and holds the Execute of a cacheable read.
    async fn on_execute(
        &mut self,
        frame: &Bytes,
        body: &Bytes,
        holdable: bool,
    ) -> Result<bool, SessionError> {
        let parsed = extended::execute(body).map(|(p, rows)| (body.slice_ref(p), rows));
        let stmt = parsed
            .as_ref()
            .and_then(|(p, _)| self.engine.known.portal(p).cloned());
        let (Some((portal, max_rows)), Some(stmt)) = (parsed, stmt) else {
            self.engine.batch.effects.merge(&Bumps::opaque());
            self.engine.settings_may_have_changed();
            self.engine.tx.wrote();
            return Ok(false);
        };
        let plan = match self.memo_plan(stmt.hash) {
            Some(plan) => plan,
            None => self.plan(stmt.hash, &stmt.sql).await?,
        };
        plan.stats.call();
        if plan.begin_strict.is_some() {
            self.before_begin(&plan).await?;
        }
        self.engine.batch.effects.merge(&plan.effects);
        self.note_effects(&plan);
        let hold = holdable && plan.read.is_ok();
        if hold {
            self.engine
                .batch
                .hold_execute(portal, max_rows, plan, frame);
        }
        Ok(hold)
    }

    /// Forwards the held part of the batch; the rest of it goes straight
    /// through until Sync.
    pub(super) fn release_batch(&mut self) {
        if let Some(raw) = self.engine.batch.release() {
            self.forward(&raw);
            self.engine.batch.give_back(raw);
            self.engine.pipeline.unsynced = true;
        }
    }

    pub(super) async fn on_sync(
        &mut self,
        frame: Bytes,
        started: Instant,
    ) -> Result<Flow, SessionError> {
        let mut inflight = Inflight::default();
        if self.engine.batch.holds() && !self.engine.batch.forwarded {
            match self.batch_key().await? {
                Ok((key, plan, row_limit)) => {
                    // The held frames and this Sync: what a refresh sends.
                    let execute_at = self.engine.batch.execute_at();
                    let mut request = self.engine.batch.release().unwrap_or_default();
                    request.extend_from_slice(&frame);
                    // A row-limited Execute goes out with one row more, so
                    // that a result that fits is whole and can be stored.
                    if let Some(at) =
                        execute_at.filter(|_| row_limit > 0 && row_limit < i32::MAX as u32)
                    {
                        set_row_limit(&mut request[at], row_limit + 1);
                        inflight.row_cut = Some(RowCut::new(row_limit));
                    }
                    match self
                        .ask_cache(Ok(key), &plan, started, &request, row_limit)
                        .await?
                    {
                        Answer::Served { refreshed } => {
                            // The backend never saw the held Parse: replay it
                            // before anything else it is sent, unless the
                            // refresh just sent it.
                            if let Some(parse) = self.engine.batch.parse.take() {
                                self.engine
                                    .known
                                    .unsent_parses
                                    .retain(|(n, _)| *n != parse.0);
                                if !refreshed {
                                    self.engine.known.unsent_parses.push(parse);
                                }
                            }
                            self.engine.batch.give_back(request);
                            self.engine.batch.reset();
                            return Ok(Flow::Continue);
                        }
                        Answer::Forward(capture) => {
                            if capture.is_some() {
                                inflight.timing = Some((Arc::clone(&plan.stats), started));
                            }
                            inflight.capture = capture;
                            request.truncate(request.len() - frame.len());
                            self.forward(&request);
                            self.engine.batch.give_back(request);
                        }
                    }
                }
                Err(reason) => self.app.cache.bypassed(&self.engine.db, reason),
            }
        }
        if let Some(raw) = self.engine.batch.release() {
            self.forward(&raw);
            self.engine.batch.give_back(raw);
        }
        self.forward(&frame);
        (inflight.effects, inflight.parsed) = self.engine.batch.reset();
        self.engine.pipeline.push_sync(inflight);
        Ok(Flow::Continue)
    }

    /// The key of a held batch of the shape drivers send for one query:
    /// `[Parse] Bind [Describe] Execute Sync` on the unnamed portal.
    async fn batch_key(
        &mut self,
    ) -> Result<Result<(RequestKey, Arc<Plan>, u32), BypassReason>, SessionError> {
        let query = match self.engine.batch.single_query() {
            Ok(q) => q,
            Err(reason) => return Ok(Err(reason)),
        };
        let Some((_, statement)) = extended::bind_names(query.bind_body()) else {
            return Ok(Err(BypassReason::UnsupportedShape));
        };
        let Some(stmt) = self.engine.known.statements.get(statement).cloned() else {
            return Ok(Err(BypassReason::UnsupportedShape));
        };
        match binds_time_literal(query.bind_body()) {
            None => return Ok(Err(BypassReason::UnsupportedShape)),
            Some(true) => return Ok(Err(BypassReason::TimeLiteral)),
            Some(false) => {}
        }
        let mut plan = Arc::clone(&query.plan);
        let current = plan.generation == self.engine.db.catalog.generation()
            && plan.policy_generation == self.app.policy_generation();
        let decided = match current {
            true => self.may_serve_now(&plan, false),
            false => None,
        };
        let decided = match decided {
            Some(decided) => decided,
            None => {
                if !current {
                    // The catalog or the policy changed since the Execute.
                    plan = self.plan(stmt.hash, &stmt.sql).await?;
                }
                self.may_serve(&plan, false).await?
            }
        };
        let prefix = match decided {
            Ok(prefix) => prefix,
            Err(reason) => {
                plan.stats.bypassed(reason);
                return Ok(Err(reason));
            }
        };
        Ok(
            extended_key(prefix, &stmt, self.engine.batch.shape(), query.bind_body())
                .map(|key| (key, plan, query.row_limit)),
        )
    }

    /// A whole one-query batch at the start of the client's buffer, if
    /// the cache can decide on it now, without a round trip: what its
    /// frames say and what the session knows (a statement it defined, a
    /// plan it memoised, a read it may serve). `None` leaves the batch to
    /// the frame-by-frame path, nothing changed, and it gets the same
    /// answer there.
    pub(super) fn whole_batch(&self) -> Option<ReadyBatch> {
        if !(self.engine.pipeline.is_quiet()
            && self.engine.tx.status == TxStatus::Idle
            && !self.engine.batch.holds())
        {
            return None;
        }
        let buf = self.client.buffered();
        let at = WholeBatch::at_start(buf, self.client.max_frame())?;
        // What the session knows first: a write or a read it may not serve
        // now (every run of such a statement) costs no decoding.
        let (portal, statement) = extended::bind_names(at.bind_body(buf))?;
        let stmt = self.engine.known.statements.get(statement)?;
        let plan = self.memo_plan(stmt.hash)?;
        if plan.begin_strict.is_some() {
            return None;
        }
        let prefix = self.may_serve_now(&plan, false)?.ok()?;
        if !portal.is_empty() {
            return None;
        }
        let mut tags = [fe::BIND, fe::DESCRIBE, 0, fe::EXECUTE];
        let shape = match at.describe_body(buf) {
            Some(body) => {
                let (kind, name) = extended::target(body)?;
                if !describes_the_bound(kind, name, portal, statement) {
                    return None;
                }
                tags[2] = kind;
                &tags[..]
            }
            None => &[fe::BIND, fe::EXECUTE][..],
        };
        // A row limit needs the frame rewritten ([`Self::on_sync`]).
        let (portal, max_rows) = extended::execute(at.execute_body(buf))?;
        if !portal.is_empty() || max_rows > 0 {
            return None;
        }
        Some(ReadyBatch {
            len: at.len,
            key: extended_key(prefix, stmt, shape, at.bind_body(buf)).ok()?,
            statement: Arc::clone(stmt),
            plan,
        })
    }

    /// Answers or forwards a batch [`Self::whole_batch`] found: what
    /// Bind, Describe, Execute and Sync would each have done in turn.
    pub(super) async fn on_whole_batch(&mut self, ready: ReadyBatch) -> Result<(), SessionError> {
        let ReadyBatch {
            len,
            key,
            statement,
            plan,
        } = ready;
        let request = self.client.split_to(len);
        self.engine.known.bind_portal(Bytes::new(), statement);
        self.engine.pipeline.executed();
        plan.stats.call();
        self.note_effects(&plan);
        let started = Instant::now();
        self.engine.db.hold.touch_at(started);
        match self.ask_cache(Ok(key), &plan, started, &request, 0).await? {
            Answer::Served { .. } => {}
            Answer::Forward(capture) => {
                let mut inflight = Inflight {
                    effects: plan.effects.clone(),
                    ..Inflight::default()
                };
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), started));
                }
                inflight.capture = capture;
                self.forward(&request);
                self.engine.pipeline.push_sync(inflight);
            }
        }
        Ok(())
    }
}

/// What [`Session::whole_batch`] decided, for [`Session::on_whole_batch`].
pub(super) struct ReadyBatch {
    len: usize,
    key: RequestKey,
    statement: Arc<Statement>,
    plan: Arc<Plan>,
}

/// Whether a text-format parameter of a Bind may be a time literal
/// (`now`, `today`...): its answer changes with the clock. `None` if the
/// Bind is malformed.
fn binds_time_literal(body: &[u8]) -> Option<bool> {
    let mut clock = false;
    // The result formats are not needed, only the check that they are whole.
    let _results =
        extended::walk_bind(body, |format, value| clock |= may_tell_time(format, value))?;
    Some(clock)
}

fn may_tell_time(format: i16, value: Option<&[u8]>) -> bool {
    format == 0 && value.is_some_and(|v| v.len() <= 16 && is_time_literal_text(v))
}

/// The key of a bound statement run in a batch of `shape` (the tags and
/// Describe kind of its frames), hashed as its Bind's `body` is read.
/// Refused if a parameter may be a time literal, or the Bind is malformed.
fn extended_key(
    prefix: u128,
    stmt: &Statement,
    shape: &[u8],
    body: &[u8],
) -> Result<RequestKey, BypassReason> {
    let mut k = KeyBuilder::new(prefix, key::EXTENDED, stmt.hash);
    k.bytes(shape).bytes(&stmt.param_types);
    let mut clock = false;
    let results = extended::walk_bind(body, |format, value| {
        clock |= may_tell_time(format, value);
        k.u64(format as u64).value(value);
    })
    .ok_or(BypassReason::UnsupportedShape)?;
    if clock {
        return Err(BypassReason::TimeLiteral);
    }
    for f in results {
        k.u64(f as u64);
    }
    // The row limit stays out of the key: a result that completed within
    // one limit is the whole result, for any limit it fits.
    Ok(k.finish())
}
