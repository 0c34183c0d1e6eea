//! The local tier: moka, bounded in bytes, entries stored as the backend's
//! own response bytes so a hit is a single write.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

/// A stored result: the backend's frames from the first response message up
/// to (not including) ReadyForQuery.
#[derive(Debug)]
pub struct CachedResponse {
    pub bytes: Bytes,
    pub created: Instant,
    /// How long it may be served; `None`: until evicted or invalidated.
    pub ttl: Option<Duration>,
    /// Past this age a hit refreshes it in the background.
    pub refresh: Option<Duration>,
}

impl CachedResponse {
    pub fn wants_refresh(&self) -> bool {
        self.refresh.is_some_and(|r| self.created.elapsed() >= r)
    }
}

/// How long an entry lives, and when it is refreshed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lifetime {
    pub ttl: Option<Duration>,
    pub refresh: Option<Duration>,
}

struct PerEntryTtl;

impl moka::Expiry<u128, Arc<CachedResponse>> for PerEntryTtl {
    fn expire_after_create(
        &self,
        _key: &u128,
        value: &Arc<CachedResponse>,
        _created_at: Instant,
    ) -> Option<Duration> {
        value.ttl
    }
}

/// Memory an entry costs besides its bytes, charged against `max_bytes`:
/// moka's node, deque, timer-wheel and hash-table slots, the `Arc`, the key
/// and the entry's lifetime fields, plus allocator rounding. Measured with `bench/cache.sh` (peak RSS after one
/// million small entries), so that the budget holds for real.
const ENTRY_OVERHEAD: usize = 360;

/// The hash table is made for this many entries (one per KiB of budget,
/// at most a hundred thousand: 2 MiB of slots) rather than grown from
/// nothing, so a filling cache does not rehash on the way: every miss
/// inserts.
fn initial_entries(max_bytes: u64) -> usize {
    usize::try_from(max_bytes / 1024).map_or(MAX_INITIAL_ENTRIES, |n| n.min(MAX_INITIAL_ENTRIES))
}

const MAX_INITIAL_ENTRIES: usize = 100_000;

pub struct LocalCache {
    /// `None`: no local tier (`cache.local.max_bytes = 0`), Redis only.
    /// Keyed by digests, hashed with foldhash: SipHash of each key was a
    /// tenth of a lookup.
    inner: Option<moka::sync::Cache<u128, Arc<CachedResponse>, foldhash::fast::RandomState>>,
    max_entry_bytes: usize,
}

impl LocalCache {
    /// `max_bytes` of zero means no local tier at all. Each entry has its
    /// own lifetime.
    pub fn new(max_bytes: u64, max_entry_bytes: usize) -> Self {
        Self::with_evictions(max_bytes, max_entry_bytes, None)
    }

    /// Counts what leaves the tier, and why, in `evictions`.
    pub fn with_evictions(
        max_bytes: u64,
        max_entry_bytes: usize,
        evictions: Option<crate::metrics::Evictions>,
    ) -> Self {
        if max_bytes == 0 {
            return Self {
                inner: None,
                max_entry_bytes,
            };
        }
        let mut builder = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .initial_capacity(initial_entries(max_bytes))
            .expire_after(PerEntryTtl)
            .weigher(|_k: &u128, v: &Arc<CachedResponse>| {
                u32::try_from(v.bytes.len() + ENTRY_OVERHEAD).unwrap_or(u32::MAX)
            });
        if let Some(e) = evictions {
            builder = builder.eviction_listener(move |_k, _v, cause| {
                use moka::notification::RemovalCause;
                match cause {
                    RemovalCause::Size => e.size.inc(),
                    RemovalCause::Expired => {
                        e.expired.inc();
                        e.ttl.inc();
                    }
                    RemovalCause::Replaced => e.replaced.inc(),
                    RemovalCause::Explicit => e.explicit.inc(),
                }
            });
        }
        Self {
            inner: Some(builder.build_with_hasher(foldhash::fast::RandomState::default())),
            max_entry_bytes,
        }
    }

    pub fn get(&self, key: u128) -> Option<Arc<CachedResponse>> {
        self.inner.as_ref()?.get(&key)
    }

    /// Stores a copy of `bytes` in an allocation of exactly its size (a
    /// capture buffer may have grown to twice what it holds).
    pub fn insert(&self, key: u128, bytes: &[u8], lifetime: Lifetime) {
        self.insert_aged(key, bytes, lifetime, Duration::ZERO);
    }

    /// Stores an entry that is already `age` old (it came from Redis).
    pub fn insert_aged(&self, key: u128, bytes: &[u8], lifetime: Lifetime, age: Duration) {
        let Some(inner) = &self.inner else { return };
        if bytes.len() > self.max_entry_bytes {
            return;
        }
        let ttl = match lifetime.ttl {
            Some(ttl) if ttl <= age => return,
            Some(ttl) => Some(ttl - age),
            None => None,
        };
        inner.insert(
            key,
            Arc::new(CachedResponse {
                bytes: Bytes::copy_from_slice(bytes),
                created: Instant::now().checked_sub(age).unwrap_or_else(Instant::now),
                ttl,
                refresh: lifetime.refresh,
            }),
        );
    }

    /// Drops every entry (INVALIDATE ALL).
    pub fn clear(&self) {
        if let Some(inner) = &self.inner {
            inner.invalidate_all();
        }
    }

    pub fn max_entry_bytes(&self) -> usize {
        self.max_entry_bytes
    }

    pub fn entry_count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |c| {
            c.run_pending_tasks();
            c.entry_count()
        })
    }

    pub fn weighted_bytes(&self) -> u64 {
        self.inner.as_ref().map_or(0, |c| {
            c.run_pending_tasks();
            c.weighted_size()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_its_byte_budget() {
        let cache = LocalCache::new(64 * 1024, 4096);
        for k in 0..1000u128 {
            cache.insert(k, &[0u8; 1000], Lifetime::default());
        }
        assert!(
            cache.weighted_bytes() <= 64 * 1024,
            "{}",
            cache.weighted_bytes()
        );
        assert!(cache.entry_count() < 100);
    }

    #[test]
    fn a_zero_budget_means_no_local_tier() {
        let cache = LocalCache::new(0, 100);
        cache.insert(1, &[0u8; 10], Lifetime::default());
        assert!(cache.get(1).is_none());
        assert_eq!(cache.entry_count(), 0);
    }

    #[test]
    fn entries_over_the_size_limit_are_not_stored() {
        let cache = LocalCache::new(1 << 20, 100);
        cache.insert(1, &[0u8; 101], Lifetime::default());
        cache.insert(2, &[0u8; 100], Lifetime::default());
        assert!(cache.get(1).is_none());
        assert_eq!(cache.get(2).unwrap().bytes.len(), 100);
    }

    #[test]
    fn each_entry_expires_after_its_own_ttl() {
        let cache = LocalCache::new(1 << 20, 100);
        let short = Lifetime {
            ttl: Some(Duration::from_millis(30)),
            refresh: None,
        };
        cache.insert(1, b"short", short);
        cache.insert(2, b"forever", Lifetime::default());
        // Already older than its TTL: not stored at all.
        cache.insert_aged(3, b"old", short, Duration::from_millis(31));
        assert!(cache.get(3).is_none());
        assert!(cache.get(1).is_some());
        let deadline = Instant::now() + Duration::from_secs(5);
        while cache.get(1).is_some() {
            assert!(Instant::now() < deadline, "the entry never expired");
            std::thread::yield_now();
        }
        assert!(cache.get(2).is_some());
        let aged = Lifetime {
            ttl: None,
            refresh: Some(Duration::from_millis(10)),
        };
        cache.insert_aged(4, b"x", aged, Duration::from_millis(10));
        assert!(cache.get(4).unwrap().wants_refresh());
        cache.insert(5, b"x", aged);
        assert!(!cache.get(5).unwrap().wants_refresh());
    }
}
