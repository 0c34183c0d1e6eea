//! A fill: where a forwarded read's answer is stored ([`Fill`]), and miss
//! coalescing: concurrent identical misses wait for the first one instead
//! of all going to PostgreSQL.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{DbState, Lifetime, Reads, Request};

/// Misses being filled now, by local key. Most fills have no one waiting
/// for them: the channel that wakes waiters is made by the first waiter,
/// so an uncontended miss allocates nothing here. Keyed by digests:
/// foldhash, not SipHash.
#[derive(Default)]
pub struct Fills {
    filling: Mutex<HashMap<u128, Option<watch::Sender<()>>, foldhash::fast::RandomState>>,
}

/// Held by the one session filling a key; dropping it (after the store, or
/// when the fill fails) wakes the waiters.
pub struct FillGuard {
    fills: Arc<Fills>,
    key: u128,
}

impl Drop for FillGuard {
    fn drop(&mut self) {
        let mut map = self.fills.filling.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.key);
    }
}

pub enum Claim {
    /// Fill it; others wait for this guard to drop.
    Fill(FillGuard),
    /// Someone is filling it: wait until `changed()` fails (they finished).
    Wait(watch::Receiver<()>),
}

impl Fills {
    pub fn claim(self: &Arc<Self>, key: u128) -> Claim {
        let mut map = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        match map.entry(key) {
            Entry::Occupied(mut filling) => {
                let waiters = filling
                    .get_mut()
                    .get_or_insert_with(|| watch::channel(()).0);
                Claim::Wait(waiters.subscribe())
            }
            Entry::Vacant(free) => {
                free.insert(None);
                Claim::Fill(self.guard(key))
            }
        }
    }

    /// Claims `key` only if nobody fills it now.
    pub fn try_claim(self: &Arc<Self>, key: u128) -> Option<FillGuard> {
        let mut map = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        match map.entry(key) {
            Entry::Occupied(_) => None,
            Entry::Vacant(free) => {
                free.insert(None);
                Some(self.guard(key))
            }
        }
    }

    fn guard(self: &Arc<Self>, key: u128) -> FillGuard {
        FillGuard {
            fills: Arc::clone(self),
            key,
        }
    }
}

/// Where a forwarded read's answer will be stored: the keys made from the
/// versions read *before* it was forwarded.
pub struct Fill {
    /// `None`: not kept locally (`tier=shared`).
    pub(super) local: Option<u128>,
    /// The disk tier's key: the local one mixed with the database's
    /// disk nonce.
    pub(super) disk: u128,
    /// The shared key with the versions it was made from, if the shared
    /// tier was usable.
    pub(super) shared: Option<(u128, Vec<u64>)>,
    pub(super) lifetime: Lifetime,
    /// What the result read, for the per-table entry counts.
    pub(super) reads: Reads,
    /// Concurrent misses of this key wait until it is dropped.
    _guard: Option<FillGuard>,
}

impl Fill {
    /// The WAL position a server must have replayed past for its answer
    /// to be stored under this fill's versions: the last change of every
    /// table read, and the database's epoch (changes before the stream
    /// started are not known here); `None` while any is not known.
    pub fn floor(&self, db: &DbState) -> Option<u64> {
        db.reads_floor(&self.reads)
    }
}

impl std::fmt::Debug for Fill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fill").field("local", &self.local).finish()
    }
}

impl Fill {
    /// A fill of `key` in the local tier, reading nothing: what a
    /// session's tests capture into.
    #[cfg(test)]
    pub fn local_only(key: u128) -> Self {
        Self {
            local: Some(key),
            disk: key,
            shared: None,
            lifetime: Lifetime::default(),
            reads: Arc::from([]),
            _guard: None,
        }
    }

    /// The local key it stores under.
    #[cfg(test)]
    pub fn local_key(&self) -> Option<u128> {
        self.local
    }

    pub(super) fn new(
        req: &Request<'_>,
        local: u128,
        shared: Option<(u128, Vec<u64>)>,
        guard: Option<FillGuard>,
    ) -> Self {
        Self {
            local: req.tier.local().then_some(local),
            disk: local ^ req.db.disk_nonce,
            shared,
            lifetime: req.lifetime,
            reads: Arc::clone(req.reads),
            _guard: guard,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_claim_waits_until_the_first_guard_drops() {
        let fills = Arc::new(Fills::default());
        let Claim::Fill(guard) = fills.claim(7) else {
            panic!("the first claim fills");
        };
        let Claim::Wait(mut waiting) = fills.claim(7) else {
            panic!("the second claim waits");
        };
        assert!(fills.try_claim(7).is_none());
        assert!(fills.try_claim(8).is_some(), "other keys are free");
        drop(guard);
        assert!(waiting.changed().await.is_err(), "the filler finished");
        assert!(fills.try_claim(7).is_some());
    }

    #[tokio::test]
    async fn every_waiter_of_a_fill_wakes_when_it_ends() {
        let fills = Arc::new(Fills::default());
        let Some(guard) = fills.try_claim(3) else {
            panic!("a free key is claimed");
        };
        let (Claim::Wait(mut first), Claim::Wait(mut second)) = (fills.claim(3), fills.claim(3))
        else {
            panic!("later claims wait");
        };
        drop(guard);
        assert!(first.changed().await.is_err());
        assert!(second.changed().await.is_err());
    }
}
