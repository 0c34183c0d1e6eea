//! Whether a session's backend connection can serve another client once
//! the session ends ([`crate::pool`]): what the session noted of it, and
//! the hand-back at the client's Terminate.

use std::time::Instant;

use crate::pool::{LoginSettings, Server, Statuses};

/// What the session knows of its backend connection beyond the relay.
pub(super) struct ServerBook {
    /// The parameters PostgreSQL reported, latest value each; kept in
    /// session mode only, for a connection handed back whole.
    pub statuses: Statuses,
    /// What PostgreSQL asked of the login on this connection.
    pub trust: Trust,
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

/// What PostgreSQL asked of the login on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Trust {
    /// Nothing known: the login is not over, or pgcache logged in itself.
    Unknown,
    /// PostgreSQL asked for something before AuthenticationOk: the
    /// connection is not one any client may have.
    Challenged,
    /// PostgreSQL let the login in without asking for anything.
    Trusted,
}

impl ServerBook {
    /// PostgreSQL let the login in without a password.
    pub fn trusted(&self) -> bool {
        self.trust == Trust::Trusted
    }

    pub fn new(pooling: bool) -> Self {
        Self {
            statuses: Statuses::default(),
            trust: Trust::Unknown,
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
            trust: match server.trusted {
                true => Trust::Trusted,
                false => Trust::Unknown,
            },
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
