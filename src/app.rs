//! State shared by every session of one pgcache instance. Nothing in pgcache
//! is process-global, so several instances can run in one test binary.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cache::catalog::fetch::Fetcher;
use crate::cache::hold::Paused;
use crate::cache::shared::{Background, SharedTier};
use crate::cache::{Cache, DbState, LocalCache};
use crate::classify::prerequisites::Prerequisites;
use crate::config::{self, Config, ConfigError};
use crate::invalidation::{self, ReplicationError, Streams};
use crate::metrics::Metrics;
use crate::pool::ServerPool;
use crate::replica::{Out, Replicas};
use crate::upstream::Upstream;
use crate::{auth, cancel, policy, tls};

pub struct App {
    /// The configuration in force: what RELOAD applied, with the sections
    /// that need a restart kept as they were at start-up.
    config: RwLock<Arc<Config>>,
    /// `upstream.url`, parsed once.
    pub upstream: Arc<Upstream>,
    pub cancel: Arc<cancel::CancelRegistry>,
    /// Server connections parked between sessions.
    pub pool: Arc<ServerPool>,
    /// Every client session, for `SHOW CLIENTS` and `SHOW POOLS`.
    pub clients: Arc<crate::pool::clients::Clients>,
    /// Shutdown requested: sessions close once idle.
    pub drain: CancellationToken,
    /// The listening socket was handed to a new pgcache
    /// ([`crate::handover`]): stop accepting, keep serving.
    pub handed_over: CancellationToken,
    /// Shutdown timeout expired: sessions close now.
    pub force: CancellationToken,
    pub cache: Arc<Cache>,
    /// Statement plans, shared by the sessions of each database.
    pub plans: crate::session::SharedPlans,
    /// What fresh logins start with, shared by the sessions that log in
    /// alike.
    pub logins: crate::session::SharedLogins,
    pub streams: Arc<Streams>,
    /// Read replicas, watched for health and lag.
    pub replicas: Arc<Replicas>,
    pub metrics: Arc<Metrics>,
    /// Bound by [`App::start`], served by [`crate::serve`].
    metrics_listener: Mutex<Option<TcpListener>>,
    /// Where `/metrics` is served (known after [`App::start`]).
    pub metrics_addr: OnceLock<SocketAddr>,
    /// The caching policy, replaced by RELOAD.
    policy: RwLock<Arc<policy::Policy>>,
    policy_generation: AtomicU64,
    /// TLS towards clients.
    pub tls: tls::ClientTls,
    /// Terminate-mode authentication: users, auth_query.
    pub auth: auth::Authenticator,
    /// Where RELOAD reads the configuration from.
    config_source: OnceLock<(Option<PathBuf>, config::Overrides)>,
}

/// How long start-up waits for another pgcache to hand its disk tier
/// over ([`App::open_disk`]).
const DISK_HANDOVER_WAIT: Duration = Duration::from_secs(5);

/// Why pgcache cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("upstream.url: {0}")]
    Upstream(#[from] crate::upstream::UpstreamError),
    #[error("upstream.replicas: {0}")]
    Replica(String),
    #[error(transparent)]
    Disk(#[from] crate::cache::disk::DiskError),
    // The cause is part of the message, not a source: printed as a chain,
    // it would be said twice.
    #[error("cannot listen on {addr} (metrics.listen): {cause}")]
    MetricsListen {
        addr: SocketAddr,
        cause: std::io::Error,
    },
}

impl App {
    pub fn new(config: Config) -> Result<Self, StartError> {
        config.validate()?;
        // rustls in redis-rs (rediss://) takes the process's provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = tls::ClientTls::new(&config.tls)?;
        let upstream = Upstream::new(&config.upstream.url, config.connect_timeout())?;
        let upstream = Arc::new(upstream);
        let metrics = Arc::new(Metrics::new());
        let local = LocalCache::with_evictions(
            config.cache.local.max_bytes,
            config.cache.max_entry_bytes,
            Some(metrics.evictions.clone()),
        );
        let cache = Arc::new(Cache::new(local, Arc::clone(&metrics)));
        let drain = CancellationToken::new();
        let pooled = crate::pool::Pools::new(config.pool.default_pool_size, metrics.pooled.clone());
        let pool = Arc::new(ServerPool::new(metrics.pool.clone(), pooled));
        let streams = Arc::new(Streams::new(
            Arc::clone(&cache),
            Arc::clone(&upstream),
            config.replication.clone(),
            // Its own: a pgcache handing its disk tier over stops only
            // its streams.
            drain.child_token(),
            metrics.invalidations.replication.clone(),
            metrics.invalidations.notify.clone(),
            Arc::clone(&pool),
        ));
        let replicas =
            Replicas::new(&config, &metrics).map_err(|e| StartError::Replica(e.to_string()))?;
        Ok(Self {
            replicas: Arc::new(replicas),
            auth: auth::Authenticator::new(&config.auth, Arc::clone(&upstream)),
            cache,
            plans: Default::default(),
            logins: Default::default(),
            streams,
            upstream,
            cancel: Arc::default(),
            clients: Arc::default(),
            pool,
            drain,
            handed_over: CancellationToken::new(),
            force: CancellationToken::new(),
            metrics,
            metrics_listener: Mutex::new(None),
            metrics_addr: OnceLock::new(),
            policy: RwLock::new(Arc::new(policy::Policy::new(&config.cache, 1))),
            policy_generation: AtomicU64::new(1),
            config_source: OnceLock::new(),
            tls,
            config: RwLock::new(Arc::new(config)),
        })
    }

    /// Builds the shared state and runs the start-up checks: with caching
    /// and `replication.enabled`, PostgreSQL must be able to stream changes,
    /// or pgcache refuses to start (`replication.required`) or runs with
    /// TTL-only invalidation and says so.
    pub async fn start(config: Config) -> Result<Arc<Self>, StartError> {
        let app = Self::new(config)?;
        let config = app.config();
        let addr = config.metrics.listen;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|cause| StartError::MetricsListen { addr, cause })?;
        if let Ok(bound) = listener.local_addr() {
            let _ = app.metrics_addr.set(bound);
        }
        *app.metrics_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(listener);
        if config.cache.enabled && config.replication.enabled {
            match invalidation::preflight(&app.upstream).await {
                Ok(()) => {
                    app.cache.set_replication(true);
                    if config.replication.ddl_event_trigger {
                        invalidation::probe_origin(&app.upstream).await;
                    }
                }
                Err(e @ ReplicationError::Login(_)) => return Err(e.into()),
                Err(e) if config.replication.required => return Err(e.into()),
                Err(e) => warn!(
                    "REPLICATION IS OFF ({e}). Writes made outside pgcache are NOT seen: cached results expire only \
                     after cache.default_ttl_secs ({}s)",
                    config.cache.default_ttl_secs
                ),
            }
        }
        if config.cache.enabled && config.redis.nodes().is_some() {
            // Entries of different PostgreSQL clusters must never meet in one
            // Redis: name the cluster by its system identifier when possible.
            let namespace = match invalidation::cluster_id(&app.upstream).await {
                Some(id) => id,
                None => {
                    let fallback = app.upstream.namespace();
                    warn!(
                        "cannot read PostgreSQL's system identifier: shared-tier keys are named after upstream.url \
                         ({fallback}), so every instance must use the same upstream.url"
                    );
                    fallback
                }
            };
            if let Some(tier) = shared_tier(&config, &namespace, &app.metrics) {
                app.cache.set_shared(tier);
            }
        }
        if let Some(tier) = app.cache.shared() {
            tier.spawn(Background {
                databases: Arc::clone(&app.cache.databases),
                drain: app.drain.clone(),
                resyncs: app.metrics.invalidations.resync.clone(),
                peers: app.metrics.invalidations.peer.clone(),
            });
        }
        app.start_replicas().await?;
        let app = Arc::new(app);
        if config.cache.enabled && config.cache.disk.enabled() {
            app.open_disk().await?;
        }
        // Session mode has pools too: pgcache's own requests for hits.
        tokio::spawn(maintain_pools(Arc::downgrade(&app)));
        Ok(app)
    }

    /// Opens the disk tier. Another pgcache may use its directory: in a
    /// rolling restart it hands it over moments after it handed this one
    /// its listening socket, so start-up waits up to
    /// [`DISK_HANDOVER_WAIT`] for it (clients queue on the socket
    /// meanwhile, none is refused) and every database starts warm. Past
    /// that, it is opened once that pgcache has stopped, and memory and
    /// Redis answer meanwhile.
    async fn open_disk(self: &Arc<Self>) -> Result<(), StartError> {
        use crate::cache::disk::{DiskError, DiskTier};
        let config = self.config();
        let deadline = tokio::time::Instant::now() + DISK_HANDOVER_WAIT;
        let mut opened = DiskTier::open(&config.cache.disk, self.metrics.disk.clone());
        while matches!(opened, Err(DiskError::Locked { .. }))
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
            opened = DiskTier::open(&config.cache.disk, self.metrics.disk.clone());
        }
        match opened {
            Ok((tier, carried)) => self.install_disk(tier, carried),
            Err(DiskError::Locked { path }) => {
                info!(path = %path.display(), "another pgcache uses the disk tier: opening it once that one stops");
                let app = Arc::downgrade(self);
                tokio::spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let Some(app) = app.upgrade() else { return };
                        if app.drain.is_cancelled() {
                            return;
                        }
                        match DiskTier::open(&config.cache.disk, app.metrics.disk.clone()) {
                            Ok((tier, carried)) => return app.install_disk(tier, carried),
                            Err(DiskError::Locked { .. }) => {}
                            Err(e) => return warn!("the disk tier stays off: {e}"),
                        }
                    }
                });
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Puts the disk tier in use, with what the last run carried: the
    /// databases it names take their counters back when first used, and
    /// their streams start now, to read what changed meanwhile. A database
    /// already in use here (the tier was opened late) starts over: its
    /// slot is dropped when its stream next starts.
    fn install_disk(
        self: &Arc<Self>,
        tier: Arc<crate::cache::disk::DiskTier>,
        carried: Option<crate::cache::carry::Carried>,
    ) {
        tier.spawn_probe(self.drain.clone());
        let (fresh, in_use): (Vec<_>, Vec<_>) = carried
            .map(|c| c.databases)
            .unwrap_or_default()
            .into_iter()
            .partition(|(name, _)| self.cache.databases.get(name).is_none());
        for (name, db) in in_use {
            let upstream = Arc::clone(&self.upstream);
            tokio::spawn(async move {
                if let Ok(ctl) = upstream.control(&name).await
                    && let Err(e) = crate::invalidation::slot::drop_inactive(&ctl, &db.slot).await
                {
                    warn!(database = %name, slot = %db.slot, error = %e, "could not drop the last run's replication slot");
                }
            });
        }
        self.cache.databases.carry(fresh);
        self.cache.set_disk(tier);
        for name in self.cache.databases.carried_names() {
            info!(database = %name, "the disk tier carried this database's entries: resuming its stream");
            self.streams.ensure(&self.cache.db(&name));
        }
    }

    /// The listening socket went to a new pgcache, which waits for the
    /// disk tier: stop the streams (the cache answers nothing more once
    /// their lease runs out; the sessions go on, relayed) and carry the
    /// entries to it now rather than when this one stops.
    pub async fn hand_disk_over(&self) {
        if self.cache.disk().is_none() {
            return;
        }
        self.streams.stop().await;
        self.carry_disk();
    }

    /// At the end of a clean stop, once the sessions and the streams are
    /// done (or at a handover): what the next run needs to serve the disk
    /// tier's entries again ([`crate::cache::carry`]). Once only.
    pub fn carry_disk(&self) {
        let Some(tier) = self.cache.disk() else {
            return;
        };
        if !self.cache.replication_on() {
            // Nothing proves what changed while pgcache was stopped.
            tier.close();
            return;
        }
        let databases = self
            .cache
            .databases
            .all()
            .into_iter()
            .filter_map(|(name, db)| {
                let slot = db.stream.slot().filter(|s| *s == tier.slot_name(&name))?;
                let (epoch, families) = db.versions.carried();
                Some((
                    name,
                    crate::cache::carry::CarriedDb {
                        slot,
                        nonce: db.disk_nonce,
                        epoch,
                        families,
                    },
                ))
            })
            .collect();
        if tier.carry(crate::cache::carry::Carried::new(databases)) {
            info!("the disk tier carries its entries to the next run");
        }
    }

    /// Checks each replica and starts watching it: one that answers but
    /// is not a standby of the primary is refused with the reason; one
    /// that cannot be reached starts out of rotation.
    async fn start_replicas(&self) -> Result<(), StartError> {
        if !self.replicas.enabled() {
            return Ok(());
        }
        let Some(primary_id) = invalidation::cluster_id(&self.upstream).await else {
            return Err(StartError::Replica(
                "cannot read the primary's system identifier (pg_control_system()), which every replica must share"
                    .to_owned(),
            ));
        };
        for replica in &self.replicas.servers {
            match crate::replica::monitor::check(&replica.upstream, &primary_id).await {
                Ok(_) => {}
                Err(why @ (Out::OtherCluster { .. } | Out::NotInRecovery)) => {
                    return Err(StartError::Replica(format!("{}: {why}", replica.name)));
                }
                Err(why) => warn!(replica = %replica.name, "replica out of rotation: {why}"),
            }
        }
        let _ = self.replicas.primary_id.set(primary_id);
        let drain = self.drain.clone();
        tokio::spawn(crate::replica::monitor::watch_primary(
            Arc::clone(&self.upstream),
            Arc::clone(&self.replicas),
            drain.clone(),
        ));
        for replica in &self.replicas.servers {
            tokio::spawn(crate::replica::monitor::watch(
                Arc::clone(replica),
                Arc::clone(&self.replicas),
                drain.clone(),
            ));
        }
        Ok(())
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The metrics listener bound at start-up, taken once by [`crate::serve`].
    pub(crate) fn take_metrics_listener(&self) -> Option<TcpListener> {
        self.metrics_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// The facts known of `rels` and `funcs` in `db`; names not known yet are
    /// queued for the database's fetcher, started here on first need.
    /// Starts `db`'s catalog fetcher, unless one runs: sessions queued
    /// names whose facts they want.
    pub fn fetch_catalog(&self, db: &Arc<DbState>) {
        if db.catalog.claim_fetcher() {
            let fetcher = Fetcher {
                db: Arc::clone(db),
                upstream: Arc::clone(&self.upstream),
                publication: self.publication(),
                drain: self.drain.clone(),
            };
            tokio::spawn(fetcher.run());
        }
    }

    /// A database's first statements wait a little (`at_most`) for the
    /// facts of the names they use (`rels`, `funcs`), fetched now.
    pub async fn wait_for_facts(
        &self,
        db: &Arc<DbState>,
        (rels, funcs): (&[String], &[String]),
        at_most: Duration,
    ) {
        let rels: Vec<&str> = rels.iter().map(String::as_str).collect();
        let funcs: Vec<&str> = funcs.iter().map(String::as_str).collect();
        self.fetch_catalog(db);
        self.cache
            .wait_for_facts(db, (&rels[..], &funcs[..]), at_most)
            .await;
    }

    /// What a statement of a session on `db` needs of pgcache before it
    /// goes out ([`crate::classify::prerequisites`]), done: the databases
    /// it names let go of (held so until it is answered: returned), the
    /// tables it names taken out of the publication.
    pub async fn meet_prerequisites(&self, db: &str, needs: &Prerequisites) -> Vec<Paused> {
        let mut paused = Vec::new();
        for name in &needs.free_databases {
            paused.extend(self.streams.release(name, db).await);
        }
        if let Some(publication) = self.publication() {
            for table in &needs.unpublish {
                invalidation::take_out_for_unlogged(&self.upstream, db, &publication, table).await;
            }
        }
        paused
    }

    /// The publication that decides which tables are readable, when
    /// replication is on.
    pub fn publication(&self) -> Option<String> {
        self.cache
            .replication_on()
            .then(|| self.config().replication.publication.clone())
    }

    /// The policy's generation: one atomic load, for sessions to notice a RELOAD.
    pub fn policy_generation(&self) -> u64 {
        self.policy_generation.load(Ordering::Acquire)
    }

    pub fn policy(&self) -> Arc<policy::Policy> {
        Arc::clone(&self.policy.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Remembers where the configuration came from, for RELOAD.
    pub fn set_config_source(&self, path: Option<PathBuf>, overrides: config::Overrides) {
        let _ = self.config_source.set((path, overrides));
    }

    /// Re-reads the configuration and applies what can change live: the
    /// caching policy (`cache.mode`, `default_ttl_secs`,
    /// `refresh_after_secs`, `coalesce_wait_ms`, `tables`, `roles`,
    /// `databases`), the admin credentials, `auth.users`/`auth_query` and
    /// the TLS certificate. Returns what changed but needs a restart (kept
    /// as it was); on error nothing changes.
    pub fn reload(&self) -> Result<Vec<String>, ConfigError> {
        let (path, overrides) = self
            .config_source
            .get()
            .cloned()
            .unwrap_or((None, config::Overrides::default()));
        let mut new = Config::load(path.as_deref(), &overrides)?;
        self.tls
            .reload(&new.tls)
            .map_err(|e| ConfigError::Invalid(vec![e.to_string()]))?;
        let old = self.config();
        let restart = new.keep_restart_only(&old);
        self.auth.reload(&new.auth);
        let generation = self.policy_generation() + 1;
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(policy::Policy::new(&new.cache, generation));
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        self.policy_generation.store(generation, Ordering::Release);
        tracing::info!(?restart, "configuration reloaded");
        Ok(restart)
    }
}

/// Keeps transaction-mode pools within their idle time and lifetime, and
/// the primary's at `pool.min_pool_size`.
async fn maintain_pools(app: std::sync::Weak<App>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(app) = app.upgrade() else {
            return;
        };
        if app.drain.is_cancelled() {
            return;
        }
        let config = app.config();
        app.pool.pooled.maintain(&config.pool, &app.upstream);
        for replica in &app.replicas.servers {
            replica.pools.reap(&config.pool);
        }
    }
}

/// The shared tier, when `redis.url` is set and caching is on;
/// `namespace` keeps the entries of different PostgreSQL clusters apart.
fn shared_tier(config: &Config, namespace: &str, metrics: &Metrics) -> Option<Arc<SharedTier>> {
    let nodes = config.redis.nodes().filter(|_| config.cache.enabled)?;
    Some(Arc::new(SharedTier::new(
        config,
        nodes,
        namespace,
        metrics.shared.clone(),
    )))
}
