//! What the driver may read of the engine and tell it: the engine's
//! state is private, and the driver goes through these.
//!
//! Reads are plain accessors. Changes name what happened (a server was
//! attached or detached, the client was sent its bytes, shutdown began)
//! rather than set a field.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;

use super::answers::Relayed;
use super::life::Shutdown;
use super::{Action, Engine, Instance, LinkStep};
use crate::cache::DbState;
use crate::cache::Waited;
use crate::cache::hold::Paused;
use crate::cancel::{CancelGuard, CancelTarget};
use crate::pool::transaction::{Lent, Pool};
use crate::pool::{PoolError, PoolKey};
use crate::protocol::startup::Startup;
use crate::protocol::{TxStatus, messages};
use crate::session::SessionError;
use crate::session::link::{Link, UNKNOWN_STATE};
use crate::session::replica::ReplicaLeg;
use crate::session::reuse::{Fate, ServerBook};
use crate::upstream::UpstreamAddr;

/// Where a session in transaction mode takes a connection from: its pool,
/// and how long it waits for one (`None`: as long as it takes).
pub(in crate::session) type Checkout = (Arc<Pool>, Option<Duration>);

impl Engine {
    pub fn startup(&self) -> &Startup {
        &self.startup
    }

    pub fn tx_status(&self) -> TxStatus {
        self.tx.status
    }

    /// This database's cache state.
    pub fn db(&self) -> &Arc<DbState> {
        &self.db
    }

    /// What was staged for the backend is gone (the fuzz target sends
    /// nothing).
    #[doc(hidden)]
    pub fn drop_staged(&mut self) {
        self.pipeline.to_backend.clear();
    }

    /// Logged in, and nothing asked of the backend: the session waits on
    /// its client.
    pub fn waits_on_client(&self) -> bool {
        self.logged_in() && !self.pipeline.awaits_backend()
    }

    /// Transaction mode: the pool to take a connection from and how long
    /// to wait for one; `None` in session mode. The error of a checkout
    /// that failed for an own query fails the statement that waited on it.
    pub fn checkout(&mut self, instance: &dyn Instance) -> Result<Option<Checkout>, SessionError> {
        let Link::Pooled(link) = &mut self.link else {
            return Ok(None);
        };
        if let Some(e) = link.no_connection.take() {
            return Err(SessionError::Pool(*e));
        }
        Ok(Some((
            Arc::clone(&link.pool),
            instance.pool_knobs(&mut link.knobs).wait,
        )))
    }

    /// Transaction mode: the pool granted the session a server connection
    /// (`queued`: after a wait): the client's settings go on it first, if
    /// it has others ([`super::Purpose::Apply`]).
    pub fn granted(&mut self, lent: Lent, queued: bool) {
        let Link::Pooled(link) = &mut self.link else {
            return;
        };
        if let Some(apply) = link.granted(lent, queued, &mut self.pipeline) {
            self.apply_first(apply);
        }
    }

    /// Transaction mode: taking a server connection for what the client
    /// sent failed with `pool`'s error. While the client's requests are whole
    /// (synced), each it is owed an answer for fails with the pool's error
    /// (staged for the client), its statements forgotten, and the session
    /// goes on. Otherwise the session ends with the error.
    pub(super) fn fail_unsent(&mut self, pool: PoolError) -> Result<(), SessionError> {
        if self.pipeline.unsynced {
            return Err(SessionError::Pool(pool));
        }
        tracing::info!(code = pool.sqlstate(), "{pool}");
        for request in self.pipeline.drop_unsent() {
            for name in &request.parsed {
                self.known.statements.remove(name);
            }
            let (code, message) = (pool.sqlstate(), pool.to_string());
            messages::error_response(&mut self.out, "ERROR", code, &message);
            self.out
                .extend_from_slice(&messages::ready_for_query(self.tx.status));
        }
        Ok(())
    }

    /// Transaction mode: what to do with the server connection now.
    /// `attached`: one is held; `unread`: it sent bytes not read yet.
    /// A pinned session keeps its connection, but its settings are still
    /// read back, as they are what pgcache's own requests for it run in.
    pub(super) fn link_step(&self, attached: bool, unread: bool) -> Option<LinkStep> {
        let Link::Pooled(link) = &self.link else {
            return None;
        };
        if !attached {
            return (!self.pipeline.to_backend.is_empty()).then_some(LinkStep::CheckOut);
        }
        if !self.may_give_back(unread) {
            None
        } else if link.state_dirty {
            Some(LinkStep::ReadBack)
        } else if link.pinned.is_some() {
            None
        } else if link.listens.carries_foreign() {
            Some(LinkStep::Close)
        } else {
            Some(LinkStep::GiveBack)
        }
    }

    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Bytes staged for the client.
    pub fn out(&self) -> &BytesMut {
        &self.out
    }

    /// What the client is sent of the bytes buffered from a server
    /// (`buf`) that [`Engine::on_backend`] handled (`relayed`): those bytes
    /// as they are when nothing was rewritten, else what the engine staged
    /// with the rest after it.
    pub fn for_client<'a>(&'a mut self, buf: &'a [u8], relayed: &Relayed) -> &'a [u8] {
        if self.out.is_empty() && relayed.from == 0 {
            &buf[..relayed.end]
        } else {
            self.out.extend_from_slice(&buf[relayed.from..relayed.end]);
            &self.out
        }
    }

    /// The client was sent what was staged for it.
    pub fn client_sent(&mut self) {
        self.out.clear();
    }

    /// What the server connection is owed as it is, before any request
    /// staged for it: the StartupMessage, a login's answers, a retry.
    pub(super) fn take_to_server(&mut self) -> Option<BytesMut> {
        (!self.to_server.is_empty()).then(|| self.to_server.split())
    }

    /// The backend's close is expected: it sent FATAL, or the client
    /// ended the session.
    pub fn close_expected(&self) -> bool {
        self.ending.is_some()
    }

    /// Databases let go of for a statement, until it is answered.
    /// Shutting down: the session closes once idle.
    pub fn drain(&mut self) {
        self.shutdown = Shutdown::Draining;
    }

    pub fn draining(&self) -> bool {
        self.shutdown == Shutdown::Draining
    }

    /// A server connection from the pool is the session's now: cancels
    /// go to it.
    pub fn attach_server(&mut self, addr: &UpstreamAddr, key: Arc<CancelTarget>) {
        if self.backend_addr != *addr {
            self.backend_addr = addr.clone();
        }
        self.backend_key = Some(key);
        self.retarget_cancel();
    }

    /// The server connection went back to its pool, or was closed: a
    /// cancel has nothing to reach, and what it listened on was the
    /// connection's.
    pub fn detach_server(&mut self) {
        if let Link::Pooled(link) = &mut self.link {
            link.listens = Default::default();
        }
        self.backend_key = None;
        self.retarget_cancel();
    }

    /// The server connection is closed, in a state no other client may
    /// see: its lease ends, and nothing is owed to it.
    pub fn drop_server(&mut self) {
        if let Link::Pooled(link) = &mut self.link {
            link.lent = None;
            link.translator.clear_owed();
        }
    }

    /// The client's cancel key (transaction mode: pgcache's own), which
    /// follows the session's server connection.
    pub fn register_cancel(&mut self, guard: CancelGuard) {
        guard.retarget(self.backend_key.clone());
        self.cancel = Some(guard);
    }

    /// Cancels reach the session's server connection as it is now.
    pub fn retarget_cancel(&self) {
        if let Some(cancel) = &self.cancel {
            cancel.retarget(self.backend_key.clone());
        }
    }

    /// The client's cancel key sends cancels to `target` for now.
    pub fn cancel_towards(&self, target: Option<Arc<CancelTarget>>) {
        if let Some(cancel) = &self.cancel {
            cancel.retarget(target);
        }
    }

    /// The prerequisites of the frame being decided were met
    /// ([`super::Need::Prerequisites`]).
    pub fn prerequisites_met(&mut self, paused: Vec<Paused>) {
        self.paused.extend(paused);
        self.found.prerequisites = true;
    }

    /// The facts of the names the frame being decided uses were looked up,
    /// or waited for ([`super::Need::Fetched`]).
    pub fn facts_met(&mut self) {
        self.found.facts = true;
    }

    /// Where a wait of the frame's lookup leaves what it waited for
    /// ([`super::Need::Cache`]).
    pub fn lookup_waited(&mut self) -> &mut Waited {
        &mut self.found.lookup
    }

    /// `cache.first_read_wait_ms`, as the session's policy has it.
    pub fn first_read_wait(&self) -> std::time::Duration {
        self.known.policy.first_read_wait
    }

    pub fn replica(&self) -> Option<&ReplicaLeg> {
        self.replica.as_deref()
    }

    /// Puts answers pgcache gave in the server's place (`answers`) after
    /// the complete frames in the server's buffer `buf`, as if they had
    /// arrived: nothing was owed before them. The next read of the buffer
    /// knows them for pgcache's.
    pub fn splice(&mut self, buf: &mut BytesMut, answers: &[u8]) {
        let at: usize = crate::protocol::codec::frames(buf).map(<[u8]>::len).sum();
        let tail = buf.split_off(at);
        buf.extend_from_slice(answers);
        buf.extend_from_slice(&tail);
        if let Link::Pooled(link) = &mut self.link {
            link.spliced = at..at + answers.len();
        }
    }

    /// Transaction mode: how long a pooled connection may live, as the
    /// policy now says (`None` in session mode).
    pub fn pooled_lifetime(&mut self, instance: &dyn Instance) -> Option<std::time::Duration> {
        match &mut self.link {
            Link::Pooled(link) => Some(instance.pool_knobs(&mut link.knobs).lifetime),
            Link::Session(_) => None,
        }
    }

    /// The client left with requests in flight: the backend's key, to
    /// cancel them (a backend busy with a long query would not notice the
    /// closed socket until it writes).
    pub fn cancel_on_leaving(&self) -> Option<Arc<CancelTarget>> {
        (self.pipeline.len() > 0)
            .then(|| self.backend_key.clone())
            .flatten()
    }

    /// The session's connection goes back to its pool when the session
    /// ends ([`Engine::part_at_end`]): it is not told to end. A pooled
    /// lease, idle, not pinned.
    pub fn backend_outlives_session(&self) -> bool {
        matches!(&self.link, Link::Pooled(link) if link.lent.is_some() && link.pinned.is_none())
            && self.backend_idle()
    }

    /// Transaction mode: the session lets its connection go now (`close`:
    /// see [`super::LinkStep::Close`]). `None` in session mode.
    pub(super) fn part(&mut self, instance: &dyn Instance, close: bool) -> Option<Parting> {
        let Link::Pooled(link) = &mut self.link else {
            return None;
        };
        let lifetime = instance.pool_knobs(&mut link.knobs).lifetime;
        Some(match link.lent.take() {
            Some(lent) if !close => Parting::Back(lent, lifetime),
            lent => {
                // The connection the client logged in on, which is not the
                // pool's, or one that listens for another client.
                link.own_statements = None;
                Parting::Close {
                    listening: lent.is_some(),
                }
            }
        })
    }

    /// At the session's end (`unread`: the server sent bytes not read).
    /// In transaction mode an idle connection goes back to its pool (its
    /// settings unknown if they may have changed), any other is closed; in
    /// session mode, see [`Self::park_at_end`].
    pub fn part_at_end(&mut self, instance: &dyn Instance, unread: bool) -> Option<Parting> {
        let clean = self.may_give_back(unread);
        let Link::Pooled(link) = &mut self.link else {
            return self.park_at_end(instance, unread);
        };
        Some(match link.lent.take() {
            Some(mut lent) if clean && link.pinned.is_none() && !link.listens.carries_foreign() => {
                if link.state_dirty {
                    lent.state = UNKNOWN_STATE;
                }
                Parting::Back(lent, instance.pool_knobs(&mut link.knobs).lifetime)
            }
            _ => Parting::Close { listening: false },
        })
    }

    /// Session mode, at the session's end: the connection is parked for
    /// the next client if it may serve one: handed back clean, not ended
    /// by FATAL, nothing `unread` from it; and PostgreSQL asked no
    /// password on it, unless pgcache checks its clients itself.
    fn park_at_end(&mut self, instance: &dyn Instance, unread: bool) -> Option<Parting> {
        let Link::Session(link) = &mut self.link else {
            return None;
        };
        let key = link.parks_under.take()?;
        if self.server.fate == Fate::Tainted {
            instance.metrics().pool.closed_tainted.inc();
        }
        let trusted = self.server.trusted() || link.checked_by_pgcache;
        if unread || self.server.fate != Fate::HandedBack || self.backend_fatal() || !trusted {
            return None;
        }
        let book = std::mem::replace(&mut self.server, ServerBook::new(false));
        Some(Parting::Park(Box::new(Parked {
            key,
            target: Arc::clone(self.backend_key.as_ref()?),
            addr: self.backend_addr.clone(),
            book,
        })))
    }
}

/// Session mode: a connection parked at the session's end, under its
/// key, with its cancel key, its address and what the session noted of it.
pub(in crate::session) struct Parked {
    pub key: PoolKey,
    pub target: Arc<CancelTarget>,
    pub addr: UpstreamAddr,
    pub book: ServerBook,
}

/// What becomes of a server connection the session lets go of.
pub(in crate::session) enum Parting {
    /// Session mode: parked for the next client.
    Park(Box<Parked>),
    /// Back to its pool with the books it lent, to live at most so long.
    Back(Lent, std::time::Duration),
    /// Closed, with a Terminate so that PostgreSQL does not log a lost
    /// client: no pool's, or in a state no other client may see
    /// (`listening`: a pool's that listens for a client that let it go).
    Close { listening: bool },
}
