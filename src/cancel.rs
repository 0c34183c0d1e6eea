//! CancelRequest routing.
//!
//! Each client is handed pgcache's own BackendKeyData (a random process id and
//! secret), never the backend's: a client must not be able to cancel another
//! proxy session's queries by guessing, and later a session may not be tied to
//! one backend for its whole life. A CancelRequest arriving on a new
//! connection is looked up here and sent on to the right backend.

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

struct Entry {
    secret: Vec<u8>,
    target: CancelTarget,
}

#[derive(Default)]
pub struct CancelRegistry {
    entries: Mutex<HashMap<u32, Entry>>,
}

/// Removes the registration when the session ends.
pub struct CancelGuard {
    registry: Arc<CancelRegistry>,
    pid: u32,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.pid);
    }
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Entry>> {
        // A panic while holding this lock cannot leave the map inconsistent.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a backend and returns the key to hand to the client. The
    /// client's secret has the same length as the backend's (4 bytes in
    /// protocol 3.0, longer in 3.2).
    pub fn register(self: &Arc<Self>, target: CancelTarget) -> (u32, Vec<u8>, CancelGuard) {
        let mut rng = rand::rng();
        let mut secret = vec![0u8; target.backend_secret.len().max(4)];
        rng.fill(&mut secret[..]);
        let mut map = self.lock();
        let pid = loop {
            // Positive, non-zero, like a real process id.
            let candidate = rng.random_range(1..=i32::MAX as u32);
            if !map.contains_key(&candidate) {
                break candidate;
            }
        };
        map.insert(
            pid,
            Entry {
                secret: secret.clone(),
                target,
            },
        );
        let guard = CancelGuard {
            registry: Arc::clone(self),
            pid,
        };
        (pid, secret, guard)
    }

    /// The backend to cancel for a client's key, if the key is valid.
    pub fn lookup(&self, pid: u32, secret: &[u8]) -> Option<CancelTarget> {
        let map = self.lock();
        let entry = map.get(&pid)?;
        constant_time_eq(&entry.secret, secret).then(|| entry.target.clone())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
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
        let (pid, secret, guard) = reg.register(target(77));
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
        let a = reg.register(target(1));
        let b = reg.register(target(2));
        assert_ne!((a.0, &a.1), (b.0, &b.1));
        assert_eq!(reg.len(), 2);
    }
}
