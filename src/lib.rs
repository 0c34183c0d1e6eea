//! pgcache: a read-through query-result caching proxy for PostgreSQL.
//!
//! Applications connect to pgcache instead of PostgreSQL. Each client gets
//! its own backend connection (session mode) and every message is relayed as
//! raw bytes; see docs/architecture.md for the full picture.
//!
//! Module map, from the bottom up (a module uses only those above it):
//! - [`protocol`]: frames, the framed stream, startup packets, messages
//!   pgcache writes itself, every SQLSTATE it reports.
//! - [`config`]: defaults < TOML file < environment < flags, validated.
//! - [`upstream`]: `upstream.url` parsed once, TLS towards PostgreSQL.
//! - [`scram`], [`classify`], [`hints`], [`policy`]: pure logic.
//! - [`metrics`]: the Prometheus registry.
//! - [`cache`]: the facade over both tiers, keys, versions, the catalog.
//! - [`invalidation`]: logical replication streams that bump versions.
//! - [`backend`], [`cancel`], [`tls`], [`auth`]: connections and logins.
//! - [`pool`]: server connections parked between sessions.
//! - [`replica`]: read replicas, their health and lag, the choice of one.
//! - [`app`]: the state one instance shares between its sessions.
//! - [`session`]: one client, from startup to the relay loop.
//! - [`admin`], [`http`], [`server`]: the console, the HTTP endpoint,
//!   the accept loop.

pub mod admin;
pub mod app;
pub mod auth;
pub mod backend;
pub mod cache;
pub mod cancel;
pub mod classify;
pub mod config;
pub mod handover;
pub mod hints;
pub mod http;
pub mod invalidation;
pub mod metrics;
pub mod origin;
pub mod policy;
pub mod pool;
pub mod protocol;
pub mod replica;
pub mod scram;
pub mod server;
pub mod session;
pub mod shutdown;
pub mod tls;
pub mod uninstall;
pub mod upstream;

pub use app::{App, StartError};
pub use config::Config;
pub use server::{run, serve};
