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
use std::time::Instant;

use bytes::BytesMut;
use tracing::debug;

use crate::App;
use crate::cache::hold::Paused;
use crate::cache::{DbState, Fill, Publication};
use crate::cancel::{CancelGuard, CancelTarget};
use crate::pool::clients::Client;
use crate::pool::marks::{Marks, Pin};
use crate::protocol::TxStatus;
use crate::protocol::startup::Startup;
use crate::session::batch::Batch;
use crate::session::known::Known;
use crate::session::link::{Knobs, Link};
use crate::session::pipeline::Pipeline;
use crate::session::reuse::ServerBook;
use crate::session::transaction::Transaction;
use crate::upstream::UpstreamAddr;

mod answers;
#[cfg(test)]
mod tests;

pub(super) use answers::MAX_BACKEND_FRAME;

/// What the engine may read with each event: shared state that never
/// blocks, and the time.
pub(super) struct Ctx<'a> {
    pub app: &'a App,
    /// The session's line in `SHOW CLIENTS`.
    pub client: &'a Client,
    pub now: Instant,
}

/// What the engine asks the driver to do, in order, before the client is
/// sent what the engine staged for it.
pub(super) enum Action {
    /// Send invalidations to Redis (and every other instance).
    Publish(Publication),
    /// Store a complete answer in the cache tiers.
    Store(Box<Fill>, BytesMut),
    /// Follow the database's changes: start its stream if none runs.
    Watch,
}

/// The state of one client session.
pub(super) struct Engine {
    /// Cache lookups and fills are on (`cache.enabled`).
    pub caching: bool,
    pub startup: Startup,
    /// The first ReadyForQuery has been seen (authentication is over).
    pub ready: bool,
    pub pipeline: Pipeline,
    pub tx: Transaction<(Box<Fill>, BytesMut)>,
    pub batch: Batch,
    /// What the session knows of itself: settings, plans, statements.
    pub known: Known,
    /// This database's cache state (a placeholder until logged in).
    pub db: Arc<DbState>,
    /// What the driver is to do before the client hears more.
    pub actions: Vec<Action>,
    /// Staging for client writes that pgcache assembles or rewrites.
    pub out: BytesMut,
    /// Transaction mode: where server connections come from, and what of
    /// the client's state goes with it from one to the next.
    pub link: Link,
    /// What decides whether the backend connection outlives the session.
    pub server: ServerBook,
    /// The backend reported a FATAL error: its close is expected.
    pub backend_fatal: bool,
    /// The client sent Terminate: so is the backend's close that follows.
    pub client_ended: bool,
    /// Databases pgcache let go of for a statement of this session that
    /// needs them free, until it is answered.
    pub paused: Vec<Paused>,
    /// Shutting down: the session closes once idle.
    pub draining: bool,
    /// Where the backend connection is.
    pub backend_addr: UpstreamAddr,
    /// The backend's own cancel key, and the registration of ours.
    pub backend_key: Option<Arc<CancelTarget>>,
    pub cancel: Option<CancelGuard>,
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
            ready: false,
            pipeline: Pipeline::default(),
            tx: Transaction::default(),
            batch: Batch::default(),
            known,
            db: Arc::default(),
            actions: Vec::new(),
            out: BytesMut::new(),
            link,
            server,
            backend_fatal: false,
            client_ended: false,
            paused: Vec::new(),
            draining: false,
            backend_key: None,
            cancel: None,
        }
    }

    /// Logged in, outside a transaction block, and nothing asked of the
    /// backend: pgcache may use the connection for itself.
    pub fn backend_idle(&self) -> bool {
        self.ready && self.tx.status == TxStatus::Idle && self.pipeline.is_quiet()
    }

    /// Notes what a Query's or Parse's text means for the connection
    /// ([`Marks`]); parked connections are closed before a database-level
    /// statement goes out.
    pub fn note_marks(&mut self, ctx: &Ctx, marks: Marks) {
        self.server.tainted |= marks.taints;
        if marks.evicts {
            ctx.app.pool.evict_all();
        }
        if self.link.is_pooled() {
            self.link.state_dirty |= marks.settings;
            self.link.schema_changes |= marks.schema;
            if let Some(why) = marks.pin {
                self.pin(ctx, why);
            }
        }
    }

    /// Transaction mode: a feature that lives in one backend keeps the
    /// session on its connection from now on.
    pub fn pin(&mut self, ctx: &Ctx, why: Pin) {
        if !self.link.is_pooled() || self.link.pinned.is_some() {
            return;
        }
        debug!(
            reason = why.as_str(),
            "session pinned to its server connection"
        );
        let pins = &ctx.app.metrics.pooled.pins;
        pins.with_label_values(&[why.as_str()]).inc();
        self.link.pinned = Some(why);
        ctx.client.pin(why.as_str());
    }

    /// At the client's Terminate: true if the connection is kept for the
    /// pool of parked connections, in which case the Terminate is not
    /// forwarded.
    pub fn hand_back(&mut self, ctx: &Ctx) -> bool {
        self.server.handed_back = self.server.pooling
            && !self.server.tainted
            && self.backend_idle()
            && !self.batch.holds()
            && !ctx.app.drain.is_cancelled();
        self.server.handed_back
    }

    /// A statement may have changed the session's settings: they are read
    /// again before the next cacheable read.
    pub fn settings_may_have_changed(&mut self) {
        self.known.prefix = None;
        self.server.login_state = false;
        self.link.state_dirty = true;
    }

    /// [`Knobs`], read again after a RELOAD.
    pub fn knobs(&mut self, ctx: &Ctx) -> Knobs {
        let generation = ctx.app.policy_generation();
        if self.link.knobs.generation != generation {
            let config = ctx.app.config();
            self.link.knobs = Knobs {
                generation,
                wait: config.pool.query_wait_timeout(),
                lifetime: config.pool.server_lifetime(),
                max_prepared: config.pool.max_prepared_statements,
            };
        }
        self.link.knobs
    }
}
