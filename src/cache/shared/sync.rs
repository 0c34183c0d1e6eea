//! Keeping the version mirrors in sync: the subscription to the
//! invalidation channel, the messages on it, and resynchronisation after
//! every gap (see the module documentation of [`super`]).

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use tracing::{debug, info, warn};

use super::{Background, DDL, EPOCH, SharedError, SharedTier, TABLE, WAKE, WATCH, WRITES};
use crate::cache::database::DbState;
use crate::cache::versions::{Scope, Version};

impl SharedTier {
    /// Keeps a subscription to the invalidation channel, applying what other
    /// instances announce, and resynchronises after every gap.
    pub(super) async fn subscribe(&self, bg: &Background) {
        let mut backoff = Duration::from_millis(100);
        let mut node = 0usize;
        loop {
            let url = &self.nodes.urls[node % self.nodes.urls.len()];
            node += 1;
            let attempt = async {
                let client = self.client(url)?;
                let mut pubsub = tokio::time::timeout(
                    self.timeout.max(Duration::from_secs(1)),
                    client.get_async_pubsub(),
                )
                .await
                .map_err(|_| {
                    redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))
                })??;
                pubsub.subscribe(&self.channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            let result = tokio::select! {
                r = attempt => r,
                _ = bg.drain.cancelled() => return,
            };
            let pubsub = match result {
                Ok(p) => p,
                Err(e) => {
                    debug!(error = %e, "cannot subscribe to Redis");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = bg.drain.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            // Whatever was announced while unsubscribed is lost.
            self.sync_gen.fetch_add(1, Ordering::AcqRel);
            self.subscribed.store(true, Ordering::Release);
            info!("subscribed to shared invalidations");
            let mut messages = pubsub.into_on_message();
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    msg = messages.next() => match msg {
                        Some(msg) => self.on_message(bg, msg.get_payload_bytes()),
                        None => break,
                    },
                    _ = self.resync.notified() => self.resync_all(bg).await,
                    _ = self.wake.notified() => self.ask_heartbeats(bg).await,
                    _ = tick.tick() => {
                        self.resync_all(bg).await;
                        self.ask_heartbeats(bg).await;
                    }
                    _ = bg.drain.cancelled() => return,
                }
            }
            self.subscribed.store(false, Ordering::Release);
            warn!("lost the Redis subscription: shared tier paused until resynchronised");
        }
    }

    /// Brings every database whose mirrors are not from the current
    /// generation up to date with Redis.
    async fn resync_all(&self, bg: &Background) {
        if !self.subscribed.load(Ordering::Acquire) {
            return;
        }
        let generation = self.sync_gen.load(Ordering::Acquire);
        for (_, db) in bg.databases.all() {
            let synced = db.sync.synced.load(Ordering::Acquire);
            if synced == generation {
                continue;
            }
            // Never synced and nothing to tell: the mirrors start from
            // Redis. Otherwise this instance may have missed bumps, or
            // failed to send its own.
            let missed = synced != 0 || db.sync.dirty.load(Ordering::Acquire);
            match self.resync_db(&db, missed).await {
                Ok(()) => {
                    if missed {
                        bg.resyncs.inc();
                    }
                    // A failure from now on moves the generation again.
                    db.sync.dirty.store(false, Ordering::Release);
                    db.sync.synced.store(generation, Ordering::Release);
                    // A statement waiting for the database's cache to be
                    // servable may be now.
                    db.stream.changed.notify_waiters();
                    self.metrics.resyncs.inc();
                }
                Err(e) => {
                    debug!(database = %db.name, error = %e, "resynchronisation failed; will retry");
                    return;
                }
            }
        }
    }

    async fn resync_db(&self, db: &DbState, missed: bool) -> Result<(), SharedError> {
        let header = if missed {
            message_header(&db.name, &[EPOCH.to_owned()])
        } else {
            Vec::new()
        };
        let mut pairs: Vec<(String, u64)> = vec![
            (EPOCH.to_owned(), db.versions.epoch.shared()),
            (DDL.to_owned(), db.versions.ddl.shared()),
            (WRITES.to_owned(), db.versions.writes.shared()),
        ];
        for f in db.versions.families() {
            pairs.push((format!("{TABLE}{}", f.name), f.version.shared()));
        }
        let hash = self.versions_key(&db.name);
        let all = self
            .run(async |mut c| {
                let mut invocation = self.resync_script.key(&hash);
                invocation.arg(&self.channel).arg(&header);
                for (field, value) in &pairs {
                    invocation.arg(field).arg(*value);
                }
                invocation.invoke_async::<Vec<(String, u64)>>(&mut c).await
            })
            .await?;
        // With `missed`, the epoch in `all` is new: what this instance may
        // have missed is treated as changed, locally and everywhere.
        for (field, value) in all {
            apply_field(db, &field, value);
        }
        Ok(())
    }

    fn on_message(&self, bg: &Background, payload: &[u8]) {
        let Some((database, updates)) = parse_message(payload) else {
            warn!("malformed invalidation message ignored");
            return;
        };
        // Databases this instance does not serve have no mirrors to update.
        let Some(db) = bg.databases.get(&database) else {
            return;
        };
        if let [(field, age)] = updates.as_slice()
            && field == WATCH
        {
            return self.vouched(&db, *age);
        }
        if let [(field, _)] = updates.as_slice()
            && field == WAKE
        {
            return db.stream.demand.note();
        }
        self.metrics
            .invalidations_received
            .inc_by(updates.len() as u64);
        bg.peers.inc();
        for (field, value) in updates {
            apply_field(&db, &field, value);
        }
    }
}

impl SharedTier {
    /// A lookup newly needs another instance's vouch ([`Self::ask_heartbeats`]
    /// runs soon).
    pub fn want_heartbeats(&self) {
        self.wake.notify_one();
    }

    /// Asks the other instances for heartbeats of every database whose
    /// lookups need their vouch (this instance's own stream not current):
    /// theirs rest when nothing of theirs needs them.
    async fn ask_heartbeats(&self, bg: &Background) {
        for (_, db) in bg.databases.all() {
            if db.stream.demand.vouch_wanted(Duration::from_secs(1)) {
                self.wake_others(&db).await;
            }
        }
    }

    /// Asks the other instances for `db`'s heartbeats, now: their vouch or
    /// their coverage is needed.
    pub async fn wake_others(&self, db: &DbState) {
        let mut message = message_header(&db.name, &[WAKE.to_owned()]);
        message.extend_from_slice(b"0");
        let sent = self
            .run(async |mut c| {
                redis::cmd("PUBLISH")
                    .arg(&self.channel)
                    .arg(&message)
                    .query_async::<i64>(&mut c)
                    .await
            })
            .await;
        if let Err(e) = sent {
            debug!(database = %db.name, error = %e, "cannot ask for heartbeats");
        }
    }
}

/// Raises the mirror of one field to `value`.
pub(super) fn apply_field(db: &DbState, field: &str, value: u64) {
    let version: &Version = match field {
        EPOCH => &db.versions.epoch,
        WRITES => &db.versions.writes,
        DDL => {
            if db.versions.ddl.raise_shared(value) {
                db.catalog.forget(&crate::classify::Ddl::All);
                db.versions.schema_changed();
            }
            return;
        }
        _ => match field.strip_prefix(TABLE) {
            Some(name) => {
                // A stripe of a table this instance does not key by row:
                // no mirror is kept ([`crate::cache::versions::RowVersions`]).
                if let Some((table, _)) = name.rsplit_once("#k")
                    && Scope::of(name) == Scope::Row
                    && db.versions.family(table).rows().is_none()
                {
                    return;
                }
                db.versions.family(name).version.raise_shared(value);
                return;
            }
            None => return,
        },
    };
    version.raise_shared(value);
}

/// `u16 database length, database, u16 field count, (u16 length, field)*`;
/// the bump script appends the new values as comma-separated decimals.
pub(super) fn message_header(database: &str, fields: &[String]) -> Vec<u8> {
    let mut out = Vec::with_capacity(database.len() + 4 + fields.len() * 16);
    out.extend_from_slice(&(database.len() as u16).to_le_bytes());
    out.extend_from_slice(database.as_bytes());
    out.extend_from_slice(&(fields.len() as u16).to_le_bytes());
    for f in fields {
        out.extend_from_slice(&(f.len() as u16).to_le_bytes());
        out.extend_from_slice(f.as_bytes());
    }
    out
}

fn parse_message(payload: &[u8]) -> Option<(String, Vec<(String, u64)>)> {
    fn take<'a>(p: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = (p.get(..n)?, p.get(n..)?);
        *p = tail;
        Some(head)
    }
    fn u16_le(p: &mut &[u8]) -> Option<usize> {
        let b = take(p, 2)?;
        Some(u16::from_le_bytes([b[0], b[1]]) as usize)
    }
    let mut p = payload;
    let len = u16_le(&mut p)?;
    let database = std::str::from_utf8(take(&mut p, len)?).ok()?.to_owned();
    let count = u16_le(&mut p)?;
    let mut fields = Vec::with_capacity(count.min(1024));
    for _ in 0..count {
        let len = u16_le(&mut p)?;
        fields.push(std::str::from_utf8(take(&mut p, len)?).ok()?.to_owned());
    }
    let values = std::str::from_utf8(p).ok()?;
    let values: Vec<u64> = values
        .split(',')
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    (values.len() == fields.len()).then(|| (database, fields.into_iter().zip(values).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused() {
        let fields = vec!["t:public.a,b".to_owned(), EPOCH.to_owned()];
        let mut msg = message_header("my\ndb", &fields);
        msg.extend_from_slice(b"7,9");
        let (db, updates) = parse_message(&msg).unwrap();
        assert_eq!(db, "my\ndb");
        assert_eq!(
            updates,
            vec![("t:public.a,b".to_owned(), 7), ("e".to_owned(), 9)]
        );
        let mut short = message_header("db", &fields);
        short.extend_from_slice(b"7");
        assert!(parse_message(&short).is_none(), "a value is missing");
        assert!(parse_message(&msg[..msg.len() - 4]).is_none());
        assert!(parse_message(b"").is_none());
        assert!(parse_message(&[0xff, 0xff, 1]).is_none());
    }

    #[test]
    fn fields_raise_the_right_mirrors() {
        let db = DbState::default();
        apply_field(&db, "t:public.a", 4);
        apply_field(&db, EPOCH, 2);
        assert_eq!(db.versions.family("public.a").version.shared(), 4);
        assert_eq!(db.versions.epoch.shared(), 2);
        let generation = db.catalog.generation();
        apply_field(&db, DDL, 1);
        assert_ne!(
            db.catalog.generation(),
            generation,
            "DDL elsewhere reloads the catalog"
        );
        apply_field(&db, "nonsense", 9);
        apply_field(&db, "t:public.a", 3);
        assert_eq!(
            db.versions.family("public.a").version.shared(),
            4,
            "never backwards"
        );
    }
}
