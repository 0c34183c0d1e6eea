//! The sessions' connections to one replica, as `SHOW SERVERS` and
//! `SHOW POOLS` tell of them. A connection is listed from the moment it is
//! logged in until the session drops it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One session's connection to the replica.
pub struct Connection {
    /// Its id in `SHOW SERVERS`, from the same sequence as the pools'.
    pub id: u64,
    pub user: Box<str>,
    pub database: Box<str>,
    /// The client whose reads it takes.
    pub client: u64,
    pub pid: u32,
    pub born: Instant,
    active: AtomicBool,
    /// When it last became active or idle, in milliseconds since `born`.
    since_ms: AtomicU64,
}

impl Connection {
    pub fn new(id: u64, user: &str, database: &str, client: u64, pid: u32) -> Self {
        Self {
            id,
            user: user.into(),
            database: database.into(),
            client,
            pid,
            born: Instant::now(),
            active: AtomicBool::new(false),
            since_ms: AtomicU64::new(0),
        }
    }

    /// A read was written to it (`true`), or its answer ended.
    pub fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::Relaxed);
        let ms = self.born.elapsed().as_millis() as u64;
        self.since_ms.store(ms, Ordering::Relaxed);
    }

    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// How long ago it became active or idle.
    pub fn since(&self) -> Duration {
        let at = Duration::from_millis(self.since_ms.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(at)
    }
}

/// The open connections to one replica, by id.
#[derive(Default)]
pub struct Connections(Mutex<BTreeMap<u64, Arc<Connection>>>);

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Connection>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn opened(&self, conn: Arc<Connection>) {
        self.lock().insert(conn.id, conn);
    }

    pub fn closed(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// The open connections, oldest id first.
    pub fn all(&self) -> Vec<Arc<Connection>> {
        self.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_listed_while_open_with_its_state() {
        let conns = Connections::default();
        let a = Arc::new(Connection::new(7, "app", "shop", 3, 4242));
        conns.opened(Arc::clone(&a));
        conns.opened(Arc::new(Connection::new(2, "app", "shop", 4, 4243)));
        let ids: Vec<u64> = conns.all().iter().map(|c| c.id).collect();
        assert_eq!(ids, [2, 7]);
        assert!(!a.is_active());
        a.set_active(true);
        assert!(conns.all()[1].is_active());
        assert!(a.since() <= a.born.elapsed());
        conns.closed(7);
        assert_eq!(conns.all().len(), 1);
    }
}
