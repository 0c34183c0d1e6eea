//! What `SHOW POOLS` and `SHOW SERVERS` tell of a pool and its
//! connections.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Pool;

/// What `SHOW SERVERS` tells of a connection.
pub struct ServerRow {
    pub id: u64,
    pub pid: u32,
    pub addr: String,
    pub active: bool,
    pub age: Duration,
    /// Since it was taken (active) or given back (idle).
    pub since: Duration,
    /// The client holding it (0: none).
    pub client: u64,
    pub prepared: usize,
}

/// What `SHOW POOLS` tells of a pool.
pub struct PoolRow {
    pub database: String,
    pub user: String,
    pub waiting: usize,
    pub active: usize,
    pub idle: usize,
    pub open: usize,
    pub checkouts: u64,
    pub wait_us: u64,
}

impl Pool {
    pub fn row(&self) -> PoolRow {
        let books = self.lock();
        PoolRow {
            database: self.id.database.to_string(),
            user: self.id.user.to_string(),
            waiting: self.waiting.load(Ordering::Relaxed),
            active: books.held.len(),
            idle: books.idle.len(),
            open: books.open,
            checkouts: self.checkouts.load(Ordering::Relaxed),
            wait_us: self.wait_us.load(Ordering::Relaxed),
        }
    }

    /// `SHOW SERVERS` rows: held connections, then idle ones.
    pub fn servers(&self) -> Vec<ServerRow> {
        let books = self.lock();
        let mut rows: Vec<ServerRow> = books
            .held
            .iter()
            .map(|(id, h)| ServerRow {
                id: *id,
                pid: h.pid,
                addr: h.addr.to_string(),
                active: true,
                age: h.born.elapsed(),
                since: h.since.elapsed(),
                client: h.client,
                prepared: h.prepared,
            })
            .collect();
        rows.sort_by_key(|r| r.id);
        rows.extend(books.idle.iter().map(|i| {
            let s = &i.server;
            ServerRow {
                id: s.id,
                pid: s.key.backend_pid,
                addr: s.shown.to_string(),
                active: false,
                age: s.born.elapsed(),
                since: s.idle_since.elapsed(),
                client: 0,
                prepared: s.prepared.len(),
            }
        }));
        rows
    }
}
