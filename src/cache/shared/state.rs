//! What the shared tier keeps for each database: where it stands with
//! Redis, and its rounds of read-your-writes confirmation (the protocol is
//! in [`super::confirm`]). Plain state, held in each database's
//! [`crate::cache::DbState`].

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64};

use tokio::sync::watch;

/// Where this database stands with the shared tier.
#[derive(Default)]
pub struct SharedSync {
    /// The shared tier's sync generation the versions were last read from
    /// Redis under; 0 = never.
    pub synced: AtomicU64,
    /// A bump of this instance never reached Redis.
    pub dirty: AtomicBool,
    /// Read-your-writes confirmations with Redis.
    pub confirms: Confirms,
}

/// One database's rounds of confirmation.
pub struct Confirms {
    state: Mutex<Rounds>,
    /// The newest round answered, and the newest that failed.
    pub(super) answered: watch::Sender<(u64, u64)>,
}

#[derive(Default)]
pub(super) struct Rounds {
    /// Rounds whose fields were taken for sending. The next round, `sent +
    /// 1`, carries what `wanted` holds when it is taken.
    pub(super) sent: u64,
    /// A task is sending rounds.
    pub(super) in_flight: bool,
    /// Fields the next round asks for.
    pub(super) wanted: BTreeSet<String>,
}

impl Default for Confirms {
    fn default() -> Self {
        Self {
            state: Mutex::new(Rounds::default()),
            answered: watch::channel((0, 0)).0,
        }
    }
}

impl Confirms {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Rounds> {
        // Every critical section leaves the rounds whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}
