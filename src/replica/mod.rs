//! Read replicas: the standbys of the primary that take reads
//! (`upstream.replicas`, [`crate::config::ReplicasConfig`]). Each is
//! watched ([`monitor`]): it must be in recovery with the primary's system
//! identifier, and its replay position is read often, against the
//! primary's position sampled against time ([`PrimaryClock`]), which gives
//! its lag in bytes and in time. A replica that is down, refuses, is
//! promoted or falls behind its limits leaves the rotation; it comes back
//! after a run of good polls.
//!
//! A WAL position is a `u64` here, as PostgreSQL's `pg_lsn` is.

mod clock;
mod conn;
mod connections;
pub mod monitor;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use clock::PrimaryClock;
pub use conn::ReplicaConn;
pub use connections::{Connection, Connections};

use crate::classify::BypassReason;
use crate::config::{ReplicasConfig, Routing};
use crate::metrics::ReplicaMetrics;
use crate::pool::Pools;
use crate::upstream::{Upstream, UpstreamError};

/// Parses a WAL position as PostgreSQL writes it (`16/B374D848`).
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    let high = u32::from_str_radix(high, 16).ok()?;
    let low = u32::from_str_radix(low, 16).ok()?;
    Some((u64::from(high) << 32) | u64::from(low))
}

/// A WAL position as PostgreSQL writes it.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Why a replica is out of rotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    /// Not checked yet.
    Starting,
    /// It cannot be reached, or a query of pgcache's failed.
    Unreachable(String),
    /// It is not in recovery: promoted, or not a standby at all.
    NotInRecovery,
    /// It belongs to another cluster (a logical subscriber, or a mistake).
    OtherCluster { found: String, primary: String },
    /// It is further behind than `replicas.max_lag_ms` or `max_lag_bytes`.
    Lagging,
}

impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Out::Starting => write!(f, "not checked yet"),
            Out::Unreachable(why) => write!(f, "unreachable: {why}"),
            Out::NotInRecovery => write!(
                f,
                "not in recovery: it was promoted, or it is not a standby (a logical subscriber \
                 is not a replica pgcache can read from)"
            ),
            Out::OtherCluster { found, primary } => write!(
                f,
                "another cluster: its system identifier is {found}, the primary's {primary} \
                 (a logical subscriber or an unrelated server is not a replica)"
            ),
            Out::Lagging => write!(
                f,
                "behind the primary past replicas.max_lag_ms/max_lag_bytes"
            ),
        }
    }
}

/// What the last poll of a replica found.
#[derive(Debug, Clone)]
pub struct Health {
    /// `None`: in rotation.
    pub out: Option<Out>,
    /// The position it has replayed to.
    pub replay_lsn: u64,
    /// How far behind the primary it is, in WAL bytes and in time.
    pub lag_bytes: u64,
    pub lag: Duration,
    /// Good polls in a row while out of rotation.
    good_polls: u32,
}

/// One standby.
pub struct Replica {
    /// How `SHOW SERVERS` and the metrics name it (host:port).
    pub name: String,
    /// Its URL, parsed: addresses, TLS, pgcache's own connections.
    pub upstream: Upstream,
    pub weight: u32,
    /// Whether it is in rotation; sessions wait on it too: a session's
    /// idle connection is closed when its replica leaves the rotation.
    rotation: tokio::sync::watch::Sender<bool>,
    /// The position it has replayed to, as last read.
    replay: AtomicU64,
    /// The latest reading of its position, with when it was asked for
    /// ([`Self::known_since`]).
    latest: Mutex<Option<(u64, Instant)>>,
    health: Mutex<Health>,
    pub metrics: ReplicaMetrics,
    /// The sessions' own connections to it (session mode).
    pub connections: Connections,
    /// Transaction mode's connections to it: a pool per database and
    /// user, each as large as the primary's.
    pub pools: Pools,
}

impl Replica {
    pub fn in_rotation(&self) -> bool {
        *self.rotation.borrow()
    }

    /// The position it had replayed to when last read.
    pub fn replayed(&self) -> u64 {
        self.replay.load(Ordering::Acquire)
    }

    /// A read's probe found it had replayed to `lsn`: fresher than the
    /// last poll, so the next read that needs as much can go there.
    pub fn replayed_past(&self, lsn: u64) {
        self.replay.fetch_max(lsn, Ordering::AcqRel);
    }

    /// Its position was `lsn` when asked at `asked` (by a poll or a read's
    /// probe). The latest question wins: a later, lower answer means a
    /// restart (a standby resumes from its restartpoint).
    pub fn observed(&self, lsn: u64, asked: Instant) {
        let mut latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        if latest.is_none_or(|(_, at)| at <= asked) {
            *latest = Some((lsn, asked));
        }
    }

    /// A position a read on a connection opened (logged in) at `opened`
    /// will find replayed, without asking: the latest reading, if it was
    /// asked for after then. A restart ends every connection, so if that
    /// connection still answers, the reading was of the same server run,
    /// whose position only moves forward.
    pub fn known_since(&self, opened: Instant) -> Option<u64> {
        let latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        latest
            .filter(|(_, asked)| *asked >= opened)
            .map(|(lsn, _)| lsn)
    }

    /// In rotation, as after good polls: for tests of the sessions that
    /// route to it, without a monitor.
    #[cfg(test)]
    pub(crate) fn admit(&self) {
        self.rotation.send_replace(true);
    }

    /// Follows whether it is in rotation.
    pub fn watch_rotation(&self) -> tokio::sync::watch::Receiver<bool> {
        self.rotation.subscribe()
    }

    pub fn health(&self) -> Health {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A poll found it unusable: out of rotation now. Returns whether
    /// that is news.
    fn take_out(&self, why: Out) -> bool {
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        health.good_polls = 0;
        let news = health.out.as_ref() != Some(&why);
        let was_in = self.rotation.send_replace(false);
        // Drained: a connection held for a read goes when the read ends.
        self.pools.evict(None);
        health.out = Some(why);
        self.metrics.up.set(0);
        news || was_in
    }

    /// A poll read its replay position, and how far behind the primary
    /// that is.
    fn record(&self, replay_lsn: u64, lag_bytes: u64, lag: Duration) {
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        health.replay_lsn = replay_lsn;
        health.lag_bytes = lag_bytes;
        health.lag = lag;
        self.replay.fetch_max(replay_lsn, Ordering::AcqRel);
        self.metrics.lag_bytes.set(lag_bytes as i64);
        self.metrics.lag_seconds.set(lag.as_secs_f64());
    }

    /// A good poll. Back in rotation after `needed` good polls in a row;
    /// true if it came back now.
    fn good_poll(&self, needed: u32) -> bool {
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        if health.out.is_none() {
            return false;
        }
        health.good_polls += 1;
        if health.good_polls < needed {
            return false;
        }
        health.out = None;
        health.good_polls = 0;
        self.rotation.send_replace(true);
        self.metrics.up.set(1);
        true
    }

    /// Its replay position was read again after a reconnect: a standby
    /// that restarted resumes from its restartpoint, behind what was
    /// read before.
    fn reset_replay(&self) {
        self.replay.store(0, Ordering::Release);
        *self.latest.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// The replicas of the primary, and how reads are routed to them.
pub struct Replicas {
    pub servers: Vec<Arc<Replica>>,
    pub routing: Routing,
    primary_weight: u32,
    pub config: ReplicasConfig,
    pub primary: PrimaryClock,
    /// The primary's system identifier, which every replica must share.
    pub primary_id: std::sync::OnceLock<String>,
    /// Reads routing sent to the primary.
    pub to_primary: ReplicaMetrics,
}

impl Replicas {
    /// The replicas `upstream.replicas` lists; none when routing is off.
    pub fn new(
        config: &crate::Config,
        metrics: &crate::metrics::Metrics,
    ) -> Result<Self, UpstreamError> {
        let routing = match config.upstream.replicas.is_empty() {
            true => Routing::Off,
            false => config.replicas.routing,
        };
        let mut servers = Vec::new();
        if routing != Routing::Off {
            for replica in &config.upstream.replicas {
                let upstream = Upstream::new(replica.url(), config.connect_timeout())?;
                let name = upstream.describe();
                servers.push(Arc::new(Replica {
                    metrics: metrics.replicas.of(&name),
                    name,
                    upstream,
                    weight: replica.weight(),
                    rotation: tokio::sync::watch::Sender::new(false),
                    replay: AtomicU64::new(0),
                    latest: Mutex::new(None),
                    health: Mutex::new(Health {
                        out: Some(Out::Starting),
                        replay_lsn: 0,
                        lag_bytes: 0,
                        lag: Duration::ZERO,
                        good_polls: 0,
                    }),
                    connections: Connections::default(),
                    pools: Pools::new(config.pool.default_pool_size, metrics.pooled.clone()),
                }));
            }
        }
        Ok(Self {
            servers,
            routing,
            primary_weight: config.replicas.primary_weight,
            config: config.replicas.clone(),
            primary: PrimaryClock::default(),
            primary_id: std::sync::OnceLock::new(),
            to_primary: metrics.replicas.of("primary"),
        })
    }

    pub fn enabled(&self) -> bool {
        self.routing != Routing::Off
    }

    /// Whether a read planned as `read` (a cacheable read, or why it is
    /// not) may go to a replica; `replica_safe`: every function it calls
    /// is stable or immutable and not the server's own
    /// (the plan's `replica_safe`). `misses` routes cacheable reads only;
    /// `all_reads` also reads the cache may not keep but a standby answers
    /// as the primary would: with stable functions (`now()`), a time
    /// literal, hinted or ruled out of the cache, or of a table outside the
    /// publication (an unlogged one, which a standby refuses with `0A000`,
    /// is retried on the primary). Never volatile functions (`nextval`,
    /// advisory locks, `set_config`, `random()`), the server's own
    /// (`pg_backend_pid()`, `pg_is_in_recovery()`), system catalogs and
    /// statistics, temporary objects or what is not a plain SELECT.
    pub fn routes(&self, read: Result<(), BypassReason>, replica_safe: bool) -> bool {
        use BypassReason as R;
        match (self.routing, read) {
            (Routing::Off, _) => false,
            (_, Ok(())) => true,
            (Routing::Misses, Err(_)) => false,
            (Routing::AllReads, Err(reason)) => {
                replica_safe
                    && matches!(
                        reason,
                        R::VolatileFunction
                            | R::TimeLiteral
                            | R::Hint
                            | R::OptIn
                            | R::TableRule
                            | R::RoleRule
                            | R::DatabaseRule
                            | R::NotPublished
                    )
            }
        }
    }

    /// The replica a read goes to, among those in rotation that have
    /// replayed at least to `at_least`, by weight (the primary's
    /// `replicas.primary_weight` among them); `None`: the primary.
    /// `pick` is a random number: the choice is the caller's draw.
    pub fn choose(&self, at_least: u64, pick: u64) -> Option<&Arc<Replica>> {
        let usable = || {
            self.servers
                .iter()
                .filter(move |r| r.in_rotation() && r.replayed() >= at_least)
        };
        let total: u64 = usable().map(|r| u64::from(r.weight)).sum();
        if total == 0 {
            return None;
        }
        let mut at = pick % (total + u64::from(self.primary_weight));
        for replica in usable() {
            if at < u64::from(replica.weight) {
                return Some(replica);
            }
            at -= u64::from(replica.weight);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reads_adds_reads_a_standby_answers_as_the_primary_and_no_more() {
        use BypassReason as R;
        let misses = replicas("[upstream]\nreplicas = [\"postgres://a:1\"]\n");
        let all = replicas(
            "[upstream]\nreplicas = [\"postgres://a:1\"]\n[replicas]\nrouting = \"all_reads\"\n",
        );
        let off = replicas(
            "[upstream]\nreplicas = [\"postgres://a:1\"]\n[replicas]\nrouting = \"off\"\n",
        );
        assert!(misses.routes(Ok(()), true) && all.routes(Ok(()), true));
        assert!(!off.routes(Ok(()), true));
        for reason in [
            R::VolatileFunction,
            R::TimeLiteral,
            R::Hint,
            R::NotPublished,
            R::TableRule,
        ] {
            assert!(!misses.routes(Err(reason), true), "{reason:?}");
            assert!(all.routes(Err(reason), true), "{reason:?}");
            assert!(
                !all.routes(Err(reason), false),
                "{reason:?} with a function a standby may not run"
            );
        }
        for reason in [
            R::SystemCatalog,
            R::NotATable,
            R::NotSelect,
            R::LockingClause,
            R::TempObjects,
            R::MultiStatement,
            R::UnknownRelation,
        ] {
            assert!(!all.routes(Err(reason), true), "{reason:?}");
        }
    }

    fn replicas(toml: &str) -> Replicas {
        let config = crate::Config::from_toml(toml, "t".as_ref()).expect("config");
        let metrics = crate::metrics::Metrics::new();
        Replicas::new(&config, &metrics).expect("replicas")
    }

    #[test]
    fn positions_read_and_write_as_postgresql_writes_them() {
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16B374D848"), None);
        assert_eq!(parse_lsn("x/1"), None);
    }

    #[test]
    fn a_position_is_known_to_connections_opened_before_it_was_asked() {
        let set = replicas("[upstream]\nreplicas = [\"postgres://a:1\"]\n");
        let a = &set.servers[0];
        let t0 = Instant::now();
        let (t1, t2, t3) = (
            t0 + Duration::from_millis(1),
            t0 + Duration::from_millis(2),
            t0 + Duration::from_millis(3),
        );
        assert_eq!(a.known_since(t0), None, "never asked");
        a.observed(100, t1);
        assert_eq!(a.known_since(t0), Some(100));
        assert_eq!(a.known_since(t1), Some(100));
        assert_eq!(a.known_since(t2), None, "opened after: maybe another run");
        // A later question with a lower answer: a restart. It stands.
        a.observed(50, t3);
        assert_eq!(a.known_since(t0), Some(50));
        // An answer asked for earlier, arriving late, changes nothing.
        a.observed(400, t2);
        assert_eq!(a.known_since(t0), Some(50));
        a.reset_replay();
        assert_eq!(a.known_since(t0), None, "the monitor reconnected");
    }

    #[test]
    fn reads_go_by_weight_to_replicas_in_rotation_and_far_enough() {
        let set = replicas(
            "[upstream]\nreplicas = [\"postgres://a:1\", { url = \"postgres://b:2\", weight = 3 }]\n",
        );
        let (a, b) = (&set.servers[0], &set.servers[1]);
        // Nothing in rotation yet: the primary.
        assert!(set.choose(0, 0).is_none());
        a.record(100, 0, Duration::ZERO);
        b.record(200, 0, Duration::ZERO);
        for _ in 0..3 {
            a.good_poll(3);
            b.good_poll(3);
        }
        assert!(a.in_rotation() && b.in_rotation());
        let picks: Vec<&str> = (0..4)
            .map(|pick| set.choose(0, pick).expect("a replica").name.as_str())
            .collect();
        assert_eq!(picks, ["a:1", "b:2", "b:2", "b:2"], "by weight");
        // Only b has replayed past 150.
        assert!((0..4).all(|pick| set.choose(150, pick).unwrap().name == "b:2"));
        assert!(set.choose(250, 0).is_none(), "none has replayed to 250");
        // Out of rotation at once; back only after three good polls.
        assert!(b.take_out(Out::Lagging));
        assert!(!b.take_out(Out::Lagging), "not news the second time");
        assert!((0..4).all(|pick| set.choose(0, pick).unwrap().name == "a:1"));
        b.record(300, 0, Duration::ZERO);
        assert!(!b.good_poll(3));
        assert!(!b.good_poll(3));
        assert!(b.good_poll(3));
        assert!(set.choose(250, 0).is_some());
    }

    #[test]
    fn the_primary_takes_its_weight_of_routed_reads() {
        let set = replicas(
            "[upstream]\nreplicas = [\"postgres://a:1\"]\n[replicas]\nprimary_weight = 1\n",
        );
        set.servers[0].record(1, 0, Duration::ZERO);
        for _ in 0..3 {
            set.servers[0].good_poll(3);
        }
        assert!(set.choose(0, 0).is_some());
        assert!(set.choose(0, 1).is_none(), "the primary's turn");
    }

    #[test]
    fn no_replicas_or_routing_off_routes_nothing() {
        assert!(!replicas("").enabled());
        let off = replicas(
            "[upstream]\nreplicas = [\"postgres://a:1\"]\n[replicas]\nrouting = \"off\"\n",
        );
        assert!(!off.enabled());
        assert!(off.servers.is_empty());
    }
}
