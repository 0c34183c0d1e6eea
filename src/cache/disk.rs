//! The disk tier: stored answers kept in files under `cache.disk.path`,
//! between memory and Redis. A miss in memory looks here before Redis; a
//! disk hit is promoted to memory.
//!
//! The files are an LSM tree (lsm-tree, the engine of fjall;
//! docs/design.md says why not foyer): answers are packed, compressed and
//! checksummed in blocks, and the tree is compacted first in, first out:
//! past its share of `max_bytes`, its oldest files are dropped whole. It
//! has no journal: what is still in memory when pgcache dies is lost,
//! which for a cache is a few misses, and a file is in the tree only once
//! it is whole. Entries are never updated or deleted: a key names one
//! state of what it reads (the versions are part of it), so an
//! invalidation makes old entries unreachable and they leave with their
//! file.
//!
//! The tier is never a reason for a client error. Writes go through a
//! bounded queue to a thread of their own, off the response path (dropped
//! when it is full). A read slower than `read_timeout_ms`, or one that
//! fails, is a miss. A directory that stops taking writes (a full disk, a
//! path made read-only) is found by a probe written beside the files;
//! while it fails the tier is set aside (`pgcache_disk_up` 0, one log
//! line) and the other tiers answer.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use lsm_tree::{AbstractTree, Tree};

use super::carry::Carried;
use super::{Lifetime, unix_ms};
use crate::config::DiskCacheConfig;
use crate::metrics::DiskMetrics;

/// The smallest `cache.disk.max_bytes`.
pub const MIN_BYTES: u64 = 4 * 1024 * 1024;

/// The tree's own directory under `cache.disk.path`, named after the
/// layout of its entries.
const TREE: &str = "pgcache-disk-v1";

/// Held locked by the pgcache that uses the directory.
const LOCK: &str = "pgcache.lock";
/// The directory's instance id: it names the replication slots whose
/// changes the carried entries are proven against.
const INSTANCE: &str = "pgcache-instance";

/// The probe file written beside the tree to tell whether the directory
/// still takes writes.
const PROBE: &str = "pgcache-probe";
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Answers waiting for the writer thread; past this, stores are dropped.
const QUEUE: usize = 1024;

/// Why the disk tier cannot start: a start-up error.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cache.disk.path {path}: {cause}")]
    Unusable {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("cache.disk.path {path}: {cause}")]
    Open {
        path: PathBuf,
        cause: lsm_tree::Error,
    },
    /// Another pgcache uses the directory (it is handing over to this one).
    #[error("cache.disk.path {path}: in use by another pgcache")]
    Locked { path: PathBuf },
}

/// One stored answer: when it was made, how long it lives, and the frames.
#[derive(Debug, Clone)]
pub struct Stored {
    created_ms: u64,
    /// 0: no TTL.
    ttl_ms: u64,
    /// 0: never refreshed.
    refresh_ms: u64,
    pub payload: Bytes,
}

/// Created, TTL and refresh (milliseconds), then a checksum of the key,
/// those and the frames: the tree does not check its blocks when it
/// reads them, so a corrupt or misplaced entry is told here.
const HEADER: usize = 32;

impl Stored {
    fn new(bytes: &[u8], lifetime: Lifetime) -> Self {
        let ms = |d: Option<Duration>| d.map_or(0, |d| (d.as_millis() as u64).max(1));
        Self {
            created_ms: unix_ms(),
            ttl_ms: ms(lifetime.ttl),
            refresh_ms: ms(lifetime.refresh),
            payload: Bytes::copy_from_slice(bytes),
        }
    }

    /// Its lifetime, and how old it is now; `None` once its TTL ran out.
    pub fn lifetime(&self) -> Option<(Lifetime, Duration)> {
        let age = Duration::from_millis(unix_ms().saturating_sub(self.created_ms));
        let ms = |v: u64| (v > 0).then(|| Duration::from_millis(v));
        let lifetime = Lifetime {
            ttl: ms(self.ttl_ms),
            refresh: ms(self.refresh_ms),
        };
        match lifetime.ttl {
            Some(ttl) if ttl <= age => None,
            _ => Some((lifetime, age)),
        }
    }

    fn encode(&self, key: u128) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.payload.len());
        out.put_u64_le(self.created_ms);
        out.put_u64_le(self.ttl_ms);
        out.put_u64_le(self.refresh_ms);
        out.put_u64_le(checksum(key, &out, &self.payload));
        out.extend_from_slice(&self.payload);
        out
    }

    /// `None` for a value that is not whole, or not what was stored under
    /// `key`.
    fn decode(key: u128, value: &[u8]) -> Option<Self> {
        let (mut header, payload) = value.split_at_checked(HEADER)?;
        let stored = Self {
            created_ms: header.get_u64_le(),
            ttl_ms: header.get_u64_le(),
            refresh_ms: header.get_u64_le(),
            payload: Bytes::copy_from_slice(payload),
        };
        (header.get_u64_le() == checksum(key, &value[..HEADER - 8], payload)).then_some(stored)
    }
}

fn checksum(key: u128, header: &[u8], payload: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&key.to_le_bytes());
    h.update(header);
    h.update(payload);
    h.digest()
}

/// What a disk read found.
pub enum Read {
    Hit(Stored),
    Miss,
    /// Past the read deadline, or the read failed: a miss all the same.
    Failed,
}

pub struct DiskTier {
    /// Locked while this pgcache uses the directory.
    lock: std::fs::File,
    instance: u32,
    max_retained_wal: u64,
    answers: Tree,
    budget: Budget,
    dir: PathBuf,
    read_timeout: Duration,
    /// To the writer thread.
    queue: SyncSender<(u128, Stored)>,
    /// The directory takes writes (the last probe succeeded).
    up: AtomicBool,
    /// Closed for good (carried, or pgcache stopping): nothing is read or
    /// written any more. The writer holds the lock while it writes, so
    /// once [`DiskTier::close`] has it, no write follows.
    closed: AtomicBool,
    writing: std::sync::Mutex<()>,
    metrics: DiskMetrics,
}

impl DiskTier {
    /// Opens the tier's files under `config.path`, creating the directory;
    /// an error if it cannot be written there, or another pgcache uses it.
    /// With what the last run carried, if it stopped cleanly; else the
    /// files start empty.
    pub fn open(
        config: &DiskCacheConfig,
        metrics: DiskMetrics,
    ) -> Result<(Arc<Self>, Option<Carried>), DiskError> {
        let dir = config.path.clone();
        let unusable = |cause| DiskError::Unusable {
            path: dir.clone(),
            cause,
        };
        std::fs::create_dir_all(&dir).map_err(unusable)?;
        probe(&dir).map_err(unusable)?;
        let lock = lock(&dir)?;
        let instance = instance(&dir).map_err(unusable)?;
        let carried = Carried::take(&dir).map_err(unusable)?;
        let budget = Budget::of(config.max_bytes);
        let whole = carried
            .as_ref()
            .is_some_and(|c| tree_files(&dir.join(TREE)) == c.files);
        if carried.is_some() && !whole {
            tracing::warn!(path = %dir.display(),
                "the disk tier's files changed since the last run stopped: it starts empty");
        }
        let carried = carried.filter(|_| whole);
        let answers = open_tree(&dir, &budget, carried.is_some(), &metrics)?;
        let (queue, writes) = std::sync::mpsc::sync_channel(QUEUE);
        metrics.up.set(1);
        metrics
            .capacity
            .set(i64::try_from(config.max_bytes).unwrap_or(i64::MAX));
        let tier = Arc::new(Self {
            lock,
            instance,
            max_retained_wal: config.max_retained_wal_bytes,
            answers,
            budget,
            dir: dir.clone(),
            read_timeout: Duration::from_millis(config.read_timeout_ms),
            queue,
            up: AtomicBool::new(true),
            closed: AtomicBool::new(false),
            writing: std::sync::Mutex::new(()),
            metrics,
        });
        let writer = Arc::downgrade(&tier);
        std::thread::Builder::new()
            .name("pgcache-disk".to_owned())
            .spawn(move || write_all(writer, writes))
            .map_err(unusable)?;
        Ok((tier, carried))
    }

    /// The persistent replication slot of `database`'s stream.
    pub fn slot_name(&self, database: &str) -> String {
        crate::invalidation::slot::persistent_name(self.instance, database)
    }

    pub fn max_retained_wal(&self) -> u64 {
        self.max_retained_wal
    }

    /// Writes what the next run needs to serve the entries again: after
    /// the files reached the disk, so that a crash in between leaves the
    /// entries but not the means to use them.
    /// Then the directory is unlocked, for a pgcache taking over.
    /// Once only.
    pub fn carry(&self, mut carried: Carried) -> bool {
        if !self.close() {
            return false;
        }
        carried.files = tree_files(&self.dir.join(TREE));
        if let Err(e) = carried.save(&self.dir) {
            tracing::warn!(path = %self.dir.display(), error = %e,
                "could not save what the disk tier carries: the next run starts it empty");
        }
        if let Err(e) = self.lock.unlock() {
            tracing::warn!(error = %e, "could not unlock the disk tier's directory");
        }
        true
    }

    /// Queues an answer for the writer thread; dropped (and counted) when
    /// the queue is full or the tier is set aside.
    pub fn store(&self, key: u128, bytes: &[u8], lifetime: Lifetime) {
        if !self.is_up() {
            return;
        }
        match self.queue.try_send((key, Stored::new(bytes, lifetime))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.metrics.dropped.inc();
            }
        }
    }

    /// Reads the answer stored under `key`, within the read deadline.
    pub async fn get(self: &Arc<Self>, key: u128) -> Read {
        if !self.is_up() {
            return Read::Miss;
        }
        let tier = Arc::clone(self);
        let read = tokio::task::spawn_blocking(move || tier.answers.get(key.to_be_bytes(), None));
        match tokio::time::timeout(self.read_timeout, read).await {
            Ok(Ok(Ok(Some(value)))) => match Stored::decode(key, &value) {
                Some(stored) => Read::Hit(stored),
                None => {
                    self.metrics.read_failures.inc();
                    Read::Failed
                }
            },
            Ok(Ok(Ok(None))) => {
                self.metrics.misses.inc();
                Read::Miss
            }
            Ok(Ok(Err(e))) => {
                tracing::debug!(error = %e, "disk tier read failed: a miss");
                self.metrics.read_failures.inc();
                Read::Failed
            }
            Ok(Err(_)) => {
                self.metrics.read_failures.inc();
                Read::Failed
            }
            Err(_) => {
                self.metrics.read_timeouts.inc();
                Read::Failed
            }
        }
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire) && !self.closed.load(Ordering::Acquire)
    }

    /// Bytes the tier's files take on disk.
    pub fn used_bytes(&self) -> u64 {
        used_bytes(&self.dir.join(TREE))
    }

    /// Adds an answer to the tree (the writer thread's work): into memory,
    /// and once that holds a memtable's worth, into a file of its own,
    /// after which the oldest files go if the files are over their share.
    fn write(&self, key: u128, stored: &Stored, seqno: u64) -> lsm_tree::Result<()> {
        let (_, memtable) = self
            .answers
            .insert(key.to_be_bytes(), stored.encode(key), seqno);
        if u64::from(memtable) >= self.budget.memtable {
            self.answers.flush_active_memtable(0)?;
            // Only to drop the oldest files: under the limit, FIFO would
            // merge the overlapping ones, rewriting what it will drop.
            if self.answers.disk_space() > self.budget.files {
                let fifo = lsm_tree::compaction::Fifo::new(self.budget.files, None);
                self.answers.compact(Arc::new(fifo), 0)?;
            }
        }
        Ok(())
    }

    /// Entries in the tree (an estimate: dropped files are subtracted
    /// whole).
    pub fn entries(&self) -> u64 {
        self.answers.approximate_len() as u64
    }

    /// Probes the directory every second, setting the tier aside while it
    /// takes no writes and bringing it back when it does; hands what was
    /// written to the operating system; refreshes the gauges.
    pub fn spawn_probe(self: &Arc<Self>, drain: tokio_util::sync::CancellationToken) {
        let tier = Arc::clone(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(PROBE_EVERY);
            loop {
                tokio::select! {
                    _ = drain.cancelled() => return,
                    _ = every.tick() => {}
                }
                let t = Arc::clone(&tier);
                let probed = tokio::task::spawn_blocking(move || {
                    probe(&t.dir)?;
                    Ok(t.used_bytes())
                })
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
                tier.probed(probed);
            }
        });
    }

    fn probed(&self, result: std::io::Result<u64>) {
        match result {
            Ok(used) => {
                self.metrics
                    .bytes
                    .set(i64::try_from(used).unwrap_or(i64::MAX));
                self.metrics
                    .entries
                    .set(i64::try_from(self.entries()).unwrap_or(i64::MAX));
                if !self.up.swap(true, Ordering::AcqRel) {
                    tracing::warn!(path = %self.dir.display(), "the disk tier takes writes again: back in use");
                    self.metrics.up.set(1);
                }
            }
            Err(e) => {
                if self.up.swap(false, Ordering::AcqRel) {
                    tracing::warn!(path = %self.dir.display(), error = %e,
                        "the disk tier's directory takes no writes: set aside, memory and Redis answer meanwhile");
                    self.metrics.up.set(0);
                    self.metrics.set_aside.inc();
                }
            }
        }
    }

    /// Writes what is still in memory to a file.
    /// Writes what is still in memory to a file, and stops: false if it
    /// was closed already.
    pub fn close(&self) -> bool {
        let _writing = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.swap(true, Ordering::AcqRel) {
            return false;
        }
        if let Err(e) = self.answers.flush_active_memtable(0) {
            tracing::warn!(error = %e, "closing the disk tier");
        }
        true
    }
}

/// How `cache.disk.max_bytes` is shared out: the tree's files, compacted
/// first in, first out past their share, which a flush overshoots by up to
/// a memtable; and the memory it uses.
struct Budget {
    files: u64,
    memtable: u64,
    block_cache: u64,
}

impl Budget {
    fn of(max_bytes: u64) -> Self {
        // FIFO compaction drops a whole file once the files are over
        // their share, so they overshoot it by up to one flushed memtable.
        let memtable = (max_bytes / 32).clamp(256 * 1024, 64 * 1024 * 1024);
        Self {
            files: max_bytes - 2 * memtable,
            memtable,
            block_cache: (max_bytes / 64).clamp(1024 * 1024, 64 * 1024 * 1024),
        }
    }
}

/// The writer thread: writes queued answers until the tier is dropped.
/// A write that fails is counted; the probe decides whether the tier is
/// set aside.
fn write_all(tier: std::sync::Weak<DiskTier>, writes: Receiver<(u128, Stored)>) {
    let mut seqno = match tier.upgrade() {
        Some(tier) => tier.answers.get_highest_seqno().map_or(0, |s| s + 1),
        None => return,
    };
    while let Ok((key, stored)) = writes.recv() {
        let Some(tier) = tier.upgrade() else { return };
        let _writing = tier.writing.lock().unwrap_or_else(|e| e.into_inner());
        if tier.closed.load(Ordering::Acquire) {
            return;
        }
        seqno += 1;
        match tier.write(key, &stored, seqno) {
            Ok(()) => tier.metrics.stores.inc(),
            Err(e) => {
                tracing::debug!(error = %e, "disk tier write failed");
                tier.metrics.write_failures.inc();
            }
        }
    }
}

/// Every file under `tree`, by path under it, with the xxh3 of its bytes.
fn tree_files(tree: &Path) -> std::collections::BTreeMap<String, u64> {
    let mut files = std::collections::BTreeMap::new();
    let mut dirs = vec![tree.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if let (Ok(bytes), Ok(name)) = (std::fs::read(&path), path.strip_prefix(tree)) {
                files.insert(
                    name.display().to_string(),
                    xxhash_rust::xxh3::xxh3_64(&bytes),
                );
            }
        }
    }
    files
}

/// Locks the directory for this pgcache.
fn lock(dir: &Path) -> Result<std::fs::File, DiskError> {
    let unusable = |cause| DiskError::Unusable {
        path: dir.to_owned(),
        cause,
    };
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK))
        .map_err(unusable)?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(std::fs::TryLockError::WouldBlock) => Err(DiskError::Locked {
            path: dir.to_owned(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(unusable(e)),
    }
}

/// Opens the tree in `dir`: as the last run left it if it was `carried`;
/// else, its entries' keys cannot be matched again, and it starts empty.
fn open_tree(
    dir: &Path,
    budget: &Budget,
    carried: bool,
    metrics: &DiskMetrics,
) -> Result<Tree, DiskError> {
    let unusable = |cause| DiskError::Unusable {
        path: dir.to_owned(),
        cause,
    };
    let tree = dir.join(TREE);
    if !carried && tree.exists() {
        let discarded = lsm_tree::Config::new(&tree)
            .open()
            .map_or(0, |answers| answers.approximate_len());
        if discarded > 0 {
            tracing::warn!(path = %dir.display(), entries = discarded,
                "the disk tier starts empty: the last run did not stop cleanly, so its entries cannot be proven fresh");
            metrics.discarded.inc_by(discarded as u64);
        }
        std::fs::remove_dir_all(&tree).map_err(unusable)?;
    }
    let config = || {
        lsm_tree::Config::new(&tree)
            .use_cache(Arc::new(lsm_tree::Cache::with_capacity_bytes(
                budget.block_cache,
            )))
            .compression(lsm_tree::CompressionType::Lz4)
    };
    match config().open() {
        Ok(answers) => Ok(answers),
        // Files that cannot be read back are a cache lost, not a reason
        // not to start.
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e,
                "the disk tier's files cannot be read: it starts empty");
            std::fs::remove_dir_all(&tree).map_err(unusable)?;
            config().open().map_err(|cause| DiskError::Open {
                path: dir.to_owned(),
                cause,
            })
        }
    }
}

/// The directory's instance id, made at its first use.
fn instance(dir: &Path) -> std::io::Result<u32> {
    let path = dir.join(INSTANCE);
    if let Ok(text) = std::fs::read_to_string(&path)
        && let Ok(id) = u32::from_str_radix(text.trim(), 16)
    {
        return Ok(id);
    }
    let id = rand::random::<u32>();
    std::fs::write(&path, format!("{id:08x}\n"))?;
    Ok(id)
}

/// Writes, syncs and removes a page-sized file in `dir`.
fn probe(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(PROBE);
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)?;
    file.write_all(&[0u8; 4096])?;
    file.sync_data()?;
    drop(file);
    std::fs::remove_file(&path)
}

/// Bytes the files under `dir` take on disk (blocks allocated, not their
/// apparent length).
fn used_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => used_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_leaves_room_for_the_journal_and_a_flush() {
        for max in [MIN_BYTES, 8 << 20, 100 << 20, 1 << 30, 64 << 30] {
            let b = Budget::of(max);
            assert!(b.files + 2 * b.memtable <= max, "{max}");
            assert!(b.files >= max / 2, "{max}: files get {}", b.files);
        }
    }

    #[test]
    fn a_stored_answer_reads_back_with_its_lifetime() {
        let lifetime = Lifetime {
            ttl: Some(Duration::from_secs(60)),
            refresh: None,
        };
        let mut stored = Stored::new(b"frames", lifetime);
        stored.created_ms -= 1_000;
        let back = Stored::decode(7, &stored.encode(7)).unwrap();
        assert_eq!(back.payload, stored.payload);
        let (lifetime, age) = back.lifetime().unwrap();
        assert_eq!(lifetime.ttl, Some(Duration::from_secs(60)));
        assert_eq!(lifetime.refresh, None);
        assert!(age >= Duration::from_secs(1));
        let expired = Stored {
            ttl_ms: 500,
            ..stored.clone()
        };
        assert!(expired.lifetime().is_none());
        assert!(Stored::decode(7, &[0u8; HEADER - 1]).is_none());
        let mut flipped = stored.encode(7);
        *flipped.last_mut().unwrap() ^= 1;
        assert!(Stored::decode(7, &flipped).is_none(), "a corrupt entry");
        assert!(
            Stored::decode(8, &stored.encode(7)).is_none(),
            "another key's"
        );
    }
}
