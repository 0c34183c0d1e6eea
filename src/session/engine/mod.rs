//! The session engine: what a client session knows and decides, with no
//! I/O. The driver ([`super::relay`]) reads the sockets, hands the engine
//! what arrived, and carries out what it asks for; only the driver awaits.
//!
//! Every rule of a session lives in the engine's sub-states, each a type
//! with its own tests: the requests in flight ([`Pipeline`]), the extended
//! batch held until Sync ([`Batch`]), the transaction's books
//! ([`Transaction`]), what the session knows of itself ([`Known`]), and
//! where its server connections come from ([`Link`], [`ServerBook`]).

use std::sync::Arc;

use bytes::BytesMut;
use tracing::debug;

use crate::cache::catalog::Facts;
use crate::cache::catalog::fetch::Lookup;
use crate::cache::hold::Paused;
use crate::cache::{DbState, Fill};
use crate::cancel::{CancelGuard, CancelTarget};
use crate::classify::{Begin, BypassReason, Isolation};
use crate::hints::Scan;
use crate::pool::marks::{Marks, Pin};
use crate::protocol::startup::Startup;
use crate::protocol::{TxStatus, extended, messages};
use crate::session::batch::Batch;
use crate::session::known::Known;
use crate::session::link::Link;
use crate::session::pipeline::{Inflight, Pipeline};
use crate::session::plan::Plan;
use crate::session::replica::{Observed, ReplicaLeg};
use crate::session::reuse::{Fate, ServerBook, Settings};
use crate::session::transaction::Transaction;
use crate::upstream::UpstreamAddr;

mod answers;
mod auth;
mod batches;
mod events;
mod greeting;
mod hidden;
mod intake;
mod life;
mod lookup;
mod output;
mod requests;
mod routing;
mod settings;
mod surface;
#[cfg(test)]
mod tests;
mod timeouts;

pub(super) use answers::Relayed;
pub(super) use auth::Start;
pub(super) use events::{Action, Asked, Ctx, Found, Instance, Lesson, LinkStep, Need, ReadyBatch};
pub(super) use greeting::Greeting;
use hidden::{Own, Purpose};
pub(super) use hidden::{OwnStep, Verdict};
use intake::Intake;
use life::{Ending, Exchange, Phase, Shutdown};
pub(super) use output::{Held, Io, Leg, ReplicaReturn};
pub(super) use routing::ReplicaStep;
pub(super) use surface::Parting;
pub(super) use timeouts::IdleTimeouts;

/// The state of one client session.
pub(super) struct Engine {
    /// Cache lookups and fills are on (`cache.enabled`).
    caching: bool,
    startup: Startup,
    /// Logging in, or logged in.
    phase: Phase,
    pipeline: Pipeline,
    tx: Transaction<(Box<Fill>, BytesMut)>,
    batch: Batch,
    /// What the session knows of itself: settings, plans, statements.
    known: Known,
    /// This database's cache state (a placeholder until logged in).
    db: Arc<DbState>,
    /// What the driver is to do before the client hears more.
    actions: Vec<Action>,
    /// Staging for client writes that pgcache assembles or rewrites.
    out: BytesMut,
    /// What a server sent, handled and still to be relayed to the client
    /// ([`output::Io::Relay`]).
    relaying: Option<(Leg, answers::Relayed)>,
    /// What the server connection is owed as it is, before any request
    /// staged for it: the StartupMessage, a login's answers, a retried
    /// request.
    to_server: BytesMut,
    /// Transaction mode: where server connections come from, and what of
    /// the client's state goes with it from one to the next.
    link: Link,
    /// What decides whether the backend connection outlives the session.
    server: ServerBook,
    /// Why the backend's close that follows is expected, once it is.
    ending: Option<Ending>,
    /// Databases pgcache let go of for a statement of this session that
    /// needs them free, until it is answered.
    paused: Vec<Paused>,
    /// Whether pgcache is shutting down: draining, the session closes
    /// once idle.
    shutdown: Shutdown,
    /// Where the backend connection is.
    backend_addr: UpstreamAddr,
    /// The backend's own cancel key, and the registration of ours.
    backend_key: Option<Arc<CancelTarget>>,
    cancel: Option<CancelGuard>,
    /// What the frame being decided waited for.
    found: Found,
    /// The decision waiting on what `found` is to hold (boxed: rare, and
    /// every idle session would keep room for it).
    waiting: Option<Box<intake::Waiting>>,
    /// Whether the client's buffered bytes are to be taken.
    intake: Intake,
    /// The session's connection to a replica, once a read went to one.
    replica: Option<Box<ReplicaLeg>>,
    /// What the session has seen: it never reads from a replica behind it.
    observed: Observed,
    /// pgcache's own queries on the server connection.
    own: Own,
    /// How long the session may wait on its client.
    timeouts: IdleTimeouts,
    /// The session's last activity, as the driver told it; `None` until
    /// its timeouts are set.
    last_activity: Option<std::time::Instant>,
}

impl Engine {
    pub fn new(
        caching: bool,
        startup: Startup,
        known: Known,
        (link, server): (Link, ServerBook),
        backend_addr: UpstreamAddr,
    ) -> Self {
        Self {
            backend_addr,
            caching,
            startup,
            phase: Phase::LoggingIn(Exchange::Over),
            pipeline: Pipeline::default(),
            tx: Transaction::default(),
            batch: Batch::default(),
            known,
            db: Arc::default(),
            actions: Vec::new(),
            out: BytesMut::new(),
            relaying: None,
            to_server: BytesMut::new(),
            link,
            server,
            ending: None,
            paused: Vec::new(),
            shutdown: Shutdown::Running,
            backend_key: None,
            cancel: None,
            found: Found::default(),
            waiting: None,
            intake: Intake::Taken,
            replica: None,
            observed: Observed::default(),
            own: Own::default(),
            timeouts: IdleTimeouts::default(),
            last_activity: None,
        }
    }

    /// Logged in, outside a transaction block, and nothing asked of the
    /// backend: pgcache may use the connection for itself.
    pub fn backend_idle(&self) -> bool {
        self.logged_in() && self.tx.status == TxStatus::Idle && self.pipeline.is_quiet()
    }

    /// Notes what a Query's or Parse's text (`frame`) means for the
    /// connection ([`Marks`]); parked connections are closed before a
    /// database-level statement goes out.
    pub fn note_marks(&mut self, ctx: &Ctx, marks: Marks, frame: &[u8]) {
        if marks.taints {
            self.server.taint();
        }
        if marks.evicts {
            ctx.instance.evict_parked();
        }
        if let Link::Pooled(pooled) = &mut self.link {
            pooled.state_dirty |= marks.settings;
            pooled.schema_changes |= marks.schema;
            if marks.listen {
                pooled.listens.note(extended::statement_text(frame));
            }
            if let Some(why) = marks.pin {
                self.pin(ctx, why);
            }
        }
    }

    /// What a keyed read reads for this run's rows (`reads` works it
    /// out). Only while this instance's own stream is up: the stream moves
    /// the rows' stripes, and another instance's vouch covers the tables'
    /// versions alone.
    pub(super) fn keyed_reads(
        &mut self,
        plan: &Plan,
        reads: impl FnOnce(&mut Known) -> Option<crate::cache::Reads>,
    ) -> Option<crate::cache::Reads> {
        plan.keyed.as_ref()?;
        self.db
            .stream
            .is_streaming()
            .then(|| reads(&mut self.known))
            .flatten()
    }

    /// What a keyed read of `plan` reads for the rows a Bind of statement
    /// `stmt` names, with its parameters `bound`.
    pub(super) fn bound_reads(
        &mut self,
        plan: &Plan,
        stmt: &crate::session::known::Statement,
        bound: &crate::cache::rowkey::Bound<'_>,
    ) -> Option<crate::cache::Reads> {
        let keyed = plan.keyed.as_ref()?;
        self.keyed_reads(plan, |_| {
            let literals = match keyed.rows.literal {
                true => crate::hints::literals(std::str::from_utf8(&stmt.sql).ok()?),
                false => Vec::new(),
            };
            keyed.reads(crate::cache::rowkey::Values {
                literals: &literals,
                bound: Some(bound),
            })
        })
    }

    /// At a Bind of `stmt` whose plan (as last made) is a keyed write: what
    /// the run moves, for the rows its parameters (Bind `body`) name.
    pub(super) fn bound_effects(
        &self,
        stmt: &crate::session::known::Statement,
        body: &[u8],
    ) -> Option<(Arc<Plan>, crate::cache::Bumps)> {
        let generation = self.db.catalog.generation();
        let policy = self.known.policy.generation;
        let plan = self.known.plan(stmt.hash, generation, policy)?;
        plan.keyed_write.as_ref()?;
        let bound = crate::cache::rowkey::Bound::read(&stmt.param_types, body)?;
        let literals = match plan
            .keyed_write
            .as_ref()
            .is_some_and(|(k, _)| k.rows.literal)
        {
            true => crate::hints::literals(std::str::from_utf8(&stmt.sql).ok()?),
            false => Vec::new(),
        };
        let values = crate::cache::rowkey::Values {
            literals: &literals,
            bound: Some(&bound),
        };
        let effects = crate::session::keyed::run_effects(
            &plan.effects,
            plan.keyed_write.as_ref(),
            &self.db.versions,
            values,
        );
        Some((plan, effects))
    }

    /// Transaction mode: a feature that lives in one backend keeps the
    /// session on its connection from now on.
    pub fn pin(&mut self, ctx: &Ctx, why: Pin) {
        let Link::Pooled(pooled) = &mut self.link else {
            return;
        };
        if pooled.pinned.is_some() {
            return;
        }
        debug!(
            reason = why.as_str(),
            "session pinned to its server connection"
        );
        let pins = &ctx.instance.metrics().pooled.pins;
        pins.with_label_values(&[why.as_str()]).inc();
        pooled.pinned = Some(why);
        ctx.client.pin(why.as_str());
    }

    /// Gives back the memory of requests past: staging buffers and the
    /// queue of requests in flight, where empty.
    pub fn release_buffers(&mut self) {
        if self.out.is_empty() {
            self.out = BytesMut::new();
        }
        self.pipeline.release();
        self.batch.release_memory();
        if let Link::Pooled(link) = &mut self.link
            && link.scratch.is_empty()
        {
            link.scratch = BytesMut::new();
        }
    }

    /// Transaction mode: the held connection is in a state another client
    /// may be given it in (apart from settings, which are read back);
    /// `unread`: the backend sent bytes not read yet.
    pub fn may_give_back(&self, unread: bool) -> bool {
        let Link::Pooled(link) = &self.link else {
            return false;
        };
        self.backend_idle()
            && !self.batch.holds()
            && !unread
            && !self.backend_fatal()
            && link.translator.is_idle()
    }

    /// At the client's Terminate: true if the connection is kept for the
    /// pool of parked connections, in which case the Terminate is not
    /// forwarded.
    pub fn hand_back(&mut self, ctx: &Ctx) -> bool {
        let handed_back = self.server.fate == Fate::Parkable
            && self.backend_idle()
            && !self.batch.holds()
            && !ctx.instance.draining();
        if handed_back {
            self.server.fate = Fate::HandedBack;
        }
        handed_back
    }

    /// A statement may have changed the session's settings: they are read
    /// again before the next cacheable read.
    pub fn settings_may_have_changed(&mut self) {
        self.known.prefix = None;
        self.server.settings = Settings::Changed;
        self.link.settings_may_have_changed();
    }

    /// The frames staged for the backend, for the driver to write (and
    /// clear), and the answers pgcache gives in the server's place. In
    /// transaction mode the client's statement names are turned into the
    /// held connection's (into `scratch`), and a statement the connection
    /// already has is answered by pgcache.
    pub fn staged(&mut self, instance: &dyn Instance) -> (&mut BytesMut, BytesMut) {
        let Link::Pooled(pooled) = &mut self.link else {
            return (&mut self.pipeline.to_backend, BytesMut::new());
        };
        let max = instance.pool_knobs(&mut pooled.knobs).max_prepared;
        let idle = self.tx.status == TxStatus::Idle;
        // Both buffers keep their memory from one flush to the next.
        let mut out = std::mem::take(&mut pooled.scratch);
        let answers = pooled.translate(&self.pipeline.to_backend, max, idle, &mut out);
        pooled.scratch = out;
        self.pipeline.to_backend.clear();
        (&mut pooled.scratch, answers)
    }

    /// Queues a frame for the backend, first replaying any Parse the
    /// backend has not seen because the cache answered it.
    pub fn forward(&mut self, frame: &[u8]) {
        if self.pipeline.to_backend.is_empty() && !self.known.unsent_parses.is_empty() {
            for (_, raw) in self.known.unsent_parses.drain(..) {
                self.pipeline.to_backend.extend_from_slice(&raw);
            }
            self.pipeline.to_backend.extend_from_slice(&messages::SYNC);
            self.pipeline.push_hidden(Inflight::hidden(None));
        }
        self.pipeline.to_backend.extend_from_slice(frame);
    }

    /// State changes a forwarded statement causes at once.
    pub(super) fn note_effects(&mut self, plan: &Plan) {
        if plan.settings {
            self.settings_may_have_changed();
        }
        if plan.creates_temp {
            self.known.temp = true;
        }
        if let Some(begin) = plan.begins {
            self.tx.begin(begin);
        }
        if plan.writes {
            self.tx.wrote();
        }
    }

    /// Whether a read may be served from (and stored in) the cache now, and
    /// under which session prefix; the settings are read first if they are
    /// not known.
    pub(super) fn may_serve(
        &mut self,
        ctx: &Ctx,
        plan: &Plan,
        in_transaction_ok: bool,
    ) -> Result<Result<u128, BypassReason>, Need> {
        if let Err(reason) = &plan.read {
            // With no stream, no table is published yet: say why.
            if *reason == BypassReason::NotPublished
                && let Err(down) = ctx.instance.cache().freshness(&self.db, ctx.now)
            {
                return Ok(Err(down));
            }
            return Ok(Err(*reason));
        }
        if !self.known.policy.database_allowed(self.startup.database()) {
            return Ok(Err(BypassReason::DatabaseRule));
        }
        if self.known.temp {
            return Ok(Err(BypassReason::TempObjects));
        }
        // The stream's freshness is checked by the lookup, just before an
        // answer could be served.
        if !self.pipeline.is_quiet() {
            return Ok(Err(BypassReason::Pipelined));
        }
        if self.tx.status == TxStatus::InTransaction && !in_transaction_ok {
            return Ok(Err(BypassReason::UnsupportedShape));
        }
        if let Err(reason) = self.tx.reads_may_use_cache() {
            return Ok(Err(reason));
        }
        Ok(self
            .session_prefix(ctx)?
            .and_then(|prefix| self.role_may_serve(prefix)))
    }

    fn role_may_serve(&self, prefix: u128) -> Result<u128, BypassReason> {
        match &self.known.role {
            Some(role) if !self.known.policy.role_allowed(role) => Err(BypassReason::RoleRule),
            _ => Ok(prefix),
        }
    }

    /// Reads inside a transaction can only use the cache if the session's
    /// settings are known, and they can only be read while it is idle: so
    /// they are read just before a BEGIN goes out, if they are not known.
    pub(super) fn before_begin(&mut self, ctx: &Ctx, plan: &Plan) -> Result<(), Need> {
        if plan
            .begins
            .is_some_and(|b| b != Begin::At(Isolation::Snapshot))
            && self.known.prefix.is_none()
            && self.backend_idle()
            && !self.found.settings
        {
            return Err(self.read_settings(ctx));
        }
        Ok(())
    }

    /// The plan for a statement text: the session's memo, another text of
    /// its shape, or made now from the facts of the names it uses.
    pub fn plan(&mut self, ctx: &Ctx, hash: u128, sql: &[u8]) -> Result<Arc<Plan>, Need> {
        let generation = self.db.catalog.generation();
        let policy_generation = ctx.instance.policy_generation();
        if let Some(plan) = self.known.plan(hash, generation, policy_generation) {
            return Ok(plan);
        }
        if self.known.policy.generation != policy_generation {
            self.known.policy = ctx.instance.policy();
        }
        let scanned = ctx.instance.cache().scan(hash, sql);
        if !scanned.scan().hints.problems.is_empty() {
            self.warn_hints(ctx, hash, &scanned.scan().hints.problems);
        }
        // Another text of this shape, planned by a session of the database.
        let plan_key = scanned.plan_key();
        let known = ctx
            .instance
            .plans()
            .get(&self.db, plan_key, generation, policy_generation);
        if let Some(plan) = known {
            self.known.remember_plan(hash, &plan);
            self.seed_keyed_reads(hash, &plan, scanned.scan(), sql);
            return Ok(plan);
        }
        let analysis = ctx.instance.cache().analyzed(scanned, sql);
        let every_read = ctx.instance.replicas().routing == crate::config::Routing::AllReads;
        let (rels, funcs) = Plan::names(&analysis, every_read);
        let facts = self.facts(ctx, &rels, &funcs)?;
        let plan = Arc::new(Plan::new(
            &analysis,
            &facts,
            &self.db.versions,
            generation,
            &self.known.policy,
        ));
        for table in plan.began() {
            self.actions.push(Action::Mirror(table));
        }
        if let Ok(families) = &plan.read {
            plan.stats.set_reads(&self.db, families);
        }
        // A plan made while facts were being fetched is made again once
        // they are known.
        if facts.complete() {
            self.known.remember_plan(hash, &plan);
            self.seed_keyed_reads(hash, &plan, &analysis.scan, sql);
            ctx.instance.plans().put(&self.db, analysis.plan_key, &plan);
        }
        Ok(plan)
    }

    /// A text just scanned (`scan`) whose plan reads by key: what its run
    /// reads is worked out from the scan's literals, rather than by lexing
    /// the text again at its lookup.
    fn seed_keyed_reads(&mut self, hash: u128, plan: &Arc<Plan>, scan: &Scan, sql: &[u8]) {
        let Some(keyed) = plan.keyed.as_ref() else {
            return;
        };
        let Ok(sql) = std::str::from_utf8(sql) else {
            return;
        };
        if let Some(reads) = crate::session::keyed::literal_reads(keyed, &scan.literals(sql)) {
            self.known.seed_keyed_reads(hash, plan, reads);
        }
    }

    /// The facts of the names a statement uses. Names not known yet are
    /// queued for the database's fetcher, which looks them up on pgcache's
    /// own connection while this statement goes on without them. Only when
    /// pgcache cannot open a connection of its own does the session look
    /// them up itself, on its idle backend.
    fn facts(&mut self, ctx: &Ctx, rels: &[&str], funcs: &[&str]) -> Result<Facts, Need> {
        if rels.is_empty() && funcs.is_empty() {
            return Ok(Facts::default());
        }
        let (facts, queued) = self
            .db
            .catalog
            .facts(rels.iter().copied(), funcs.iter().copied());
        if queued {
            self.actions.push(Action::Fetch);
        }
        if facts.complete() || self.found.facts {
            return Ok(facts);
        }
        if self.db.catalog.fetcher_down() && self.backend_idle() {
            self.found.facts = true;
            let wanted = self.db.catalog.take_wanted();
            if wanted.is_empty() {
                return Ok(facts);
            }
            let publication = ctx.instance.publication();
            let mut lookup = Lookup::new(&wanted, publication.as_deref());
            let Some(sql) = lookup.next_query() else {
                self.db.catalog.install(&wanted, lookup.finish());
                return Err(Need::Own);
            };
            self.ask(Purpose::Facts(Box::new((wanted, lookup))), &sql);
            return Err(Need::Own);
        }
        let names = || rels.iter().chain(funcs).copied();
        if ctx
            .instance
            .cache()
            .may_wait_for_facts(self.known.policy.first_read_wait)
            && !self.db.catalog.made_by_ddl(names())
        {
            let owned = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
            return Err(Need::Fetched {
                rels: owned(rels),
                funcs: owned(funcs),
            });
        }
        Ok(facts)
    }
}
