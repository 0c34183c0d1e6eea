//! The local tier: moka, bounded in bytes, entries stored as the backend's
//! own response bytes so a hit is a single write.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

/// A stored result: the backend's frames from the first response message up
/// to (not including) ReadyForQuery.
#[derive(Debug)]
pub struct CachedResponse {
    pub bytes: Bytes,
}

/// Memory an entry costs besides its bytes, charged against `max_bytes`:
/// moka's node, deque and hash-table slots, the `Arc` and the key, plus
/// allocator rounding. Measured with `bench/cache.sh` (peak RSS after one
/// million small entries), so that the budget holds for real.
const ENTRY_OVERHEAD: usize = 320;

pub struct LocalCache {
    /// `None`: no local tier (`cache.local.max_bytes = 0`), Redis only.
    inner: Option<moka::sync::Cache<u128, Arc<CachedResponse>>>,
    max_entry_bytes: usize,
}

impl LocalCache {
    /// `ttl` of zero means entries live until evicted or invalidated;
    /// `max_bytes` of zero means no local tier at all.
    pub fn new(max_bytes: u64, max_entry_bytes: usize, ttl: Duration) -> Self {
        if max_bytes == 0 {
            return Self {
                inner: None,
                max_entry_bytes,
            };
        }
        let mut builder = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_k: &u128, v: &Arc<CachedResponse>| {
                u32::try_from(v.bytes.len() + ENTRY_OVERHEAD).unwrap_or(u32::MAX)
            });
        if !ttl.is_zero() {
            builder = builder.time_to_live(ttl);
        }
        Self {
            inner: Some(builder.build()),
            max_entry_bytes,
        }
    }

    pub fn get(&self, key: u128) -> Option<Arc<CachedResponse>> {
        self.inner.as_ref()?.get(&key)
    }

    /// Stores a copy of `bytes` in an allocation of exactly its size (a
    /// capture buffer may have grown to twice what it holds).
    pub fn insert(&self, key: u128, bytes: &[u8]) {
        if let Some(inner) = &self.inner
            && bytes.len() <= self.max_entry_bytes
        {
            inner.insert(
                key,
                Arc::new(CachedResponse {
                    bytes: Bytes::copy_from_slice(bytes),
                }),
            );
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
        let cache = LocalCache::new(64 * 1024, 4096, Duration::ZERO);
        for k in 0..1000u128 {
            cache.insert(k, &[0u8; 1000]);
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
        let cache = LocalCache::new(0, 100, Duration::ZERO);
        cache.insert(1, &[0u8; 10]);
        assert!(cache.get(1).is_none());
        assert_eq!(cache.entry_count(), 0);
    }

    #[test]
    fn entries_over_the_size_limit_are_not_stored() {
        let cache = LocalCache::new(1 << 20, 100, Duration::ZERO);
        cache.insert(1, &[0u8; 101]);
        cache.insert(2, &[0u8; 100]);
        assert!(cache.get(1).is_none());
        assert_eq!(cache.get(2).unwrap().bytes.len(), 100);
    }
}
