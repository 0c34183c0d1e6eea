//! The idle timeouts of a session waiting on its client, as PostgreSQL's
//! own: `idle_session_timeout` and `idle_in_transaction_session_timeout`.

use super::SessionError;
use crate::protocol::{TxStatus, sqlstate};

/// `server.client_idle_timeout_secs` and
/// `server.idle_in_transaction_timeout_secs`, as PostgreSQL's own.
pub(super) struct IdleTimeouts {
    idle: Option<std::time::Duration>,
    in_transaction: Option<std::time::Duration>,
    /// Either is set: the loop keeps the time of the last activity.
    pub any: bool,
}

impl IdleTimeouts {
    pub fn new(server: &crate::config::ServerConfig) -> Self {
        let secs = |s: u64| (s > 0).then(|| std::time::Duration::from_secs(s));
        let idle = secs(server.client_idle_timeout_secs);
        let in_transaction = secs(server.idle_in_transaction_timeout_secs);
        Self {
            idle,
            in_transaction,
            any: idle.is_some() || in_transaction.is_some(),
        }
    }

    pub fn deadline(
        &self,
        waiting: bool,
        status: TxStatus,
        since: tokio::time::Instant,
    ) -> Option<tokio::time::Instant> {
        let limit = if status == TxStatus::Idle {
            self.idle
        } else {
            self.in_transaction
        };
        limit.filter(|_| waiting).map(|l| since + l)
    }

    pub fn error(&self, status: TxStatus) -> SessionError {
        if status == TxStatus::Idle {
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
}

/// Ready at `deadline`, never without one. The timer is boxed: the relay
/// loop's waits keep its room, and most sessions have no deadline.
pub(super) async fn sleep_until_or_never(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => Box::pin(tokio::time::sleep_until(d)).await,
        None => std::future::pending().await,
    }
}
