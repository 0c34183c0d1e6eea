//! Where a session stands in its life: logging in (how far the login's
//! exchange with PostgreSQL is, relayed or answered by pgcache), then
//! serving; and, once known, why its backend's close is expected.

use std::time::Instant;

use super::Engine;
use crate::auth::BackendLogin;

/// Logging in, or logged in.
pub(super) enum Phase {
    /// PostgreSQL's first ReadyForQuery (or pgcache's greeting) is still
    /// to come; the login's exchange stands as `Exchange` says.
    LoggingIn(Exchange),
    /// Logged in: the session's requests are served.
    Serving,
}

/// Where the exchange of a login stands.
pub(super) enum Exchange {
    /// No exchange is going on: the connection replays an earlier login,
    /// pgcache greets the client, or the exchange is over.
    Over,
    /// PostgreSQL's exchange is relayed, up to AuthenticationOk.
    Relayed,
    /// Relayed, and SCRAM-SHA-256-PLUS was taken out of PostgreSQL's
    /// offer (pgcache ends both TLS legs, so no binding can match): the
    /// client's first SASL message is still to come.
    PlusHidden,
    /// Terminate mode: pgcache answers PostgreSQL's exchange for the
    /// client it authenticated, by `deadline`; the client waits.
    Answered {
        login: Box<BackendLogin>,
        deadline: Instant,
    },
}

/// Whether pgcache is shutting down, as far as the session is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shutdown {
    Running,
    /// Draining: the session ends once idle ([`Engine::drained`]).
    Draining,
}

/// Why the backend's close that follows is expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The client sent Terminate.
    ClientEnded,
    /// The backend reported a FATAL error: its connection is no other
    /// client's to have.
    BackendFatal,
}

impl Engine {
    /// The first ReadyForQuery has been seen (the login is over).
    pub(super) fn logged_in(&self) -> bool {
        matches!(self.phase, Phase::Serving)
    }

    /// Notes why the session ends; a backend's FATAL error is never
    /// forgotten for a later reason.
    pub(super) fn end_with(&mut self, ending: Ending) {
        if self.ending != Some(Ending::BackendFatal) {
            self.ending = Some(ending);
        }
    }

    /// The backend reported a FATAL error.
    pub(super) fn backend_fatal(&self) -> bool {
        self.ending == Some(Ending::BackendFatal)
    }

    /// Where a login's exchange stands (over once logged in).
    pub(super) fn exchange(&self) -> &Exchange {
        match &self.phase {
            Phase::LoggingIn(exchange) => exchange,
            Phase::Serving => &Exchange::Over,
        }
    }

    /// The exchange under way, to move on; `None` once logged in.
    pub(super) fn exchange_mut(&mut self) -> Option<&mut Exchange> {
        match &mut self.phase {
            Phase::LoggingIn(exchange) => Some(exchange),
            Phase::Serving => None,
        }
    }

    /// The login's exchange moves on; nothing changes once logged in.
    pub(super) fn set_exchange(&mut self, exchange: Exchange) {
        if let Phase::LoggingIn(now) = &mut self.phase {
            *now = exchange;
        }
    }
}
