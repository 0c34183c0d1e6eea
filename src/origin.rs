//! This instance's name on its connections to PostgreSQL, its client
//! sessions' and its own, so the DDL event trigger can tell the stream
//! which instance sent the DDL: that instance handled it already, its
//! session by analysing the statement, pgcache itself where it ran it (its
//! publication's tables); see [`crate::invalidation::trigger`].

use std::borrow::Cow;
use std::sync::atomic::{AtomicU8, Ordering};

/// The setting the connections carry, in their startup `options`. A
/// placeholder setting: `SHOW ALL` and `pg_settings` do not list it.
pub const ORIGIN_SETTING: &str = "pgcache.origin";

const UNKNOWN: u8 = 0;
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 2;

/// This instance's origin, and whether the upstream takes it.
#[derive(Debug)]
pub struct Origin {
    /// Names this instance: on its connections, in its heartbeats.
    pub id: u64,
    /// Whether a login with the setting was accepted: PostgreSQL takes any
    /// placeholder, a pooler in between may refuse it (PgBouncer does,
    /// unless told to ignore it). Until known, connections go without.
    state: AtomicU8,
}

impl Default for Origin {
    fn default() -> Self {
        Self {
            id: rand::random(),
            state: AtomicU8::new(UNKNOWN),
        }
    }
}

impl Origin {
    /// [`ORIGIN_SETTING`]'s value on this instance's connections.
    pub fn value(&self) -> String {
        format!("{:016x}", self.id)
    }

    fn accepted(&self) -> bool {
        self.state.load(Ordering::Acquire) == ACCEPTED
    }

    /// [`ORIGIN_SETTING`] as an `options` startup parameter's entry.
    pub fn option(&self) -> String {
        format!("-c {ORIGIN_SETTING}={}", self.value())
    }

    /// The `options` entry of this instance's logins, once the upstream is
    /// known to take it.
    pub fn options(&self) -> Option<String> {
        self.accepted().then(|| self.option())
    }

    /// A client's StartupMessage `raw` as it goes to PostgreSQL: with
    /// [`ORIGIN_SETTING`] added once the upstream is known to take it
    /// (unchanged where it cannot be added).
    pub fn client_startup<'a>(&self, raw: &'a [u8]) -> Cow<'a, [u8]> {
        if !self.accepted() {
            return Cow::Borrowed(raw);
        }
        match crate::protocol::startup::with_setting(raw, ORIGIN_SETTING, &self.value()) {
            Some(tagged) => Cow::Owned(tagged),
            None => Cow::Borrowed(raw),
        }
    }

    /// Whether the upstream's answer is known.
    pub fn known(&self) -> bool {
        self.state.load(Ordering::Acquire) != UNKNOWN
    }

    /// The upstream took a login with the setting, or refused it.
    pub fn settle(&self, accepted: bool) {
        let state = if accepted { ACCEPTED } else { REFUSED };
        self.state.store(state, Ordering::Release);
    }
}
