//! One client session, from its StartupMessage to its last packet (what
//! comes before, TLS and cancel requests, is the server's:
//! [`crate::server`]).
//!
//! ```text
//! StartupMessage ──▶ the door (TLS, limits), admin console,   admission.rs
//!                    terminate-mode auth, the session's mode  (I/O: relay.rs)
//!                ──▶ connect backend, log in                  engine/auth.rs
//! loop select!:                                               relay.rs
//!   backend frames → note Z/K/E/G, tee captures → client      engine/answers.rs
//!   client frames  → Query, function call                    engine/requests.rs
//!                    Parse/Bind/Describe/Execute/Sync         engine/batches.rs
//!                    (caching off: forwarded)                 engine/requests.rs
//!   what the engine asks next, polled in its order            engine/output.rs
//!                    carried out                              traffic.rs
//!   drain          → close once idle (57P01)
//! ```
//!
//! Decisions are made in synchronous code: admission (`admission.rs`) and
//! the session itself, the [`engine::Engine`], split by concern: the
//! requests in flight (`pipeline.rs`), the extended batch held until Sync
//! (`batch.rs`), the transaction's books (`transaction.rs`), what a
//! statement means for the cache (`plan.rs`), and what the session knows of
//! itself (`known.rs`, read by pgcache's own queries, `engine/hidden.rs`).
//! The driver (`relay.rs`, `traffic.rs`) does the I/O: it
//! feeds the engine what arrived and carries out what
//! `Engine::poll_io` asks, until it asks nothing. The cache itself is
//! behind [`crate::cache::Cache`].

mod admission;
mod batch;
mod capture;
mod engine;
mod error;
mod explain;
#[doc(hidden)]
pub mod fuzz;
mod instance;
mod keyed;
mod known;
mod link;
mod logins;
mod offload;
mod pipeline;
mod plan;
mod relay;
mod replica;
mod reuse;
mod row_limit;
mod traffic;
mod transaction;

pub use admission::Negotiated;
pub use error::SessionError;
pub use logins::SharedLogins;
pub use plan::SharedPlans;
pub(crate) use relay::{refused, serve};

/// How long a closing session waits for the client to hang up.
pub(crate) const LINGER: std::time::Duration = std::time::Duration::from_millis(500);
