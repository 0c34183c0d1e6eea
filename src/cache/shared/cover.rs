//! Coverage: which changes the instances' replication streams have applied
//! to Redis's counters, so that a starting instance does not void every
//! instance's entries when another one's stream saw what it missed.
//!
//! Field `w` of a database's version hash is an LSN: every change committed
//! before it has been bumped in Redis, by streams that followed one another
//! without a gap since the epoch was last bumped at a stream's start. A
//! stream extends it at each of its heartbeats back, but only if its own
//! start is within it (its coverage joins on). A stream that starts bumps
//! the epoch only if `w` does not reach its start within a short wait:
//! when no live instance's stream covers the time this one missed.
//!
//! Each extension also announces a vouch (`w` on the invalidation channel,
//! with the age of the heartbeat): every instance whose mirrors are in sync
//! may serve the database's cache as fresh as that, before its own stream
//! is up (a stream cannot start while a transaction that took a lock is
//! open, since its slot waits for that transaction).

use std::time::{Duration, Instant};

use tracing::debug;

use super::sync::message_header;
use super::{SharedTier, WATCH};
use crate::cache::database::DbState;

/// Extends the coverage if the stream's start is within it, and announces
/// a vouch. KEYS[1]: the version hash. ARGV[1]: channel; ARGV[2]: message
/// header for `w`; ARGV[3]: the stream's start; ARGV[4]: the position it
/// applied; ARGV[5]: the vouch (its heartbeat's age, in ms).
pub(super) const COVER: &str = r"
local covered = tonumber(redis.call('HGET', KEYS[1], 'w') or '0')
if covered < tonumber(ARGV[3]) then
  return 0
end
if covered < tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'w', ARGV[4])
end
redis.call('PUBLISH', ARGV[1], ARGV[2] .. ARGV[5])
return 1
";

/// Coverage starts again at a stream's start, once its epoch bump is in
/// Redis. KEYS[1]: the version hash. ARGV[1]: the stream's start.
pub(super) const CLAIM: &str = r"
local covered = tonumber(redis.call('HGET', KEYS[1], 'w') or '0')
if covered < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'w', ARGV[1])
end
return 1
";

impl SharedTier {
    /// A stream that started at `start` has applied every change committed
    /// before `applied`, up to its heartbeat sent at `sent`. Failures are
    /// logged: the coverage then stops here, which only costs a restarted
    /// instance an epoch bump.
    pub async fn cover(&self, db: &DbState, start: u64, applied: u64, sent: Instant) {
        let header = message_header(&db.name, &[WATCH.to_owned()]);
        let hash = self.versions_key(&db.name);
        let age = sent.elapsed().as_millis() as u64;
        let result = self
            .run(async |mut c| {
                self.cover_script
                    .key(&hash)
                    .arg(&self.channel)
                    .arg(&header)
                    .arg(start)
                    .arg(applied)
                    .arg(age)
                    .invoke_async::<u8>(&mut c)
                    .await
            })
            .await;
        if let Err(e) = result {
            debug!(database = %db.name, error = %e, "coverage not extended");
        }
    }

    /// Whether the changes committed before `start` are covered: waits up
    /// to `at_most` for a live instance's stream to extend the coverage
    /// past `start`, but gives up after `live` if no instance vouched for
    /// the database meanwhile (none is streaming).
    pub async fn covered(
        &self,
        db: &DbState,
        start: u64,
        live: Duration,
        at_most: Duration,
    ) -> bool {
        let began = Instant::now();
        let hash = self.versions_key(&db.name);
        loop {
            let changed = db.stream.changed.notified();
            let covered = self
                .run(async |mut c| {
                    redis::cmd("HGET")
                        .arg(&hash)
                        .arg(WATCH)
                        .query_async::<Option<u64>>(&mut c)
                        .await
                })
                .await;
            match covered {
                Ok(Some(covered)) if covered >= start => return true,
                Ok(_) => {}
                Err(e) => {
                    debug!(database = %db.name, error = %e, "coverage unknown");
                    return false;
                }
            }
            let waited = began.elapsed();
            if waited >= at_most || (waited >= live && !db.stream.vouched_within(waited + live)) {
                return false;
            }
            // A vouch comes with every extension: look again then, or
            // once it is time to ask whether any instance is live.
            let next = if waited < live { live } else { at_most };
            let _ = tokio::time::timeout(next - waited, changed).await;
        }
    }

    /// This instance's stream started at `start` after bumping the epoch:
    /// coverage starts again there.
    pub async fn claim_cover(&self, db: &DbState, start: u64) {
        let hash = self.versions_key(&db.name);
        let result = self
            .run(async |mut c| {
                self.claim_script
                    .key(&hash)
                    .arg(start)
                    .invoke_async::<u8>(&mut c)
                    .await
            })
            .await;
        if let Err(e) = result {
            debug!(database = %db.name, error = %e, "coverage not claimed");
        }
    }

    /// Another instance vouched for `db` with a heartbeat `age_ms` old
    /// when announced; the transit may have taken up to the shared tier's
    /// deadline.
    pub(super) fn vouched(&self, db: &DbState, age_ms: u64) {
        let age = Duration::from_millis(age_ms) + self.timeout;
        if let Some(sent) = Instant::now().checked_sub(age) {
            db.stream.vouch(sent, self.lease);
        }
    }
}
