//! Every SQLSTATE pgcache reports itself, in one place. PostgreSQL's own
//! errors are relayed verbatim and never pass through here.

/// The backend could not be reached or went away.
pub const CONNECTION_FAILURE: &str = "08006";
/// A client took too long to start up or to authenticate.
pub const CONNECTION_EXCEPTION: &str = "08000";
/// The client broke the protocol.
pub const PROTOCOL_VIOLATION: &str = "08P01";
/// Too many client connections, or too many starting from one address.
pub const TOO_MANY_CONNECTIONS: &str = "53300";
/// pgcache is shutting down.
pub const ADMIN_SHUTDOWN: &str = "57P01";
/// `server.client_idle_timeout_secs`, as PostgreSQL's idle_session_timeout.
pub const IDLE_SESSION_TIMEOUT: &str = "57P05";
/// No pooled server connection became free within
/// `pool.query_wait_timeout_secs`.
pub const QUERY_CANCELED: &str = "57014";
/// `server.idle_in_transaction_timeout_secs`, as PostgreSQL's own.
pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";
/// A login pgcache refuses (TLS required, a refused SCRAM relay, a user
/// whose password it cannot check).
pub const INVALID_AUTHORIZATION: &str = "28000";
/// A wrong password (or an unknown user).
pub const INVALID_PASSWORD: &str = "28P01";
/// An admin command pgcache does not know.
pub const SYNTAX_ERROR: &str = "42601";
/// The admin console's answer to the extended protocol; PostgreSQL's
/// refusal of a Bind whose statement's result type changed.
pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
/// PostgreSQL's refusal of a Bind whose statement names a type dropped
/// since (`cache lookup failed for type`).
pub const INTERNAL_ERROR: &str = "XX000";
/// Transaction mode: a client's statement name is taken, by a Parse or a
/// SQL `PREPARE` (pgcache answers in the server's place).
pub const DUPLICATE_PSTATEMENT: &str = "42P05";
/// A statement pgcache answers itself, in a failed transaction block.
pub const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
/// RELOAD found a broken configuration.
pub const CONFIG_FILE_ERROR: &str = "F0000";
/// A warning notice (a hint pgcache ignored, a change that needs a restart).
pub const WARNING: &str = "01000";
/// A NOTICE that reports, not warns (`/*+ explain */`).
pub const SUCCESSFUL_COMPLETION: &str = "00000";
