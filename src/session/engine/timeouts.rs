//! When a session ends of itself. The idle timeouts of a session waiting
//! on its client, as PostgreSQL's own: `idle_session_timeout` and
//! `idle_in_transaction_session_timeout`. The engine keeps them and the
//! time of the client's last activity, and gives the driver its next
//! deadline ([`Engine::poll_timeout`]); the clock is the driver's, passed
//! in. And pgcache's shutdown: a draining session ends once idle, and
//! every session at the drain's deadline.

use std::time::{Duration, Instant};

use super::life::Shutdown;
use super::{Ctx, Engine};
use crate::protocol::{TxStatus, sqlstate};
use crate::session::SessionError;

/// `server.client_idle_timeout_secs` and
/// `server.idle_in_transaction_timeout_secs`, as PostgreSQL's own.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdleTimeouts {
    idle: Option<Duration>,
    in_transaction: Option<Duration>,
}

impl IdleTimeouts {
    pub fn new(server: &crate::config::ServerConfig) -> Self {
        let secs = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        Self {
            idle: secs(server.client_idle_timeout_secs),
            in_transaction: secs(server.idle_in_transaction_timeout_secs),
        }
    }

    /// Either is set: the time of the client's last activity matters.
    fn any(&self) -> bool {
        self.idle.is_some() || self.in_transaction.is_some()
    }

    fn limit(&self, status: TxStatus) -> Option<Duration> {
        if status == TxStatus::Idle {
            self.idle
        } else {
            self.in_transaction
        }
    }
}

impl Engine {
    /// The session's idle timeouts, counted from `now`.
    pub fn set_idle_timeouts(&mut self, timeouts: IdleTimeouts, now: Instant) {
        self.timeouts = timeouts;
        self.last_activity = Some(now);
    }

    /// Whether the driver is to tell the engine of each activity
    /// ([`Self::note_activity`]): only when a timeout is set.
    pub fn tracks_activity(&self) -> bool {
        self.timeouts.any()
    }

    /// Bytes came from the client or the backend, or something woke the
    /// session, at `now`.
    pub fn note_activity(&mut self, now: Instant) {
        self.last_activity = Some(now);
    }

    /// When the session is to end: pgcache's login for the client is
    /// overdue, or it idles waiting on its client (logged in, nothing
    /// asked of the backend) and a timeout applies to its transaction
    /// state.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if let Some(deadline) = self.login_deadline() {
            return Some(deadline);
        }
        let waiting = self.waits_on_client();
        let limit = self.timeouts.limit(self.tx.status)?;
        let since = self.last_activity?;
        waiting.then(|| since + limit)
    }

    /// The deadline of [`Self::poll_timeout`] passed: the error the
    /// client is told, as PostgreSQL words it.
    pub fn on_timeout(&self, ctx: &Ctx) -> SessionError {
        if self.login_deadline().is_some() {
            return self.login_failed(ctx, "PostgreSQL did not finish authentication in time");
        }
        if self.tx.status == TxStatus::Idle {
            SessionError::refused(
                sqlstate::IDLE_SESSION_TIMEOUT,
                "terminating connection due to idle-session timeout",
            )
        } else {
            SessionError::refused(
                sqlstate::IDLE_IN_TRANSACTION_TIMEOUT,
                "terminating connection due to idle-in-transaction timeout",
            )
        }
    }

    /// Draining, the session may end now (idle, holding no batch): the
    /// error the client is told.
    pub fn drained(&self) -> Option<SessionError> {
        let idle = self.backend_idle() && !self.batch.holds();
        (self.shutdown == Shutdown::Draining && idle).then(|| {
            SessionError::refused(
                sqlstate::ADMIN_SHUTDOWN,
                "terminating connection due to pgcache shutdown",
            )
        })
    }

    /// The drain's deadline passed: every session ends, with this error.
    pub fn forced() -> SessionError {
        SessionError::refused(
            sqlstate::ADMIN_SHUTDOWN,
            "terminating connection: pgcache shutdown timeout reached",
        )
    }

    /// The backend's connection ended (cleanly, or with `error`): what the
    /// client is told, unless the close was expected (the client's
    /// Terminate, or the backend's own FATAL error, already told).
    pub fn on_backend_lost(&self, error: Option<std::io::Error>) -> Option<SessionError> {
        if self.close_expected() {
            return None;
        }
        let error = error.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "server closed the connection unexpectedly",
            )
        });
        Some(SessionError::BackendIo(error))
    }
}
