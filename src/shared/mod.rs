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

pub mod entry;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::sync::{Notify, Semaphore};
use tracing::{debug, info, warn};

use crate::App;
use crate::cache::{Bumps, DbState, Version};
use crate::config::{Config, RedisNodes, redact};
use crate::metrics::SharedMetrics;

/// Field names in a database's version hash.
const EPOCH: &str = "e";
const DDL: &str = "d";
const TABLE: &str = "t:";

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

/// A connection to a single Redis or to a cluster.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Stops pgcache from waiting on a Redis that fails: after `threshold`
/// consecutive failures it stays open for `open_for`; then the next
/// operation is a trial, and one more failure opens it again.
struct Breaker {
    threshold: u32,
    open_for: Duration,
    failures: AtomicU32,
    /// Milliseconds since `start` until which the breaker is open.
    open_until: AtomicU64,
    start: Instant,
}

impl Breaker {
    fn allows(&self) -> bool {
        self.start.elapsed().as_millis() as u64 >= self.open_until.load(Ordering::Acquire)
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// Returns true when this failure opened the breaker.
    fn failure(&self) -> bool {
        if self.failures.fetch_add(1, Ordering::AcqRel) + 1 < self.threshold {
            return false;
        }
        let until = self.start.elapsed() + self.open_for;
        self.open_until
            .store(until.as_millis() as u64, Ordering::Release);
        // Half-open afterwards: the first failure opens it again.
        self.failures
            .store(self.threshold.saturating_sub(1), Ordering::Release);
        true
    }
}

/// A bump of this instance on its way to Redis. While one exists, the
/// shared tier is not read (its mirrors may be behind this instance's own
/// writes). Dropped without [`Pending::done`], it marks the tier out of sync.
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
            self.db.shared_dirty.store(true, Ordering::Release);
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
    stores: Arc<Semaphore>,
    bump: Script,
    resync_script: Script,
    metrics: SharedMetrics,
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
            breaker: Breaker {
                threshold: shared.breaker_failures,
                open_for: Duration::from_millis(shared.breaker_open_ms),
                failures: AtomicU32::new(0),
                open_until: AtomicU64::new(0),
                start: Instant::now(),
            },
            subscribed: AtomicBool::new(false),
            sync_gen: AtomicU64::new(1),
            pending: AtomicU64::new(0),
            resync: Notify::new(),
            stores: Arc::new(Semaphore::new(shared.max_pending_stores)),
            bump: Script::new(BUMP),
            resync_script: Script::new(RESYNC),
            metrics,
        }
    }

    /// Connects in the background and keeps the subscription: spawned once
    /// by [`App::start`].
    pub fn spawn(app: &Arc<App>) {
        let Some(tier) = app.shared.clone() else {
            return;
        };
        let app_for_conn = Arc::clone(app);
        let for_conn = Arc::clone(&tier);
        tokio::spawn(async move { for_conn.connect(&app_for_conn).await });
        let app = Arc::clone(app);
        tokio::spawn(async move { tier.subscribe(&app).await });
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
        if db.shared_synced.load(Ordering::Acquire) != self.sync_gen.load(Ordering::Acquire) {
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
    ) -> Result<T, String> {
        if !self.breaker.allows() {
            return Err("circuit breaker open".to_owned());
        }
        let conn = self.conn().ok_or("not connected")?;
        self.metrics.round_trips.inc();
        let result = match tokio::time::timeout(self.timeout, op(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("timed out after {:?}", self.timeout)),
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
        let value = entry::encode(key, crate::cache::unix_ms(), versions, payload);
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
            .collect();
        if bumps.epoch || bumps.schema {
            fields.push(EPOCH.to_owned());
        }
        if bumps.schema {
            fields.push(DDL.to_owned());
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

    /// Something may have been missed: stop using the shared tier until
    /// every database has been resynchronised.
    fn out_of_sync(&self, why: &str) {
        debug!(why, "shared tier out of sync");
        self.sync_gen.fetch_add(1, Ordering::AcqRel);
        self.resync.notify_one();
    }

    /// Establishes the connection, retrying until it works.
    async fn connect(&self, app: &App) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = async {
                if self.nodes.cluster {
                    let mut builder =
                        redis::cluster::ClusterClient::builder(self.nodes.urls.clone());
                    if let Some(certs) = self.tls_certificates()? {
                        builder = builder.certs(certs);
                    }
                    let client = builder
                        .connection_timeout(self.timeout.max(Duration::from_secs(1)))
                        .response_timeout(self.timeout)
                        .build()?;
                    Ok::<_, redis::RedisError>(Conn::Cluster(client.get_async_connection().await?))
                } else {
                    let client = self.client(&self.nodes.urls[0])?;
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.timeout.max(Duration::from_secs(1))))
                        .set_response_timeout(Some(self.timeout))
                        .set_max_delay(Duration::from_secs(1));
                    Ok(Conn::Single(
                        ConnectionManager::new_with_config(client, config).await?,
                    ))
                }
            };
            let result = tokio::select! {
                r = attempt => r,
                _ = app.drain.cancelled() => return,
            };
            match result {
                Ok(conn) => {
                    let _ = self.conn.set(conn);
                    info!(redis = %self.describe(), "shared tier connected");
                    return;
                }
                Err(e) => {
                    warn!(redis = %self.describe(), error = %e, retry_in = ?backoff, "cannot reach Redis: local tier only until it can be reached");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = app.drain.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The CA certificates of `redis.ca_file`, if set.
    fn tls_certificates(&self) -> redis::RedisResult<Option<redis::TlsCertificates>> {
        let Some(path) = &self.nodes.ca_file else {
            return Ok(None);
        };
        let root_cert = std::fs::read(path)?;
        Ok(Some(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root_cert),
        }))
    }

    /// A client for one node, trusting `redis.ca_file` for `rediss://`.
    fn client(&self, url: &str) -> redis::RedisResult<redis::Client> {
        match self.tls_certificates()? {
            Some(certs) if url.starts_with("rediss://") => {
                redis::Client::build_with_tls(url, certs)
            }
            _ => redis::Client::open(url),
        }
    }

    fn describe(&self) -> String {
        self.nodes
            .urls
            .iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Keeps a subscription to the invalidation channel, applying what other
    /// instances announce, and resynchronises after every gap.
    async fn subscribe(&self, app: &App) {
        let mut backoff = Duration::from_millis(100);
        let mut node = 0usize;
        loop {
            let url = &self.nodes.urls[node % self.nodes.urls.len()];
            node += 1;
            let attempt = async {
                let client = self.client(url)?;
                let mut pubsub = tokio::time::timeout(
                    self.timeout.max(Duration::from_secs(1)),
                    client.get_async_pubsub(),
                )
                .await
                .map_err(|_| {
                    redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
                })??;
                pubsub.subscribe(&self.channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            let result = tokio::select! {
                r = attempt => r,
                _ = app.drain.cancelled() => return,
            };
            let pubsub = match result {
                Ok(p) => p,
                Err(e) => {
                    debug!(error = %e, "cannot subscribe to Redis");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = app.drain.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            // Whatever was announced while unsubscribed is lost.
            self.sync_gen.fetch_add(1, Ordering::AcqRel);
            self.subscribed.store(true, Ordering::Release);
            info!("subscribed to shared invalidations");
            let mut messages = pubsub.into_on_message();
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    msg = messages.next() => match msg {
                        Some(msg) => self.on_message(app, msg.get_payload_bytes()),
                        None => break,
                    },
                    _ = self.resync.notified() => self.resync_all(app).await,
                    _ = tick.tick() => self.resync_all(app).await,
                    _ = app.drain.cancelled() => return,
                }
            }
            self.subscribed.store(false, Ordering::Release);
            warn!("lost the Redis subscription: shared tier paused until resynchronised");
        }
    }

    /// Brings every database whose mirrors are not from the current
    /// generation up to date with Redis.
    async fn resync_all(&self, app: &App) {
        if !self.subscribed.load(Ordering::Acquire) {
            return;
        }
        let generation = self.sync_gen.load(Ordering::Acquire);
        for (_, db) in app.cache.databases() {
            let synced = db.shared_synced.load(Ordering::Acquire);
            if synced == generation {
                continue;
            }
            // Never synced and nothing to tell: the mirrors start from
            // Redis. Otherwise this instance may have missed bumps, or
            // failed to send its own.
            let missed = synced != 0 || db.shared_dirty.load(Ordering::Acquire);
            match self.resync_db(&db, missed).await {
                Ok(()) => {
                    if missed {
                        app.metrics.invalidations.resync.inc();
                    }
                    // A failure from now on moves the generation again.
                    db.shared_dirty.store(false, Ordering::Release);
                    db.shared_synced.store(generation, Ordering::Release);
                    self.metrics.resyncs.inc();
                }
                Err(e) => {
                    debug!(database = %db.name, error = %e, "resynchronisation failed; will retry");
                    return;
                }
            }
        }
    }

    async fn resync_db(&self, db: &DbState, missed: bool) -> Result<(), String> {
        let header = if missed {
            message_header(&db.name, &[EPOCH.to_owned()])
        } else {
            Vec::new()
        };
        let mut pairs: Vec<(String, u64)> = vec![
            (EPOCH.to_owned(), db.epoch.shared()),
            (DDL.to_owned(), db.ddl.shared()),
        ];
        for f in db.families() {
            pairs.push((format!("{TABLE}{}", f.name), f.version.shared()));
        }
        let hash = self.versions_key(&db.name);
        let all = self
            .run(async |mut c| {
                let mut invocation = self.resync_script.key(&hash);
                invocation.arg(&self.channel).arg(&header);
                for (field, value) in &pairs {
                    invocation.arg(field).arg(*value);
                }
                invocation.invoke_async::<Vec<(String, u64)>>(&mut c).await
            })
            .await?;
        // With `missed`, the epoch in `all` is new: what this instance may
        // have missed is treated as changed, locally and everywhere.
        for (field, value) in all {
            apply_field(db, &field, value);
        }
        Ok(())
    }

    fn on_message(&self, app: &App, payload: &[u8]) {
        let Some((database, updates)) = parse_message(payload) else {
            warn!("malformed invalidation message ignored");
            return;
        };
        // Databases this instance does not serve have no mirrors to update.
        let Some(db) = app.cache.existing_db(&database) else {
            return;
        };
        self.metrics
            .invalidations_received
            .inc_by(updates.len() as u64);
        app.metrics.invalidations.peer.inc();
        for (field, value) in updates {
            apply_field(&db, &field, value);
        }
    }
}

/// Raises the mirror of one field to `value`.
fn apply_field(db: &DbState, field: &str, value: u64) {
    let version: &Version = match field {
        EPOCH => &db.epoch,
        DDL => {
            if db.ddl.raise_shared(value) {
                db.reload_catalog();
            }
            return;
        }
        _ => match field.strip_prefix(TABLE) {
            Some(table) => {
                db.family(table).version.raise_shared(value);
                return;
            }
            None => return,
        },
    };
    version.raise_shared(value);
}

/// `u16 database length, database, u16 field count, (u16 length, field)*`;
/// the bump script appends the new values as comma-separated decimals.
fn message_header(database: &str, fields: &[String]) -> Vec<u8> {
    let mut out = Vec::with_capacity(database.len() + 4 + fields.len() * 16);
    out.extend_from_slice(&(database.len() as u16).to_le_bytes());
    out.extend_from_slice(database.as_bytes());
    out.extend_from_slice(&(fields.len() as u16).to_le_bytes());
    for f in fields {
        out.extend_from_slice(&(f.len() as u16).to_le_bytes());
        out.extend_from_slice(f.as_bytes());
    }
    out
}

fn parse_message(payload: &[u8]) -> Option<(String, Vec<(String, u64)>)> {
    fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (p.get(..n)?, p.get(n..)?);
        *p = tail;
        Some(head)
    }
    fn u16_le(p: &mut &[u8]) -> Option<usize> {
        let b = take(p, 2)?;
        Some(u16::from_le_bytes([b[0], b[1]]) as usize)
    }
    let mut p = payload;
    let len = u16_le(&mut p)?;
    let database = std::str::from_utf8(take(&mut p, len)?).ok()?.to_owned();
    let count = u16_le(&mut p)?;
    let mut fields = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let len = u16_le(&mut p)?;
        fields.push(std::str::from_utf8(take(&mut p, len)?).ok()?.to_owned());
    }
    let values = std::str::from_utf8(p).ok()?;
    let values: Vec<u64> = values
        .split(',')
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    (values.len() == fields.len()).then(|| (database, fields.into_iter().zip(values).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused() {
        let fields = vec!["t:public.a,b".to_owned(), EPOCH.to_owned()];
        let mut msg = message_header("my\ndb", &fields);
        msg.extend_from_slice(b"7,9");
        let (db, updates) = parse_message(&msg).unwrap();
        assert_eq!(db, "my\ndb");
        assert_eq!(
            updates,
            vec![("t:public.a,b".to_owned(), 7), ("e".to_owned(), 9)]
        );
        let mut short = message_header("db", &fields);
        short.extend_from_slice(b"7");
        assert!(parse_message(&short).is_none(), "a value is missing");
        assert!(parse_message(&msg[..msg.len() - 4]).is_none());
        assert!(parse_message(b"").is_none());
        assert!(parse_message(&[0xff, 0xff, 1]).is_none());
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_reopens_at_the_trial() {
        let b = Breaker {
            threshold: 3,
            open_for: Duration::from_millis(30),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            start: Instant::now(),
        };
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.allows());
        assert!(b.failure(), "third consecutive failure opens it");
        assert!(!b.allows());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !b.allows() {
            assert!(Instant::now() < deadline, "the breaker never closed");
            std::thread::yield_now();
        }
        assert!(b.failure(), "one failure at the trial opens it again");
        assert!(!b.allows());
    }

    #[test]
    fn fields_raise_the_right_mirrors() {
        let db = DbState::default();
        apply_field(&db, "t:public.a", 4);
        apply_field(&db, EPOCH, 2);
        assert_eq!(db.family("public.a").version.shared(), 4);
        assert_eq!(db.epoch.shared(), 2);
        let generation = db.catalog_gen();
        apply_field(&db, DDL, 1);
        assert_ne!(
            db.catalog_gen(),
            generation,
            "DDL elsewhere reloads the catalog"
        );
        apply_field(&db, "nonsense", 9);
        apply_field(&db, "t:public.a", 3);
        assert_eq!(db.family("public.a").version.shared(), 4, "never backwards");
    }
}
