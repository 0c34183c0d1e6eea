//! Where a session stands in its life: logging in (a relayed login's
//! exchange, if any), then serving; and, once known, why its backend's
//! close is expected.

use std::time::Instant;

use super::Engine;
use crate::auth::BackendLogin;

/// Logging in, or logged in.
pub(super) enum Phase {
    /// PostgreSQL's first ReadyForQuery (or pgcache's greeting) is still
    /// to come; a relayed login's exchange stands as `Relay` says.
    LoggingIn(Relay),
    /// Logged in: the session's requests are served.
    Serving,
}

/// Where the exchange of a login stands.
pub(super) enum Relay {
    /// No exchange is going on: the connection replays an earlier login,
    /// pgcache greets the client, or the exchange is over.
    Off,
    /// PostgreSQL's exchange is relayed, up to AuthenticationOk.
    On,
    /// Relayed, and SCRAM-SHA-256-PLUS was taken out of PostgreSQL's
    /// offer (pgcache ends both TLS legs, so no binding can match): the
    /// client's first SASL message is still to come.
    PlusHidden,
    /// Terminate mode: pgcache answers PostgreSQL's exchange for the
    /// client it authenticated, by `deadline`; the client waits.
    ForClient {
        login: Box<BackendLogin>,
        deadline: Instant,
    },
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

    /// Where a login's exchange stands (off once logged in).
    pub(super) fn relay(&self) -> &Relay {
        match &self.phase {
            Phase::LoggingIn(relay) => relay,
            Phase::Serving => &Relay::Off,
        }
    }

    pub(super) fn relay_mut(&mut self) -> Option<&mut Relay> {
        match &mut self.phase {
            Phase::LoggingIn(relay) => Some(relay),
            Phase::Serving => None,
        }
    }

    /// A relayed login moves on; nothing changes once logged in.
    pub(super) fn set_relay(&mut self, relay: Relay) {
        if let Phase::LoggingIn(now) = &mut self.phase {
            *now = relay;
        }
    }
}
