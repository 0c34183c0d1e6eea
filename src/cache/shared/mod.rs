//! The shared tier: Redis (or Redis Cluster) holding results for every
//! pgcache instance, and the table versions that keep them coherent.
//!
//! **Entries.** A local miss looks up `{ns}e:{key}` (one GET); a backend
//! miss stores there off the response path (SET with PX). Values carry their
//! format, versions, key and a checksum ([`entry`]); one that fails a check
//! is a miss, counted, never served.
//!
//! **Versions.** The counters in the hash `{ns}v:{database}` are the source
//! of truth: field `e` the epoch, `d` DDL, `t:<table>` each table. An
//! instance that learns of a change (a write it relayed, its replication
//! stream, the admin console) bumps its local counters at once, then runs
//! one script that increments the fields in Redis and publishes the new
//! values on `{ns}inval`; every instance raises its mirrors to them. The
//! shared key of a request is made only from mirrored values, which only
//! Redis hands out, so no two instances can use one value for different
//! states of a table.
//!
//! **When not in sync, not used.** The shared tier is consulted only while
//! this instance is subscribed, the database's mirrors were read under the
//! current subscription, no bump of this instance is on its way to Redis,
//! and the breaker is closed. A failed bump, a lost subscription (Redis
//! delivers messages at most once, and a subscriber only loses them by
//! losing its connection) or a restart of Redis makes this instance
//! resynchronise: it raises Redis's counters to its own (in case Redis lost
//! them), bumps the epoch (what it may have missed is treated as changed),
//! publishes that, and reads every counter back.
//!
//! **Degrade, never fail.** Every operation has a deadline
//! (`cache.shared.timeout_ms`); failures open a circuit breaker; without
//! Redis the local tier and PostgreSQL answer, and clients see no errors.

mod breaker;
pub mod confirm;
mod conn;
mod cover;
pub mod entry;
pub mod state;
mod sync;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use redis::Script;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::database::{Databases, DbState};
use super::versions::{Bumps, Family, unix_ms};
use crate::config::{Config, Consistency, RedisNodes};
use crate::metrics::SharedMetrics;
use breaker::Breaker;
use conn::Conn;
use sync::{apply_field, message_header};

/// Field names in a database's version hash.
const EPOCH: &str = "e";
const DDL: &str = "d";
const TABLE: &str = "t:";
/// Coverage: the LSN before which every change is bumped, and on the
/// channel, a vouch ([`cover`]).
const WATCH: &str = "w";
/// The writes watermark (`read_your_writes`): bumped by every write through
/// an instance, read with every confirmation.
const WRITES: &str = "r";
/// On the channel only: an instance needs the database's heartbeats of
/// the others (their vouch, their coverage), which rest when nothing needs
/// them ([`crate::cache::demand`]).
const WAKE: &str = "h";

/// Increments fields and announces the new values, in one round trip.
/// KEYS[1]: the version hash. ARGV[1]: channel; ARGV[2]: message header
/// (database and field names, see [`message_header`]); ARGV[3..]: fields.
const BUMP: &str = r"
local values = {}
for i = 3, #ARGV do
  values[#values + 1] = redis.call('HINCRBY', KEYS[1], ARGV[i], 1)
end
redis.call('PUBLISH', ARGV[1], ARGV[2] .. table.concat(values, ','))
return values
";

/// Raises fields to at least the given values (Redis may have lost them),
/// optionally bumps the epoch and announces it, and returns the whole hash.
/// KEYS[1]: the version hash. ARGV[1]: channel; ARGV[2]: message header for
/// the epoch, or '' for no bump; ARGV[3..]: field, value pairs.
const RESYNC: &str = r"
for i = 3, #ARGV, 2 do
  local current = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if current < tonumber(ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
if ARGV[2] ~= '' then
  local epoch = redis.call('HINCRBY', KEYS[1], 'e', 1)
  redis.call('PUBLISH', ARGV[1], ARGV[2] .. epoch)
end
return redis.call('HGETALL', KEYS[1])
";

/// Why a Redis operation did not happen. The shared tier fails open: these
/// are counted and logged, never shown to a client.
#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("circuit breaker open")]
    BreakerOpen,
    #[error("not connected")]
    NotConnected,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
}

/// What the shared tier's background tasks work with.
pub struct Background {
    pub databases: Arc<Databases>,
    pub drain: CancellationToken,
    /// Counts resynchronisations that bumped an epoch.
    pub resyncs: prometheus::IntCounter,
    /// Counts invalidations announced by other instances.
    pub peers: prometheus::IntCounter,
}

/// A bump of this instance on its way to Redis. While one exists, the
/// shared tier is not read (its mirrors may be behind this instance's own
/// writes). Dropped before it is done, it marks the tier out of sync.
pub struct Pending {
    tier: Arc<SharedTier>,
    db: Arc<DbState>,
    done: bool,
}

impl Pending {
    fn done(mut self) {
        self.done = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            // Redis does not know of this change: its entries for the
            // database may be stale until a resync bumps the epoch there.
            self.db.sync.dirty.store(true, Ordering::Release);
            self.tier.out_of_sync("a bump did not reach Redis");
        }
        self.tier.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

pub struct SharedTier {
    nodes: RedisNodes,
    conn: std::sync::OnceLock<Conn>,
    /// `{prefix}{cluster id}:`, in front of every key.
    ns: String,
    channel: String,
    ttl_ms: u64,
    timeout: Duration,
    max_entry_bytes: usize,
    breaker: Breaker,
    /// Subscribed to the invalidation channel.
    subscribed: AtomicBool,
    /// Bumped on every (re)subscription and loss of sync; a database's
    /// mirrors are usable only if read under the current generation.
    sync_gen: AtomicU64,
    /// Bumps of this instance on their way to Redis.
    pending: AtomicU64,
    resync: Notify,
    /// A lookup newly needs another instance's vouch: ask for heartbeats.
    wake: Notify,
    stores: Arc<Semaphore>,
    bump: Script,
    resync_script: Script,
    cover_script: Script,
    claim_script: Script,
    /// `replication.max_staleness_ms`: how long a vouch is good for.
    lease: Duration,
    metrics: SharedMetrics,
    /// `cache.shared.consistency = "read_your_writes"`: every read
    /// confirms its versions with Redis first ([`confirm`]).
    pub read_your_writes: bool,
}

impl SharedTier {
    /// `namespace` keeps the entries of different PostgreSQL clusters apart.
    pub fn new(
        config: &Config,
        nodes: RedisNodes,
        namespace: &str,
        metrics: SharedMetrics,
    ) -> Self {
        let shared = &config.cache.shared;
        let ns = format!("{}{namespace}:", shared.prefix);
        Self {
            nodes,
            conn: std::sync::OnceLock::new(),
            channel: format!("{ns}inval"),
            ns,
            ttl_ms: shared.ttl_secs.saturating_mul(1000),
            timeout: config.shared_timeout(),
            max_entry_bytes: shared.max_entry_bytes,
            breaker: Breaker::new(
                shared.breaker_failures,
                Duration::from_millis(shared.breaker_open_ms),
            ),
            subscribed: AtomicBool::new(false),
            sync_gen: AtomicU64::new(1),
            pending: AtomicU64::new(0),
            resync: Notify::new(),
            wake: Notify::new(),
            stores: Arc::new(Semaphore::new(shared.max_pending_stores)),
            bump: Script::new(BUMP),
            resync_script: Script::new(RESYNC),
            cover_script: Script::new(cover::COVER),
            claim_script: Script::new(cover::CLAIM),
            lease: config.max_staleness(),
            metrics,
            read_your_writes: shared.consistency == Consistency::ReadYourWrites,
        }
    }

    /// Connects in the background and keeps the subscription, until
    /// `bg.drain` is cancelled.
    pub fn spawn(self: &Arc<Self>, bg: Background) {
        let for_conn = Arc::clone(self);
        let drain = bg.drain.clone();
        tokio::spawn(async move { for_conn.connect(&drain).await });
        let tier = Arc::clone(self);
        tokio::spawn(async move { tier.subscribe(&bg).await });
    }

    pub fn breaker_open(&self) -> bool {
        !self.breaker.allows()
    }

    /// The shared tier is in use (for metrics and readiness).
    pub fn is_up(&self) -> bool {
        self.conn.get().is_some()
            && self.subscribed.load(Ordering::Acquire)
            && self.breaker.allows()
    }

    /// Whether `db`'s shared tier may be read and written now. Called after
    /// the local key's versions were read and before the shared key's are.
    pub fn usable(&self, db: &DbState) -> bool {
        if self.pending.load(Ordering::Acquire) != 0 || !self.is_up() {
            return false;
        }
        if db.sync.synced.load(Ordering::Acquire) != self.sync_gen.load(Ordering::Acquire) {
            self.resync.notify_one();
            return false;
        }
        true
    }

    pub fn skipped(&self) {
        self.metrics.skipped.inc();
    }

    fn conn(&self) -> Option<Conn> {
        self.conn.get().cloned()
    }

    /// Runs one Redis operation under the deadline and the breaker.
    async fn run<T>(
        &self,
        op: impl AsyncFnOnce(Conn) -> redis::RedisResult<T>,
    ) -> Result<T, SharedError> {
        if !self.breaker.allows() {
            return Err(SharedError::BreakerOpen);
        }
        let conn = self.conn().ok_or(SharedError::NotConnected)?;
        self.metrics.round_trips.inc();
        let result = match tokio::time::timeout(self.timeout, op(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(SharedError::Redis(e)),
            Err(_) => Err(SharedError::Timeout(self.timeout)),
        };
        match &result {
            Ok(_) => self.breaker.success(),
            Err(e) => {
                if self.breaker.failure() {
                    self.metrics.breaker_opens.inc();
                    warn!(error = %e, "Redis failing: shared tier paused");
                }
            }
        }
        result
    }

    fn entry_key(&self, key: u128) -> String {
        format!("{}e:{key:032x}", self.ns)
    }

    fn versions_key(&self, database: &str) -> String {
        format!("{}v:{database}", self.ns)
    }

    /// The stored entry for `key`, if Redis has a sound one made under
    /// `versions`.
    pub async fn get(&self, key: u128, versions: &[u64]) -> Option<entry::Entry> {
        let redis_key = self.entry_key(key);
        let value = match self
            .run(async |mut c| {
                redis::cmd("GET")
                    .arg(&redis_key)
                    .query_async::<Option<Vec<u8>>>(&mut c)
                    .await
            })
            .await
        {
            Ok(Some(v)) => v,
            Ok(None) => {
                self.metrics.miss.inc();
                return None;
            }
            Err(e) => {
                debug!(error = %e, "shared lookup failed");
                self.metrics.error.inc();
                return None;
            }
        };
        match entry::decode(Bytes::from(value), key, versions) {
            Ok(entry) => {
                self.metrics.hit.inc();
                Some(entry)
            }
            Err(why) => {
                self.metrics.rejected.inc();
                let m = &self.metrics;
                match why {
                    entry::Rejection::Format => m.rejected_format.inc(),
                    entry::Rejection::Checksum => m.rejected_checksum.inc(),
                    entry::Rejection::Key => m.rejected_key.inc(),
                    entry::Rejection::Versions => m.rejected_versions.inc(),
                }
                warn!(key = %redis_key, reason = ?why, "shared entry rejected");
                None
            }
        }
    }

    /// Stores a result in the background, to expire after `ttl` (at most
    /// `cache.shared.ttl_secs`); dropped (and counted) if too many stores
    /// are in flight or it is too large.
    pub fn put(
        self: &Arc<Self>,
        key: u128,
        versions: &[u64],
        payload: &[u8],
        ttl: Option<Duration>,
    ) {
        if payload.len() > self.max_entry_bytes {
            self.metrics.store_too_large.inc();
            return;
        }
        let Ok(permit) = Arc::clone(&self.stores).try_acquire_owned() else {
            self.metrics.store_dropped.inc();
            return;
        };
        let value = entry::encode(key, unix_ms(), versions, payload);
        let value_len = value.len() as u64;
        let ttl_ms = ttl.map_or(self.ttl_ms, |t| {
            (t.as_millis() as u64).clamp(1, self.ttl_ms)
        });
        let tier = Arc::clone(self);
        tokio::spawn(async move {
            let redis_key = tier.entry_key(key);
            let result = tier
                .run(async |mut c| {
                    redis::cmd("SET")
                        .arg(&redis_key)
                        .arg(value)
                        .arg("PX")
                        .arg(ttl_ms)
                        .query_async::<()>(&mut c)
                        .await
                })
                .await;
            match result {
                Ok(()) => {
                    tier.metrics.stored.inc();
                    tier.metrics.stored_bytes.inc_by(value_len);
                }
                Err(e) => {
                    debug!(error = %e, "shared store failed");
                    tier.metrics.store_failed.inc();
                }
            }
            drop(permit);
        });
    }

    /// Announces that a bump of this instance is on its way: call before
    /// bumping the local counters.
    pub fn begin(self: &Arc<Self>, db: &Arc<DbState>) -> Pending {
        self.pending.fetch_add(1, Ordering::AcqRel);
        Pending {
            tier: Arc::clone(self),
            db: Arc::clone(db),
            done: false,
        }
    }

    /// Sends `bumps` (already applied locally) to Redis and every instance.
    pub async fn publish(&self, db: &DbState, bumps: &Bumps, pending: Pending) {
        let mut fields: Vec<String> = bumps
            .families
            .iter()
            .map(|f| format!("{TABLE}{}", f.name))
            .chain(bumps.elsewhere.iter().map(|name| format!("{TABLE}{name}")))
            .collect();
        if bumps.epoch || !bumps.ddl.is_none() {
            fields.push(EPOCH.to_owned());
        }
        // Other instances forget all they know of the catalog: the names
        // are not sent.
        if bumps.ddl.changes_facts() {
            fields.push(DDL.to_owned());
        }
        if bumps.watermark && self.read_your_writes {
            fields.push(WRITES.to_owned());
        }
        if fields.is_empty() {
            pending.done();
            return;
        }
        let header = message_header(&db.name, &fields);
        let hash = self.versions_key(&db.name);
        let result = self
            .run(async |mut c| {
                let mut invocation = self.bump.key(&hash);
                invocation.arg(&self.channel).arg(&header);
                for f in &fields {
                    invocation.arg(f);
                }
                invocation.invoke_async::<Vec<u64>>(&mut c).await
            })
            .await;
        match result {
            Ok(values) if values.len() == fields.len() => {
                self.metrics.invalidations_sent.inc_by(fields.len() as u64);
                for (field, value) in fields.iter().zip(values) {
                    apply_field(db, field, value);
                }
                pending.done();
            }
            Ok(_) => warn!("unexpected reply from the bump script"),
            Err(e) => debug!(error = %e, "bump not sent; resynchronising"),
        }
        // A `Pending` dropped undone marks the tier out of sync.
    }

    /// Raises this instance's mirrors of `families` to Redis's counters.
    pub async fn mirror(
        &self,
        db: &DbState,
        families: impl Iterator<Item = &Arc<Family>>,
    ) -> Result<(), SharedError> {
        let families: Vec<&Arc<Family>> = families.collect();
        let hash = self.versions_key(&db.name);
        let values = self
            .run(async |mut c| {
                let mut cmd = redis::cmd("HMGET");
                cmd.arg(&hash);
                for f in &families {
                    cmd.arg(format!("{TABLE}{}", f.name));
                }
                cmd.query_async::<Vec<Option<u64>>>(&mut c).await
            })
            .await?;
        for (f, value) in families.iter().zip(values) {
            f.version.raise_shared(value.unwrap_or(0));
        }
        Ok(())
    }

    /// Something may have been missed: stop using the shared tier until
    /// every database has been resynchronised.
    fn out_of_sync(&self, why: &str) {
        debug!(why, "shared tier out of sync");
        self.sync_gen.fetch_add(1, Ordering::AcqRel);
        self.resync.notify_one();
    }
}
