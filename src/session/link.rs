//! Transaction mode: a session's server connection comes from its pool
//! ([`crate::pool::transaction`]) when a request has to go to PostgreSQL,
//! and goes back once the session is idle again (no transaction, nothing
//! in flight, no batch half sent). Between the two the session holds no
//! backend, and cache hits are answered without a connection.
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

use crate::invalidation::control::quote_literal;
use crate::pool::listens::Listens;
use crate::pool::marks::Pin;
use crate::pool::prepared::{Answer, ServerStatements, Translator};
use crate::pool::transaction::{Lent, Pool};
use crate::pool::{PoolError, PoolKey, Statuses};
use crate::protocol::messages;
use crate::protocol::startup::Startup;
use crate::session::pipeline::{Inflight, Pipeline};

/// [`crate::pool::transaction::Pooled::state`] of a connection left in a
/// state pgcache did not read.
pub(super) const UNKNOWN_STATE: u64 = u64::MAX;

/// A session's settings, as pgcache applies them to pooled connections.
#[derive(Debug, Clone, Default)]
pub(super) struct ClientState {
    /// Name and value; `session_authorization` and `role` first, as they
    /// reset what follows.
    pub(super) settings: Vec<(String, String)>,
    /// Identifies the settings: 0 for none (a connection as it logged in).
    pub id: u64,
}

/// Reads a session's settings back, on the connection it changed them on.
/// Startup parameters show as `client` on a connection that logged in with
/// them, as `session` on a pooled one they were applied to.
pub(super) const CAPTURE: &str = "SELECT 'session_authorization', pg_catalog.current_setting('session_authorization') \
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
    pub(super) fn captured(
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
pub(super) fn set_config_sql(settings: &[(String, String)]) -> String {
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
    pub(super) generation: u64,
    pub wait: Option<std::time::Duration>,
    pub lifetime: std::time::Duration,
    pub max_prepared: usize,
}

/// Where a session's server connections come from: its mode, as typed
/// state.
pub(super) enum Link {
    /// Session mode: the connection the session logged in on, for its
    /// whole life.
    Session(SessionLink),
    /// Transaction mode: a connection from the pool whenever a request has
    /// to go to PostgreSQL.
    Pooled(Box<PooledLink>),
}

/// Session mode's link.
#[derive(Default)]
pub(super) struct SessionLink {
    /// The pool of the session's database and user that pgcache's own
    /// requests for its hits run on, off its connection.
    pub checks: Option<Arc<Pool>>,
    /// The session's settings as last read with its cache key: what those
    /// requests run in.
    pub state: ClientState,
    /// The session's connection is parked under this key at its end, if
    /// it is handed back clean ([`super::engine::Engine::part_at_end`]).
    pub parks_under: Option<PoolKey>,
    /// pgcache authenticated the client itself: its connection may be
    /// parked though PostgreSQL asked a password on it.
    pub checked_by_pgcache: bool,
}

/// Transaction mode's link: the pool, the connection held now, and what
/// of the client's state goes with it from one connection to the next.
pub(super) struct PooledLink {
    /// The pool of the session's database and user.
    pub pool: Arc<Pool>,
    /// The books of the pooled connection held now (its lease and stream
    /// are the driver's). `None` while attached means the connection the
    /// client logged in on, which no pool owns (passthrough
    /// authentication).
    pub(super) lent: Option<Lent>,
    /// Why the session keeps its connection for good.
    pub pinned: Option<Pin>,
    pub state: ClientState,
    /// The client's startup parameters (and `options`' settings): what a
    /// `RESET` of one goes back to.
    pub(super) startup: Vec<(String, String)>,
    /// The session's settings may have changed on the connection it holds.
    pub state_dirty: bool,
    /// The state was applied once (and so checked, as PostgreSQL checks
    /// startup parameters at login).
    pub(super) state_checked: bool,
    /// The client's prepared statements, moved from connection to
    /// connection.
    pub translator: Translator,
    /// The statements of the connection the client logged in on.
    /// Boxed, and made only when used: most pooled sessions log in on
    /// no connection of their own.
    pub(super) own_statements: Option<Box<ServerStatements>>,
    /// Why pgcache's own query for the statement under way found no
    /// connection: the statement fails with it rather than wait again.
    pub no_connection: Option<Box<PoolError>>,
    /// The pool generation the session's settings were read in.
    pub prefix_generation: Option<u64>,
    /// The translated frames of one flush.
    pub scratch: BytesMut,
    /// pgcache's own answers spliced into the backend's buffer, where they
    /// are: read as if the server had sent them, but not translated again.
    pub spliced: std::ops::Range<usize>,
    /// A statement that may change the schema went out: the database's
    /// schema generation moves when the session is next idle.
    pub schema_changes: bool,
    /// The channels the client listens on, and whether its connection
    /// sent a notification for another.
    pub listens: Listens,
    /// What the client was last told of each parameter, where it differs
    /// from the pool's login (kept small: most clients are told nothing
    /// beyond it). A connection taking the client's settings reports the
    /// values the client has already, which it is not told again.
    pub told: Statuses,
    pub(super) knobs: Knobs,
}

impl Link {
    /// Session mode: the session keeps the connection it logged in on.
    pub fn session() -> Self {
        Link::Session(SessionLink::default())
    }

    pub fn pooled(pool: Arc<Pool>, state: ClientState) -> Self {
        Link::Pooled(Box::new(PooledLink {
            pool,
            lent: None,
            pinned: None,
            startup: state.settings.clone(),
            state,
            state_dirty: false,
            state_checked: false,
            translator: Translator::default(),
            own_statements: None,
            no_connection: None,
            prefix_generation: None,
            scratch: BytesMut::new(),
            spliced: 0..0,
            schema_changes: false,
            listens: Listens::default(),
            told: Statuses::default(),
            knobs: Knobs::default(),
        }))
    }

    pub fn is_pooled(&self) -> bool {
        matches!(self, Link::Pooled(_))
    }

    /// The client's settings, for pgcache's own requests on its behalf.
    pub fn state(&self) -> &ClientState {
        match self {
            Link::Session(own) => &own.state,
            Link::Pooled(pooled) => &pooled.state,
        }
    }

    /// The pool whose login reads on a replica use, when the session may
    /// read there: one pgcache can log in for and, in transaction mode,
    /// neither pinned to its connection nor with settings not read back.
    pub fn replica_login(&self) -> Option<&Arc<Pool>> {
        match self {
            Link::Session(own) => own.checks.as_ref(),
            Link::Pooled(p) if p.pinned.is_some() || p.state_dirty => None,
            Link::Pooled(p) => Some(&p.pool),
        }
        .filter(|pool| pool.can_log_in())
    }

    /// A statement may have changed the session's settings on the
    /// connection it holds.
    pub fn settings_may_have_changed(&mut self) {
        if let Link::Pooled(pooled) = self {
            pooled.state_dirty = true;
        }
    }
}

impl PooledLink {
    /// A connection granted by the pool is the session's. Returns the
    /// query that gives it the client's settings, to run at once, if they
    /// differ from its own; or queues that query ahead of `to_backend`'s
    /// requests when `queued` and the settings were checked once already
    /// (a failure the first time is the client's login error, as
    /// PostgreSQL reports a bad startup parameter).
    pub(super) fn granted(
        &mut self,
        mut lent: Lent,
        queued: bool,
        pipeline: &mut Pipeline,
    ) -> Option<BytesMut> {
        let differs = lent.state != self.state.id;
        lent.state = self.state.id;
        self.lent = Some(lent);
        if !differs {
            return None;
        }
        let apply = messages::query(&self.state.apply_sql());
        if self.state_checked && queued {
            let mut queued = apply;
            queued.extend_from_slice(&pipeline.to_backend);
            pipeline.to_backend = queued;
            pipeline.push_front(Inflight::hidden(None));
            return None;
        }
        self.state_checked = true;
        // A simple Query: the server's unnamed statement is gone.
        self.server_statements().forget_unnamed();
        Some(apply)
    }

    /// The settings read back with [`CAPTURE`] are the session's.
    pub(super) fn settled(&mut self, state: ClientState) {
        self.state = state;
        self.state_dirty = false;
        if let Some(lent) = &mut self.lent {
            lent.state = self.state.id;
        }
    }

    pub(super) fn server_statements(&mut self) -> &mut ServerStatements {
        statements_of(&mut self.lent, &mut self.own_statements)
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
        let server = statements_of(&mut self.lent, &mut self.own_statements);
        self.translator
            .translate(frames, server, max_prepared, idle, out)
    }

    /// One server frame: whether the client gets it, pgcache's answers to
    /// insert after it, and what to send the server again.
    pub fn on_server_frame(&mut self, frame: &[u8]) -> Answer {
        let server = statements_of(&mut self.lent, &mut self.own_statements);
        self.translator.on_frame(frame, server)
    }
}

/// The statements of the connection a session holds: a field apart from
/// its translator, so both are borrowed at once (every frame goes through
/// the two).
fn statements_of<'a>(
    lent: &'a mut Option<Lent>,
    own: &'a mut Option<Box<ServerStatements>>,
) -> &'a mut ServerStatements {
    match lent {
        Some(lent) => &mut lent.prepared,
        None => own.get_or_insert_with(Box::default),
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
