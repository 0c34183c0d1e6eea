//! Why a session got no server connection, with the SQLSTATE its client
//! is told.

use crate::backend::BackendError;
use crate::protocol::sqlstate;

/// Why no server connection could be had.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "canceling statement: no server connection became free within pool.query_wait_timeout_secs ({0}s)"
    )]
    WaitTimeout(u64),
    /// Every slot is taken, and the caller would rather not wait (a read
    /// for a replica goes to the primary instead).
    #[error("every connection of the pool is in use")]
    Full,
    #[error(transparent)]
    Connect(#[from] BackendError),
    /// PostgreSQL refused the login (its own message).
    #[error("{message}")]
    Server { code: String, message: String },
    #[error("pgcache could not log in to PostgreSQL for the pool: {0}")]
    Login(String),
}

impl PoolError {
    pub fn sqlstate(&self) -> &str {
        match self {
            PoolError::WaitTimeout(_) => sqlstate::QUERY_CANCELED,
            PoolError::Full => sqlstate::TOO_MANY_CONNECTIONS,
            PoolError::Connect(_) => sqlstate::CONNECTION_FAILURE,
            PoolError::Server { code, .. } => code,
            PoolError::Login(_) => sqlstate::INVALID_AUTHORIZATION,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_errors_know_their_sqlstate() {
        assert_eq!(PoolError::WaitTimeout(5).sqlstate(), "57014");
        assert!(PoolError::WaitTimeout(5).to_string().contains("(5s)"));
    }
}
