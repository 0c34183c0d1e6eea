//! What goes in and out of the engine besides frames and bytes: the
//! context it reads with each event, the actions it asks of the driver,
//! what a decision waits for, and what the driver found meanwhile.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;

use crate::cache::sampler::Check;
use crate::cache::versions::Family;
use crate::cache::{Cache, Fill, Publication, Wait, Waited};
use crate::cancel::{CancelGuard, CancelTarget};
use crate::classify::prerequisites::Prerequisites;
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::pool::clients::Client;
use crate::pool::errand::Errand;
use crate::pool::transaction::{Pool, SettingsRow};
use crate::replica::Replicas;
use crate::session::capture::Capture;
use crate::session::link::Knobs;
use crate::session::logins::{Login, SharedLogins};
use crate::session::plan::SharedPlans;
use crate::upstream::Upstream;

/// What the engine may read with each event: shared state that never
/// blocks, the time, and randomness.
pub(in crate::session) struct Ctx<'a> {
    pub instance: &'a dyn Instance,
    /// The session's line in `SHOW CLIENTS`.
    pub client: &'a Client,
    pub now: Instant,
    /// Draws a random number (which replica takes a read, which hit the
    /// sampler checks): the driver's is `rand::random`, a test's is
    /// seeded.
    pub draw: fn() -> u64,
}

/// The pgcache instance as the engine sees it: the shared state it reads
/// and the few effects it has on other sessions at once (a cancel key
/// given, parked connections closed, a pool taught). The driver passes its
/// [`crate::App`]; the engine reaches nothing else of it: not the
/// configuration, TLS, the listeners or the shutdown's tokens.
pub(in crate::session) trait Instance: Sync {
    /// The cache tiers and each database's versions and catalog.
    fn cache(&self) -> &Cache;
    fn metrics(&self) -> &Metrics;
    fn replicas(&self) -> &Replicas;
    /// `upstream.url`: how pgcache logs in to the primary.
    fn upstream(&self) -> &Upstream;
    /// Plans shared by the sessions of each database.
    fn plans(&self) -> &SharedPlans;
    /// What fresh logins start with, shared by the sessions that log in
    /// alike.
    fn logins(&self) -> &SharedLogins;
    /// The caching policy in force.
    fn policy(&self) -> Arc<Policy>;
    /// The policy's generation: one atomic load, to notice a RELOAD.
    fn policy_generation(&self) -> u64;
    /// The publication pgcache follows, when replication is on.
    fn publication(&self) -> Option<String>;
    /// The transaction pool's settings in force: `memo`, read again after
    /// a RELOAD ([`Self::policy_generation`]).
    fn pool_knobs(&self, memo: &mut Knobs) -> Knobs;
    /// A cancel key for a session whose server connection changes: its
    /// process id, its secret, and the guard that drops it.
    fn register_cancel(&self) -> (u32, Vec<u8>, CancelGuard);
    /// A cancel key for a session on one server connection for its whole
    /// life: the backend's own.
    fn register_cancel_for(&self, backend: &CancelTarget) -> (u32, Vec<u8>, CancelGuard);
    /// Closes every parked server connection: a database-level statement
    /// goes out.
    fn evict_parked(&self);
    /// Shutdown was requested: sessions close once idle.
    fn draining(&self) -> bool;
    /// Teaches `pool` (the session's, or the one its hits' checks run
    /// on) what its later sessions start from.
    fn teach_pool(&self, pool: &Pool, lesson: Lesson<'_>);
}

/// What a session learnt that its pool's later sessions use
/// ([`Instance::teach_pool`]).
pub(in crate::session) enum Lesson<'a> {
    /// PostgreSQL let the client in without asking a password.
    Trusted,
    /// How the server reports the startup value `value` of `name`.
    Reported {
        name: &'a str,
        value: &'a str,
        reported: &'a str,
    },
    /// The settings a client state (`state`) reads as under the policy's
    /// settings generation `policy`, on the pool's connections of
    /// `generation`.
    Settings {
        state: u64,
        policy: u64,
        generation: u64,
        row: Arc<SettingsRow>,
    },
}

/// What the engine asks the driver to do, in order, before the client is
/// sent what the engine staged for it.
pub(in crate::session) enum Action {
    /// Send invalidations to Redis (and every other instance).
    Publish(Publication),
    /// Read this instance's mirrors of the table's rows' counters from
    /// Redis: it began keying the table by row.
    Mirror(Arc<Family>),
    /// Store a complete answer in the cache tiers.
    Store(Box<Fill>, BytesMut),
    /// Follow the database's changes: start its stream if none runs.
    Watch,
    /// Look up the catalog facts the database's sessions asked for, on
    /// pgcache's own connection, if no fetcher does yet.
    Fetch,
    /// Judge a sampled hit against PostgreSQL's answer, complete at that
    /// time.
    Judge(Box<Check>, BytesMut, Instant),
    /// Run pgcache's own request for a hit served (a refresh, a check) off
    /// the client's path, into the capture.
    Offload(Box<Errand>, Capture),
}

/// What a session in transaction mode is to do with its server connection
/// now: the engine decides, the driver takes and gives back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum LinkStep {
    /// Frames wait for the backend and no connection is held: take one.
    CheckOut,
    /// The connection could go back, but the client's settings may have
    /// changed on it: read them back first (then decide again).
    ReadBack,
    /// The connection is in a state another client may be given it in.
    GiveBack,
    /// The connection is idle but carries another client's LISTEN: closed.
    Close,
}

/// What a client frame's decision waits for. The driver meets it, notes
/// what it found in [`Found`], and feeds the engine the same frame again.
pub(in crate::session) enum Need {
    /// The statement's prerequisites: databases pgcache lets go of,
    /// tables taken out of its publication (named as the client's session
    /// resolves them, when it could ask).
    Prerequisites(Box<Prerequisites>),
    /// pgcache's own queries, asked on the session's idle backend: its
    /// settings, or the facts of the names the statement uses when
    /// pgcache has no connection of its own. The driver runs them
    /// ([`super::Engine::own_request`]).
    Own,
    /// The facts of these relations and functions, being fetched: a
    /// database's first statements wait for them a little while a tier
    /// could answer (`cache.first_read_wait_ms`).
    Fetched {
        rels: Vec<String>,
        funcs: Vec<String>,
    },
    /// What the cache waits for: Redis, or a concurrent fill.
    Cache(Wait),
}

/// What the driver found out while a frame waited; forgotten once the
/// frame is decided.
#[derive(Default)]
pub(in crate::session) struct Found {
    pub prerequisites: bool,
    /// The statement's prerequisites, while its tables are resolved.
    pub needs: Option<Box<Prerequisites>>,
    /// The facts were looked up (or could not be).
    pub facts: bool,
    /// The settings were read (or could not be).
    pub settings: bool,
    /// What the settings query asked for: a login's probe, or everything
    /// (with so many columns before the fingerprint).
    pub asked: Option<Asked>,
    /// The probe did not match the login's kept answer.
    pub probe_missed: bool,
    pub lookup: Waited,
}

/// The settings query in flight ([`crate::session::logins`]).
pub(in crate::session) enum Asked {
    Probe(Arc<Login>),
    Everything { columns: usize },
}

impl Found {
    pub fn clear(&mut self) {
        if self.prerequisites
            || self.needs.is_some()
            || self.facts
            || self.settings
            || self.asked.is_some()
            || self.probe_missed
            || !self.lookup.is_empty()
        {
            *self = Found::default();
        }
    }
}

/// A whole one-query batch at the start of the client's buffer that the
/// engine can decide on at once ([`Engine::whole_batch`]).
pub(in crate::session) struct ReadyBatch {
    /// Its bytes at the start of the buffer.
    pub len: usize,
    pub query: super::batches::DecidedQuery,
}
