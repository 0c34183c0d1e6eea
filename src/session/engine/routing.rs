//! Reads the engine routes to a replica ([`crate::session::replica`]):
//! whether a read may go there and to which, staging it once the driver
//! holds a connection, what its answer leaves (the position observed, a
//! fill kept or refused), and its way to the primary when the replica
//! cannot answer.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tracing::debug;

use super::{Ctx, Engine, Need};
use crate::cache::versions::Family;
use crate::classify::BypassReason;
use crate::pool::prepared::ServerStatements;
use crate::pool::transaction::Pool;
use crate::protocol::{TxStatus, messages, sqlstate};
use crate::replica::Replica;
use crate::session::known::Statement;
use crate::session::link::UNKNOWN_STATE;
use crate::session::pipeline::Inflight;
use crate::session::plan::Plan;
use crate::session::replica::{ReadState, ReplicaLeg, Routed, Verdict, without_parse};

/// What a read routed to a replica needs of the driver next
/// ([`Engine::replica_step`]).
pub(in crate::session) enum ReplicaStep {
    /// A connection to the leg's replica, logged in with `pool`'s
    /// credentials: the session's own, or (`pooled`) one of the replica's
    /// pool for the session's. Then [`Engine::replica_connected`].
    Connect {
        server: Arc<Replica>,
        pool: Arc<Pool>,
        pooled: bool,
    },
    /// The session's settings, applied on the connection first (this SQL).
    /// Then [`Engine::replica_settings_applied`].
    Apply(String),
    /// The read, behind a probe where needed: to write now.
    Write(BytesMut),
    /// The replica cannot take it, for this reason: the read goes to the
    /// primary ([`Engine::on_replica_lost`]).
    Fail(&'static str),
}

impl Engine {
    /// What the read routed to a replica needs next, if one waits for the
    /// driver ([`Self::replica_chosen`]); `held`: the replica the session
    /// holds a connection to. `now`: the time, for a probe's answer.
    pub fn replica_step(
        &mut self,
        held: Option<&Arc<Replica>>,
        now: Instant,
    ) -> Option<ReplicaStep> {
        if !self.replica_chosen() {
            return None;
        }
        let Some(pool) = self.link.replica_login().cloned() else {
            return Some(ReplicaStep::Fail("no credentials to log in with"));
        };
        let server = &self.replica.as_ref()?.server;
        if held.is_none_or(|held| !Arc::ptr_eq(held, server)) {
            let server = Arc::clone(server);
            let pooled = self.link.is_pooled();
            return Some(ReplicaStep::Connect {
                server,
                pool,
                pooled,
            });
        }
        if let Some(sql) = self.replica_settings_due() {
            return Some(ReplicaStep::Apply(sql));
        }
        self.stage_replica(now);
        self.take_replica_staged().map(ReplicaStep::Write)
    }

    /// Sends a read to a replica when `replicas.routing` may: a cacheable
    /// read that missed or bypassed the cache, for a client pgcache can
    /// log in for (its settings known, no temporary objects, in
    /// transaction mode not pinned), outside a transaction block, with
    /// nothing else in flight, and not a request the cache checks against
    /// the primary (under `read_your_writes`, only one whose versions were
    /// confirmed with Redis). The replica must have replayed the writes
    /// through this instance (through any, under `read_your_writes`) and
    /// what the session observed. The read is staged once the driver
    /// has a connection there ([`Self::stage_replica`]); `statement`: the
    /// one an extended batch binds. False: the primary.
    pub(super) fn route(
        &mut self,
        ctx: &Ctx,
        plan: &Plan,
        inflight: &mut Inflight,
        request: &[u8],
        statement: Option<&Arc<Statement>>,
    ) -> bool {
        let replicas = &ctx.instance.replicas();
        let read = plan.read_or_why();
        if !replicas.routes(read, plan.replica_safe) {
            return false;
        }
        let may = self.link.replica_login().is_some()
            && !self.known.temp
            && self.known.prefix.is_some()
            // Other instances' writes are known from Redis, asked once
            // the read began.
            && (!ctx.instance.cache().read_your_writes() || self.found.lookup.confirmed())
            && self.tx.status == TxStatus::Idle
            && self.pipeline.is_quiet()
            && inflight.row_cut.is_none()
            && inflight.capture.as_ref().is_none_or(|c| c.fill().is_some());
        if !may {
            return false;
        }
        let db = &self.db;
        let seen = self.observed.needed(|at| db.stream.covering(at));
        let server = db
            .floor(&db.versions.writes)
            .zip(seen)
            .map(|(writes, seen)| writes.max(seen))
            .and_then(|needed| Some((needed, replicas.choose(needed, (ctx.draw)())?)));
        let Some((needed, server)) = server else {
            debug!(
                observed = ?self.observed,
                "no replica has replayed what the session needs"
            );
            replicas.to_primary.routed.inc();
            return false;
        };
        let fill_floor = inflight
            .capture
            .as_ref()
            .and_then(|c| c.fill())
            .and_then(|fill| fill.floor(&self.db));
        let server = Arc::clone(server);
        server.metrics.routed.inc();
        ReplicaLeg::choose(&mut self.replica, &server);
        let request = (Bytes::copy_from_slice(request), statement.cloned());
        inflight.routed = Some(Box::new(Routed::new(server, request, needed, fill_floor)));
        true
    }

    /// The driver holds a connection for the read chosen for a replica
    /// (its books in the leg, [`ReplicaLeg::on_connection`]): stages the
    /// probe and the read there, with the requests of pgcache's own that
    /// prepare its statement, ahead of it in the pipeline.
    /// No probe goes first when the replica's position since the
    /// connection logged in is known to be far enough (a poll's or an
    /// earlier probe's, [`ReplicaLeg::known`]): a read then costs the
    /// replica one transaction, not two. `now`: the time, for the probe's
    /// answer to be placed.
    fn stage_replica(&mut self, now: Instant) {
        let routed = self.pipeline.front().and_then(|r| r.routed.as_deref());
        let (Some(leg), Some(routed)) = (&mut self.replica, routed) else {
            return;
        };
        leg.replayed = leg.known(routed.needed, routed.fill_floor);
        let probe = leg.replayed.is_none();
        leg.asked = probe.then_some(now);
        let own = leg.stage(&routed.request, routed.statement.as_deref(), probe);
        for _ in 0..own {
            self.pipeline.push_front(Inflight::hidden(None));
        }
        if probe {
            self.pipeline.push_front(Inflight {
                probe: true,
                ..Inflight::hidden(None)
            });
        }
    }

    /// The read's replica connection is another one: in the state of
    /// `applied`, with `prepared`, logged in at `opened`.
    pub fn replica_connected(&mut self, applied: u64, prepared: ServerStatements, opened: Instant) {
        if let Some(leg) = &mut self.replica {
            leg.on_connection(applied, prepared, Some(opened));
        }
    }

    /// The settings the replica connection must be given before the read
    /// goes to it: the SQL, when the state it last took is not the
    /// session's. Its books say "unknown" until
    /// [`Self::replica_settings_applied`], so a failure leaves no doubt
    /// taken for knowledge.
    pub fn replica_settings_due(&mut self) -> Option<String> {
        let state = self.link.state();
        let leg = self.replica.as_deref_mut()?;
        if leg.applied == state.id {
            return None;
        }
        leg.applied = UNKNOWN_STATE;
        Some(state.apply_sql())
    }

    /// The replica connection took the session's settings.
    pub fn replica_settings_applied(&mut self) {
        let id = self.link.state().id;
        if let Some(leg) = &mut self.replica {
            leg.applied = id;
        }
    }

    /// What [`Self::stage_replica`] staged for the replica, to write now.
    fn take_replica_staged(&mut self) -> Option<BytesMut> {
        let leg = self.replica.as_deref_mut()?;
        Some(std::mem::take(&mut leg.staged))
    }

    /// A pooled replica connection goes back to its pool: the state it is
    /// in and the statements it holds, as the leg kept them (the leg
    /// knows nothing of the next one).
    pub fn replica_books(&mut self) -> Option<(u64, ServerStatements)> {
        let leg = self.replica.as_deref_mut()?;
        let prepared = std::mem::take(&mut leg.prepared);
        let applied = std::mem::replace(&mut leg.applied, UNKNOWN_STATE);
        Some((applied, prepared))
    }

    /// An uncacheable read a replica may take (`routing = "all_reads"`)
    /// goes there only with the session's settings known, which a
    /// cacheable read would have asked for already: ask now.
    pub(super) fn settings_for_replica(&mut self, ctx: &Ctx, plan: &Plan) -> Result<(), Need> {
        if let Err(reason) = plan.read
            && self.known.prefix.is_none()
            && self.tx.status == TxStatus::Idle
            && ctx
                .instance
                .replicas()
                .routes(Err(reason), plan.replica_safe)
        {
            let _known = self.session_prefix(ctx)?;
        }
        Ok(())
    }

    /// Sends a held batch that missed (`request`, to its Sync) to a
    /// replica when [`Self::route`] may. The replica gets the statement
    /// under a name of its own; the client's Parse is kept with the read
    /// ([`Routed::parse`]): answered by pgcache once the replica's answer
    /// stands, or sent to the primary with the read, which answers it, a
    /// failure included.
    pub(super) fn route_batch(
        &mut self,
        ctx: &Ctx,
        plan: &Plan,
        statement: &Arc<Statement>,
        inflight: &mut Inflight,
        request: &[u8],
    ) -> bool {
        if !ctx.instance.replicas().enabled() {
            return false;
        }
        let (rest, parsed) = without_parse(request);
        if !self.route(ctx, plan, inflight, &rest, Some(statement)) {
            return false;
        }
        if parsed && let Some(routed) = &mut inflight.routed {
            routed.parse = self.batch.take_parse();
        }
        true
    }

    /// Whether an Execute's read is held to its Sync: a cacheable read, or
    /// one a replica may take (`all_reads`), whose session's settings are
    /// then read first.
    pub(super) fn may_hold(&mut self, ctx: &Ctx, plan: &Plan) -> Result<bool, Need> {
        let read = plan.read_or_why();
        if read.is_ok() {
            return Ok(true);
        }
        if !ctx.instance.replicas().routes(read, plan.replica_safe) {
            return Ok(false);
        }
        self.settings_for_replica(ctx, plan)?;
        Ok(true)
    }

    /// Sends a held batch the cache may not serve (`reason`) to a replica
    /// when the routing policy takes such a read: one query (`[Parse] Bind
    /// [Describe] Execute Sync` on the unnamed portal), without a row
    /// limit. `sync` is the batch's Sync; false: the batch is still held.
    pub(super) fn route_held(
        &mut self,
        ctx: &Ctx,
        reason: BypassReason,
        sync: &[u8],
        inflight: &mut Inflight,
    ) -> bool {
        let Ok(query) = self.batch.single_query() else {
            return false;
        };
        let view = query.view();
        let Ok(name) = view.statement() else {
            return false;
        };
        // A time literal is found in the Bind, not in the plan.
        let read = match reason {
            BypassReason::TimeLiteral => Err(reason),
            _ => query.plan.read_or_why(),
        };
        if view.row_limit() > 0
            || !ctx
                .instance
                .replicas()
                .routes(read, query.plan.replica_safe)
        {
            return false;
        }
        let Some(statement) = self.known.statements.get(name).cloned() else {
            return false;
        };
        let mut request = self.batch.release().unwrap_or_default();
        request.extend_from_slice(sync);
        let routed = self.route_batch(ctx, &query.plan, &statement, inflight, &request);
        if !routed {
            // Forwarded, as the caller would have (its Sync after it).
            request.truncate(request.len() - sync.len());
            self.forward(&request);
        }
        self.batch.give_back(request);
        routed
    }

    /// A hit showed the session its tables as of their last change: a
    /// replica it reads from next must have replayed that far.
    pub(super) fn observed_hit(&mut self, reads: &[Arc<Family>], now: Instant) {
        match self.db.reads_floor(reads) {
            Some(at) => self.observed.saw(at),
            None => self.observed.saw_pending(now),
        }
    }

    /// A read routed to a replica is answered. False if the replica
    /// could not answer it: it goes to the primary, and completes there.
    /// Else the session has observed the replica's position, and the
    /// answer is kept for the cache only if the replica had replayed past
    /// every change it depends on.
    pub(super) fn routed_done(&mut self, done: &mut Inflight) -> bool {
        let Some(routed) = done.routed.take() else {
            return true;
        };
        let (replayed, asked) = self.replica.as_mut().map_or((None, None), |leg| {
            leg.read = ReadState::Answered;
            if routed.to_primary() {
                // A statement it should have had may be missing there.
                leg.prepared.clear();
            }
            (leg.replayed.take(), leg.asked.take())
        });
        if let Some(replayed) = replayed {
            routed.server.replayed_past(replayed);
            if let Some(asked) = asked {
                routed.server.observed(replayed, asked);
            }
        }
        if routed.to_primary() {
            routed.server.metrics.retries.inc();
            self.forward(&routed.for_primary());
            return false;
        }
        if let Some(replayed) = replayed {
            self.observed.saw(replayed);
        }
        if done.capture.is_some() && !routed.may_store(replayed) {
            routed.server.metrics.refused_fills.inc();
            done.capture = None;
        }
        true
    }

    /// A read in flight on the replica: the session reads neither its
    /// client nor the primary until it is answered.
    pub fn replica_busy(&self) -> bool {
        self.replica.as_ref().is_some_and(|leg| leg.busy())
    }

    /// The read on the replica is answered: its connection is to be let
    /// go now ([`super::Io::ReplicaDone`]), and a cancel goes to the
    /// primary again.
    pub(super) fn replica_answered(&mut self) -> bool {
        match &mut self.replica {
            Some(leg) if leg.read == ReadState::Answered => {
                leg.read = ReadState::Idle;
                self.retarget_cancel();
                true
            }
            _ => false,
        }
    }

    /// A read is routed to a replica and waits for the driver to get a
    /// connection there.
    pub fn replica_chosen(&self) -> bool {
        self.replica
            .as_ref()
            .is_some_and(|leg| leg.read == ReadState::Chosen)
    }

    /// The replica cannot take the read staged for it, or lost it before
    /// its answer reached the client: it goes to the primary. False if
    /// part of the answer already reached the client (the read failed).
    fn replica_failed(&mut self) -> bool {
        let Some(leg) = &mut self.replica else {
            return true;
        };
        leg.staged.clear();
        leg.read = ReadState::Idle;
        // Its connection is closed: in doubt until another is had.
        leg.on_connection(UNKNOWN_STATE, Default::default(), None);
        let mut request = None;
        let mut started = false;
        while let Some(done) = self.pipeline.pop() {
            if let Some(routed) = &done.routed {
                started |= routed.verdict == Verdict::Relayed;
                let frame = routed.for_primary();
                request = Some((done, frame));
            }
        }
        let Some((mut done, frame)) = request else {
            return true;
        };
        if started {
            return false;
        }
        done.routed = None;
        self.forward(&frame);
        self.pipeline.push(done);
        true
    }

    /// The replica's connection ended or failed while a read was there:
    /// the cancel key is the primary's again, and the read goes to the
    /// primary if none of its answer reached the client (true); else the
    /// client is told it failed (staged in `out`).
    pub fn on_replica_lost(&mut self) -> bool {
        self.retarget_cancel();
        if self.replica_failed() {
            if let Some(leg) = &self.replica {
                leg.server.metrics.retries.inc();
            }
            return true;
        }
        messages::error_response(
            &mut self.out,
            "ERROR",
            sqlstate::CONNECTION_FAILURE,
            "the replica's connection was lost while it answered",
        );
        self.out
            .extend_from_slice(&messages::ready_for_query(self.tx.status));
        false
    }
}
