//! Server connections kept for the next client once a session ends, as
//! PgBouncer's session mode keeps them: a client that logs in with the same
//! user, database and startup parameters gets a parked connection instead
//! of a new PostgreSQL backend (a fork, a login and a cold catalog cache).
//!
//! A connection is parked only when reusing it cannot show: the session
//! ended with a Terminate while idle, `DISCARD ALL` succeeded, and nothing
//! in the session left state that `DISCARD ALL` keeps ([`marks`]). Who may
//! have it follows from how it logged in: one PostgreSQL let in without a
//! password (`trust`) may serve any client of its key, since PostgreSQL
//! sees every pgcache connection from the same address; one that needed a
//! password serves only clients pgcache authenticated itself (terminate
//! mode); in passthrough mode such a connection is closed.
//!
//! A connection's settings are fixed at login by the role's and database's
//! `ALTER ... SET`, which `DISCARD ALL` does not re-read. So each reuse
//! runs a check query, and its answer (those settings and the
//! configuration's load time) must have been seen, unchanged, since before
//! the connection logged in ([`Seen`]): a change made at any time after
//! its login shows as a new answer first seen after it. (The first
//! connection reused after pgcache starts is closed for that reason.)

pub mod clients;
pub mod errand;
mod error;
pub mod listens;
mod login;
pub mod marks;
mod owed;
mod pools;
pub mod prepared;
pub mod reference;
pub mod reported;
mod statement;
pub mod transaction;

pub use error::PoolError;
pub use pools::Pools;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tracing::debug;

use crate::backend::BackendStream;
use crate::config::PoolConfig;
use crate::metrics::PoolMetrics;
use crate::protocol::answer::{Answered, read_answer};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::startup::Startup;
use crate::protocol::stream::FramedStream;
use crate::protocol::{TxStatus, backend as be, messages};
use crate::upstream::UpstreamAddr;

/// What a parked connection's settings depend on beyond its startup
/// packet: every `ALTER ROLE/DATABASE ... SET` (the whole table: it is
/// small, and reading all of it costs less than finding the rows that
/// apply), and when the configuration (pg_hba.conf among it) was last
/// loaded. Measured with pgbench: about twice a `SELECT 1`.
pub(crate) const CHECK: &str = "SELECT 0::oid, 0::oid, NULL::text[], pg_catalog.pg_conf_load_time() \
     UNION ALL SELECT s.setdatabase, s.setrole, s.setconfig, NULL FROM pg_catalog.pg_db_role_setting s";

/// How often parked connections past their idle time are closed.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// The startup that a connection was made for, in a canonical form: two
/// clients with the same key get identical sessions from PostgreSQL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    user: Box<str>,
    database: Box<str>,
    /// The protocol version and every other parameter, sorted.
    rest: Box<str>,
}

impl PoolKey {
    /// `None` for a startup that must have a connection of its own: a
    /// replication connection, or one that negotiates protocol options.
    pub fn of(startup: &Startup) -> Option<PoolKey> {
        let mut rest: Vec<(&str, &str)> = Vec::new();
        for (name, value) in &startup.params {
            match name.as_str() {
                "user" | "database" => {}
                "replication" => return None,
                n if n.starts_with("_pq_.") => return None,
                n => rest.push((n, value)),
            }
        }
        rest.sort_unstable();
        let mut text = startup.version.to_string();
        for (name, value) in rest {
            text.push('\0');
            text.push_str(name);
            text.push('\0');
            text.push_str(value);
        }
        Some(PoolKey {
            user: startup.user().into(),
            database: startup.database().into(),
            rest: text.into(),
        })
    }
}

/// The latest ParameterStatus frame of each parameter, in the order
/// PostgreSQL first reported them: what a reused connection's client is
/// told at login.
/// Names and frames are shared, not copied, when a login's statuses are
/// handed to each client of a pool.
#[derive(Debug, Default, Clone)]
pub struct Statuses(Vec<(Bytes, Bytes)>);

impl Statuses {
    /// Whether this very ParameterStatus frame (header included) is
    /// noted: the parameter, with this value.
    pub fn has_frame(&self, frame: &[u8]) -> bool {
        self.0.iter().any(|(_, f)| **f == *frame)
    }

    /// Whether a parameter is noted, by the name a ParameterStatus frame
    /// (header included) gives.
    pub fn names(&self, frame: &[u8]) -> bool {
        let body = &frame[HEADER_LEN.min(frame.len())..];
        let name = body.split(|b| *b == 0).next().unwrap_or_default();
        self.0.iter().any(|(n, _)| **n == *name)
    }

    /// Notes a ParameterStatus frame (header included).
    pub fn note(&mut self, frame: &[u8]) {
        let body = &frame[HEADER_LEN.min(frame.len())..];
        let name = body.split(|b| *b == 0).next().unwrap_or_default();
        match self.0.iter_mut().find(|(n, _)| **n == *name) {
            Some((_, f)) => *f = Bytes::copy_from_slice(frame),
            None => self
                .0
                .push((Bytes::copy_from_slice(name), Bytes::copy_from_slice(frame))),
        }
    }

    /// What PostgreSQL tells a client at login: AuthenticationOk, these
    /// statuses, BackendKeyData of `key_body`'s parts, ReadyForQuery. Made
    /// at its final size: grown frame by frame, it was several
    /// reallocations of every such login.
    pub fn login_frames(&self, key_body: &[&[u8]]) -> BytesMut {
        let statuses: usize = self.0.iter().map(|(_, frame)| frame.len()).sum();
        let key: usize = key_body.iter().map(|part| part.len()).sum();
        let mut out = BytesMut::with_capacity(9 + statuses + HEADER_LEN + key + 6);
        out.extend_from_slice(&[be::AUTHENTICATION, 0, 0, 0, 8, 0, 0, 0, 0]);
        for (_, frame) in &self.0 {
            out.extend_from_slice(frame);
        }
        out.extend_from_slice(&[be::BACKEND_KEY_DATA]);
        out.extend_from_slice(&((4 + key) as u32).to_be_bytes());
        for part in key_body {
            out.extend_from_slice(part);
        }
        out.extend_from_slice(&messages::ready_for_query(TxStatus::Idle));
        out
    }

    /// Whether PostgreSQL reported this parameter.
    pub fn has(&self, name: &str) -> bool {
        self.0.iter().any(|(n, _)| **n == *name.as_bytes())
    }

    /// Sets a parameter's value, as if PostgreSQL had reported it.
    pub fn set(&mut self, name: &str, value: &str) {
        let len = (4 + name.len() + value.len() + 2) as u32;
        let mut frame = BytesMut::with_capacity(len as usize + 1);
        frame.extend_from_slice(&[be::PARAMETER_STATUS]);
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(name.as_bytes());
        frame.extend_from_slice(&[0]);
        frame.extend_from_slice(value.as_bytes());
        frame.extend_from_slice(&[0]);
        self.note(&frame);
    }
}

/// A logged-in server connection that a session can hand back.
pub struct Server {
    pub stream: FramedStream<BackendStream>,
    pub addr: UpstreamAddr,
    pub statuses: Statuses,
    /// The body of PostgreSQL's BackendKeyData.
    pub key_data: Vec<u8>,
    /// PostgreSQL let it in without asking for a password.
    pub trusted: bool,
    /// When it logged in.
    pub born: Instant,
    /// The session settings a client starts with on it, once read.
    pub login_settings: Option<LoginSettings>,
}

/// The answer of a session's settings query (see `session/engine/hidden.rs`) in
/// a connection's login state, and the policy generation it was asked
/// under. `DISCARD ALL` returns the connection to that state, and the
/// pool's check closes it if what login applies changed.
#[derive(Debug, Clone)]
pub struct LoginSettings {
    pub generation: u64,
    pub row: std::sync::Arc<crate::pool::transaction::SettingsRow>,
}

impl Server {
    /// The connection for a new session, with what PostgreSQL would send a
    /// client logging in on it now (AuthenticationOk, the parameters, the
    /// key, ReadyForQuery) waiting in its read buffer, for the relay to
    /// handle as it handles a fresh login's.
    pub fn replay_login(self) -> (FramedStream<BackendStream>, UpstreamAddr) {
        let login = self.statuses.login_frames(&[&self.key_data]);
        let mut stream = self.stream;
        let buf = stream.buffer_mut();
        let rest = buf.split();
        buf.extend_from_slice(&login);
        buf.extend_from_slice(&rest);
        (stream, self.addr)
    }
}

/// The check's latest answer, and since when it has been seen without a
/// change: a connection that logged in before that may carry older
/// settings.
struct Seen {
    answer: Box<str>,
    since: Instant,
}

struct Parked {
    key: PoolKey,
    server: Server,
    at: Instant,
}

#[derive(Default)]
struct Idle {
    /// Oldest first.
    parked: VecDeque<Parked>,
    /// Bumped by [`ServerPool::evict_all`]: a reset that began before is
    /// not parked.
    epoch: u64,
    seen: Option<Seen>,
    reaping: bool,
}

pub struct ServerPool {
    idle: Mutex<Idle>,
    metrics: PoolMetrics,
    /// Transaction mode's pools ([`transaction`]).
    pub pooled: Arc<Pools>,
}

impl ServerPool {
    pub fn new(metrics: PoolMetrics, pooled: Pools) -> Self {
        Self {
            idle: Mutex::new(Idle::default()),
            metrics,
            pooled: Arc::new(pooled),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        // Every critical section leaves the state whole.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Parked connections now.
    pub fn idle_count(&self) -> usize {
        self.lock().parked.len()
    }

    /// A parked connection for `key` that passed its check, newest first;
    /// `trusted_only` when the client was not authenticated by pgcache.
    pub async fn take(
        &self,
        config: &PoolConfig,
        key: &PoolKey,
        trusted_only: bool,
    ) -> Option<Server> {
        loop {
            let parked = {
                let mut idle = self.lock();
                let found = idle
                    .parked
                    .iter()
                    .rposition(|p| p.key == *key && (p.server.trusted || !trusted_only))?;
                let parked = idle.parked.remove(found).expect("found above");
                self.metrics.idle.set(idle.parked.len() as i64);
                parked
            };
            let mut server = parked.server;
            let checked = tokio::time::timeout(config.check_timeout(), check(&mut server)).await;
            match checked {
                Ok(Some(answer)) => {
                    // Unchanged since before it logged in: it has what a
                    // new login would get.
                    if self.saw(&answer) <= server.born {
                        self.metrics.reused.inc();
                        return Some(server);
                    }
                    debug!("parked server connection may predate a settings change");
                    self.metrics.closed_stale.inc();
                }
                _ => self.metrics.closed_failed.inc(),
            }
        }
    }

    /// Resets a connection whose session ended and parks it, off the
    /// client's path; it is closed instead if the reset fails, if it is too
    /// old, or if an eviction happened meanwhile.
    pub fn give_back(self: &Arc<Self>, config: &PoolConfig, key: PoolKey, mut server: Server) {
        if config.max_idle_servers == 0 || server.born.elapsed() > config.server_lifetime() {
            return;
        }
        let epoch = self.lock().epoch;
        let pool = Arc::clone(self);
        let config = config.clone();
        tokio::spawn(async move {
            let reset = tokio::time::timeout(config.check_timeout(), reset(&mut server)).await;
            if reset != Ok(true) {
                pool.metrics.closed_failed.inc();
                return;
            }
            let mut idle = pool.lock();
            if idle.epoch != epoch {
                pool.metrics.closed_evicted.inc();
                return;
            }
            while idle.parked.len() >= config.max_idle_servers {
                idle.parked.pop_front();
                pool.metrics.closed_full.inc();
            }
            idle.parked.push_back(Parked {
                key,
                server,
                at: Instant::now(),
            });
            pool.metrics.idle.set(idle.parked.len() as i64);
            pool.metrics.parked.inc();
            if !idle.reaping {
                idle.reaping = true;
                tokio::spawn(reap(Arc::downgrade(&pool), config.server_idle_timeout()));
            }
        });
    }

    /// Closes every parked connection, and keeps resets under way from
    /// parking theirs: a statement is about to need the databases free.
    pub fn evict_all(&self) {
        self.pooled.evict(None);
        let mut idle = self.lock();
        idle.epoch += 1;
        let n = idle.parked.len();
        idle.parked.clear();
        self.metrics.closed_evicted.inc_by(n as u64);
        self.metrics.idle.set(0);
    }

    /// Closes the parked connections to `database`: pgcache lets go of it.
    pub fn evict_database(&self, database: &str) {
        self.pooled.evict(Some(database));
        let mut idle = self.lock();
        let before = idle.parked.len();
        idle.parked.retain(|p| &*p.key.database != database);
        let n = before - idle.parked.len();
        self.metrics.closed_evicted.inc_by(n as u64);
        self.metrics.idle.set(idle.parked.len() as i64);
    }

    /// Records a check's answer; returns since when it has been seen.
    fn saw(&self, answer: &str) -> Instant {
        let mut idle = self.lock();
        match &idle.seen {
            Some(seen) if *seen.answer == *answer => seen.since,
            _ => {
                let since = Instant::now();
                idle.seen = Some(Seen {
                    answer: answer.into(),
                    since,
                });
                since
            }
        }
    }
}

/// Closes parked connections idle past `timeout`, until the pool is gone.
async fn reap(pool: Weak<ServerPool>, timeout: Duration) {
    let mut tick = tokio::time::interval(REAP_EVERY);
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        let mut idle = pool.lock();
        let before = idle.parked.len();
        idle.parked.retain(|p| p.at.elapsed() < timeout);
        let expired = before - idle.parked.len();
        pool.metrics.closed_expired.inc_by(expired as u64);
        pool.metrics.idle.set(idle.parked.len() as i64);
    }
}

/// `DISCARD ALL`: true if it succeeded and left the connection idle.
async fn reset(server: &mut Server) -> bool {
    let answered = ask(server, "DISCARD ALL").await;
    answered.is_some_and(|a| a.clean())
}

/// The check query's answer as one text; `None` if it failed.
async fn check(server: &mut Server) -> Option<Box<str>> {
    let answered = ask(server, CHECK).await.filter(Answered::clean)?;
    let rows = answered.result.ok().filter(|r| !r.is_empty())?;
    let mut answer = String::new();
    for value in rows.iter().flatten() {
        answer.push_str(value.as_deref().unwrap_or("\\N"));
        answer.push('\n');
    }
    Some(answer.into())
}

/// Runs `sql` on a parked connection: its answer, `None` if the
/// connection failed. Parameter changes are noted; notices are dropped
/// (no client is listening).
async fn ask(server: &mut Server, sql: &str) -> Option<Answered> {
    let Server {
        stream, statuses, ..
    } = server;
    let note = |frame: BytesMut| {
        if frame[0] == be::PARAMETER_STATUS {
            statuses.note(&frame);
        }
    };
    read_answer(stream, &messages::query(sql), note)
        .await
        .ok()?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::startup::{StartupPacket, encode_startup, parse};

    fn startup(params: &[(&str, &str)]) -> Startup {
        match parse(&encode_startup(params)).unwrap() {
            StartupPacket::Startup(s) => s,
            _ => unreachable!(),
        }
    }

    #[test]
    fn keys_ignore_parameter_order_but_not_values() {
        let a = PoolKey::of(&startup(&[
            ("user", "u"),
            ("database", "d"),
            ("a", "1"),
            ("b", "2"),
        ]));
        let b = PoolKey::of(&startup(&[
            ("b", "2"),
            ("user", "u"),
            ("a", "1"),
            ("database", "d"),
        ]));
        let c = PoolKey::of(&startup(&[
            ("user", "u"),
            ("database", "d"),
            ("a", "1"),
            ("b", "3"),
        ]));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let other_db = PoolKey::of(&startup(&[
            ("user", "u"),
            ("database", "e"),
            ("a", "1"),
            ("b", "2"),
        ]));
        assert_ne!(a, other_db);
    }

    #[test]
    fn replication_and_protocol_options_get_their_own_connection() {
        assert!(PoolKey::of(&startup(&[("user", "u"), ("replication", "database")])).is_none());
        assert!(PoolKey::of(&startup(&[("user", "u"), ("_pq_.x", "1")])).is_none());
    }

    #[test]
    fn statuses_keep_the_latest_value_in_first_order() {
        let frame = |name: &str, value: &str| {
            let mut f = BytesMut::new();
            let len = (4 + name.len() + value.len() + 2) as u32;
            f.extend_from_slice(&[be::PARAMETER_STATUS]);
            f.extend_from_slice(&len.to_be_bytes());
            f.extend_from_slice(name.as_bytes());
            f.extend_from_slice(&[0]);
            f.extend_from_slice(value.as_bytes());
            f.extend_from_slice(&[0]);
            f
        };
        let mut s = Statuses::default();
        s.note(&frame("DateStyle", "ISO, MDY"));
        s.note(&frame("TimeZone", "UTC"));
        s.note(&frame("DateStyle", "SQL, DMY"));
        let out = s.login_frames(&[&[0, 0, 0, 7], &[1, 2, 3, 4]]);
        let mut want = BytesMut::from(&[be::AUTHENTICATION, 0, 0, 0, 8, 0, 0, 0, 0][..]);
        want.extend_from_slice(&frame("DateStyle", "SQL, DMY"));
        want.extend_from_slice(&frame("TimeZone", "UTC"));
        want.extend_from_slice(&messages::backend_key_data(7, &[1, 2, 3, 4]));
        want.extend_from_slice(&messages::ready_for_query(TxStatus::Idle));
        assert_eq!(out, want);
    }
}
