//! The session's settings: known, taken from an earlier login alike
//! ([`crate::session::logins`]), or read from its backend; and their
//! answer taken as the session's role, default isolation and cache-key
//! prefix.

use std::sync::Arc;

use super::hidden::Purpose;
use super::{Asked, Ctx, Engine, Lesson, Need};
use crate::cache::catalog::fetch::Rows;
use crate::classify::{BypassReason, Isolation};
use crate::pool::LoginSettings;
use crate::pool::transaction::SettingsRow;
use crate::session::known::{
    OWN_SETTINGS_COLUMN, ROLE_COLUMN, probe_sql, settings_columns, settings_row, settings_sql,
};
use crate::session::link::{ClientState, Link};
use crate::session::logins::Login;
use crate::session::reuse::{Settings, Source};

impl Engine {
    /// The answer to the settings query ([`Purpose::Settings`]), read under the policy's
    /// `generation` of settings (`None`: it failed).
    pub fn on_settings(&mut self, ctx: &Ctx, generation: u64, rows: Option<Rows>) {
        let columns = match self.found.asked.take() {
            Some(Asked::Probe(login)) => {
                if let Some(rows) = rows
                    && login.matches(&rows)
                {
                    self.found.settings = true;
                    ctx.instance.metrics().settings_reused.inc();
                    self.adopt_settings(&login.row, generation);
                    self.server.login_settings = Some(LoginSettings {
                        generation,
                        row: Arc::clone(&login.row),
                    });
                } else {
                    // Something outside the session changed: everything
                    // is read again, and kept anew.
                    ctx.instance.logins().forget(&self.db, &self.startup);
                    self.found.probe_missed = true;
                }
                return;
            }
            Some(Asked::Everything { columns }) => Some(columns),
            None => None,
        };
        self.found.settings = true;
        let Some(mut rows) = rows else {
            return;
        };
        let fingerprint = columns.and_then(|columns| Login::read(&rows, columns));
        if rows.is_empty() {
            return;
        }
        let mut row = rows.swap_remove(0);
        if let Some(columns) = columns
            && fingerprint.is_some()
        {
            row.truncate(columns);
        }
        let row = settings_row(row);
        self.adopt_settings(&row, generation);
        if let Some(fingerprint) = fingerprint
            && matches!(self.link, Link::Session(_))
            && self.server.settings == Settings::AsLoggedIn
            && self.server.source == Source::Fresh
        {
            let row = Arc::clone(&row);
            ctx.instance
                .logins()
                .put(&self.db, &self.startup, generation, row, fingerprint);
        }
        if let Link::Pooled(p) = &mut self.link {
            // The generation of the connection the settings were read on.
            let read_in = p.lent.as_ref().map(|l| l.generation);
            p.prefix_generation = read_in;
            if let Some(read_in) = read_in
                && !p.state_dirty
            {
                let lesson = Lesson::Settings {
                    state: p.state.id,
                    policy: generation,
                    generation: read_in,
                    row: Arc::clone(&row),
                };
                ctx.instance.teach_pool(&p.pool, lesson);
            }
        }
        if self.server.settings == Settings::AsLoggedIn {
            // What a client logging in on this connection starts with.
            self.server.login_settings = Some(LoginSettings { generation, row });
        }
    }

    /// Takes the settings query's answer as the session's: its role,
    /// default isolation and cache-key prefix.
    pub(super) fn adopt_settings(&mut self, row: &SettingsRow, generation: u64) -> u128 {
        let prefix = self.known.adopt_settings(row, generation, &self.startup);
        self.tx.default_isolation = match row.cells.get(2).and_then(|v| v.as_deref()) {
            Some("read committed" | "read uncommitted") => Isolation::PerStatement,
            _ => Isolation::Snapshot,
        };
        if let Link::Session(own) = &mut self.link {
            // Session mode: what pgcache's own requests for this session's
            // hits run in, on a connection of their own.
            let cell = |i: usize| row.cells.get(i).and_then(|v| v.as_deref());
            own.state = ClientState::read(
                self.startup.user(),
                cell(1),
                cell(ROLE_COLUMN),
                cell(OWN_SETTINGS_COLUMN),
            );
        }
        prefix
    }

    /// The hash of the session's identity and settings: known, or read from
    /// the backend when they may have changed.
    pub(super) fn session_prefix(&mut self, ctx: &Ctx) -> Result<Result<u128, BypassReason>, Need> {
        let generation = self.db.catalog.policy_settings_generation();
        // Transaction mode: settings read under other login settings of
        // the pool's connections are out of date.
        let (pool, prefix_generation, state) = match &self.link {
            Link::Pooled(p) => (
                Some(Arc::clone(&p.pool)),
                p.prefix_generation,
                (!p.state_dirty).then_some(p.state.id),
            ),
            Link::Session(_) => (None, None, None),
        };
        let pool_generation = pool.as_ref().map(|p| p.generation());
        if pool_generation != prefix_generation {
            self.known.prefix = None;
        }
        if let Some((prefix, g)) = self.known.prefix
            && g == generation
        {
            return Ok(Ok(prefix));
        }
        // Transaction mode: clients in the same state have the same
        // settings, read once per pool.
        if let (Some(pool), Some(state)) = (&pool, state)
            && let Some(row) = pool.settings(state, generation)
        {
            if let Link::Pooled(p) = &mut self.link {
                p.prefix_generation = pool_generation;
            }
            return Ok(Ok(self.adopt_settings(&row, generation)));
        }
        // A reused connection still in its login state is in the state an
        // earlier session read at login: no need to read it again.
        if pool.is_none()
            && self.server.settings == Settings::AsLoggedIn
            && let Some(login) = self.server.login_settings.clone()
            && login.generation == generation
        {
            return Ok(Ok(self.adopt_settings(&login.row, generation)));
        }
        if !self.backend_idle() || self.found.settings {
            return Ok(Err(BypassReason::SettingsUnknown));
        }
        Err(self.read_settings(ctx))
    }

    /// pgcache's own query for the session's settings: a probe, for a
    /// fresh connection in its login state when another session logged
    /// in alike ([`crate::session::logins`]); else everything.
    pub(super) fn read_settings(&mut self, ctx: &Ctx) -> Need {
        let generation = self.db.catalog.policy_settings_generation();
        if matches!(self.link, Link::Session(_))
            && self.server.source == Source::Fresh
            && self.server.settings == Settings::AsLoggedIn
            && !self.found.probe_missed
            && let Some(login) = ctx.instance.logins().get(&self.db, &self.startup)
            && login.generation == generation
        {
            self.found.asked = Some(Asked::Probe(login));
            self.ask(Purpose::Settings { generation }, &probe_sql());
            return Need::Own;
        }
        let (generation, policy_settings) = self.db.catalog.policy_settings();
        let sql = settings_sql(&policy_settings);
        self.found.asked = Some(Asked::Everything {
            columns: settings_columns(policy_settings.len()),
        });
        self.ask(Purpose::Settings { generation }, &sql);
        Need::Own
    }
}
