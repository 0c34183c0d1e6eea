//! Whether a session's backend connection can serve another client once
//! the session ends ([`crate::pool`]): what the session noted of it, and
//! the hand-back at the client's Terminate.

use std::time::Instant;

use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::pool::{LoginSettings, Server, Statuses};
use crate::protocol::stream::FramedStream;
use crate::upstream::UpstreamAddr;

/// What the session knows of its backend connection beyond the relay.
pub(super) struct ServerBook {
    /// The parameters PostgreSQL reported, latest value each; kept in
    /// session mode only, for a connection handed back whole.
    pub statuses: Statuses,
    /// What PostgreSQL asked of the login on this connection.
    pub trust: Trust,
    /// When the connection logged in (earlier than the session if reused).
    pub born: Instant,
    /// Where the connection came from.
    pub source: Source,
    /// What becomes of it at the session's end.
    pub fate: Fate,
    /// Whether the session's settings are still its login's.
    pub settings: Settings,
    /// The settings query's answer in the login state, kept with the
    /// connection for the sessions that reuse it.
    pub login_settings: Option<LoginSettings>,
}

/// Whether a session's settings are still those of its login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settings {
    /// Nothing the session ran may have changed them (as far as the cache
    /// key can tell).
    AsLoggedIn,
    /// A statement may have changed them.
    Changed,
}

/// Where a session's connection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// Opened for the session (or, in transaction mode, none is its own).
    Fresh,
    /// Parked by an earlier session: its login frames wait in the
    /// backend's buffer, to be replayed.
    Parked,
}

/// What becomes of a session's connection at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fate {
    /// Closed: connections are not parked between sessions
    /// (`pool.max_idle_servers = 0`, or transaction mode, whose pool
    /// has its own books).
    Closed,
    /// Parked for the next client, if the session hands it back.
    Parkable,
    /// Closed: the session ran something `DISCARD ALL` does not undo.
    Tainted,
    /// The client sent Terminate while the backend was idle, and the
    /// backend was not told: parked, the pool's to reset.
    HandedBack,
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
    /// The connection parked for the next client: its `stream`, where it
    /// is (`addr`), its cancel key (`key`), and what the session noted of
    /// it.
    pub fn park(
        self,
        stream: FramedStream<BackendStream>,
        key: &CancelTarget,
        addr: UpstreamAddr,
    ) -> Server {
        let mut key_data = key.backend_pid.to_be_bytes().to_vec();
        key_data.extend_from_slice(&key.backend_secret);
        let trusted = self.trusted();
        Server {
            stream,
            addr,
            statuses: self.statuses,
            key_data,
            trusted,
            born: self.born,
            login_settings: self.login_settings,
        }
    }

    /// PostgreSQL let the login in without a password.
    pub fn trusted(&self) -> bool {
        self.trust == Trust::Trusted
    }

    /// Connections are parked between sessions: the session notes what
    /// decides whether its own may be.
    pub fn parks(&self) -> bool {
        self.fate != Fate::Closed
    }

    /// The session ran something `DISCARD ALL` does not undo.
    pub fn taint(&mut self) {
        if self.fate == Fate::Parkable {
            self.fate = Fate::Tainted;
        }
    }

    /// A fresh connection, parked at the end (`parks`) or closed.
    pub fn new(parks: bool) -> Self {
        Self {
            statuses: Statuses::default(),
            trust: Trust::Unknown,
            born: Instant::now(),
            source: Source::Fresh,
            fate: match parks {
                true => Fate::Parkable,
                false => Fate::Closed,
            },
            settings: Settings::AsLoggedIn,
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
            source: Source::Parked,
            fate: Fate::Parkable,
            settings: Settings::AsLoggedIn,
            login_settings: server.login_settings.clone(),
        }
    }
}
