//! Every transaction pool of the instance, one per database and user.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::PoolError;
use super::clients::{Activity, Client};
use super::transaction::{Lease, Pool, PoolId};
use crate::backend::BackendStream;
use crate::config::{PoolConfig, PoolMode};
use crate::metrics::TransactionPoolMetrics;
use crate::protocol::stream::FramedStream;
use crate::upstream::Upstream;

/// Every pool of the instance.
pub struct Pools {
    pools: Mutex<HashMap<PoolId, Arc<Pool>>>,
    size: usize,
    next_server_id: AtomicU64,
    metrics: TransactionPoolMetrics,
}

impl Pools {
    pub fn new(size: usize, metrics: TransactionPoolMetrics) -> Self {
        Self {
            pools: Mutex::default(),
            size,
            next_server_id: AtomicU64::new(0),
            metrics,
        }
    }

    /// A new server connection's id in `SHOW SERVERS` (a replica's too).
    pub fn server_id(&self) -> u64 {
        self.next_server_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// What numbers new connections: a replica's pools number theirs as
    /// the primary's, so that ids are unique in `SHOW SERVERS`.
    pub fn ids(&self) -> &AtomicU64 {
        &self.next_server_id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PoolId, Arc<Pool>>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pool of a database and user, made on first use.
    pub fn pool(&self, database: &str, user: &str) -> Arc<Pool> {
        let id = PoolId {
            database: database.into(),
            user: user.into(),
        };
        let mut pools = self.lock();
        let pool = pools
            .entry(id.clone())
            .or_insert_with(|| Arc::new(Pool::new(id, self.size, self.metrics.clone())));
        Arc::clone(pool)
    }

    /// A connection of `pool` for client `client` (0: pgcache itself).
    pub async fn checkout(
        &self,
        pool: &Arc<Pool>,
        upstream: &Upstream,
        wait: Option<Duration>,
        client: u64,
    ) -> Result<(Lease, FramedStream<BackendStream>), PoolError> {
        pool.checkout(upstream, wait, &self.next_server_id, client)
            .await
    }

    /// A connection of `pool` for a client's requests: the client is
    /// shown waiting in `SHOW CLIENTS` until one comes, then holding it.
    pub async fn checkout_for(
        &self,
        pool: &Arc<Pool>,
        upstream: &Upstream,
        wait: Option<Duration>,
        client: &Client,
    ) -> Result<(Lease, FramedStream<BackendStream>), PoolError> {
        client.set(Activity::Waiting);
        let taken = self.checkout(pool, upstream, wait, client.id).await;
        match &taken {
            Ok((lease, _)) => client.hold(lease.server().id, lease.server().key.backend_pid),
            Err(_) => client.set(Activity::Idle),
        }
        taken
    }

    pub fn all(&self) -> Vec<Arc<Pool>> {
        let mut pools: Vec<_> = self.lock().values().cloned().collect();
        pools.sort_by(|a, b| (&a.id.database, &a.id.user).cmp(&(&b.id.database, &b.id.user)));
        pools
    }

    /// Closes idle connections past their time, and in transaction mode
    /// opens connections up to `min_pool_size` where pgcache can log in.
    pub fn maintain(self: &Arc<Self>, config: &PoolConfig, upstream: &Arc<Upstream>) {
        let min = match config.mode {
            PoolMode::Transaction => config.min_pool_size,
            PoolMode::Session => 0,
        };
        for pool in self.all() {
            pool.reap(config, config.min_pool_size);
            for _ in 0..pool.missing(min) {
                let pools = Arc::clone(self);
                let pool = Arc::clone(&pool);
                let upstream = Arc::clone(upstream);
                let lifetime = config.server_lifetime();
                tokio::spawn(async move {
                    if let Ok((lease, stream)) = pools.checkout(&pool, &upstream, None, 0).await {
                        lease.give_back(stream, lifetime);
                    }
                });
            }
        }
    }

    /// Closes idle connections past their time, keeping none open for its
    /// own sake (a replica's pools).
    pub fn reap(&self, config: &PoolConfig) {
        for pool in self.all() {
            pool.reap(config, 0);
        }
    }

    /// A pool of this registry for the clients of `primary`'s pool, which
    /// it learns to log in from.
    pub fn pool_like(&self, primary: &Pool) -> Arc<Pool> {
        let pool = self.pool(&primary.id.database, &primary.id.user);
        pool.learn_from(primary);
        pool
    }

    /// Closes the idle connections to `database` (all if `None`): a
    /// statement needs the databases free.
    pub fn evict(&self, database: Option<&str>) -> usize {
        self.all()
            .iter()
            .filter(|p| database.is_none_or(|d| *p.id.database == *d))
            .map(|p| p.evict())
            .sum()
    }
}
