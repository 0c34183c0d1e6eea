//! Heartbeats through the stream: the proof that a database's cache is
//! fresh.
//!
//! Every `replication.heartbeat_ms`, while the database's cache is in use
//! ([`crate::cache::demand`]), the stream's control connection commits
//! a transactional logical message naming this instance and a sequence
//! number, with `synchronous_commit = on` (so its commit also flushes the
//! WAL of earlier asynchronous commits, which decoding would otherwise wait
//! for). The time it was sent is kept. Logical decoding delivers
//! transactions in commit order, so when the message comes back through
//! this instance's stream, every transaction that committed before it was
//! sent has been delivered, and applied (the stream applies in order).
//! [`crate::cache::database::StreamHealth`] then serves the cache only while
//! the newest heartbeat back is younger than the lease: a stall anywhere
//! (walsender, network, decoding, pgcache) stops serving within the lease.
//!
//! Only the sending instance's clock is used: no clock skew with the
//! server can make a stale stream look fresh.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;
use tracing::debug;

use super::ReplicationError;
use crate::cache::database::DbState;
use crate::cache::demand::{Demand, rest_after};

/// Logical message prefix of heartbeats.
pub const HEARTBEAT_PREFIX: &str = "pgcache_heartbeat";

/// Heartbeats not seen back yet are forgotten past this many (a stream
/// that far behind is stale anyway).
const MAX_OUTSTANDING: usize = 10_000;

/// Heartbeats sent by one stream and not yet seen back.
pub struct Heartbeats {
    /// Tells this instance's heartbeats from other instances' in the same
    /// database.
    instance: u64,
    sent: Mutex<Sent>,
}

#[derive(Default)]
struct Sent {
    next: u64,
    /// (sequence number, when sent), oldest first.
    waiting: VecDeque<(u64, Instant)>,
}

impl Heartbeats {
    pub fn new(instance: u64) -> Self {
        Self {
            instance,
            sent: Mutex::new(Sent::default()),
        }
    }

    /// The instance whose heartbeats these are.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sent> {
        // Every critical section leaves the queue whole.
        self.sent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes a heartbeat about to be sent; returns its message content.
    /// The time is taken before sending, so it is never later than the
    /// heartbeat's commit.
    pub fn next(&self) -> String {
        let mut sent = self.lock();
        let seq = sent.next;
        sent.next += 1;
        if sent.waiting.len() >= MAX_OUTSTANDING {
            sent.waiting.pop_front();
        }
        sent.waiting.push_back((seq, Instant::now()));
        format!("{:016x}:{seq}", self.instance)
    }

    /// A heartbeat message came back through the stream: if it is one of
    /// ours, when it was sent (earlier ones still waiting are dropped: it
    /// proves more than they do).
    pub fn back(&self, content: &[u8]) -> Option<Instant> {
        let text = std::str::from_utf8(content).ok()?;
        let (instance, seq) = text.split_once(':')?;
        if u64::from_str_radix(instance, 16).ok()? != self.instance {
            return None;
        }
        let seq: u64 = seq.parse().ok()?;
        let mut sent = self.lock();
        let mut found = None;
        while let Some(&(s, at)) = sent.waiting.front() {
            if s > seq {
                break;
            }
            sent.waiting.pop_front();
            if s == seq {
                found = Some(at);
            }
        }
        found
    }
}

/// Sends heartbeats on `ctl` until one fails, which ends the stream (the
/// lease would expire anyway; a restart gets a new control connection),
/// while `db`'s heartbeats are needed ([`Demand`]): past
/// [`rest_after`] with no need they rest, and the next need sends one at
/// once.
pub async fn beat(
    ctl: Arc<tokio_postgres::Client>,
    beats: Arc<Heartbeats>,
    every: Duration,
    db: Arc<DbState>,
) -> ReplicationError {
    if let Err(e) = ctl.batch_execute("SET synchronous_commit = on").await {
        return e.into();
    }
    let demand: &Demand = &db.stream.demand;
    let rest_after = rest_after(every);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if demand.idle(rest_after) {
            debug!(database = %db.name, "heartbeats rest: nothing needs them");
            demand.rest(rest_after).await;
            tick.reset();
        }
        let sql = format!(
            "SELECT pg_catalog.pg_logical_emit_message(true, '{HEARTBEAT_PREFIX}', '{}')",
            beats.next()
        );
        demand.sent();
        if let Err(e) = ctl.batch_execute(&sql).await {
            return e.into();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_heartbeats_count_and_a_later_one_settles_earlier_ones() {
        let beats = Heartbeats::new(0xabc);
        let first = beats.next();
        let second = beats.next();
        let third = beats.next();
        assert_eq!(
            beats.back(b"0000000000000def:1"),
            None,
            "another instance's"
        );
        assert_eq!(beats.back(b"garbage"), None);
        let at = beats.back(second.as_bytes()).expect("ours");
        assert!(at.elapsed() < Duration::from_secs(5));
        assert_eq!(beats.back(first.as_bytes()), None, "settled by the second");
        assert!(beats.back(third.as_bytes()).is_some());
        assert_eq!(beats.back(third.as_bytes()), None, "counted once");
    }
}
