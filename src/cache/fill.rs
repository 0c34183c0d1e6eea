//! Miss coalescing: concurrent identical misses wait for the first one
//! instead of all going to PostgreSQL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Misses being filled now, by local key.
#[derive(Default)]
pub struct Fills {
    filling: Mutex<HashMap<u128, tokio::sync::watch::Sender<()>>>,
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
    Wait(tokio::sync::watch::Receiver<()>),
}

impl Fills {
    pub fn claim(self: &Arc<Self>, key: u128) -> Claim {
        let mut map = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = map.get(&key) {
            return Claim::Wait(tx.subscribe());
        }
        map.insert(key, tokio::sync::watch::channel(()).0);
        Claim::Fill(FillGuard {
            fills: Arc::clone(self),
            key,
        })
    }

    /// Claims `key` only if nobody fills it now.
    pub fn try_claim(self: &Arc<Self>, key: u128) -> Option<FillGuard> {
        match self.claim(key) {
            Claim::Fill(guard) => Some(guard),
            Claim::Wait(_) => None,
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
}
