//! Transaction mode: a session's server connection comes from its pool
//! ([`crate::pool::transaction`]) when a request has to go to PostgreSQL,
//! and goes back once the session is idle again (no transaction, nothing
//! in flight, no batch half sent). Between the two the session's backend
//! is [`BackendStream::Detached`], and cache hits are answered without a
//! connection.
//!
//! What the client set stays the client's ([`ClientState`]): its startup
//! parameters and every setting it changed are applied to each connection
//! it takes whose last client had other settings, and read back before a
//! connection it changed goes back. A feature whose state lives in one
//! backend ([`Pin`]) keeps the client on its connection for good.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::debug;

use super::SessionError;
use super::pipeline::Inflight;
use super::relay::Session;
use crate::backend::BackendStream;
use crate::invalidation::control::quote_literal;
use crate::pool::clients::Activity;
use crate::pool::marks::Pin;
use crate::pool::prepared::{Answer, ServerStatements, Translator};
use crate::pool::transaction::{Lease, Pool, PoolError};
use crate::protocol::startup::Startup;
use crate::protocol::stream::FramedStream;
use crate::protocol::{TxStatus, messages};

/// [`crate::pool::transaction::Pooled::state`] of a connection left in a
/// state pgcache did not read.
pub(super) const UNKNOWN_STATE: u64 = u64::MAX;

/// A session's settings, as pgcache applies them to pooled connections.
#[derive(Debug, Clone, Default)]
pub(super) struct ClientState {
    /// Name and value; `session_authorization` and `role` first, as they
    /// reset what follows.
    settings: Vec<(String, String)>,
    /// Identifies the settings: 0 for none (a connection as it logged in).
    pub id: u64,
}

/// Reads a session's settings back, on the connection it changed them on.
/// Startup parameters show as `client` on a connection that logged in with
/// them, as `session` on a pooled one they were applied to.
const CAPTURE: &str = "SELECT 'session_authorization', pg_catalog.current_setting('session_authorization') \
     UNION ALL SELECT 'role', pg_catalog.current_setting('role') \
     UNION ALL SELECT name, setting FROM pg_catalog.pg_settings \
     WHERE source IN ('client', 'session') AND name NOT IN ('session_authorization', 'role')";

impl ClientState {
    /// A client's startup parameters as settings; `options` gives its
    /// `-c name=value` (or `--name=value`) pairs.
    pub fn from_startup(startup: &Startup) -> Result<Self, String> {
        let mut settings = Vec::new();
        for (name, value) in &startup.params {
            match name.as_str() {
                "user" | "database" | "replication" => {}
                "options" => settings.extend(command_line_options(value)?),
                _ => settings.push((name.clone(), value.clone())),
            }
        }
        Ok(Self::new(settings))
    }

    fn new(mut settings: Vec<(String, String)>) -> Self {
        let rank = |name: &str| match name {
            "session_authorization" => 0,
            "role" => 1,
            _ => 2,
        };
        settings.sort_by(|a, b| (rank(&a.0), &a.0).cmp(&(rank(&b.0), &b.0)));
        settings.dedup_by(|a, b| a.0 == b.0);
        let id = if settings.is_empty() {
            0
        } else {
            let mut h = std::hash::DefaultHasher::new();
            settings.hash(&mut h);
            h.finish().clamp(1, UNKNOWN_STATE - 1)
        };
        Self { settings, id }
    }

    /// The settings read back with [`CAPTURE`], with the startup
    /// parameters among `startup` that the session no longer has, which
    /// are returned too. Directly, `RESET` (or `RESET ALL`, `DISCARD ALL`,
    /// `SET ... TO DEFAULT`) takes a startup parameter back to the value
    /// the client logged in with; a pooled connection, which logged in
    /// without it, goes back to the server's default, so pgcache sets it
    /// again.
    fn captured(
        rows: Vec<Vec<Option<String>>>,
        user: &str,
        startup: &[(String, String)],
    ) -> (Self, Vec<(String, String)>) {
        let pairs: Vec<(String, String)> = rows
            .into_iter()
            .filter_map(|row| {
                let mut row = row.into_iter();
                Some((row.next()??, row.next()??))
            })
            .collect();
        let reset: Vec<(String, String)> = startup
            .iter()
            .filter(|(name, _)| !pairs.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)))
            .cloned()
            .collect();
        let state = Self::of_session(pairs.into_iter().chain(reset.iter().cloned()), user);
        (state, reset)
    }

    /// Session mode: the state the settings query read (its session user,
    /// `role`, and the settings from startup or `SET` as a JSON object).
    pub(super) fn read(
        user: &str,
        session_user: Option<&str>,
        role: Option<&str>,
        own: Option<&str>,
    ) -> Self {
        let identity = [("session_authorization", session_user), ("role", role)]
            .into_iter()
            .filter_map(|(name, value)| Some((name.to_owned(), value?.to_owned())));
        let own = own
            .and_then(|json| serde_json::from_str::<HashMap<String, String>>(json).ok())
            .unwrap_or_default();
        Self::of_session(identity.chain(own), user)
    }

    /// A session's settings, leaving out what equals a login as `user`.
    fn of_session(settings: impl Iterator<Item = (String, String)>, user: &str) -> Self {
        let settings = settings
            .filter(|(name, value)| match name.as_str() {
                "session_authorization" => value != user,
                "role" => value != "none",
                _ => true,
            })
            .collect();
        Self::new(settings)
    }

    /// Puts a pooled connection in this state: its login state, then each
    /// setting. One implicit transaction: a failure changes nothing.
    pub(super) fn apply_sql(&self) -> String {
        let mut sql = String::from("SET SESSION AUTHORIZATION DEFAULT; RESET ROLE; RESET ALL");
        if !self.settings.is_empty() {
            sql.push_str("; ");
            sql.push_str(&set_config_sql(&self.settings));
        }
        sql
    }
}

/// One statement that sets each of `settings` for the session.
fn set_config_sql(settings: &[(String, String)]) -> String {
    let mut sql = String::from("SELECT FROM (VALUES ");
    for (i, (name, value)) in settings.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        sql.push_str(&quote_literal(name));
        sql.push_str(", ");
        sql.push_str(&quote_literal(value));
        sql.push(')');
    }
    sql.push_str(") AS s(n, v), LATERAL pg_catalog.set_config(s.n, s.v, false)");
    sql
}

/// `-c name=value` and `--name=value` pairs of a startup `options` value,
/// as PostgreSQL reads them (`\` escapes a space).
fn command_line_options(options: &str) -> Result<Vec<(String, String)>, String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut pairs = Vec::new();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        let pair = if w == "-c" {
            words.next()
        } else if let Some(rest) = w.strip_prefix("--") {
            Some(rest.to_owned())
        } else {
            w.strip_prefix("-c").map(str::to_owned)
        };
        let Some((name, value)) = pair.as_deref().and_then(|p| p.split_once('=')) else {
            return Err(format!(
                "startup option \"{w}\" is not supported in transaction pooling mode"
            ));
        };
        pairs.push((name.replace('-', "_"), value.to_owned()));
    }
    Ok(pairs)
}

/// The pool settings a pooled session needs at every checkout, read from
/// the configuration once per RELOAD rather than once per transaction:
/// the configuration's lock and reference count are shared by every
/// session, on every core.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Knobs {
    /// The policy generation they were read in (0: not yet read).
    generation: u64,
    pub wait: Option<std::time::Duration>,
    pub lifetime: std::time::Duration,
    pub max_prepared: usize,
}

/// Where a session's server connections come from.
pub(super) struct Link {
    /// Transaction mode: the pool of the session's database and user.
    pub pool: Option<Arc<Pool>>,
    /// Session mode: the pool of the session's database and user that
    /// pgcache's own requests for its hits run on, off its connection.
    pub checks: Option<Arc<Pool>>,
    /// The pooled connection held now; its stream is the session's
    /// backend. `None` while attached means the connection the client
    /// logged in on, which no pool owns (passthrough authentication).
    lease: Option<Lease>,
    /// Why the session keeps its connection for good.
    pub pinned: Option<Pin>,
    pub state: ClientState,
    /// The client's startup parameters (and `options`' settings): what a
    /// `RESET` of one goes back to.
    startup: Vec<(String, String)>,
    /// The session's settings may have changed on the connection it holds.
    pub state_dirty: bool,
    /// The state was applied once (and so checked, as PostgreSQL checks
    /// startup parameters at login).
    state_checked: bool,
    /// The client's prepared statements, moved from connection to
    /// connection.
    pub translator: Translator,
    /// The statements of the connection the client logged in on.
    own_statements: ServerStatements,
    /// Why pgcache's own query for the statement under way found no
    /// connection: the statement fails with it rather than wait again.
    pub no_connection: Option<PoolError>,
    /// The pool generation the session's settings were read in.
    pub prefix_generation: Option<u64>,
    /// The translated frames of one flush.
    pub scratch: BytesMut,
    /// A statement that may change the schema went out: the database's
    /// schema generation moves when the session is next idle.
    pub schema_changes: bool,
    knobs: Knobs,
}

impl Link {
    /// Session mode: the session keeps the connection it logged in on.
    pub fn session() -> Self {
        Self {
            pool: None,
            checks: None,
            lease: None,
            pinned: None,
            state: ClientState::default(),
            startup: Vec::new(),
            state_dirty: false,
            state_checked: true,
            translator: Translator::default(),
            own_statements: ServerStatements::default(),
            no_connection: None,
            prefix_generation: None,
            scratch: BytesMut::new(),
            schema_changes: false,
            knobs: Knobs::default(),
        }
    }

    pub fn pooled(pool: Arc<Pool>, state: ClientState) -> Self {
        Self {
            pool: Some(pool),
            startup: state.settings.clone(),
            state,
            state_checked: false,
            ..Self::session()
        }
    }

    pub fn is_pooled(&self) -> bool {
        self.pool.is_some()
    }

    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    fn server_statements(&mut self) -> &mut ServerStatements {
        statements_of(&mut self.lease, &mut self.own_statements)
    }

    /// The client's frames for the connection it holds, into `out`; returns
    /// the answers pgcache gives at once. `idle`: the session is outside a
    /// transaction block.
    pub fn translate(
        &mut self,
        frames: &[u8],
        max_prepared: usize,
        idle: bool,
        out: &mut BytesMut,
    ) -> BytesMut {
        let server = statements_of(&mut self.lease, &mut self.own_statements);
        self.translator
            .translate(frames, server, max_prepared, idle, out)
    }

    /// One server frame: whether the client gets it, pgcache's answers to
    /// insert after it, and what to send the server again.
    pub fn on_server_frame(&mut self, frame: &[u8]) -> Answer {
        let server = statements_of(&mut self.lease, &mut self.own_statements);
        self.translator.on_frame(frame, server)
    }
}

/// The statements of the connection a session holds: a field apart from
/// its translator, so both are borrowed at once (every frame goes through
/// the two).
fn statements_of<'a>(
    lease: &'a mut Option<Lease>,
    own: &'a mut ServerStatements,
) -> &'a mut ServerStatements {
    match lease {
        Some(lease) => &mut lease.server_mut().prepared,
        None => own,
    }
}

/// A session's backend while it holds no server connection.
pub(super) fn detached() -> FramedStream<BackendStream> {
    FramedStream::new(BackendStream::Detached, BytesMut::new(), 0)
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// [`Knobs`], read again after a RELOAD.
    pub(super) fn knobs(&mut self) -> Knobs {
        let generation = self.app.policy_generation();
        if self.engine.link.knobs.generation != generation {
            let config = self.app.config();
            self.engine.link.knobs = Knobs {
                generation,
                wait: config.pool.query_wait_timeout(),
                lifetime: config.pool.server_lifetime(),
                max_prepared: config.pool.max_prepared_statements,
            };
        }
        self.engine.link.knobs
    }

    pub(super) fn attached(&self) -> bool {
        !matches!(self.backend.get_ref(), BackendStream::Detached)
    }

    /// Transaction mode, with no connection: takes one from the pool and
    /// gives it the client's settings: queued before the client's
    /// requests when `queued`, else at once (pgcache's own queries read
    /// the settings; and the first time, a failure is the client's login
    /// error, as PostgreSQL reports a bad startup parameter).
    pub(super) async fn attach(&mut self, queued: bool) -> Result<(), SessionError> {
        if self.attached() {
            return Ok(());
        }
        let Some(pool) = self.engine.link.pool.clone() else {
            return Ok(());
        };
        if let Some(e) = self.engine.link.no_connection.take() {
            return Err(SessionError::Pool(e));
        }
        let wait = self.knobs().wait;
        tracing::trace!(status = ?self.engine.tx.status, "taking a server connection");
        let client = Arc::clone(&self.entry.client);
        client.set(Activity::Waiting);
        let id = client.id;
        let taken = self
            .app
            .pool
            .pooled
            .checkout(&pool, &self.app.upstream, wait, id)
            .await;
        let (mut lease, stream) = match taken {
            Ok(taken) => taken,
            Err(e) => {
                client.set(Activity::Idle);
                return Err(SessionError::Pool(e));
            }
        };
        let server = lease.server();
        client.hold(server.id, server.key.backend_pid);
        self.backend = stream;
        // One address for the whole pool: copied once, not per checkout.
        if self.engine.backend_addr != server.addr {
            self.engine.backend_addr = server.addr.clone();
        }
        self.engine.backend_key = Some(server.key.clone());
        if let Some(cancel) = &self.engine.cancel {
            cancel.retarget(self.engine.backend_key.clone());
        }
        let state = &self.engine.link.state;
        let differs = server.state != state.id;
        lease.server_mut().state = state.id;
        self.engine.link.lease = Some(lease);
        if !differs {
            return Ok(());
        }
        let apply = messages::query(&state.apply_sql());
        if self.engine.link.state_checked && queued {
            let mut queued = apply;
            queued.extend_from_slice(&self.engine.pipeline.to_backend);
            self.engine.pipeline.to_backend = queued;
            self.engine.pipeline.push_front(Inflight::hidden(None));
            return Ok(());
        }
        self.engine.link.state_checked = true;
        // A simple Query: the server's unnamed statement is gone.
        self.engine.link.server_statements().forget_unnamed();
        match Box::pin(self.run_hidden(&apply)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => {
                // In an unknown state: closed.
                self.drop_backend();
                Err(match error {
                    Some(frame) => SessionError::from_server_error(&frame),
                    None => SessionError::BackendIo(std::io::ErrorKind::InvalidData.into()),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Transaction mode: gives the connection back once the session is
    /// idle, reading its settings first if they may have changed.
    pub(super) async fn detach_if_idle(&mut self) -> Result<(), SessionError> {
        if !self.engine.link.is_pooled()
            || !self.attached()
            || !self.backend_idle()
            || self.engine.batch.holds()
            || !self.backend.buffered().is_empty()
            || self.engine.backend_fatal
            || !self.engine.link.translator.is_idle()
        {
            return Ok(());
        }
        if self.engine.link.state_dirty {
            if !Box::pin(self.settle_settings()).await? {
                // Unreadable: the connection is closed, not given back.
                self.drop_backend();
                return Ok(());
            }
            if !self.backend_idle() || !self.backend.buffered().is_empty() {
                return Ok(());
            }
        }
        if self.engine.link.pinned.is_some() {
            return Ok(());
        }
        tracing::trace!(status = ?self.engine.tx.status, "giving the server connection back");
        let lifetime = self.knobs().lifetime;
        let stream = std::mem::replace(&mut self.backend, detached());
        match self.engine.link.lease.take() {
            Some(lease) => lease.give_back(stream, lifetime),
            None => {
                // The connection the client logged in on: not the pool's.
                let mut stream = stream;
                let _ = stream.write_all(&messages::TERMINATE).await;
                self.engine.link.own_statements.clear();
            }
        }
        self.detached_now();
        Ok(())
    }

    /// Reads back the settings the session changed, and sets again the
    /// startup parameters it reset ([`ClientState::captured`]); false if
    /// the connection is in a state pgcache cannot tell.
    async fn settle_settings(&mut self) -> Result<bool, SessionError> {
        let user = self.engine.startup.user().to_owned();
        let Ok(rows) = self.run_hidden(&messages::hidden_query(CAPTURE)).await? else {
            return Ok(false);
        };
        let (state, reset) = ClientState::captured(rows, &user, &self.engine.link.startup);
        if !reset.is_empty() {
            debug!(?reset, "startup parameters set again after a reset");
            let again = messages::hidden_query(&set_config_sql(&reset));
            if self.run_hidden(&again).await?.is_err() {
                return Ok(false);
            }
        }
        self.engine.link.state = state;
        self.engine.link.state_dirty = false;
        debug!(settings = ?self.engine.link.state.settings, "session settings read back");
        if let Some(lease) = &mut self.engine.link.lease {
            lease.server_mut().state = self.engine.link.state.id;
        }
        Ok(true)
    }

    /// The session holds no connection any more.
    fn detached_now(&mut self) {
        self.engine.backend_key = None;
        if let Some(cancel) = &self.engine.cancel {
            cancel.retarget(None);
        }
        self.entry.client.hold(0, 0);
    }

    /// Closes the held connection: it is in a state no other client may
    /// see.
    pub(super) fn drop_backend(&mut self) {
        self.engine.link.lease = None;
        self.engine.link.translator.clear_owed();
        self.backend = detached();
        self.detached_now();
    }

    /// At the session's end: an idle pooled connection goes back to the
    /// pool; any other is closed.
    pub(super) fn release_at_end(&mut self) {
        if !self.engine.link.is_pooled() || !self.attached() {
            return;
        }
        let clean = self.engine.link.pinned.is_none()
            && self.backend_idle()
            && !self.engine.batch.holds()
            && self.backend.buffered().is_empty()
            && !self.engine.backend_fatal
            && self.engine.link.translator.is_idle();
        match self.engine.link.lease.take() {
            Some(mut lease) if clean => {
                if self.engine.link.state_dirty {
                    lease.server_mut().state = UNKNOWN_STATE;
                }
                let lifetime = self.knobs().lifetime;
                let stream = std::mem::replace(&mut self.backend, detached());
                lease.give_back(stream, lifetime);
            }
            _ => {
                // Closed, with a word, so PostgreSQL does not log a lost client.
                let mut stream = std::mem::replace(&mut self.backend, detached());
                tokio::spawn(async move {
                    let _ = stream.write_all(&messages::TERMINATE).await;
                });
                self.drop_backend();
            }
        }
    }

    /// A feature that lives in one backend: the session keeps its
    /// connection from now on.
    pub(super) fn pin(&mut self, why: Pin) {
        if !self.engine.link.is_pooled() || self.engine.link.pinned.is_some() {
            return;
        }
        debug!(
            reason = why.as_str(),
            "session pinned to its server connection"
        );
        self.app
            .metrics
            .pooled
            .pins
            .with_label_values(&[why.as_str()])
            .inc();
        self.engine.link.pinned = Some(why);
        self.entry.client.pin(why.as_str());
    }

    /// Transaction mode, for a client pgcache can log in for: what
    /// PostgreSQL tells a client at login (the latest login's parameters,
    /// with the client's own where it gave them), with a key of
    /// pgcache's, and no connection taken unless none ever logged in.
    pub(super) async fn greet(&mut self) -> Result<(), SessionError> {
        let pool = self
            .engine
            .link
            .pool
            .clone()
            .expect("greet is for pooled sessions");
        let statuses = match pool.statuses() {
            Some(statuses) => statuses,
            None => {
                self.attach(false).await?;
                pool.statuses().unwrap_or_default()
            }
        };
        let (pid, secret, guard) = self.app.cancel.register_pooled();
        guard.retarget(self.engine.backend_key.clone());
        self.engine.cancel = Some(guard);
        // The client's own values where it gave them (a name reported
        // once is only ever replaced).
        let mut shown = statuses;
        for (name, value) in &self.engine.startup.params {
            if shown.has(name) {
                shown.set(name, value);
            }
        }
        let out = shown.login_frames(&[&pid.to_be_bytes(), &secret]);
        self.engine.server.statuses = shown;
        let ctx = super::relay::ctx(&self.app, &self.entry);
        self.engine.on_ready_for_query(&ctx, TxStatus::Idle);
        self.carry_out().await;
        self.client
            .write_all(&out)
            .await
            .map_err(SessionError::ClientIo)?;
        self.detach_if_idle().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_options_become_settings() {
        let pairs =
            command_line_options("-c search_path=a,b --work-mem=64MB -cstatement_timeout=5")
                .unwrap();
        assert_eq!(
            pairs,
            vec![
                ("search_path".into(), "a,b".into()),
                ("work_mem".into(), "64MB".into()),
                ("statement_timeout".into(), "5".into()),
            ]
        );
        let escaped = command_line_options(r"-c application_name=a\ b").unwrap();
        assert_eq!(escaped, vec![("application_name".into(), "a b".into())]);
        assert!(command_line_options("-d 5").is_err());
    }

    #[test]
    fn the_same_settings_have_the_same_id_and_none_is_the_login_state() {
        let a = ClientState::new(vec![("b".into(), "1".into()), ("a".into(), "2".into())]);
        let b = ClientState::new(vec![("a".into(), "2".into()), ("b".into(), "1".into())]);
        let c = ClientState::new(vec![("a".into(), "3".into()), ("b".into(), "1".into())]);
        assert_eq!(a.id, b.id);
        assert_ne!(a.id, c.id);
        assert_eq!(ClientState::new(Vec::new()).id, 0);
        assert!(a.id != 0 && a.id != UNKNOWN_STATE);
    }

    #[test]
    fn captured_settings_leave_out_the_login_identity_and_apply_in_order() {
        let row = |n: &str, v: &str| vec![Some(n.to_owned()), Some(v.to_owned())];
        let (state, reset) = ClientState::captured(
            vec![
                row("session_authorization", "app"),
                row("role", "reader"),
                row("TimeZone", "Europe/Paris"),
            ],
            "app",
            &[],
        );
        assert!(reset.is_empty());
        assert_eq!(
            state.settings,
            vec![
                ("role".into(), "reader".into()),
                ("TimeZone".into(), "Europe/Paris".into())
            ]
        );
        let sql = state.apply_sql();
        assert!(sql.starts_with("SET SESSION AUTHORIZATION DEFAULT; RESET ROLE; RESET ALL; "));
        assert!(sql.contains("('role', 'reader'), ('TimeZone', 'Europe/Paris')"));
        let (none, _) = ClientState::captured(vec![row("role", "none")], "app", &[]);
        assert_eq!(none.id, 0);
    }

    #[test]
    fn a_reset_startup_parameter_goes_back_to_its_startup_value() {
        let row = |n: &str, v: &str| vec![Some(n.to_owned()), Some(v.to_owned())];
        let startup = [
            ("datestyle".to_owned(), "Postgres, MDY".to_owned()),
            ("timezone".to_owned(), "PST8PDT".to_owned()),
        ];
        // `RESET datestyle`: TimeZone is still the client's, DateStyle is
        // the server's default.
        let (state, reset) =
            ClientState::captured(vec![row("TimeZone", "PST8PDT")], "app", &startup);
        assert_eq!(reset, vec![startup[0].clone()]);
        assert_eq!(
            state.settings,
            vec![
                ("TimeZone".into(), "PST8PDT".into()),
                ("datestyle".into(), "Postgres, MDY".into())
            ]
        );
        assert!(
            set_config_sql(&reset).contains("('datestyle', 'Postgres, MDY')"),
            "{}",
            set_config_sql(&reset)
        );
        // Changed, not reset: nothing to set again.
        let (_, reset) = ClientState::captured(
            vec![row("DateStyle", "ISO, DMY"), row("TimeZone", "UTC")],
            "app",
            &startup,
        );
        assert!(reset.is_empty());
    }
}
