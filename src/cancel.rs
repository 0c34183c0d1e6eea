//! CancelRequest routing.
//!
//! A client is handed the key of the backend it talks to with pgcache's own
//! secret in place of PostgreSQL's: the process id is the real one, so
//! `pg_backend_pid()`, BackendKeyData and the pid in a NotificationResponse
//! agree, and `pg_terminate_backend` on it reaches that client's backend.
//! The secret is pgcache's, drawn at random per session, so a client cannot
//! cancel another session's queries by guessing, nor go round pgcache with
//! the backend's key. A client that is not tied to one backend (a pooled
//! one) gets a [`ClientPid::Synthetic`] id instead. A CancelRequest arriving
//! on a new connection is looked up here and sent on to the right backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rand::Rng;

use crate::upstream::UpstreamAddr;

#[derive(Debug, Clone)]
pub struct CancelTarget {
    pub addr: UpstreamAddr,
    pub backend_pid: u32,
    pub backend_secret: Vec<u8>,
}

/// The process id a client is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientPid {
    /// The backend's own: the client keeps one backend for its session.
    Backend,
    /// A made-up one: the client's backend may change under it.
    Synthetic,
}

/// The backend a key cancels: fixed for a session that keeps its backend,
/// moved by a pooled session each time it takes a server connection (and
/// emptied between them, when there is nothing to cancel).
type Slot = Arc<Mutex<Option<Arc<CancelTarget>>>>;

struct Entry {
    secret: Vec<u8>,
    target: Slot,
}

/// Registered keys by the process id clients were shown. Two sessions can
/// be shown the same id (two upstream servers, or a backend's pid reused
/// before the old session's guard is dropped); their secrets tell them
/// apart.
#[derive(Default)]
pub struct CancelRegistry {
    entries: Mutex<HashMap<u32, Vec<Entry>>>,
}

/// Removes the registration when the session ends.
pub struct CancelGuard {
    registry: Arc<CancelRegistry>,
    pid: u32,
    secret: Vec<u8>,
    target: Slot,
}

impl CancelGuard {
    /// The key the client is given: its process id and secret.
    pub fn key(&self) -> (u32, &[u8]) {
        (self.pid, &self.secret)
    }

    /// A pooled session's key now cancels on `target` (`None`: nothing).
    pub fn retarget(&self, target: Option<Arc<CancelTarget>>) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = target;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let mut map = self.registry.lock();
        if let Some(entries) = map.get_mut(&self.pid) {
            entries.retain(|e| e.secret != self.secret);
            if entries.is_empty() {
                map.remove(&self.pid);
            }
        }
    }
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Vec<Entry>>> {
        // A panic while holding this lock cannot leave the map inconsistent.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a backend and returns the key to hand to the client. The
    /// client's secret has the same length as the backend's (4 bytes in
    /// protocol 3.0, longer in 3.2).
    pub fn register(
        self: &Arc<Self>,
        target: CancelTarget,
        shown: ClientPid,
    ) -> (u32, Vec<u8>, CancelGuard) {
        let pid = (shown == ClientPid::Backend).then_some(target.backend_pid);
        let len = target.backend_secret.len().max(4);
        self.add(pid, len, Some(Arc::new(target)))
    }

    /// Registers a pooled session, whose key cancels on whichever server
    /// connection it holds at the time ([`CancelGuard::retarget`]).
    pub fn register_pooled(self: &Arc<Self>) -> (u32, Vec<u8>, CancelGuard) {
        self.add(None, 4, None)
    }

    /// `pid`: the one to show, or `None` for a made-up one.
    fn add(
        self: &Arc<Self>,
        pid: Option<u32>,
        secret_len: usize,
        target: Option<Arc<CancelTarget>>,
    ) -> (u32, Vec<u8>, CancelGuard) {
        let mut rng = rand::rng();
        let mut map = self.lock();
        let (pid, secret) = loop {
            // Positive, non-zero, like a real process id.
            let pid = pid.unwrap_or_else(|| rng.random_range(1..=i32::MAX as u32));
            let mut secret = vec![0u8; secret_len];
            rng.fill(&mut secret[..]);
            let taken = map
                .get(&pid)
                .is_some_and(|entries| entries.iter().any(|e| e.secret == secret));
            if !taken {
                break (pid, secret);
            }
        };
        let target = Arc::new(Mutex::new(target));
        map.entry(pid).or_default().push(Entry {
            secret: secret.clone(),
            target: Arc::clone(&target),
        });
        let guard = CancelGuard {
            registry: Arc::clone(self),
            pid,
            secret: secret.clone(),
            target,
        };
        (pid, secret, guard)
    }

    /// The backend to cancel for a client's key, if the key is valid.
    pub fn lookup(&self, pid: u32, secret: &[u8]) -> Option<Arc<CancelTarget>> {
        let map = self.lock();
        let entries = map.get(&pid)?;
        // Every candidate is compared, so the time taken tells nothing.
        let mut found = None;
        for entry in entries {
            if constant_time_eq(&entry.secret, secret) {
                found = Some(Arc::clone(&entry.target));
            }
        }
        let slot = found?;
        slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(pid: u32) -> CancelTarget {
        CancelTarget {
            addr: UpstreamAddr::Tcp {
                host: "h".into(),
                port: 1,
            },
            backend_pid: pid,
            backend_secret: vec![9, 9, 9, 9],
        }
    }

    #[test]
    fn only_the_exact_key_finds_the_backend_and_only_while_registered() {
        let reg = Arc::new(CancelRegistry::default());
        let (pid, secret, guard) = reg.register(target(77), ClientPid::Synthetic);
        assert_ne!(pid, 77);
        assert_eq!(secret.len(), 4);
        assert_eq!(reg.lookup(pid, &secret).unwrap().backend_pid, 77);
        let mut wrong = secret.clone();
        wrong[0] ^= 1;
        assert!(reg.lookup(pid, &wrong).is_none());
        assert!(reg.lookup(pid, &secret[..3]).is_none());
        drop(guard);
        assert!(reg.lookup(pid, &secret).is_none());
        assert!(reg.is_empty());
    }

    #[test]
    fn keys_are_distinct_per_session() {
        let reg = Arc::new(CancelRegistry::default());
        let a = reg.register(target(1), ClientPid::Synthetic);
        let b = reg.register(target(2), ClientPid::Synthetic);
        assert_ne!((a.0, &a.1), (b.0, &b.1));
        assert_eq!(reg.len(), 2);
    }

    #[test]
    fn a_backend_pid_shown_twice_is_told_apart_by_the_secret() {
        let reg = Arc::new(CancelRegistry::default());
        let (pid_a, secret_a, guard_a) = reg.register(target(42), ClientPid::Backend);
        let mut other = target(42);
        other.backend_secret = vec![7, 7, 7, 7];
        let (pid_b, secret_b, guard_b) = reg.register(other, ClientPid::Backend);
        assert_eq!((pid_a, pid_b), (42, 42));
        assert_ne!(
            secret_a,
            [9, 9, 9, 9],
            "the backend's secret is never shown"
        );
        assert_eq!(
            reg.lookup(42, &secret_a).unwrap().backend_secret,
            [9, 9, 9, 9]
        );
        assert_eq!(
            reg.lookup(42, &secret_b).unwrap().backend_secret,
            [7, 7, 7, 7]
        );
        drop(guard_a);
        assert!(reg.lookup(42, &secret_a).is_none());
        assert!(reg.lookup(42, &secret_b).is_some());
        drop(guard_b);
        assert!(reg.is_empty());
    }

    #[test]
    fn a_pooled_key_cancels_on_the_server_it_holds_now() {
        let reg = Arc::new(CancelRegistry::default());
        let (pid, secret, guard) = reg.register_pooled();
        assert!(reg.lookup(pid, &secret).is_none(), "nothing held yet");
        guard.retarget(Some(Arc::new(target(5))));
        assert_eq!(reg.lookup(pid, &secret).unwrap().backend_pid, 5);
        guard.retarget(Some(Arc::new(target(6))));
        assert_eq!(reg.lookup(pid, &secret).unwrap().backend_pid, 6);
        guard.retarget(None);
        assert!(reg.lookup(pid, &secret).is_none());
        assert_eq!(reg.len(), 1);
    }
}
