//! Invalidation from PostgreSQL logical replication, so writes that never
//! pass through pgcache (other services, psql, cron jobs, other pgcache
//! instances) invalidate cached results too.
//!
//! One stream per database that clients use, started when the first session
//! to it logs in:
//!
//! ```text
//! control connection (tokio-postgres, upstream credentials)
//!   → keep the publication current: the tables with a replica identity
//!     that statements use, never one without (that would make its
//!     UPDATE/DELETE fail)
//!   → install the DDL event trigger (best effort, `trigger.rs`)
//! replication connection (pgwire-replication)
//!   → CREATE_REPLICATION_SLOT ... TEMPORARY LOGICAL pgoutput
//!   → START_REPLICATION; then bump the epoch (anything may have been
//!     missed) and only then mark the stream up
//!   → per transaction: collect the relations changed; at Commit bump their
//!     versions and acknowledge the LSN; a `pgcache_ddl` message forgets
//!     what the DDL changed; a `pgcache_heartbeat` of ours renews the
//!     staleness lease (see [`heartbeat`])
//! heartbeat task (on the control connection): a logical message every
//!   `replication.heartbeat_ms`; its failure restarts the stream
//! on error: mark the stream down (no cache for the database), back off,
//! reconnect
//! ```

#[macro_use]
pub mod control;
mod decoder;
pub mod heartbeat;
pub mod listen;
pub mod pgoutput;
mod publication;
pub mod replication;
pub mod slot;
mod trigger;

pub use control::{cluster_id, full_message, preflight, probe_origin, quote_ident, quote_literal};
pub use publication::{Alter, alter_tables, take_out_for_unlogged};
pub use replication::Streams;

#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("replication check failed: {0}")]
    Preflight(String),
    /// PostgreSQL refused pgcache's own login: no setting fixes that but
    /// the credentials, so pgcache never starts without them.
    #[error("{0}")]
    Login(String),
    #[error("control connection: {0}")]
    Control(#[from] tokio_postgres::Error),
    #[error("replication connection: {0}")]
    Stream(#[from] pgwire_replication::PgWireError),
    #[error("{0}")]
    Config(String),
}

/// Logical message prefix the DDL event trigger emits.
pub const DDL_MESSAGE_PREFIX: &str = "pgcache_ddl";
