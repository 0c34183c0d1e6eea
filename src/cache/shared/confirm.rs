//! Read-your-writes across instances (`cache.shared.consistency =
//! "read_your_writes"`): before a read may be answered from the cache, this
//! instance confirms with Redis that its version mirrors of the tables it
//! reads are not behind.
//!
//! Why that suffices: an instance sends a write's version bumps to Redis
//! before its client hears that the write completed (see
//! [`super::SharedTier::publish`]). A read that begins after that moment
//! asks Redis after it too, so it sees the bump, raises its mirrors, and
//! misses. Pub/sub alone delivers the bump about a millisecond later, which
//! is the window `eventual` leaves open.
//!
//! The same round trip raises the writes watermark ([`WRITES`]): a read
//! routed to a replica after another instance's write needs a replica that
//! replayed it, as after one of this instance's own.
//!
//! Reads share round trips, as a group commit does: while one `HMGET` is
//! on its way, the reads that arrive gather their fields for the next one,
//! which leaves as soon as the first returns. A read never takes an answer
//! to a request sent before it began.

use std::sync::Arc;

use super::sync::apply_field;
use super::{EPOCH, SharedError, SharedTier, TABLE, WRITES};
use crate::cache::database::DbState;
use crate::cache::versions::Family;

impl SharedTier {
    /// Raises `db`'s mirrors of the epoch and of `reads` to what Redis
    /// holds now, in a round trip that leaves after this call began.
    pub async fn confirm(
        self: &Arc<Self>,
        db: &Arc<DbState>,
        reads: &[Arc<Family>],
    ) -> Result<(), SharedError> {
        let confirms = &db.sync.confirms;
        let mut answered = confirms.answered.subscribe();
        let (round, lead) = {
            let mut rounds = confirms.lock();
            rounds.wanted.insert(EPOCH.to_owned());
            rounds.wanted.insert(WRITES.to_owned());
            for family in reads {
                rounds.wanted.insert(format!("{TABLE}{}", family.name));
            }
            // A round already taken may have left before this read began:
            // this read's fields go with the next one.
            let lead = !rounds.in_flight;
            rounds.in_flight = true;
            (rounds.sent + 1, lead)
        };
        if lead {
            // Its own task: the rounds go on if this read is dropped.
            let tier = Arc::clone(self);
            let db = Arc::clone(db);
            tokio::spawn(async move { tier.confirm_rounds(&db).await });
        }
        let (_, failed) = *answered
            .wait_for(|(done, _)| *done >= round)
            .await
            .map_err(|_| SharedError::NotConnected)?;
        // A failure of this round, or of a later one (which may hide
        // whether this one failed), is no confirmation.
        if failed < round {
            Ok(())
        } else {
            Err(SharedError::NotConnected)
        }
    }

    /// Sends rounds until no read waits for another.
    async fn confirm_rounds(&self, db: &DbState) {
        let confirms = &db.sync.confirms;
        loop {
            let (round, fields) = {
                let mut rounds = confirms.lock();
                rounds.sent += 1;
                (rounds.sent, std::mem::take(&mut rounds.wanted))
            };
            let fields: Vec<String> = fields.into_iter().collect();
            let hash = self.versions_key(&db.name);
            let result = self
                .run(async |mut c| {
                    redis::cmd("HMGET")
                        .arg(&hash)
                        .arg(&fields)
                        .query_async::<Vec<Option<u64>>>(&mut c)
                        .await
                })
                .await;
            let ok = match result {
                Ok(values) => {
                    for (field, value) in fields.iter().zip(values) {
                        if let Some(value) = value {
                            apply_field(db, field, value);
                        }
                    }
                    true
                }
                Err(_) => false,
            };
            let more = {
                let mut rounds = confirms.lock();
                let more = !rounds.wanted.is_empty();
                // Under the lock: a read that comes after this either saw
                // `in_flight` and is in `wanted`, or leads a new task.
                rounds.in_flight = more;
                more
            };
            // Rounds of two leaders can finish out of order: never go back.
            confirms.answered.send_modify(|(done, failed)| {
                *done = (*done).max(round);
                if !ok {
                    *failed = (*failed).max(round);
                }
            });
            if !more {
                return;
            }
        }
    }
}
