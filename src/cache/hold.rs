//! pgcache's hold on a database: the connections it keeps there of its own
//! (the replication stream, whose temporary slot is active, its control
//! connection, the catalog fetcher's). PostgreSQL refuses `DROP DATABASE`
//! (even `WITH (FORCE)`) while a logical slot on it is active, and
//! `ALTER DATABASE ... RENAME` or `CREATE DATABASE ... TEMPLATE` while
//! anyone is connected to it. So pgcache lets go of a database when such a
//! statement comes through it, and when no client has used the database for
//! `replication.idle_release_secs`; the next client to use it takes hold
//! again.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

pub struct Hold {
    anchor: Instant,
    /// When a client last used the database, in milliseconds since
    /// `anchor`.
    last_use: AtomicU64,
    /// Cancelled to let go; a new one is put in its place at once, for
    /// whoever takes hold next.
    token: Mutex<CancellationToken>,
    /// Statements that need the database free and have not finished:
    /// nothing takes hold again meanwhile.
    pauses: Arc<AtomicUsize>,
}

impl Default for Hold {
    fn default() -> Self {
        Self {
            anchor: Instant::now(),
            last_use: AtomicU64::new(0),
            token: Mutex::default(),
            pauses: Arc::default(),
        }
    }
}

impl Hold {
    /// A client used the database now.
    pub fn touch(&self) {
        self.touch_at(Instant::now());
    }

    /// A client used the database at `now` (a statement's start, read
    /// once for everything the statement times).
    pub fn touch_at(&self, now: Instant) {
        let now = now.saturating_duration_since(self.anchor).as_millis() as u64;
        // Most calls find the value current; a load is cheaper than a store
        // on a line other cores read.
        if self.last_use.load(Ordering::Relaxed) != now {
            self.last_use.store(now, Ordering::Relaxed);
        }
    }

    /// How long no client has used the database.
    pub fn idle_for(&self) -> Duration {
        let last = self.last_use.load(Ordering::Relaxed);
        self.anchor
            .elapsed()
            .saturating_sub(Duration::from_millis(last))
    }

    /// Cancelled when pgcache lets go of the database; the connections of
    /// whoever holds it close then.
    pub fn token(&self) -> CancellationToken {
        self.lock().clone()
    }

    /// Lets go: everyone holding the current token closes its connections.
    pub fn let_go(&self) {
        let old = std::mem::take(&mut *self.lock());
        old.cancel();
    }

    /// Whether a statement that needs the database free is under way.
    pub fn paused(&self) -> bool {
        self.pauses.load(Ordering::Acquire) > 0
    }

    /// Keeps pgcache off the database until the guard is dropped.
    pub fn pause(&self) -> Paused {
        self.pauses.fetch_add(1, Ordering::AcqRel);
        Paused(Arc::clone(&self.pauses))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CancellationToken> {
        self.token.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Keeps pgcache off a database until dropped: held by the session whose
/// statement needs the database free, until that statement is answered.
pub struct Paused(Arc<AtomicUsize>);

impl Drop for Paused {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letting_go_cancels_the_holders_token_and_not_the_next_ones() {
        let hold = Hold::default();
        let first = hold.token();
        hold.let_go();
        assert!(first.is_cancelled());
        assert!(!hold.token().is_cancelled());
    }

    #[test]
    fn a_pause_lasts_as_long_as_its_guard() {
        let hold = Hold::default();
        let a = hold.pause();
        let b = hold.pause();
        drop(a);
        assert!(hold.paused());
        drop(b);
        assert!(!hold.paused());
    }

    #[test]
    fn use_resets_the_idle_time() {
        let hold = Hold::default();
        hold.touch();
        assert!(hold.idle_for() < Duration::from_secs(1));
    }
}
