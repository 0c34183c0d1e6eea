//! Transaction mode's greeting: what PostgreSQL tells a client at login,
//! said by pgcache for a client it logs in for.

use std::sync::Arc;

use bytes::BytesMut;

use super::hidden::Purpose;
use super::{Ctx, Engine};
use crate::invalidation::quote_literal;
use crate::pool::Statuses;
use crate::pool::reported::Reported;
use crate::protocol::{TxStatus, encoding};
use crate::session::link::Link;

/// Where transaction mode's greeting stands ([`Engine::greet`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Greeting {
    /// It needs a server connection, and the own queries asked on it
    /// answered: then greet again.
    Connection,
    /// The greeting is staged for the client: the session is logged in.
    Greeted,
}

impl Engine {
    /// Transaction mode, for a client pgcache logs in for (`attached`: a
    /// connection is held): the greeting, once it has what it needs. The
    /// pool's latest login's parameters (a connection's login first, if
    /// none ever logged in); then the client's key, pgcache's own; and,
    /// on a connection with the client's settings applied, how the server
    /// reports the client's startup values the pool has not met yet, so
    /// that a value PostgreSQL refuses fails the login as it would
    /// directly.
    pub fn greet(&mut self, ctx: &Ctx, attached: bool) -> Greeting {
        let Link::Pooled(link) = &self.link else {
            return Greeting::Greeted;
        };
        let pool = Arc::clone(&link.pool);
        let login = pool.statuses().map(Arc::unwrap_or_clone);
        let Some(statuses) = login.or_else(|| attached.then(Statuses::default)) else {
            return Greeting::Connection;
        };
        let (pid, secret) = match &self.cancel {
            Some(cancel) => (cancel.key().0, cancel.key().1.to_vec()),
            None => {
                // The first time with the statuses known: pgcache's key,
                // and what the server's reporting is still to teach.
                let (pid, secret, guard) = ctx.instance.register_cancel();
                self.register_cancel(guard);
                if self.learn_reported(&statuses) {
                    return Greeting::Connection;
                }
                (pid, secret)
            }
        };
        let out = self.greeting(ctx, statuses, &pool.reported, (pid, &secret));
        self.out.extend_from_slice(&out);
        Greeting::Greeted
    }

    /// The login's answer: the pool's latest login's parameters `shown`,
    /// with the client's own values where it gave them, reported as the
    /// server reports them (`reported`; a name reported once is only ever
    /// replaced), then pgcache's cancel key (`pid`, `secret`) and the
    /// first ReadyForQuery. The session is logged in from here.
    pub(super) fn greeting(
        &mut self,
        ctx: &Ctx,
        mut shown: Statuses,
        reported: &Reported,
        (pid, secret): (u32, &[u8]),
    ) -> BytesMut {
        // What the client is told beyond the pool's login: a connection
        // taking its settings later reports the same values, which it is
        // not told again ([`Engine::tells_client`]).
        let mut told = Statuses::default();
        for (name, value) in &self.startup.params {
            if shown.has(name) {
                let said = match name.as_str() {
                    "client_encoding" => encoding::canonical(value).map(str::to_owned),
                    _ => reported.get(name, value),
                };
                shown.set(name, said.as_deref().unwrap_or(value));
                told.set(name, said.as_deref().unwrap_or(value));
            }
        }
        let out = shown.login_frames(&[&pid.to_be_bytes(), secret]);
        if let Link::Pooled(link) = &mut self.link {
            link.told = told;
        }
        self.on_ready_for_query(ctx, TxStatus::Idle);
        out
    }

    /// Before the greeting: asks how the server reports the client's
    /// startup values the pool has not met yet (`shown`: what the server
    /// reports at login), on a connection with the client's settings
    /// applied, so that a value PostgreSQL refuses fails the login as it
    /// would directly. True if it asked.
    fn learn_reported(&mut self, shown: &Statuses) -> bool {
        let Link::Pooled(link) = &self.link else {
            return false;
        };
        let missing: Vec<(String, String)> = self
            .startup
            .params
            .iter()
            .filter(|(name, value)| {
                shown.has(name)
                    && name != "client_encoding"
                    && !link.pool.reported.knows(name, value)
            })
            .cloned()
            .collect();
        if missing.is_empty() {
            return false;
        }
        let names: Vec<String> = missing.iter().map(|(n, _)| quote_literal(n)).collect();
        let sql = format!(
            "SELECT pg_catalog.current_setting(n) FROM pg_catalog.unnest(ARRAY[{}]::text[]) \
             WITH ORDINALITY AS t(n, i) ORDER BY i",
            names.join(",")
        );
        self.ask(Purpose::Reported(missing), &sql);
        true
    }
}
