//! pgcache's own queries on a client's backend connection ("hidden
//! queries"): the session's settings, which only its own backend can tell,
//! and catalog facts when pgcache has no connection of its own. They run
//! only while the backend is idle ([`Session::backend_idle`]), so they can
//! never interleave with the client's work.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncWrite};

use super::SessionError;
use super::link::ClientState;
use super::relay::Session;
use crate::cache::catalog::Facts;
use crate::cache::catalog::fetch::{Lookup, Rows};
use crate::cache::key;
use crate::classify::BypassReason;
use crate::pool::LoginSettings;
use crate::pool::transaction::SettingsRow;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, backend as be, extended, messages};

/// Columns of the settings query that are the session's own settings, as
/// [`ClientState`] reads them: `current_setting('role')`, and the settings
/// set at startup or by the session as a JSON object. Left out of the key
/// prefix, which hashes every setting already (and never
/// `application_name`).
const ROLE_COLUMN: usize = 4;
const OWN_SETTINGS_COLUMN: usize = 5;

/// The settings query's answer, with the digest of the columns that go into
/// the cache key: not the role (the key has `current_user`) nor the
/// client's own settings (every setting is there already).
fn settings_row(cells: Vec<Option<String>>) -> Arc<SettingsRow> {
    let digest = key::settings_digest(
        cells
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ROLE_COLUMN && *i != OWN_SETTINGS_COLUMN)
            .map(|(_, value)| value),
    );
    Arc::new(SettingsRow { cells, digest })
}

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// The facts of the names a statement uses. Names not known yet are
    /// queued for the database's fetcher (started here on first need),
    /// which looks them up on pgcache's own connection while this statement
    /// goes on without them. Only when pgcache cannot open a connection of
    /// its own does the session look them up itself, on its idle backend.
    pub(super) async fn facts(
        &mut self,
        rels: &[&str],
        funcs: &[&str],
    ) -> Result<Facts, SessionError> {
        if rels.is_empty() && funcs.is_empty() {
            return Ok(Facts::default());
        }
        let db = Arc::clone(&self.engine.db);
        let facts = self.app.catalog_facts(&db, rels, funcs);
        if facts.complete() {
            return Ok(facts);
        }
        if !db.catalog.fetcher_down() || !self.backend_idle() {
            return Ok(facts);
        }
        let wanted = db.catalog.take_wanted();
        if wanted.is_empty() {
            return Ok(facts);
        }
        let publication = self.app.publication();
        let mut lookup = Lookup::new(&wanted, publication.as_deref());
        while let Some(sql) = lookup.next_query() {
            match Box::pin(self.hidden_query(&sql)).await {
                Ok(Some(rows)) => lookup.add(&rows),
                Ok(None) => {
                    db.catalog.abandon(&wanted);
                    return Ok(facts);
                }
                Err(e) => {
                    db.catalog.abandon(&wanted);
                    return Err(e);
                }
            }
        }
        db.catalog.install(&wanted, lookup.finish());
        Ok(db
            .catalog
            .facts(rels.iter().copied(), funcs.iter().copied())
            .0)
    }

    /// The session's prefix when it is known and current, as
    /// [`Self::session_prefix`] first looks for it, without a future.
    pub(super) fn known_prefix(&self) -> Option<u128> {
        let pool_generation = self.engine.link.pool.as_ref().map(|p| p.generation());
        if pool_generation != self.engine.link.prefix_generation {
            return None;
        }
        let generation = self.engine.db.catalog.policy_settings_generation();
        self.engine
            .known
            .prefix
            .and_then(|(prefix, g)| (g == generation).then_some(prefix))
    }

    /// The hash of the session's identity and settings, read from the
    /// backend when they may have changed.
    pub(super) async fn session_prefix(
        &mut self,
    ) -> Result<Result<u128, BypassReason>, SessionError> {
        let (generation, policy_settings) = self.engine.db.catalog.policy_settings();
        // Transaction mode: settings read under other login settings of
        // the pool's connections are out of date.
        let pool = self.engine.link.pool.clone();
        let pool_generation = pool.as_ref().map(|p| p.generation());
        if pool_generation != self.engine.link.prefix_generation {
            self.engine.known.prefix = None;
        }
        if let Some((prefix, g)) = self.engine.known.prefix
            && g == generation
        {
            return Ok(Ok(prefix));
        }
        // Transaction mode: clients in the same state have the same
        // settings, read once per pool.
        let state = (!self.engine.link.state_dirty).then_some(self.engine.link.state.id);
        if let (Some(pool), Some(state)) = (&pool, state)
            && let Some(row) = pool.settings(state, generation)
        {
            self.engine.link.prefix_generation = pool_generation;
            return Ok(Ok(self.adopt_settings(&row, generation)));
        }
        // A reused connection still in its login state is in the state an
        // earlier session read at login: no need to read it again.
        if pool.is_none()
            && self.engine.server.login_state
            && let Some(login) = self.engine.server.login_settings.clone()
            && login.generation == generation
        {
            return Ok(Ok(self.adopt_settings(&login.row, generation)));
        }
        if !self.backend_idle() {
            return Ok(Err(BypassReason::SettingsUnknown));
        }
        let mut sql = String::from(
            "SELECT current_user, session_user, pg_catalog.current_setting('default_transaction_isolation'), s.everything, \
             pg_catalog.current_setting('role'), s.own_settings",
        );
        for name in policy_settings.iter() {
            sql.push_str(", pg_catalog.current_setting('");
            sql.push_str(&name.replace('\'', "''"));
            sql.push_str("', true)");
        }
        sql.push_str(
            " FROM (SELECT pg_catalog.string_agg(name || '=' || setting, E'\\n' ORDER BY name) \
               FILTER (WHERE name <> 'application_name') AS everything, \
             pg_catalog.json_object_agg(name, setting) FILTER (WHERE source IN ('client', 'session') \
               AND name NOT IN ('session_authorization', 'role')) AS own_settings \
             FROM pg_catalog.pg_settings) s",
        );
        self.app.metrics.settings_queries.inc();
        let Some(rows) = Box::pin(self.hidden_query(&sql)).await? else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        let Some(row) = rows.into_iter().next().map(settings_row) else {
            return Ok(Err(BypassReason::SettingsUnknown));
        };
        let prefix = self.adopt_settings(&row, generation);
        if let Some(pool) = &pool {
            // The generation of the connection the settings were read on.
            let read_in = self.engine.link.lease().map(|l| l.server().generation);
            self.engine.link.prefix_generation = read_in;
            if let (Some(state), Some(read_in)) = (state, read_in)
                && !self.engine.link.state_dirty
            {
                pool.remember_settings(state, generation, read_in, Arc::clone(&row));
            }
        }
        if self.engine.server.login_state {
            // What a client logging in on this connection starts with.
            self.engine.server.login_settings = Some(LoginSettings { generation, row });
        }
        Ok(Ok(prefix))
    }

    /// Takes the settings query's answer as the session's: its role,
    /// default isolation and cache-key prefix.
    fn adopt_settings(&mut self, row: &SettingsRow, generation: u64) -> u128 {
        let digest = row.digest;
        let row = &row.cells;
        self.engine.known.role = row.first().cloned().flatten();
        self.engine.tx.default_strict = !matches!(
            row.get(2).and_then(|v| v.as_deref()),
            Some("read committed" | "read uncommitted")
        );
        let params = self
            .engine
            .startup
            .params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()));
        let prefix = key::session_prefix(self.engine.startup.database(), params, digest);
        self.engine.known.prefix = Some((prefix, generation));
        if !self.engine.link.is_pooled() {
            // Session mode: what pgcache's own requests for this session's
            // hits run in, on a connection of their own.
            let cell = |i: usize| row.get(i).and_then(|v| v.as_deref());
            self.engine.link.state = ClientState::read(
                self.engine.startup.user(),
                cell(1),
                cell(ROLE_COLUMN),
                cell(OWN_SETTINGS_COLUMN),
            );
        }
        prefix
    }

    /// Runs pgcache's own query on the idle backend (taking one from the
    /// pool in transaction mode) and returns its rows as text, or `None` if
    /// it failed. It leaves the client's unnamed statement and portal alone
    /// ([`messages::hidden_query`]).
    pub(super) async fn hidden_query(&mut self, sql: &str) -> Result<Option<Rows>, SessionError> {
        match self.attach(false).await {
            Ok(()) => {}
            Err(SessionError::Pool(e)) => {
                // No connection: the statement goes on without the
                // answer, and fails at once with the same error.
                self.engine.link.no_connection = Some(e);
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
        Ok(self.run_hidden(&messages::hidden_query(sql)).await?.ok())
    }

    /// Sends `request` (ending in one Sync or one simple Query) on the idle
    /// backend and reads its answer: the rows as text, or PostgreSQL's
    /// ErrorResponse (`None` when the rows could not be read).
    /// Notifications and parameter changes arriving meanwhile go on to a
    /// greeted client; notices caused by the query itself do not.
    pub(super) async fn run_hidden(
        &mut self,
        request: &[u8],
    ) -> Result<Result<Rows, Option<bytes::BytesMut>>, SessionError> {
        self.backend
            .write_all(request)
            .await
            .map_err(SessionError::BackendIo)?;
        let mut rows = Vec::new();
        let mut failed = None;
        loop {
            let frame = match self.backend.read_frame().await {
                Ok(Some(frame)) => frame,
                Ok(None) => {
                    let eof = std::io::ErrorKind::UnexpectedEof.into();
                    return Err(SessionError::BackendIo(eof));
                }
                Err(crate::protocol::stream::ReadError::Io(e)) => {
                    return Err(SessionError::BackendIo(e));
                }
                Err(e) => return Err(SessionError::BackendFrame(e)),
            };
            let body = &frame[HEADER_LEN..];
            match frame[0] {
                be::DATA_ROW => match extended::data_row(body) {
                    Some(row) => rows.push(row),
                    None => failed = Some(None),
                },
                be::ERROR_RESPONSE => {
                    self.engine.backend_fatal |= messages::is_fatal(body);
                    failed = Some(Some(frame));
                }
                be::READY_FOR_QUERY => {
                    if let Some(status) = body.first().and_then(|b| TxStatus::from_byte(*b)) {
                        self.engine.tx.status = status;
                    }
                    return Ok(match failed {
                        None => Ok(rows),
                        Some(error) => Err(error),
                    });
                }
                be::NOTIFICATION | be::PARAMETER_STATUS => {
                    if frame[0] == be::PARAMETER_STATUS {
                        self.engine.server.statuses.note(&frame);
                    }
                    // Before the client's first ReadyForQuery, pgcache is
                    // still greeting it (transaction mode, a pool
                    // connection set up for it): a ParameterStatus now
                    // would come before its AuthenticationOk, and the
                    // greeting reports the parameters itself.
                    if !self.engine.ready {
                        continue;
                    }
                    self.client
                        .write_all(&frame)
                        .await
                        .map_err(SessionError::ClientIo)?;
                }
                _ => {}
            }
        }
    }
}
