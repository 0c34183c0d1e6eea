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
//! - [`classify`]: what a statement reads, writes and calls (sqlparser).
//! - [`cache`]: keys, the local tier, catalog snapshot, table versions.
//! - [`invalidation`]: logical replication streams that bump versions.
//! - [`shared`]: the Redis tier and the versions kept coherent through it.
//! - [`protocol`]: framing, startup packets, messages pgcache writes itself.

pub mod admin;
pub mod auth;
pub mod backend;
pub mod cache;
pub mod cancel;
pub mod classify;
pub mod config;
pub mod hints;
pub mod invalidation;
pub mod metrics;
pub mod policy;
pub mod protocol;
pub mod server;
pub mod session;
pub mod shared;
pub mod stats;
pub mod tls;
pub mod upstream;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;
use tracing::warn;

pub use config::Config;
pub use server::{run, serve};

/// State shared by every session of one pgcache instance. Nothing in pgcache
/// is process-global, so several instances can run in one test binary.
pub struct App {
    pub config: Config,
    /// Backend addresses resolved from `upstream.url`.
    pub upstream: Vec<config::UpstreamAddr>,
    /// TLS towards PostgreSQL (`sslmode`, `sslrootcert` in `upstream.url`).
    pub upstream_tls: upstream::UpstreamTls,
    pub cancel: Arc<cancel::CancelRegistry>,
    /// Shutdown requested: sessions close once idle.
    pub drain: CancellationToken,
    /// Shutdown timeout expired: sessions close now.
    pub force: CancellationToken,
    pub cache: cache::CacheState,
    /// The shared tier, when `redis.url` is set and caching is on.
    pub shared: Option<Arc<shared::SharedTier>>,
    /// Replication streams invalidate (checked at start-up).
    replication: AtomicBool,
    pub metrics: metrics::Metrics,
    /// Bound by [`App::start`], served by [`serve`].
    metrics_listener: std::sync::Mutex<Option<tokio::net::TcpListener>>,
    /// Where `/metrics` is served (known after [`App::start`]).
    pub metrics_addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// The caching policy, replaced by RELOAD.
    policy: std::sync::RwLock<Arc<policy::Policy>>,
    policy_generation: std::sync::atomic::AtomicU64,
    /// The configuration now in force (RELOAD replaces the live parts).
    live_config: std::sync::RwLock<Arc<Config>>,
    /// TLS towards clients.
    pub tls: tls::ClientTls,
    /// Terminate-mode authentication: users, auth_query.
    pub auth: auth::Authenticator,
    /// Where RELOAD reads the configuration from.
    config_source: std::sync::OnceLock<(Option<std::path::PathBuf>, config::Overrides)>,
}

/// Why pgcache cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Replication(#[from] invalidation::replication::ReplicationError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot listen on {addr} (metrics.listen): {source}")]
    MetricsListen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl App {
    pub fn new(config: Config) -> Result<Self, StartError> {
        config.validate()?;
        // rustls in redis-rs (rediss://) takes the process's provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = tls::ClientTls::new(&config.tls).map_err(StartError::Tls)?;
        let upstream = config.upstream_addrs().map_err(|e| {
            StartError::Config(config::ConfigError::Invalid(vec![format!(
                "upstream.url: {e}"
            )]))
        })?;
        let upstream_tls = upstream::UpstreamUrl::parse(&config.upstream.url)
            .and_then(|url| upstream::UpstreamTls::new(&url))
            .map_err(|e| StartError::Tls(format!("upstream.url: {e}")))?;
        let metrics = metrics::Metrics::new();
        let local = cache::LocalCache::with_evictions(
            config.cache.local.max_bytes,
            config.cache.max_entry_bytes,
            Some(metrics.evictions.clone()),
        );
        let shared = match config.redis.nodes() {
            Some(nodes) if config.cache.enabled => Some(Arc::new(shared::SharedTier::new(
                &config,
                nodes,
                &upstream_namespace(&upstream),
                metrics.shared.clone(),
            ))),
            _ => None,
        };
        Ok(Self {
            cache: cache::CacheState::new(local),
            shared,
            upstream,
            upstream_tls,
            auth: auth::Authenticator::new(&config.auth),
            cancel: Arc::default(),
            drain: CancellationToken::new(),
            force: CancellationToken::new(),
            replication: AtomicBool::new(false),
            metrics,
            metrics_listener: std::sync::Mutex::new(None),
            metrics_addr: std::sync::OnceLock::new(),
            policy: std::sync::RwLock::new(Arc::new(policy::Policy::new(&config.cache, 1))),
            policy_generation: std::sync::atomic::AtomicU64::new(1),
            live_config: std::sync::RwLock::new(Arc::new(config.clone())),
            config_source: std::sync::OnceLock::new(),
            tls,
            config,
        })
    }

    /// The metrics listener bound at start-up, taken once by [`serve`].
    pub(crate) fn take_metrics_listener(&self) -> Option<tokio::net::TcpListener> {
        self.metrics_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Builds the shared state and runs the start-up checks: with caching
    /// and `replication.enabled`, PostgreSQL must be able to stream changes,
    /// or pgcache refuses to start (`replication.required`) or runs with
    /// TTL-only invalidation and says so.
    pub async fn start(config: Config) -> Result<Arc<Self>, StartError> {
        let mut app = Self::new(config)?;
        let addr = app.config.metrics.listen;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::MetricsListen { addr, source })?;
        if let Ok(bound) = listener.local_addr() {
            let _ = app.metrics_addr.set(bound);
        }
        *app.metrics_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(listener);
        if app.config.cache.enabled && app.config.replication.enabled {
            match invalidation::preflight(&app.config, &app.upstream_tls).await {
                Ok(()) => app.replication.store(true, Ordering::Release),
                Err(e) if app.config.replication.required => return Err(e.into()),
                Err(e) => warn!(
                    "REPLICATION IS OFF ({e}). Writes made outside pgcache are NOT seen: cached results expire only \
                     after cache.default_ttl_secs ({}s)",
                    app.config.cache.default_ttl_secs
                ),
            }
        }
        if let (Some(nodes), Some(_)) = (app.config.redis.nodes(), &app.shared) {
            // Entries of different PostgreSQL clusters must never meet in one
            // Redis: name the cluster by its system identifier when possible.
            let namespace = match invalidation::cluster_id(&app.config, &app.upstream_tls).await {
                Some(id) => id,
                None => {
                    let fallback = upstream_namespace(&app.upstream);
                    warn!(
                        "cannot read PostgreSQL's system identifier: shared-tier keys are named after upstream.url                          ({fallback}), so every instance must use the same upstream.url"
                    );
                    fallback
                }
            };
            app.shared = Some(Arc::new(shared::SharedTier::new(
                &app.config,
                nodes,
                &namespace,
                app.metrics.shared.clone(),
            )));
        }
        let app = Arc::new(app);
        shared::SharedTier::spawn(&app);
        Ok(app)
    }

    /// Applies invalidations: the local counters at once, then (with a
    /// shared tier) Redis and every other instance.
    pub async fn invalidate(&self, db: &Arc<cache::DbState>, bumps: &cache::Bumps) {
        self.invalidate_from(db, bumps, &self.metrics.invalidations.replication)
            .await
    }

    /// [`App::invalidate`], counted under `source`.
    pub async fn invalidate_from(
        &self,
        db: &Arc<cache::DbState>,
        bumps: &cache::Bumps,
        source: &prometheus::IntCounter,
    ) {
        source.inc();
        match &self.shared {
            None => bumps.apply_local(db),
            Some(shared) => {
                let pending = shared.begin(db);
                bumps.apply_local(db);
                shared.publish(db, bumps, pending).await;
            }
        }
    }

    /// The policy's generation: one atomic load, for sessions to notice a RELOAD.
    pub fn policy_generation(&self) -> u64 {
        self.policy_generation.load(Ordering::Acquire)
    }

    pub fn policy(&self) -> Arc<policy::Policy> {
        Arc::clone(&self.policy.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn live_config(&self) -> Arc<Config> {
        Arc::clone(&self.live_config.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Remembers where the configuration came from, for RELOAD.
    pub fn set_config_source(
        &self,
        path: Option<std::path::PathBuf>,
        overrides: config::Overrides,
    ) {
        let _ = self.config_source.set((path, overrides));
    }

    /// Re-reads the configuration and applies what can change live: the
    /// caching policy (`cache.mode`, `default_ttl_secs`,
    /// `refresh_after_secs`, `coalesce_wait_ms`, `tables`, `roles`,
    /// `databases`) and the admin credentials. Returns what changed but
    /// needs a restart; on error nothing changes.
    pub fn reload(&self) -> Result<Vec<String>, config::ConfigError> {
        let (path, overrides) = self
            .config_source
            .get()
            .cloned()
            .unwrap_or((None, config::Overrides::default()));
        let new = Config::load(path.as_deref(), &overrides)?;
        self.tls
            .reload(&new.tls)
            .map_err(|e| config::ConfigError::Invalid(vec![e]))?;
        let old = self.live_config();
        let mut restart = Vec::new();
        let sections = [
            ("server", old.server != new.server),
            ("upstream", old.upstream != new.upstream),
            ("redis", old.redis != new.redis),
            ("metrics", old.metrics != new.metrics),
            ("replication", old.replication != new.replication),
            ("cache.enabled", old.cache.enabled != new.cache.enabled),
            (
                "cache.max_entry_bytes",
                old.cache.max_entry_bytes != new.cache.max_entry_bytes,
            ),
            ("cache.local", old.cache.local != new.cache.local),
            ("cache.shared", old.cache.shared != new.cache.shared),
            ("tls.ssl_mode", old.tls.ssl_mode != new.tls.ssl_mode),
            ("auth.mode", old.auth.mode != new.auth.mode),
        ];
        for (name, changed) in sections {
            if changed {
                restart.push(name.to_owned());
            }
        }
        self.auth.reload(&new.auth);
        let generation = self.policy_generation() + 1;
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(policy::Policy::new(&new.cache, generation));
        *self.live_config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        self.policy_generation.store(generation, Ordering::Release);
        tracing::info!(?restart, "configuration reloaded");
        Ok(restart)
    }

    pub fn replication_on(&self) -> bool {
        self.replication.load(Ordering::Acquire)
    }

    /// The state of `db`'s replication stream, as the admin console and
    /// the live page show it.
    pub fn stream_state(&self, db: &cache::DbState) -> &'static str {
        if !self.replication_on() {
            "off (TTL only)"
        } else if db.is_current() {
            "streaming"
        } else if db.is_streaming() {
            "lagging"
        } else {
            "down"
        }
    }

    /// Cached results of `db` may be served: replication is off (TTL-only
    /// by configuration), or its stream is up and current.
    pub fn cache_allowed(&self, db: &cache::DbState) -> bool {
        !self.replication_on() || db.is_current()
    }
}

/// A name for the PostgreSQL cluster when its system identifier is unknown.
fn upstream_namespace(upstream: &[config::UpstreamAddr]) -> String {
    let text = format!("{upstream:?}");
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}
