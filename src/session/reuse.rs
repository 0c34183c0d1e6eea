//! Whether a session's backend connection can serve another client once
//! the session ends ([`crate::pool`]): what the session noted of it, and
//! the hand-back at the client's Terminate.

use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};

use super::relay::Session;
use crate::pool::marks::Marks;
use crate::pool::{LoginSettings, Server, Statuses};

/// What the session knows of its backend connection beyond the relay.
pub(super) struct ServerBook {
    /// The parameters PostgreSQL reported, latest value each.
    pub statuses: Statuses,
    /// PostgreSQL let the login in without a password.
    pub trusted: bool,
    /// PostgreSQL asked for something before AuthenticationOk.
    pub challenged: bool,
    /// When the connection logged in (earlier than the session if reused).
    pub born: Instant,
    /// A parked connection: its login frames wait in the backend's buffer.
    pub reused: bool,
    /// Connections are parked between sessions (`pool.max_idle_servers`).
    pub pooling: bool,
    /// The session ran something `DISCARD ALL` does not undo.
    pub tainted: bool,
    /// The client sent Terminate while the backend was idle, and the
    /// backend was not told: the connection is the pool's to reset.
    pub handed_back: bool,
    /// The session's settings are still those of its login: nothing it
    /// ran may have changed them (as far as the cache key can tell).
    pub login_state: bool,
    /// The settings query's answer in the login state, kept with the
    /// connection for the sessions that reuse it.
    pub login_settings: Option<LoginSettings>,
}

impl ServerBook {
    pub fn new(pooling: bool) -> Self {
        Self {
            statuses: Statuses::default(),
            trusted: false,
            challenged: false,
            born: Instant::now(),
            reused: false,
            pooling,
            tainted: false,
            handed_back: false,
            login_state: true,
            login_settings: None,
        }
    }

    /// For a parked connection this session took over.
    pub fn reused(server: &Server) -> Self {
        Self {
            statuses: server.statuses.clone(),
            trusted: server.trusted,
            challenged: false,
            born: server.born,
            reused: true,
            pooling: true,
            tainted: false,
            handed_back: false,
            login_state: true,
            login_settings: server.login_settings.clone(),
        }
    }
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// Notes what a Query's or Parse's text means for reuse ([`marks`]);
    /// parked connections are closed before a database-level statement
    /// goes out.
    pub(super) fn note_marks(&mut self, marks: Marks) {
        self.engine.server.tainted |= marks.taints;
        if marks.evicts {
            self.app.pool.evict_all();
        }
        if self.engine.link.is_pooled() {
            self.engine.link.state_dirty |= marks.settings;
            self.engine.link.schema_changes |= marks.schema;
            if let Some(why) = marks.pin {
                self.pin(why);
            }
        }
    }

    /// At the client's Terminate: true if the connection is kept for the
    /// pool, in which case the Terminate is not forwarded.
    pub(super) fn hand_back(&mut self) -> bool {
        self.engine.server.handed_back = self.engine.server.pooling
            && !self.engine.server.tainted
            && self.backend_idle()
            && !self.engine.batch.holds()
            && !self.app.drain.is_cancelled();
        self.engine.server.handed_back
    }

    /// A statement may have changed the session's settings: they are read
    /// again before the next cacheable read.
    pub(super) fn settings_may_have_changed(&mut self) {
        self.engine.known.prefix = None;
        self.engine.server.login_state = false;
        self.engine.link.state_dirty = true;
    }

    /// The backend connection, if this session handed it back clean.
    pub fn into_server(self) -> Option<Server> {
        if self.engine.server.pooling && self.engine.server.tainted {
            self.app.metrics.pool.closed_tainted.inc();
        }
        if !self.engine.server.handed_back
            || self.engine.backend_fatal
            || !self.backend.buffered().is_empty()
        {
            return None;
        }
        let key = self.engine.backend_key?;
        let mut key_data = key.backend_pid.to_be_bytes().to_vec();
        key_data.extend_from_slice(&key.backend_secret);
        Some(Server {
            stream: self.backend,
            addr: self.engine.backend_addr,
            statuses: self.engine.server.statuses,
            key_data,
            trusted: self.engine.server.trusted,
            born: self.engine.server.born,
            login_settings: self.engine.server.login_settings,
        })
    }
}
