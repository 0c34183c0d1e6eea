//! The replication stream of one database: a slot ([`super::slot`]),
//! pgoutput decoded into version bumps (see the module documentation of
//! [`super`]).

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use tokio_util::task::AbortOnDropHandle;

use pgwire_replication::{ReplicationClient, ReplicationConfig};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::ReplicationError;
use super::control::Control;
use super::decoder::{Committed, Decoder, Step};
use super::heartbeat::{self, Heartbeats};
use super::listen::{CHANNEL, listen};
use super::slot::{self, Slot};
use super::trigger::{install_ddl_trigger, streams_alone};
use crate::cache::hold::Paused;
use crate::cache::{Bumps, Cache, DbState, Ddl};
use crate::config::ReplicationConfig as Settings;
use crate::pool::ServerPool;
use crate::upstream::{Upstream, UpstreamAddr};

/// How long letting go of a database may take.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// How often a stream checks whether other instances stream its database
/// ([`Streams::keep_trigger`]). One that starts rewrites the trigger
/// itself once its slot is made; one gone is noticed within this long.
/// Two instances that check at once may leave the trigger saying the
/// wrong thing until the next check: the cost of a few messages each
/// taken for a change of anything, never a missed change.
const TRIGGER_CHECK: Duration = Duration::from_secs(30);

/// Starts and keeps the replication streams, one per database served.
pub struct Streams {
    cache: Arc<Cache>,
    upstream: Arc<Upstream>,
    pub(super) settings: Settings,
    drain: CancellationToken,
    /// Counts the invalidations the streams apply.
    applied: prometheus::IntCounter,
    /// Counts those asked for by NOTIFY.
    notified: prometheus::IntCounter,
    /// Server connections parked for later clients, which let go of a
    /// database with the stream.
    pool: Arc<ServerPool>,
    /// The running stream tasks ([`Streams::stop`] waits for them).
    tasks: tokio_util::task::TaskTracker,
}

impl Streams {
    pub fn new(
        cache: Arc<Cache>,
        upstream: Arc<Upstream>,
        settings: Settings,
        drain: CancellationToken,
        applied: prometheus::IntCounter,
        notified: prometheus::IntCounter,
        pool: Arc<ServerPool>,
    ) -> Self {
        Self {
            cache,
            upstream,
            settings,
            drain,
            applied,
            notified,
            pool,
            tasks: tokio_util::task::TaskTracker::new(),
        }
    }

    /// Stops every stream and waits (up to [`RELEASE_WAIT`]) for them to
    /// end: nothing moves a counter or acknowledges a position after this
    /// returns. For a pgcache handing its disk tier to the next one.
    pub async fn stop(&self) {
        self.drain.cancel();
        self.tasks.close();
        if tokio::time::timeout(RELEASE_WAIT, self.tasks.wait())
            .await
            .is_err()
        {
            warn!("the replication streams did not stop in time");
        }
    }

    /// A NOTIFY on [`CHANNEL`]: the tags and tables it names are bumped.
    async fn notified(&self, db: &Arc<DbState>, payload: &str) {
        let mut bumps = Bumps::default();
        for item in payload.split(',') {
            match db.named_bumps(item) {
                Some(named) => bumps.merge(&named),
                None => {
                    let shown: String = item.chars().take(80).collect();
                    warn!(database = %db.name, item = shown, "{CHANNEL}: not tag:NAME or table:NAME; ignored");
                }
            }
        }
        if !bumps.is_empty() {
            debug!(database = %db.name, payload, "invalidated by NOTIFY");
            self.cache
                .invalidate(db, bumps, &self.notified)
                .send()
                .await;
        }
    }

    /// Starts the stream of `db` unless it runs already.
    pub fn ensure(self: &Arc<Self>, db: &Arc<DbState>) {
        db.hold.touch();
        if !self.cache.replication_on()
            || self.drain.is_cancelled()
            || db.hold.paused()
            || !db.stream.claim()
        {
            return;
        }
        let streams = Arc::clone(self);
        let db = Arc::clone(db);
        self.tasks.spawn(async move { streams.run(db).await });
    }

    /// Every instance hears DDL from its own stream, so the catalog facts
    /// are forgotten here and only the versions are published.
    async fn invalidate(&self, db: &Arc<DbState>, mut bumps: Bumps) {
        if !bumps.ddl.is_none() {
            db.versions.schema_changed();
        }
        db.catalog.forget(&std::mem::take(&mut bumps.ddl));
        self.cache.invalidate(db, bumps, &self.applied).send().await;
    }

    /// Keeps the stream of one database running until shutdown, or until
    /// pgcache lets go of the database (see [`crate::cache::hold`]).
    async fn run(&self, db: Arc<DbState>) {
        let hold = db.hold.token();
        // A statement paused the database before it let go: if that was
        // before this token was taken, the token will not be cancelled.
        if db.hold.paused() {
            db.stream.unclaim();
            return;
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            db.stream.set_streaming(false);
            let result = tokio::select! {
                r = self.stream_once(&db) => r,
                _ = self.drain.cancelled() => return,
                _ = hold.cancelled() => break,
                _ = self.idle(&db) => {
                    info!(database = %db.name, idle_secs = self.settings.idle_release_secs,
                        "no client used the database: letting go of it");
                    db.hold.let_go();
                    self.pool.evict_database(&db.name);
                    if let Some(slot) = db.stream.slot().filter(|s| slot::is_persistent(s))
                        && let Err(e) = self.wait_slot_gone(&slot, &db.name).await
                    {
                        warn!(database = %db.name, slot, error = %e, "could not drop the replication slot");
                    }
                    break;
                }
            };
            db.stream.set_streaming(false);
            match result {
                Ok(()) => backoff = Duration::from_millis(100),
                Err(e) => {
                    warn!(database = %db.name, error = %e, retry_in = ?backoff, "replication stream down; cache off for this database");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.drain.cancelled() => return,
                _ = hold.cancelled() => break,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        db.stream.set_streaming(false);
        db.stream.unclaim();
        info!(database = %db.name, "replication stream released");
    }

    /// Returns once no client has used `db` for `idle_release_secs`
    /// (never if that is 0).
    async fn idle(&self, db: &DbState) {
        let limit = Duration::from_secs(self.settings.idle_release_secs);
        if limit.is_zero() {
            return std::future::pending().await;
        }
        loop {
            let idle = db.hold.idle_for();
            if idle >= limit {
                return;
            }
            tokio::time::sleep(limit - idle).await;
        }
    }

    /// Lets go of database `name` for a statement that needs it free, and
    /// waits until PostgreSQL has seen the stream's slot go. The returned
    /// guard keeps pgcache off the database until dropped. `via` names a
    /// database to ask about the slot on (the client's own).
    pub async fn release(&self, name: &str, via: &str) -> Option<Paused> {
        let db = self.cache.databases.get(name)?;
        let paused = db.hold.pause();
        db.hold.let_go();
        self.pool.evict_database(name);
        if !db.stream.wait_unclaimed(RELEASE_WAIT).await {
            warn!(
                database = name,
                "the replication stream did not stop in time"
            );
        }
        // Read once the stream has stopped: one that was starting when the
        // statement came had not named its slot yet, and its walsender may
        // still be exiting.
        if let Some(slot) = db.stream.slot()
            && let Err(e) = self.wait_slot_gone(&slot, via).await
        {
            warn!(database = name, slot, error = %e, "could not see the replication slot go");
        }
        info!(
            database = name,
            "let go of the database for a statement that needs it free"
        );
        Some(paused)
    }

    /// [`slot::wait_gone`], asked on a connection to database `via`.
    async fn wait_slot_gone(&self, slot: &str, via: &str) -> Result<(), ReplicationError> {
        let ctl = self.upstream.control(via).await?;
        let walsender = slot::walsender_name(slot);
        match tokio::time::timeout(RELEASE_WAIT, slot::wait_gone(&ctl, slot, &walsender)).await {
            Ok(result) => result,
            Err(_) => Err(ReplicationError::Config(
                "the slot was still there after 5 s".into(),
            )),
        }
    }

    /// What the stream needs of the database: whether the upstream takes
    /// the origin setting (not known when PostgreSQL was down at
    /// start-up), the publication current, the DDL event trigger in place.
    async fn prepare(&self, ctl: &Control, db: &DbState) -> Result<(), ReplicationError> {
        if self.settings.ddl_event_trigger {
            super::probe_origin(&self.upstream).await;
        }
        if self.settings.manage_publication {
            let synced = ctl
                .sync_publication(&self.settings.publication, None, true, None)
                .await?;
            self.note_unpublished(db, None, synced.unpublished);
        }
        self.keep_trigger(ctl, db, false).await;
        Ok(())
    }

    /// The DDL event trigger in place, its body saying whether this
    /// instance streams the database alone ([`streams_alone`]; `own_slot`:
    /// the stream's slot is made). Checked before the slot is made and
    /// after, and again every [`TRIGGER_CHECK`]: an instance that starts
    /// streaming makes the trigger list objects again; once it is gone, the
    /// trigger leaves them out again. The body is only rewritten when this
    /// changes.
    async fn keep_trigger(&self, ctl: &Control, db: &DbState, own_slot: bool) {
        if !self.settings.ddl_event_trigger {
            return;
        }
        let managed = self.settings.manage_publication;
        let publication = managed.then_some(self.settings.publication.as_str());
        let alone = streams_alone(ctl.client(), own_slot).await;
        install_ddl_trigger(ctl.client(), &db.name, publication, alone).await;
    }

    /// Heartbeats through the control connection, every `heartbeat_ms`,
    /// for as long as the handle lives.
    fn beat(
        &self,
        ctl: &Control,
        db: &Arc<DbState>,
    ) -> (Arc<Heartbeats>, AbortOnDropHandle<ReplicationError>) {
        let beats = Arc::new(Heartbeats::new(self.upstream.origin.id));
        let every = Duration::from_millis(self.settings.heartbeat_ms);
        let beat = heartbeat::beat(
            Arc::clone(ctl.client()),
            Arc::clone(&beats),
            every,
            Arc::clone(db),
        );
        (beats, AbortOnDropHandle::new(tokio::spawn(beat)))
    }

    async fn stream_once(&self, db: &Arc<DbState>) -> Result<(), ReplicationError> {
        let database = db.name.as_str();
        let ctl = Control::prepare(self.upstream.control(database).await?).await?;
        self.prepare(&ctl, db).await?;
        let slot = Slot::ready(&self.cache, ctl.client(), db).await?;
        // Named before it exists, so that a statement that needs the
        // database free waits for it even while it is being made.
        db.stream.set_slot(Some(slot.name.clone()));
        let mut stream = self.start(database, &slot).await?;
        self.keep_trigger(&ctl, db, true).await;
        let mut trigger_check =
            tokio::time::interval_at(tokio::time::Instant::now() + TRIGGER_CHECK, TRIGGER_CHECK);
        let (beats, mut beating) = self.beat(&ctl, db);
        let mut listener = listen(&self.upstream, database).await?;
        let start = self.missed(ctl.client(), db, slot.resume).await?;
        db.stream
            .started(Duration::from_millis(self.settings.max_staleness_ms));
        db.stream.set_streaming(true);
        info!(database, slot = %slot.name, "replication stream up");
        let mut state = Decoder::new(beats);
        // DDL transactions seen and not yet handled. They are handled once
        // nothing else waits in the stream, or before a heartbeat: DDL that
        // arrives together (a migration, DDL from several sessions, DDL
        // that committed while the last was being handled) costs one round
        // of queries, and lone DDL is handled as soon as it arrives.
        let mut ddl: Option<Committed> = None;
        loop {
            let ready = ddl
                .is_some()
                .then(|| stream.recv().now_or_never())
                .flatten();
            if ready.is_none()
                && let Some(committed) = ddl.take()
            {
                self.after_ddl(&ctl, db, committed).await?;
            }
            let event = match ready {
                Some(event) => event?,
                None => tokio::select! {
                    event = stream.recv() => event?,
                    () = db.catalog.unwatched_found.notified() => {
                        self.publish_unwatched(&ctl, db).await;
                        continue;
                    }
                    _ = trigger_check.tick() => {
                        self.keep_trigger(&ctl, db, true).await;
                        slot.drop_stale(ctl.client(), &self.cache).await;
                        continue;
                    }
                    payload = listener.payloads.recv() => {
                        let Some(payload) = payload else {
                            return Err(ReplicationError::Config(format!("the {CHANNEL} listener's connection ended")));
                        };
                        self.notified(db, &payload).await;
                        continue;
                    }
                    failed = &mut beating => {
                        return Err(match failed {
                            Ok(e) => e,
                            Err(_) => ReplicationError::Config("the heartbeat task ended".into()),
                        });
                    }
                },
            };
            let Some(event) = event else {
                return Ok(());
            };
            let Some(step) = state.on_event(db, event) else {
                return Ok(());
            };
            // Acknowledged only once applied, and never past DDL not yet
            // handled: a persistent slot resumes from the acknowledged
            // position, and what comes before it is not read again.
            let ack = step.ack;
            self.apply(&ctl, db, step, &mut ddl, start).await?;
            if let Some(lsn) = ack.filter(|_| ddl.is_none()) {
                stream.update_applied_lsn(lsn);
            }
        }
    }

    /// What one event asks beyond its acknowledgement: its bumps, its DDL
    /// kept for a round, and for a heartbeat back, that round first.
    async fn apply(
        &self,
        ctl: &Control,
        db: &Arc<DbState>,
        step: Step,
        ddl: &mut Option<Committed>,
        start: u64,
    ) -> Result<(), ReplicationError> {
        if !step.bumps.is_empty() {
            self.invalidate(db, step.bumps).await;
        }
        if let Some(committed) = step.ddl_committed {
            ddl.get_or_insert_default().add(committed);
        }
        if step.ddl_handled {
            db.stream.ddl_handled_by_session();
        }
        if let Some((sent, lsn)) = step.beat {
            // A heartbeat back proves what came before it, DDL named and
            // invalidated included.
            if let Some(committed) = ddl.take() {
                self.after_ddl(ctl, db, committed).await?;
            }
            db.stream.heartbeat_applied(sent, lsn);
            // After the bumps of what it follows are in Redis.
            if let Some(tier) = self.cache.shared() {
                tier.cover(db, start, lsn, sent).await;
            }
        }
        Ok(())
    }

    /// The stream just started: changes made while no stream of this
    /// instance ran were missed. Everything this instance cached for the
    /// database is void, and so is what it knows of the catalog; what Redis
    /// holds is void too, unless another live instance's stream covered the
    /// gap (see [`crate::cache::shared`]'s coverage). Returns the position
    /// the stream covers from.
    /// `resumed`: the stream reads a slot the last run left, from where
    /// that run's stream left off. The local (and disk) entries missed
    /// nothing then: what changed since comes through the stream before
    /// its first heartbeat. (With a shared tier, unless another instance's
    /// stream covered the gap, Redis's entries are void, and with them
    /// the local ones.)
    async fn missed(
        &self,
        ctl: &tokio_postgres::Client,
        db: &Arc<DbState>,
        resumed: bool,
    ) -> Result<u64, ReplicationError> {
        // At or past the slot's consistent point: the slot was made before.
        let row = ctl
            .query_one("SELECT pg_catalog.pg_current_wal_insert_lsn()::text", &[])
            .await?;
        let start = pgwire_replication::Lsn::parse(row.get(0))
            .map_err(|e| ReplicationError::Config(format!("the server's WAL position: {e}")))?
            .0;
        if resumed && self.cache.shared().is_none() {
            info!(database = %db.name, "the stream resumed where the last run's left off: disk entries kept");
            return Ok(start);
        }
        let heartbeat = Duration::from_millis(self.settings.heartbeat_ms);
        let covered = match self.cache.shared() {
            Some(tier) => {
                let lease = Duration::from_millis(self.settings.max_staleness_ms);
                // Their heartbeats may rest: ask for them.
                tier.wake_others(db).await;
                tier.covered(db, start, 2 * heartbeat, lease).await
            }
            None => false,
        };
        if covered {
            info!(database = %db.name, "another instance's stream covered the gap: shared entries kept");
            if !resumed {
                db.apply_local(&Bumps::opaque());
            }
        } else {
            self.invalidate(db, Bumps::opaque()).await;
            if let Some(tier) = self.cache.shared() {
                tier.claim_cover(db, start).await;
            }
        }
        Ok(start)
    }

    /// Opens the replication connection and starts streaming from `slot`,
    /// made now unless it is resumed.
    async fn start(&self, database: &str, slot: &Slot) -> Result<Walsender, ReplicationError> {
        let name = slot.name.as_str();
        let pg = self.upstream.control_config(database);
        let (host, port, tls) = match self.upstream.addrs.first() {
            Some(UpstreamAddr::Tcp { host, port }) => {
                (host.clone(), *port, self.upstream.tls.replication(host))
            }
            Some(UpstreamAddr::Unix { path }) => {
                let dir = path
                    .parent()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                let port = path
                    .extension()
                    .and_then(|e| e.to_str())
                    .and_then(|e| e.parse().ok())
                    .unwrap_or(5432);
                (dir, port, pgwire_replication::TlsConfig::disabled())
            }
            None => return Err(ReplicationError::Config("no upstream address".into())),
        };
        let password = pg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let cfg = ReplicationConfig::new(
            host,
            pg.get_user().unwrap_or("postgres"),
            password,
            database,
            name,
            self.settings.publication.as_str(),
        )
        .with_port(port)
        .with_tls(tls)
        .with_application_name(slot::walsender_name(name))
        .with_status_interval(Duration::from_secs(1));
        let mut stream = Walsender(ReplicationClient::connect_gated(cfg).await?);
        if let Some(create) = slot.create() {
            stream.simple_query(&create).await?;
        }
        stream.start().await?;
        stream.wait_started().await?;
        Ok(stream)
    }

    /// Transactions that ran DDL committed. The stream can deliver a
    /// commit before the transaction is visible to other sessions: wait
    /// until they are, name the objects they created or altered, forget
    /// what they changed again (a fetch may have read the old catalog
    /// meanwhile) and take tables that lost their replica identity out of
    /// the publication.
    async fn after_ddl(
        &self,
        ctl: &Control,
        db: &Arc<DbState>,
        Committed { xids, announced }: Committed,
    ) -> Result<(), ReplicationError> {
        db.stream.ddl_handled(xids.len());
        let announced_names: Vec<String> = match &announced.names {
            Ddl::Objects(names) => names.iter().map(|n| n.to_string()).collect(),
            Ddl::All | Ddl::None => Vec::new(),
        };
        let managed = self
            .settings
            .manage_publication
            .then_some(self.settings.publication.as_str());
        let round = ctl
            .after_ddl(&xids, &announced.objects, &announced_names, managed)
            .await?;
        debug!(database = %db.name, named = ?round.names, "DDL objects named");
        let mut ddl = announced.names;
        match round.names {
            Some(names) => ddl.merge(&Ddl::objects(names)),
            None => ddl = Ddl::All,
        }
        // Only tables of the names it touched can have joined or left.
        let only: Option<Vec<String>> = match &ddl {
            Ddl::All => None,
            Ddl::Objects(names) => Some(names.iter().map(|n| n.to_string()).collect()),
            Ddl::None => Some(Vec::new()),
        };
        self.invalidate(db, Bumps::ddl(ddl)).await;
        // Tables that lost their replica identity leave the publication;
        // new ones join it when first read ([`Self::publish_unwatched`]).
        if only.as_ref().is_none_or(|o| !o.is_empty()) {
            // The round looked at the tables of the names it found; for
            // anything, every table is looked at.
            let found = round.publication.filter(|_| only.is_some());
            self.sync_publication(ctl, db, only.as_deref(), false, found)
                .await;
        }
        Ok(())
    }
}

/// A replication session whose worker task ends with it. Dropping a
/// `ReplicationClient` only asks its worker to stop, and the worker may
/// still send a queued `CREATE_REPLICATION_SLOT` afterwards: a slot made
/// after pgcache let go of the database would block `DROP DATABASE`.
struct Walsender(ReplicationClient);

impl std::ops::Deref for Walsender {
    type Target = ReplicationClient;
    fn deref(&self) -> &ReplicationClient {
        &self.0
    }
}

impl std::ops::DerefMut for Walsender {
    fn deref_mut(&mut self) -> &mut ReplicationClient {
        &mut self.0
    }
}

impl Drop for Walsender {
    fn drop(&mut self) {
        self.0.abort();
    }
}
