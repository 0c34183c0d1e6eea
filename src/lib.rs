//! pgcache: a read-through query-result caching proxy for PostgreSQL.
//!
//! Applications connect to pgcache instead of PostgreSQL. Each client gets
//! its own backend connection (session mode) and every message is relayed as
//! raw bytes; see the README's "How it works" for the full picture.
//!
//! Module map:
//! - [`config`]: defaults < TOML file < environment < flags, validated.
//! - [`server`]: accept loop, connection limit, graceful shutdown.
//! - [`session`]: one client: startup negotiation and the relay loop.
//! - [`backend`]: connections to PostgreSQL, cancel forwarding.
//! - [`cancel`]: pgcache's own BackendKeyData and CancelRequest routing.
//! - [`protocol`]: framing, startup packets, messages pgcache writes itself.

pub mod backend;
pub mod cache;
pub mod cancel;
pub mod classify;
pub mod config;
pub mod protocol;
pub mod server;
pub mod session;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use server::{run, serve};

/// State shared by every session of one pgcache instance. Nothing in pgcache
/// is process-global, so several instances can run in one test binary.
pub struct App {
    pub config: Config,
    /// Backend addresses resolved from `upstream.url`.
    pub upstream: Vec<config::UpstreamAddr>,
    pub cancel: Arc<cancel::CancelRegistry>,
    /// Shutdown requested: sessions close once idle.
    pub drain: CancellationToken,
    /// Shutdown timeout expired: sessions close now.
    pub force: CancellationToken,
    pub cache: cache::CacheState,
}

impl App {
    pub fn new(config: Config) -> Result<Self, config::ConfigError> {
        config.validate()?;
        let upstream = config
            .upstream_addrs()
            .map_err(|e| config::ConfigError::Invalid(vec![format!("upstream.url: {e}")]))?;
        let local = cache::LocalCache::new(
            config.cache.local.max_bytes,
            config.cache.max_entry_bytes,
            config.default_ttl(),
        );
        Ok(Self {
            cache: cache::CacheState::new(local),
            config,
            upstream,
            cancel: Arc::default(),
            drain: CancellationToken::new(),
            force: CancellationToken::new(),
        })
    }
}
