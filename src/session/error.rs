//! Why a session ended, and what its client is told: every error knows its
//! SQLSTATE, and [`SessionError::to_fatal`] is the one place that turns an
//! error into the FATAL ErrorResponse the client reads.

use bytes::BytesMut;

use crate::backend::BackendError;
use crate::protocol::codec::FrameError;
use crate::protocol::messages;
use crate::protocol::sqlstate;
use crate::protocol::startup::StartupError;
use crate::protocol::stream::ReadError;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("client i/o: {0}")]
    ClientIo(std::io::Error),
    #[error("backend i/o: {0}")]
    BackendIo(std::io::Error),
    /// The client broke the framing (a bad or oversized length).
    #[error(transparent)]
    ClientFrame(#[from] FrameError),
    /// The client's first packets were malformed.
    #[error(transparent)]
    Startup(#[from] StartupError),
    /// The connection is dropped without a word, as PostgreSQL drops it
    /// (a TLS negotiation gone wrong).
    #[error("connection dropped: {0}")]
    Dropped(&'static str),
    /// PostgreSQL sent what pgcache cannot read.
    #[error("from backend: {0}")]
    BackendFrame(ReadError),
    #[error(transparent)]
    Connect(#[from] BackendError),
    /// pgcache refuses the session (limits, TLS, authentication, timeouts).
    #[error("{message}")]
    Refused { code: &'static str, message: String },
    /// Transaction mode: no server connection could be had.
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    /// PostgreSQL refused what pgcache did for the client (applying its
    /// startup parameters): PostgreSQL's own code and message.
    #[error("{message}")]
    Server { code: String, message: String },
}

impl SessionError {
    pub fn refused(code: &'static str, message: impl Into<String>) -> Self {
        Self::Refused {
            code,
            message: message.into(),
        }
    }

    /// Client hang-ups are routine, not worth a warning.
    /// Logs why a client at `peer` was turned away before its session
    /// began: a refusal is news, an unreachable backend a warning, the
    /// rest (a client that went away, a bad packet) detail.
    pub fn log_refusal(&self, peer: std::net::SocketAddr) {
        match self {
            SessionError::Refused { message, .. } => tracing::info!(%peer, "{message}"),
            SessionError::Connect(e) => tracing::warn!(%peer, error = %e, "backend unreachable"),
            e => tracing::debug!(%peer, error = %e, "startup failed"),
        }
    }

    pub fn is_disconnect(&self) -> bool {
        matches!(self, SessionError::ClientIo(e) if matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        ))
    }

    pub fn sqlstate(&self) -> &str {
        match self {
            Self::ClientIo(_) | Self::BackendIo(_) | Self::BackendFrame(_) | Self::Connect(_) => {
                sqlstate::CONNECTION_FAILURE
            }
            Self::ClientFrame(_) | Self::Startup(_) | Self::Dropped(_) => {
                sqlstate::PROTOCOL_VIOLATION
            }
            Self::Refused { code, .. } => code,
            Self::Pool(e) => e.sqlstate(),
            Self::Server { code, .. } => code,
        }
    }

    /// PostgreSQL's ErrorResponse frame as a [`SessionError::Server`].
    pub fn from_server_error(frame: &[u8]) -> Self {
        let fallback = (
            sqlstate::CONNECTION_FAILURE,
            "PostgreSQL refused the session's settings",
        );
        let (code, message) = messages::error_parts(frame, fallback);
        Self::Server { code, message }
    }

    /// The FATAL ErrorResponse for the client, or `None` when it cannot or
    /// need not be told (its own connection failed).
    pub fn to_fatal(&self) -> Option<BytesMut> {
        let message = match self {
            // PostgreSQL answers a startup packet of impossible length with
            // nothing (COMMERROR): it may not be a PostgreSQL client at all,
            // or one that hung up first (node-postgres sends Terminate
            // before its startup packet when ended while connecting).
            Self::ClientIo(_) | Self::Dropped(_) | Self::Startup(StartupError::BadLength(_)) => {
                return None;
            }
            Self::BackendIo(e) => format!("connection to upstream server lost: {e}"),
            Self::BackendFrame(e) => format!("connection to upstream server lost: {e}"),
            other => other.to_string(),
        };
        Some(messages::fatal(self.sqlstate(), &message))
    }
}

impl From<ReadError> for SessionError {
    /// A read error on the client's leg.
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => Self::ClientIo(e),
            ReadError::Frame(e) => Self::ClientFrame(e),
            ReadError::Truncated => Self::ClientIo(std::io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::codec::HEADER_LEN;
    use crate::protocol::messages::error_code;

    fn code_of(e: &SessionError) -> Option<String> {
        e.to_fatal()
            .map(|f| error_code(&f[HEADER_LEN..]).unwrap().to_owned())
    }

    #[test]
    fn each_error_reports_its_sqlstate() {
        let oversized = SessionError::from(FrameError::TooLarge {
            tag: b'Q',
            len: 10,
            max: 5,
        });
        assert_eq!(code_of(&oversized).as_deref(), Some("08P01"));
        let lost = SessionError::BackendIo(std::io::ErrorKind::ConnectionReset.into());
        assert_eq!(code_of(&lost).as_deref(), Some("08006"));
        let full = SessionError::refused(sqlstate::TOO_MANY_CONNECTIONS, "sorry");
        assert_eq!(code_of(&full).as_deref(), Some("53300"));
        assert_eq!(full.to_string(), "sorry");
        let startup = SessionError::from(StartupError::BadLength(3));
        assert_eq!(startup.sqlstate(), "08P01");
        assert!(startup.to_fatal().is_none(), "as PostgreSQL: not a word");
        let layout = SessionError::from(StartupError::BadLayout("no terminator"));
        assert_eq!(code_of(&layout).as_deref(), Some("08P01"));
    }

    #[test]
    fn a_client_that_hung_up_is_told_nothing() {
        let gone = SessionError::ClientIo(std::io::ErrorKind::BrokenPipe.into());
        assert!(gone.is_disconnect());
        assert!(gone.to_fatal().is_none());
        let truncated = SessionError::from(ReadError::Truncated);
        assert!(truncated.is_disconnect());
    }
}
