//! The cache path of a session.
//!
//! ```text
//! Query / Parse..Sync
//!   → plan (memoised per text: analysis × catalog snapshot → read? effects)
//!   → may it be served? (single SELECT, no temp objects, nothing in flight,
//!      not after a write in this transaction, not REPEATABLE READ, settings known)
//!   → key (session prefix, statement, parameters, epoch + table versions *now*)
//!   → hit: write the stored frames + ReadyForQuery, the backend never sees it
//!   → miss: forward, tee the response into a capture, store it at
//!      ReadyForQuery (or at COMMIT, for reads inside a transaction)
//! every forwarded request carries its effects (table versions to bump,
//! epoch, schema change), applied when its ReadyForQuery arrives and again
//! when its transaction ends.
//! ```
//!
//! pgcache learns the catalog and the session's settings by running its own
//! queries ("hidden queries") on the client's backend connection, only while
//! the session is idle, so they can never interleave with the client's work.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

use super::{Flow, MAX_BACKEND_FRAME, Session, SessionError};
use crate::cache::catalog::{Catalog, snapshot_sql};
use crate::cache::key::{self, KeyBuilder, RequestKey};
use crate::cache::{Analyzed, Bumps, Claim, DbState, Family, FillGuard, Lifetime};
use crate::classify::{BypassReason, Effect, is_time_literal_text};
use crate::config::CacheMode;
use crate::hints::Tier;
use crate::policy::Policy;
use crate::protocol::codec::{HEADER_LEN, parse_frame};
use crate::protocol::{TxStatus, backend as be, extended, frontend as fe};
use crate::shared::Pending;
use crate::stats::QueryStats;

/// What a request changes, applied when its ReadyForQuery arrives.
pub(crate) type Effects = Bumps;

/// What a lookup found.
enum Lookup {
    /// Answered; with a capture if the entry is to be refreshed.
    Hit(Option<Capture>),
    Miss(Capture),
}

/// A request the backend still owes a ReadyForQuery.
pub(crate) struct Inflight {
    /// false: pgcache's own injected messages, whose answers are swallowed.
    pub to_client: bool,
    /// Made by a Sync sent after an Execute with no CopyDone/CopyFail in
    /// between: if that Execute starts COPY FROM STDIN, PostgreSQL ignores
    /// this Sync and no ReadyForQuery will answer it.
    pub may_be_ignored: bool,
    capture: Option<Capture>,
    effects: Effects,
    /// Prepared statements this request defined: forgotten if it fails.
    parsed: Vec<Bytes>,
    failed: bool,
    /// A miss being timed for its statement's statistics.
    timing: Option<(Arc<QueryStats>, Instant)>,
}

impl Inflight {
    /// Takes over the bookkeeping of a Sync PostgreSQL ignored.
    pub(crate) fn absorb(&mut self, ignored: Inflight) {
        self.effects.merge(&ignored.effects);
        self.parsed.extend(ignored.parsed);
        self.failed |= ignored.failed;
    }
}

impl Default for Inflight {
    fn default() -> Self {
        Self {
            to_client: true,
            may_be_ignored: false,
            capture: None,
            effects: Effects::default(),
            parsed: Vec::new(),
            failed: false,
            timing: None,
        }
    }
}

/// A response being copied for the cache as it is relayed.
struct Capture {
    key: Keys,
    buf: BytesMut,
    ok: bool,
    lifetime: Lifetime,
    /// What the result read, for the per-table entry counts.
    reads: Vec<Arc<Family>>,
    /// Concurrent misses of this key wait until it is dropped.
    _fill: Option<FillGuard>,
}

impl Capture {
    /// A capture for `plan`'s result under the keys of `plan`'s tiers.
    fn new(
        plan: &Plan,
        local: u128,
        shared: Option<(u128, Vec<u64>)>,
        fill: Option<FillGuard>,
    ) -> Self {
        Capture {
            key: Keys {
                local: plan.tier.local().then_some(local),
                shared,
            },
            buf: BytesMut::new(),
            ok: true,
            lifetime: plan.lifetime,
            reads: plan.read.as_deref().unwrap_or_default().to_vec(),
            _fill: fill,
        }
    }

    /// Copies one response frame, or gives up on storing the response.
    fn add(&mut self, frame: &[u8], max: usize) {
        let storable = !matches!(
            frame[0],
            be::ERROR_RESPONSE
                | be::NOTICE_RESPONSE
                | be::PARAMETER_STATUS
                | b'G'
                | b'H'
                | b'W'
                | b's'
                | b'd'
                | b'c'
        );
        if self.ok && storable && self.buf.len() + frame.len() <= max {
            self.buf.extend_from_slice(frame);
        } else if self.ok {
            self.ok = false;
            self.buf = BytesMut::new();
        }
    }
}

/// Where a result is stored: the local key, and the shared key with the
/// versions it was made from if the shared tier was usable.
#[derive(Debug, Clone)]
struct Keys {
    /// `None`: not kept locally (`tier=shared`).
    local: Option<u128>,
    shared: Option<(u128, Vec<u64>)>,
}

/// What a statement text means for the cache, given the catalog snapshot
/// and the policy.
struct Plan {
    /// Catalog generation the plan was made with.
    generation: u64,
    policy_generation: u64,
    /// How entries of a cacheable read are kept.
    lifetime: Lifetime,
    tier: Tier,
    stats: Arc<QueryStats>,
    /// For a cacheable single SELECT: the version counters of its tables.
    read: Result<Vec<Arc<Family>>, BypassReason>,
    effects: Effects,
    /// It may change the session's settings.
    settings: bool,
    /// It may write (starts "after a write" in a transaction).
    writes: bool,
    creates_temp: bool,
    begin_strict: Option<bool>,
}

/// A prepared statement as the client defined it.
struct Statement {
    hash: u128,
    sql: Bytes,
    param_types: Bytes,
}

/// Extended-protocol messages held until Sync, to answer the batch from the
/// cache if every part of it can be. Reused from batch to batch.
#[derive(Default)]
struct Batch {
    raw: BytesMut,
    /// Tags (and Describe kinds) of the held messages, for the shape check.
    shape: Vec<u8>,
    parse: Option<(Bytes, Bytes)>,
    bind: Option<Bytes>,
    describe: Option<(u8, Bytes)>,
    execute: Option<(Bytes, i32)>,
    /// Part of the batch already went to the backend: nothing more is held.
    forwarded: bool,
    effects: Effects,
    parsed: Vec<Bytes>,
}

impl Batch {
    /// Ends the batch, keeping the buffers' memory for the next one.
    fn reset(&mut self) -> (Effects, Vec<Bytes>) {
        self.raw.clear();
        self.shape.clear();
        self.parse = None;
        self.bind = None;
        self.describe = None;
        self.execute = None;
        self.forwarded = false;
        (
            std::mem::take(&mut self.effects),
            std::mem::take(&mut self.parsed),
        )
    }
}

/// Per-session cache state.
pub(crate) struct CacheSession {
    db: Arc<DbState>,
    /// Hash of the session's identity and settings, with the catalog
    /// generation it was computed under. `None`: settings may have changed.
    prefix: Option<(u128, u64)>,
    /// default_transaction_isolation is REPEATABLE READ or SERIALIZABLE.
    default_strict: bool,
    /// The session created temporary objects: its names may shadow tables.
    temp: bool,
    tx_strict: bool,
    tx_wrote: bool,
    tx_effects: Effects,
    /// Results read inside the current transaction, stored if it commits.
    deferred: Vec<Capture>,
    /// The policy the plans were made under.
    policy: Arc<Policy>,
    /// `current_user`, read with the settings.
    role: Option<String>,
    /// Statement texts whose hint problems this client was told of.
    warned: HashSet<u128>,
    /// Visible invalidations applied locally, to send to Redis before the
    /// client hears that its statement completed.
    to_publish: Vec<(Effects, Pending)>,
    deferred_bytes: usize,
    last_was_commit: bool,
    plans: HashMap<u128, Arc<Plan>>,
    statements: HashMap<Bytes, Arc<Statement>>,
    portals: HashMap<Bytes, Arc<Statement>>,
    /// Parse messages answered from the cache that the backend has not seen.
    unsent_parses: Vec<(Bytes, Bytes)>,
    batch: Batch,
}

const MAX_PLANS: usize = 4096;
const MAX_HELD_MESSAGES: usize = 8;
const MAX_HELD_BYTES: usize = 256 * 1024;
const MAX_DEFERRED: usize = 64;
/// Bytes of results a session holds back until its transaction commits.
const MAX_DEFERRED_BYTES: usize = 4 * 1024 * 1024;
const SYNC_FRAME: [u8; 5] = [fe::SYNC, 0, 0, 0, 4];

impl CacheSession {
    pub(crate) fn new(db: Arc<DbState>, policy: Arc<Policy>) -> Self {
        Self {
            db,
            policy,
            role: None,
            warned: HashSet::new(),
            prefix: None,
            default_strict: false,
            temp: false,
            tx_strict: false,
            tx_wrote: false,
            tx_effects: Effects::default(),
            deferred: Vec::new(),
            to_publish: Vec::new(),
            deferred_bytes: 0,
            last_was_commit: false,
            plans: HashMap::new(),
            statements: HashMap::new(),
            portals: HashMap::new(),
            unsent_parses: Vec::new(),
            batch: Batch::default(),
        }
    }

    pub(crate) fn holds_batch(&self) -> bool {
        !self.batch.shape.is_empty()
    }
}

fn make_plan(
    analyzed: &Analyzed,
    catalog: Option<&Catalog>,
    db: &DbState,
    generation: u64,
    policy: &Policy,
) -> Plan {
    let analysis = &analyzed.analysis;
    let hints = &analyzed.scan.hints;
    let mut plan = Plan {
        generation,
        policy_generation: policy.generation,
        lifetime: Lifetime::default(),
        tier: hints.tier,
        stats: Arc::clone(&analyzed.stats),
        read: Err(BypassReason::NotSelect),
        effects: Effects::default(),
        settings: false,
        writes: false,
        creates_temp: false,
        begin_strict: None,
    };
    for st in &analysis.statements {
        match &st.effect {
            Effect::None => {}
            Effect::Write(rels) => {
                plan.writes = true;
                for rel in rels {
                    match catalog.and_then(|c| c.relation(&rel.name)) {
                        Some(facts) if !facts.write_hazard => {
                            plan.effects.add_family(db.family(&facts.family));
                        }
                        _ => plan.effects.epoch = true,
                    }
                }
            }
            Effect::Settings => plan.settings = true,
            Effect::Begin { strict } => plan.begin_strict = Some(*strict),
            Effect::Opaque => {
                plan.effects.merge(&Bumps::opaque());
                plan.settings = true;
                plan.writes = true;
            }
        }
        for f in &st.functions {
            match catalog.and_then(|c| c.function(f)) {
                Some(facts) if !facts.may_write => {}
                _ => {
                    // A function that may write, or one not known yet.
                    plan.effects.epoch = true;
                    plan.writes = true;
                    plan.settings = true;
                }
            }
            if f == "set_config" {
                plan.settings = true;
            }
        }
        plan.creates_temp |= st.creates_temp;
    }
    // Never an unsafe statement, whatever the hints say.
    let mut ttl = hints.ttl;
    let mut refresh = hints.refresh.or(policy.refresh_after);
    plan.read = analysis.cacheable_select().and_then(|st| {
        if hints.cache == Some(false) {
            return Err(BypassReason::Hint);
        }
        let catalog = catalog.ok_or(BypassReason::CatalogUnavailable)?;
        let mut families: Vec<&str> = Vec::with_capacity(st.relations.len());
        for rel in &st.relations {
            let facts = catalog
                .relation(&rel.name)
                .ok_or(BypassReason::UnknownRelation)?;
            let rule = policy.table(&rel.name);
            if rule.is_some_and(|r| !r.cache) {
                return Err(BypassReason::TableRule);
            }
            if let Some(secs) = rule.and_then(|r| r.ttl_secs) {
                let rule_ttl = Duration::from_secs(secs);
                ttl = Some(ttl.map_or(rule_ttl, |t| t.min(rule_ttl)));
            }
            if !facts.readable {
                // Replication cannot watch it: cacheable only with a TTL
                // the user asked for, and never a temporary or system one.
                let ttl_asked = hints.ttl.is_some() || rule.is_some_and(|r| r.ttl_only);
                if !(facts.ttl_ok && ttl_asked) {
                    return Err(if rel.name.starts_with("pg_") {
                        BypassReason::SystemCatalog
                    } else {
                        BypassReason::NotATable
                    });
                }
            }
            families.push(&facts.family);
        }
        if !st
            .functions
            .iter()
            .all(|f| catalog.function(f).is_some_and(|f| f.immutable))
        {
            return Err(BypassReason::VolatileFunction);
        }
        if policy.mode == CacheMode::OptIn && hints.cache != Some(true) {
            return Err(BypassReason::OptIn);
        }
        families.sort_unstable();
        families.dedup();
        Ok(families.into_iter().map(|f| db.family(f)).collect())
    });
    let ttl = ttl.or(policy.default_ttl);
    if let (Some(r), Some(t)) = (refresh, ttl)
        && r >= t
    {
        refresh = None;
    }
    plan.lifetime = Lifetime { ttl, refresh };
    plan
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// One complete client frame, with caching on.
    pub(super) async fn on_client_frame(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        match frame[0] {
            fe::QUERY => self.on_query(frame).await,
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::EXECUTE | fe::CLOSE => {
                self.on_extended(frame).await
            }
            fe::SYNC => self.on_sync(frame).await,
            fe::FUNCTION_CALL => {
                self.release_batch();
                self.forward(&frame);
                self.cache.prefix = None;
                self.cache.tx_wrote = true;
                self.push_request(Inflight {
                    effects: Bumps::opaque(),
                    ..Inflight::default()
                });
                Ok(Flow::Continue)
            }
            tag => {
                if tag == fe::FLUSH {
                    self.release_batch();
                    self.unsynced = true;
                }
                if tag == fe::COPY_DONE || tag == fe::COPY_FAIL {
                    self.copy.ended();
                }
                self.forward(&frame);
                Ok(if tag == fe::TERMINATE {
                    Flow::Close
                } else {
                    Flow::Continue
                })
            }
        }
    }

    /// Queues a frame for the backend, first replaying any Parse the
    /// backend has not seen because the cache answered it.
    fn forward(&mut self, frame: &[u8]) {
        if self.to_backend.is_empty() && !self.cache.unsent_parses.is_empty() {
            for (_, raw) in self.cache.unsent_parses.drain(..) {
                self.to_backend.extend_from_slice(&raw);
            }
            self.to_backend.extend_from_slice(&SYNC_FRAME);
            self.inflight.push_back(Inflight {
                to_client: false,
                ..Inflight::default()
            });
        }
        self.to_backend.extend_from_slice(frame);
    }

    async fn on_query(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        self.release_batch();
        let body = &frame[HEADER_LEN..];
        let sql = body.strip_suffix(&[0]).unwrap_or(body);
        let started = Instant::now();
        let hash = key::sql_hash(sql);
        let plan = self.plan(hash, sql).await?;
        plan.stats.call();
        self.before_begin(&plan).await?;
        let mut inflight = Inflight {
            effects: plan.effects.clone(),
            ..Inflight::default()
        };
        match self.may_serve(&plan, true).await? {
            Ok(prefix) => {
                let request = KeyBuilder::new(prefix, key::SIMPLE, hash).finish();
                match self.lookup(request, &plan, started).await? {
                    Lookup::Miss(capture) => {
                        inflight.capture = Some(capture);
                        inflight.timing = Some((Arc::clone(&plan.stats), started));
                    }
                    Lookup::Hit(refresh) => {
                        if let Some(capture) = refresh {
                            self.inject_refresh(&frame, capture);
                        }
                        return Ok(Flow::Continue);
                    }
                }
            }
            Err(reason) => self.bypassed(reason),
        }
        self.note_effects(&plan);
        self.forward(&frame);
        self.copy.executed();
        self.push_request(inflight);
        Ok(Flow::Continue)
    }

    fn bypassed(&self, reason: BypassReason) {
        if reason != BypassReason::NotSelect {
            debug!(reason = reason.label(), "cache bypass");
        }
        self.app.metrics.bypassed(reason);
        self.db_metrics().bypass.inc();
    }

    /// Answers from the local tier, else from the shared tier (filling the
    /// local one), else — after waiting for a concurrent identical miss, if
    /// there is one — returns the capture that will store the backend's
    /// answer. The backend is idle (checked by `may_serve`), so an answer
    /// from the cache cannot overtake another.
    async fn lookup(
        &mut self,
        request: RequestKey,
        plan: &Plan,
        started: Instant,
    ) -> Result<Lookup, SessionError> {
        let db = Arc::clone(&self.cache.db);
        let versions = plan.read.as_deref().unwrap_or_default();
        let mut waited = false;
        loop {
            // Local counters first, then the shared tier's state, then its
            // counters: see `SharedTier::usable`.
            let local = request.local(&db.epoch, versions);
            if plan.tier.local()
                && let Some(entry) = self.app.cache.local.get(local)
            {
                // Counted before the client can see the answer.
                self.count_hit(plan, started, entry.bytes.len(), false);
                self.write_hit(&entry.bytes).await?;
                let refresh = entry
                    .wants_refresh()
                    .then(|| self.refresh_capture(request, plan))
                    .flatten();
                return Ok(Lookup::Hit(refresh));
            }
            let mut shared = None;
            if let Some(tier) = self.app.shared.clone().filter(|_| plan.tier.shared()) {
                if tier.usable(&db) {
                    let (key, stamp) = request.shared(&db.epoch, versions);
                    if let Some(entry) = tier.get(key, &stamp).await {
                        let age = Duration::from_millis(
                            crate::cache::unix_ms().saturating_sub(entry.created_ms),
                        );
                        if plan.tier.local() {
                            self.app.cache.local.insert_aged(
                                local,
                                &entry.payload,
                                plan.lifetime,
                                age,
                            );
                        }
                        self.count_hit(plan, started, entry.payload.len(), true);
                        self.write_hit(&entry.payload).await?;
                        let refresh = plan
                            .lifetime
                            .refresh
                            .is_some_and(|r| age >= r)
                            .then(|| self.refresh_capture(request, plan))
                            .flatten();
                        return Ok(Lookup::Hit(refresh));
                    }
                    shared = Some((key, stamp));
                } else {
                    tier.skipped();
                }
            }
            // Reads inside a transaction are stored only at COMMIT: they
            // neither wait for nor hold up others.
            let fill = if waited || self.tx_status != TxStatus::Idle {
                None
            } else {
                match self.app.cache.fills.claim(local) {
                    Claim::Fill(guard) => Some(guard),
                    Claim::Wait(mut filled) => {
                        tracing::trace!(key = local, "waiting for a concurrent fill");
                        self.app.metrics.coalesced.inc();
                        let wait = self.cache.policy.coalesce_wait;
                        // Err: the filler finished (stored or failed).
                        let _ = tokio::time::timeout(wait, filled.changed()).await;
                        waited = true;
                        continue;
                    }
                }
            };
            self.app.metrics.misses.inc();
            self.db_metrics().miss.inc();
            return Ok(Lookup::Miss(Capture::new(plan, local, shared, fill)));
        }
    }

    fn count_hit(&self, plan: &Plan, started: Instant, bytes: usize, shared: bool) {
        let took = started.elapsed();
        let m = &self.app.metrics;
        m.hits.inc();
        if shared {
            m.hits_shared.inc();
        } else {
            m.hits_local.inc();
        }
        m.latency_hit.observe(took.as_secs_f64());
        m.client_bytes_out.inc_by(bytes as u64 + 6);
        self.db_metrics().hit.inc();
        plan.stats.hit(took, bytes);
    }

    fn db_metrics(&self) -> &crate::metrics::DbMetrics {
        let db = &self.cache.db;
        db.metrics
            .get_or_init(|| self.app.metrics.database(&db.name))
    }

    /// The capture of a background refresh of an entry just served, under
    /// the versions read now; `None` if one is already under way.
    fn refresh_capture(&self, request: RequestKey, plan: &Plan) -> Option<Capture> {
        // Never inside the client's transaction: its locks and snapshot are
        // the client's business.
        if self.tx_status != TxStatus::Idle {
            return None;
        }
        let db = &self.cache.db;
        let versions = plan.read.as_deref().unwrap_or_default();
        let local = request.local(&db.epoch, versions);
        let fill = self.app.cache.fills.try_claim(local)?;
        let shared = self
            .app
            .shared
            .as_ref()
            .filter(|tier| plan.tier.shared() && tier.usable(db))
            .map(|_| request.shared(&db.epoch, versions));
        self.app.metrics.refreshes.inc();
        Some(Capture::new(plan, local, shared, Some(fill)))
    }

    /// Sends `request` (ending in Sync or a Query) to the backend on
    /// pgcache's own account, to store its answer with `capture`.
    fn inject_refresh(&mut self, request: &[u8], capture: Capture) {
        self.forward(request);
        self.inflight.push_back(Inflight {
            to_client: false,
            capture: Some(capture),
            ..Inflight::default()
        });
    }

    /// Writes a stored response and the ReadyForQuery that ends it, in one write.
    async fn write_hit(&mut self, frames: &[u8]) -> Result<(), SessionError> {
        let status = match self.tx_status {
            TxStatus::Idle => b'I',
            TxStatus::InTransaction => b'T',
            TxStatus::Failed => b'E',
        };
        self.out.clear();
        self.out.extend_from_slice(frames);
        self.out
            .extend_from_slice(&[be::READY_FOR_QUERY, 0, 0, 0, 5, status]);
        self.flush_out().await
    }

    /// Reads inside a transaction can only use the cache if the session's
    /// settings are known, and they can only be read while it is idle: so
    /// read them just before a BEGIN goes out, if they are not known.
    async fn before_begin(&mut self, plan: &Plan) -> Result<(), SessionError> {
        if plan.begin_strict == Some(false) && self.cache.prefix.is_none() && self.can_hide() {
            let _ = self.session_prefix().await?;
        }
        Ok(())
    }

    /// State changes a forwarded statement causes at once.
    fn note_effects(&mut self, plan: &Plan) {
        if plan.settings {
            self.cache.prefix = None;
        }
        if plan.creates_temp {
            self.cache.temp = true;
        }
        if let Some(strict) = plan.begin_strict {
            self.cache.tx_strict = strict;
        }
        if plan.writes {
            self.cache.tx_wrote = true;
        }
    }

    /// Whether a read may be served from (and stored in) the cache now, and
    /// under which session prefix and table versions.
    async fn may_serve(
        &mut self,
        plan: &Plan,
        in_transaction_ok: bool,
    ) -> Result<Result<u128, BypassReason>, SessionError> {
        if let Err(reason) = &plan.read {
            return Ok(Err(*reason));
        }
        if !self.cache.policy.database_allowed(self.startup.database()) {
            return Ok(Err(BypassReason::DatabaseRule));
        }
        if self.cache.temp {
            return Ok(Err(BypassReason::TempObjects));
        }
        if !self.app.cache_allowed(&self.cache.db) {
            return Ok(Err(BypassReason::ReplicationDown));
        }
        if !self.inflight.is_empty() || !self.to_backend.is_empty() || self.unsynced {
            return Ok(Err(BypassReason::Pipelined));
        }
        match self.tx_status {
            TxStatus::Idle => {}
            TxStatus::Failed => return Ok(Err(BypassReason::InTransactionAfterWrite)),
            TxStatus::InTransaction => {
                if !in_transaction_ok {
                    return Ok(Err(BypassReason::UnsupportedShape));
                }
                if self.cache.tx_wrote {
                    return Ok(Err(BypassReason::InTransactionAfterWrite));
                }
                if self.cache.tx_strict || self.cache.default_strict {
                    return Ok(Err(BypassReason::IsolationLevel));
                }
            }
        }
        let prefix = self.session_prefix().await?;
        if prefix.is_ok()
            && let Some(role) = &self.cache.role
            && !self.cache.policy.role_allowed(role)
        {
            return Ok(Err(BypassReason::RoleRule));
        }
        Ok(prefix)
    }

    /// Whether pgcache may run its own query on the backend now.
    fn can_hide(&self) -> bool {
        self.ready
            && self.tx_status == TxStatus::Idle
            && self.inflight.is_empty()
            && self.to_backend.is_empty()
            && !self.unsynced
            && !self.cache.batch.forwarded
    }

    /// The memoised plan for a statement text.
    async fn plan(&mut self, hash: u128, sql: &[u8]) -> Result<Arc<Plan>, SessionError> {
        let generation = self.cache.db.catalog_gen();
        let policy_generation = self.app.policy_generation();
        if let Some(plan) = self.cache.plans.get(&hash)
            && plan.generation == generation
            && plan.policy_generation == policy_generation
        {
            return Ok(Arc::clone(plan));
        }
        if self.cache.policy.generation != policy_generation {
            self.cache.policy = self.app.policy();
        }
        let analysis = self.app.cache.analysis(hash, sql);
        if !analysis.scan.hints.problems.is_empty() {
            self.warn_hints(hash, &analysis.scan.hints.problems).await?;
        }
        let needs_catalog = analysis
            .analysis
            .statements
            .iter()
            .any(|s| !s.relations.is_empty() || !s.functions.is_empty());
        let catalog = if needs_catalog {
            self.catalog().await?
        } else {
            None
        };
        let generation = catalog.as_ref().map_or(generation, |(g, _)| *g);
        let plan = Arc::new(make_plan(
            &analysis,
            catalog.as_ref().map(|(_, c)| &**c),
            &self.cache.db,
            generation,
            &self.cache.policy,
        ));
        if let Ok(families) = &plan.read {
            plan.stats.set_reads(&self.cache.db, families);
        }
        if matches!(plan.read, Err(BypassReason::UnknownRelation)) {
            self.cache.db.request_reload();
        }
        if catalog.is_some() || !needs_catalog {
            if self.cache.plans.len() >= MAX_PLANS {
                self.cache.plans.clear();
            }
            self.cache.plans.insert(hash, Arc::clone(&plan));
        }
        Ok(plan)
    }

    /// Tells the client, once per statement text, which of its hints were
    /// malformed or unknown (the statement runs under the policy).
    async fn warn_hints(&mut self, hash: u128, problems: &[String]) -> Result<(), SessionError> {
        if self.cache.warned.len() >= MAX_PLANS {
            self.cache.warned.clear();
        }
        if !self.cache.warned.insert(hash) {
            return Ok(());
        }
        let mut out = BytesMut::new();
        for problem in problems {
            self.app.metrics.hint_problems.inc();
            crate::protocol::messages::notice_response(
                &mut out,
                "WARNING",
                "01000",
                &format!("pgcache: hint ignored: {problem}"),
            );
        }
        self.client
            .write_all(&out)
            .await
            .map_err(SessionError::ClientIo)
    }

    /// The database's catalog snapshot, loaded now if it is missing or
    /// stale and the session is idle.
    async fn catalog(&mut self) -> Result<Option<(u64, Arc<Catalog>)>, SessionError> {
        if let Some(c) = self.cache.db.catalog() {
            return Ok(Some(c));
        }
        if !self.can_hide() {
            return Ok(None);
        }
        let generation = self.cache.db.catalog_gen();
        let publication = self
            .app
            .replication_on()
            .then_some(self.app.config.replication.publication.as_str());
        let Some(rows) = self.hidden_query(&snapshot_sql(publication)).await? else {
            return Ok(None);
        };
        let catalog = Arc::new(Catalog::from_rows(&rows));
        debug!(
            relations = catalog.relation_count(),
            "catalog snapshot loaded"
        );
        self.cache.db.set_catalog(generation, Arc::clone(&catalog));
        Ok(Some((generation, catalog)))
    }

    /// The hash of the session's identity and settings, read from the
    /// backend when they may have changed.
    async fn session_prefix(&mut self) -> Result<Result<u128, BypassReason>, SessionError> {
        let generation = self.cache.db.catalog_gen();
        if let Some((prefix, g)) = self.cache.prefix
            && g == generation
        {
            return Ok(Ok(prefix));
        }
        if !self.can_hide() {
            return Ok(Err(BypassReason::SettingsUnknown));
        }
        let Some((generation, catalog)) = self.catalog().await? else {
            return Ok(Err(BypassReason::CatalogUnavailable));
        };
        let mut sql = String::from(
            "SELECT current_user, session_user, pg_catalog.current_setting('default_transaction_isolation'), \
             (SELECT pg_catalog.string_agg(name || '=' || setting, E'\\n' ORDER BY name) \
              FROM pg_catalog.pg_settings WHERE name <> 'application_name')",
        );
        for name in &catalog.policy_settings {
            sql.push_str(", pg_catalog.current_setting('");
            sql.push_str(&name.replace('\'', "''"));
            sql.push_str("', true)");
        }
        let Some(rows) = self.hidden_query(&sql).await? else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        let Some(row) = rows.into_iter().next() else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        self.cache.role = row.first().cloned().flatten();
        self.cache.default_strict = !matches!(
            row.get(2).and_then(|v| v.as_deref()),
            Some("read committed" | "read uncommitted")
        );
        let params = self
            .startup
            .params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()));
        let prefix = key::session_prefix(self.startup.database(), params, &row);
        self.cache.prefix = Some((prefix, generation));
        Ok(Ok(prefix))
    }

    /// Runs pgcache's own simple query on the idle backend and returns its
    /// rows as text, or `None` if it failed. Notifications and parameter
    /// changes arriving meanwhile go on to the client; notices caused by the
    /// query itself do not.
    async fn hidden_query(
        &mut self,
        sql: &str,
    ) -> Result<Option<Vec<Vec<Option<String>>>>, SessionError> {
        let mut msg = BytesMut::with_capacity(sql.len() + 6);
        msg.put_u8(fe::QUERY);
        msg.put_u32((sql.len() + 5) as u32);
        msg.put_slice(sql.as_bytes());
        msg.put_u8(0);
        self.backend
            .write_all(&msg)
            .await
            .map_err(SessionError::BackendIo)?;
        let mut rows = Vec::new();
        let mut failed = false;
        loop {
            while let Some(len) = parse_frame(&self.backend_buf, MAX_BACKEND_FRAME)
                .map_err(|e| SessionError::Protocol(format!("from backend: {e}")))?
            {
                let frame = self.backend_buf.split_to(len);
                let body = &frame[HEADER_LEN..];
                match frame[0] {
                    b'D' => match extended::data_row(body) {
                        Some(row) => rows.push(row),
                        None => failed = true,
                    },
                    be::ERROR_RESPONSE => failed = true,
                    be::READY_FOR_QUERY => {
                        if let Some(status) = body.first().and_then(|b| TxStatus::from_byte(*b)) {
                            self.tx_status = status;
                        }
                        return Ok((!failed).then_some(rows));
                    }
                    be::NOTIFICATION | be::PARAMETER_STATUS => {
                        self.client
                            .write_all(&frame)
                            .await
                            .map_err(SessionError::ClientIo)?;
                    }
                    _ => {}
                }
            }
            self.backend_buf.reserve(super::READ_CHUNK);
            if self
                .backend
                .read_buf(&mut self.backend_buf)
                .await
                .map_err(SessionError::BackendIo)?
                == 0
            {
                return Err(SessionError::BackendIo(
                    std::io::ErrorKind::UnexpectedEof.into(),
                ));
            }
        }
    }

    /// Parse, Bind, Describe, Execute, Close: held while the batch could
    /// still be answered from the cache, forwarded otherwise.
    async fn on_extended(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        let tag = frame[0];
        let body = frame.slice(HEADER_LEN..);
        let mut holdable = self.inflight.is_empty()
            && self.tx_status == TxStatus::Idle
            && !self.cache.batch.forwarded
            && !self.unsynced
            && self.cache.batch.shape.len() < MAX_HELD_MESSAGES
            && self.cache.batch.raw.len() + frame.len() <= MAX_HELD_BYTES;
        match tag {
            fe::PARSE => match extended::parse(&body) {
                Some(p) => {
                    let name = body.slice_ref(p.name);
                    let stmt = Arc::new(Statement {
                        hash: key::sql_hash(p.query),
                        sql: body.slice_ref(p.query),
                        param_types: body.slice_ref(p.param_types),
                    });
                    if name.is_empty() {
                        self.cache.unsent_parses.retain(|(n, _)| !n.is_empty());
                    }
                    self.cache.statements.insert(name.clone(), stmt);
                    self.cache.batch.parsed.push(name.clone());
                    holdable &= self.cache.batch.parse.is_none();
                    if holdable {
                        self.cache.batch.parse = Some((name, frame.clone()));
                    }
                }
                None => holdable = false,
            },
            // Parameters are decoded once, at Sync, if the batch may be cached.
            fe::BIND => match extended::bind_names(&body) {
                Some((portal, statement)) => {
                    let portal = body.slice_ref(portal);
                    match self.cache.statements.get(statement) {
                        Some(stmt) => {
                            let stmt = Arc::clone(stmt);
                            self.cache.portals.insert(portal, stmt);
                        }
                        None => {
                            self.cache.portals.remove(&portal);
                            holdable = false;
                        }
                    }
                    holdable &= self.cache.batch.bind.is_none();
                    if holdable {
                        self.cache.batch.bind = Some(frame.clone());
                    }
                }
                None => holdable = false,
            },
            fe::DESCRIBE => match extended::target(&body) {
                Some((kind, name)) => {
                    holdable &= self.cache.batch.describe.is_none();
                    if holdable {
                        self.cache.batch.describe = Some((kind, body.slice_ref(name)));
                    }
                }
                None => holdable = false,
            },
            fe::EXECUTE => {
                let parsed = extended::execute(&body).map(|(p, rows)| (body.slice_ref(p), rows));
                let stmt = parsed
                    .as_ref()
                    .and_then(|(p, _)| self.cache.portals.get(p).cloned());
                match (parsed, stmt) {
                    (Some((portal, max_rows)), Some(stmt)) => {
                        let plan = self.plan(stmt.hash, &stmt.sql.clone()).await?;
                        plan.stats.call();
                        self.before_begin(&plan).await?;
                        self.cache.batch.effects.merge(&plan.effects);
                        self.note_effects(&plan);
                        holdable &= plan.read.is_ok()
                            && max_rows == 0
                            && self.cache.batch.execute.is_none();
                        if holdable {
                            self.cache.batch.execute = Some((portal, max_rows));
                        }
                    }
                    _ => {
                        self.cache.batch.effects.merge(&Bumps::opaque());
                        self.cache.prefix = None;
                        self.cache.tx_wrote = true;
                        holdable = false;
                    }
                }
            }
            _ => {
                // Close
                if let Some((kind, name)) = extended::target(&body) {
                    if kind == b'S' {
                        self.cache.statements.remove(name);
                        self.cache.unsent_parses.retain(|(n, _)| n.as_ref() != name);
                    } else {
                        self.cache.portals.remove(name);
                    }
                }
                holdable = false;
            }
        }
        if tag == fe::EXECUTE {
            self.copy.executed();
        }
        if holdable {
            self.cache.batch.raw.extend_from_slice(&frame);
            self.cache.batch.shape.push(tag);
            if tag == fe::DESCRIBE {
                self.cache
                    .batch
                    .shape
                    .push(body.first().copied().unwrap_or(0));
            }
        } else {
            self.release_batch();
            self.forward(&frame);
            self.unsynced = true;
        }
        Ok(Flow::Continue)
    }

    /// Forwards the held part of the batch; the rest of it goes straight
    /// through until Sync.
    fn release_batch(&mut self) {
        if !self.cache.batch.raw.is_empty() {
            let mut raw = std::mem::take(&mut self.cache.batch.raw);
            self.forward(&raw);
            raw.clear();
            self.cache.batch.raw = raw;
            self.unsynced = true;
        }
        if self.cache.holds_batch() {
            self.cache.batch.forwarded = true;
        }
    }

    async fn on_sync(&mut self, frame: Bytes) -> Result<Flow, SessionError> {
        let started = Instant::now();
        let mut inflight = Inflight::default();
        if !self.cache.batch.raw.is_empty() && !self.cache.batch.forwarded {
            match self.extended_key().await? {
                Ok((request, plan)) => match self.lookup(request, &plan, started).await? {
                    Lookup::Miss(capture) => {
                        inflight.capture = Some(capture);
                        inflight.timing = Some((Arc::clone(&plan.stats), started));
                    }
                    Lookup::Hit(refresh) => {
                        let parse = self.cache.batch.parse.take();
                        if let Some((name, _)) = &parse {
                            self.cache.unsent_parses.retain(|(n, _)| n != name);
                        }
                        match refresh {
                            // The refresh sends the whole batch, Parse included.
                            Some(capture) => {
                                let mut request = std::mem::take(&mut self.cache.batch.raw);
                                request.extend_from_slice(&frame);
                                self.inject_refresh(&request, capture);
                                request.clear();
                                self.cache.batch.raw = request;
                            }
                            None => {
                                if let Some(parse) = parse {
                                    self.cache.unsent_parses.push(parse);
                                }
                            }
                        }
                        self.cache.batch.reset();
                        return Ok(Flow::Continue);
                    }
                },
                Err(reason) => self.bypassed(reason),
            }
        }
        if !self.cache.batch.raw.is_empty() {
            let raw = std::mem::take(&mut self.cache.batch.raw);
            self.forward(&raw);
            self.cache.batch.raw = raw;
        }
        self.forward(&frame);
        self.unsynced = false;
        (inflight.effects, inflight.parsed) = self.cache.batch.reset();
        inflight.may_be_ignored = self.copy.sync_may_be_ignored();
        self.push_request(inflight);
        Ok(Flow::Continue)
    }

    /// The key of a held batch of the shape drivers send for one query:
    /// `[Parse] Bind [Describe] Execute Sync` on the unnamed portal.
    async fn extended_key(
        &mut self,
    ) -> Result<Result<(RequestKey, Arc<Plan>), BypassReason>, SessionError> {
        // Cheap clones of refcounted bytes: the Bind stays parsed across the
        // awaits below without borrowing the session.
        let batch = &self.cache.batch;
        let (Some(bind_frame), Some((portal, 0))) = (batch.bind.clone(), batch.execute.clone())
        else {
            return Ok(Err(BypassReason::UnsupportedShape));
        };
        let Some(bind) = extended::bind(&bind_frame[HEADER_LEN..]) else {
            return Ok(Err(BypassReason::UnsupportedShape));
        };
        let describe_ok = match &batch.describe {
            None => true,
            Some((b'P', name)) => name.as_ref() == bind.portal,
            Some((_, name)) => name.as_ref() == bind.statement,
        };
        if !bind.portal.is_empty() || portal.as_ref() != bind.portal || !describe_ok {
            return Ok(Err(BypassReason::UnsupportedShape));
        }
        let Some(stmt) = self.cache.statements.get(bind.statement).cloned() else {
            return Ok(Err(BypassReason::UnsupportedShape));
        };
        if bind
            .params
            .iter()
            .zip(&bind.param_formats)
            .any(|(v, f)| *f == 0 && v.is_some_and(|v| v.len() <= 16 && is_time_literal_text(v)))
        {
            return Ok(Err(BypassReason::TimeLiteral));
        }
        let plan = self.plan(stmt.hash, &stmt.sql).await?;
        let prefix = match self.may_serve(&plan, false).await? {
            Ok(prefix) => prefix,
            Err(reason) => return Ok(Err(reason)),
        };
        let mut k = KeyBuilder::new(prefix, key::EXTENDED, stmt.hash);
        k.bytes(&self.cache.batch.shape).bytes(&stmt.param_types);
        for (value, format) in bind.params.iter().zip(&bind.param_formats) {
            k.u64(*format as u64).value(*value);
        }
        for f in &bind.result_formats {
            k.u64(*f as u64);
        }
        Ok(Ok((k.finish(), plan)))
    }

    /// A response frame (not ReadyForQuery) for the oldest request in
    /// flight. Returns whether it goes on to the client.
    pub(super) fn on_response_frame(&mut self, pos: usize, len: usize) -> bool {
        let tag = self.backend_buf[pos];
        if tag == be::PARAMETER_STATUS {
            self.cache.prefix = None;
        }
        let max = self.app.cache.local.max_entry_bytes();
        let Some(front) = self.inflight.front_mut() else {
            return true;
        };
        if !front.to_client {
            // pgcache's own request: a refresh keeps its answer, nobody
            // else sees it.
            if let Some(cap) = &mut front.capture {
                cap.add(&self.backend_buf[pos..pos + len], max);
            }
            return matches!(tag, be::NOTIFICATION | be::PARAMETER_STATUS);
        }
        match tag {
            be::NOTIFICATION => return true,
            be::ERROR_RESPONSE => {
                front.failed = true;
                self.cache.last_was_commit = false;
            }
            b'C' => {
                let body = &self.backend_buf[pos + HEADER_LEN..pos + len];
                self.cache.last_was_commit = body.starts_with(b"COMMIT\0");
            }
            _ => {}
        }
        if let Some(cap) = &mut front.capture {
            cap.add(&self.backend_buf[pos..pos + len], max);
        }
        true
    }

    /// ReadyForQuery: the oldest request is complete. Applies its effects,
    /// stores its capture, and closes the transaction's books when it ends.
    pub(super) fn on_ready_for_query(&mut self, status: TxStatus) {
        if !self.ready {
            // Logged in: only now does the database get shared state, so
            // clients naming made-up databases cannot grow the registry.
            self.cache.db = self.app.cache.db(self.startup.database());
            if self.caching {
                crate::invalidation::ensure_stream(
                    &self.app,
                    self.startup.database(),
                    &self.cache.db,
                );
            }
        }
        let previous = self.tx_status;
        tracing::trace!(?status, inflight = self.inflight.len(), "ready for query");
        self.tx_status = status;
        self.ready = true;
        if let Some(done) = self.inflight.pop_front() {
            if !done.effects.is_empty() {
                if status == TxStatus::Idle {
                    self.invalidate(done.effects);
                } else {
                    // Not visible to others before the transaction ends.
                    done.effects.apply_local(&self.cache.db);
                    self.cache.tx_effects.merge(&done.effects);
                }
            }
            if done.failed {
                for name in &done.parsed {
                    self.cache.statements.remove(name);
                }
            }
            if let Some((stats, started)) = &done.timing {
                let took = started.elapsed();
                stats.miss(took);
                self.app.metrics.latency_miss.observe(took.as_secs_f64());
            }
            if let Some(cap) = done.capture
                && cap.ok
                && !done.failed
            {
                match status {
                    TxStatus::Idle => self.store(cap),
                    TxStatus::InTransaction
                        if self.cache.deferred.len() < MAX_DEFERRED
                            && self.cache.deferred_bytes + cap.buf.len() <= MAX_DEFERRED_BYTES =>
                    {
                        self.cache.deferred_bytes += cap.buf.len();
                        self.cache.deferred.push(cap);
                    }
                    _ => {}
                }
            }
        }
        if status == TxStatus::Idle {
            if previous != TxStatus::Idle {
                // The transaction ended: its writes are visible (or gone) now.
                let effects = std::mem::take(&mut self.cache.tx_effects);
                if !effects.is_empty() {
                    self.invalidate(effects);
                }
                let deferred = std::mem::take(&mut self.cache.deferred);
                self.cache.deferred_bytes = 0;
                if self.cache.last_was_commit {
                    for cap in deferred {
                        self.store(cap);
                    }
                }
            }
            self.cache.tx_wrote = false;
            self.cache.tx_strict = false;
        }
    }

    fn store(&self, cap: Capture) {
        tracing::trace!(key = ?cap.key.local, len = cap.buf.len(), "store");
        self.app.metrics.stores.inc();
        if let Some(key) = cap.key.local {
            self.app.cache.local.insert(key, &cap.buf, cap.lifetime);
        }
        if let (Some(tier), Some((key, versions))) = (&self.app.shared, &cap.key.shared) {
            tier.put(*key, versions, &cap.buf, cap.lifetime.ttl);
        }
        for f in &cap.reads {
            f.version.note_entry();
        }
    }

    /// Applies invalidations others can now see: the local counters at
    /// once; Redis (and every other instance) before the client is told
    /// the statement completed, in [`Self::publish_invalidations`].
    fn invalidate(&mut self, effects: Effects) {
        self.app.metrics.invalidations.write.inc();
        match &self.app.shared {
            None => effects.apply_local(&self.cache.db),
            Some(tier) => {
                let pending = tier.begin(&self.cache.db);
                effects.apply_local(&self.cache.db);
                self.cache.to_publish.push((effects, pending));
            }
        }
    }

    pub(super) async fn publish_invalidations(&mut self) {
        if let Some(tier) = &self.app.shared {
            for (effects, pending) in self.cache.to_publish.drain(..) {
                tier.publish(&self.cache.db, &effects, pending).await;
            }
        }
    }
}
