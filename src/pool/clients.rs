//! Every client session of the instance, as `SHOW CLIENTS` and `SHOW POOLS`
//! show them: who it is, and what it is doing with server connections now.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::shutdown::{Shutdown, Stage};

/// What a client is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Activity {
    /// Holds no server connection (transaction mode, between transactions).
    Idle = 0,
    /// Waits for a server connection.
    Waiting = 1,
    /// Holds a server connection.
    Active = 2,
}

impl Activity {
    pub fn as_str(self) -> &'static str {
        match self {
            Activity::Idle => "idle",
            Activity::Waiting => "waiting",
            Activity::Active => "active",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Activity::Waiting,
            2 => Activity::Active,
            _ => Activity::Idle,
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One client session.
pub struct Client {
    pub id: u64,
    pub user: String,
    pub database: String,
    pub addr: SocketAddr,
    pub tls: bool,
    pub application_name: String,
    /// Unix milliseconds.
    pub connected_ms: u64,
    state: AtomicU8,
    /// When the state last changed, unix milliseconds.
    since_ms: AtomicU64,
    /// The server connection held: pgcache's id for it (0: none) and its pid.
    server: AtomicU64,
    server_pid: AtomicU32,
    /// Why the session keeps its connection for good ("" if it does not).
    pinned: Mutex<&'static str>,
    /// pgcache shutting down, as the session hears it.
    pub shutdown: Shutdown,
}

impl Client {
    pub fn state(&self) -> Activity {
        Activity::from_u8(self.state.load(Ordering::Relaxed))
    }

    pub fn since_ms(&self) -> u64 {
        self.since_ms.load(Ordering::Relaxed)
    }

    pub fn server(&self) -> (u64, u32) {
        (
            self.server.load(Ordering::Relaxed),
            self.server_pid.load(Ordering::Relaxed),
        )
    }

    pub fn pinned(&self) -> &'static str {
        *self.pinned.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set(&self, state: Activity) {
        self.state.store(state as u8, Ordering::Relaxed);
        self.since_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Holds server connection `id` (backend `pid`), or none (0).
    pub fn hold(&self, id: u64, pid: u32) {
        self.server.store(id, Ordering::Relaxed);
        self.server_pid.store(pid, Ordering::Relaxed);
        self.set(if id == 0 {
            Activity::Idle
        } else {
            Activity::Active
        });
    }

    /// Session mode: holds its own backend (`pid`) for the whole session.
    pub fn own(&self, pid: u32) {
        self.server_pid.store(pid, Ordering::Relaxed);
        self.set(Activity::Active);
    }

    pub fn pin(&self, why: &'static str) {
        *self.pinned.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }
}

/// Who a new session is.
pub struct Arrival<'a> {
    pub user: &'a str,
    pub database: &'a str,
    pub addr: SocketAddr,
    pub tls: bool,
    pub application_name: &'a str,
}

#[derive(Default)]
pub struct Clients {
    next: AtomicU64,
    map: Mutex<HashMap<u64, Arc<Client>>>,
}

/// A session's entry; removed when dropped.
pub struct ClientEntry {
    pub client: Arc<Client>,
    clients: Arc<Clients>,
}

impl Drop for ClientEntry {
    fn drop(&mut self) {
        self.clients.lock().remove(&self.client.id);
    }
}

impl Clients {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Client>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn register(self: &Arc<Self>, arrival: Arrival<'_>) -> ClientEntry {
        let now = now_ms();
        let client = Arc::new(Client {
            id: self.next.fetch_add(1, Ordering::Relaxed) + 1,
            user: arrival.user.to_owned(),
            database: arrival.database.to_owned(),
            addr: arrival.addr,
            tls: arrival.tls,
            application_name: arrival.application_name.to_owned(),
            connected_ms: now,
            state: AtomicU8::new(Activity::Idle as u8),
            since_ms: AtomicU64::new(now),
            server: AtomicU64::new(0),
            server_pid: AtomicU32::new(0),
            pinned: Mutex::new(""),
            shutdown: Shutdown::default(),
        });
        self.lock().insert(client.id, Arc::clone(&client));
        ClientEntry {
            client,
            clients: Arc::clone(self),
        }
    }

    /// Every session now, oldest first.
    /// Tells every session that shutting down reached `stage`. A session
    /// registered after this looks at the app's tokens when it starts.
    pub fn raise(&self, stage: Stage) {
        for client in self.lock().values() {
            client.shutdown.raise(stage);
        }
    }

    pub fn all(&self) -> Vec<Arc<Client>> {
        let mut all: Vec<_> = self.lock().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_follow_their_sessions() {
        let clients = Arc::new(Clients::default());
        let arrival = || Arrival {
            user: "u",
            database: "d",
            addr: "127.0.0.1:5".parse().unwrap(),
            tls: false,
            application_name: "app",
        };
        let a = clients.register(arrival());
        let b = clients.register(arrival());
        assert_eq!(clients.all().len(), 2);
        a.client.set(Activity::Waiting);
        b.client.hold(7, 4242);
        let all = clients.all();
        assert_eq!(all[0].state(), Activity::Waiting);
        assert_eq!(
            (all[1].state(), all[1].server()),
            (Activity::Active, (7, 4242))
        );
        b.client.hold(0, 0);
        assert_eq!(b.client.state(), Activity::Idle);
        drop(a);
        assert_eq!(clients.all().len(), 1);
    }
}
