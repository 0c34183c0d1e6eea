//! pgcache's own queries on the client's server connection ("hidden
//! queries"), as one sub-machine: the session's settings, catalog facts
//! when pgcache has no connection of its own, the client's settings
//! applied to a pooled connection and read back from it, how the server
//! reports startup values. A purpose asks ([`Engine::ask`]); the driver
//! sends what [`Engine::own_request`] gives it, and the answer's frames
//! come back through [`Engine::on_backend`] as any other
//! ([`Engine::on_own_frame`]); the answer goes where its purpose says, and
//! may ask the next query. They run only while the
//! backend is idle ([`Engine::backend_idle`]), so they never interleave
//! with the client's work.

use std::collections::VecDeque;

use bytes::BytesMut;

use super::life::Ending;
use super::{Ctx, Engine, Lesson};
use crate::cache::catalog::Wanted;
use crate::cache::catalog::fetch::{Lookup, Rows};
use crate::invalidation::quote_literal;
use crate::protocol::answer::{Answer, Read};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{backend as be, messages};
use crate::session::SessionError;
use crate::session::link::{CAPTURE, ClientState, Link, set_config_sql};

/// What one of pgcache's own queries is for: where its answer goes.
pub(in crate::session) enum Purpose {
    /// The session's settings, read under the policy's `generation` of
    /// settings, for the frame being decided.
    Settings { generation: u64 },
    /// Catalog facts the database's sessions asked for, one query of the
    /// lookup at a time.
    Facts(Box<(Wanted, Lookup)>),
    /// The client's settings, applied to a pooled connection just taken.
    Apply,
    /// The client's settings, read back before the connection goes back.
    ReadBack,
    /// Startup parameters the client reset, set again; then the state
    /// read back is the connection's.
    SetAgain(ClientState),
    /// How the server reports startup values the pool has not met yet.
    Reported(Vec<(String, String)>),
    /// A table a statement takes out of pgcache's publication, named as
    /// the client's session resolves it ([`Engine::needs_of`]).
    Qualify,
}

/// What becomes of the connection after an answer pgcache cannot take.
#[derive(Debug)]
pub(in crate::session) enum Verdict {
    /// In a state pgcache cannot tell: closed, not given back.
    Close,
    /// Closed, and the error is the session's.
    Fail(SessionError),
}

/// What to do after a frame of an own query's answer.
#[derive(Debug)]
pub(in crate::session) enum OwnStep {
    /// Read on.
    Read,
    /// The client's, though it came meanwhile: a notification or a
    /// parameter change.
    ToClient(BytesMut),
    /// The query is answered, and its answer taken.
    Answered,
}

/// The own queries asked and not answered yet, the first one in flight.
#[derive(Default)]
pub(in crate::session) struct Own {
    queue: VecDeque<Asked>,
    verdict: Option<Verdict>,
}

/// One own query: what it is for, its request until sent, and its
/// answer so far.
struct Asked {
    purpose: Purpose,
    request: Option<BytesMut>,
    answer: Answer,
}

/// What to do after a frame of a hidden query's answer.
#[derive(Debug)]
pub(in crate::session) enum HiddenStep {
    /// Read on.
    More,
    /// The client's, though it came meanwhile: a notification or a
    /// parameter change.
    ToClient(BytesMut),
    /// ReadyForQuery: the rows as text, or PostgreSQL's ErrorResponse
    /// (`None` when the rows could not be read).
    Done(Result<Rows, Option<BytesMut>>),
}

impl Engine {
    /// One frame of a hidden query's answer. Notifications and parameter
    /// changes go on to a greeted client (a notification of another
    /// client's LISTEN in transaction mode never does); notices caused by
    /// the query itself do not.
    pub fn on_hidden_frame(&mut self, answer: &mut Answer, frame: BytesMut) -> HiddenStep {
        if frame[0] == be::ERROR_RESPONSE && messages::is_fatal(&frame[HEADER_LEN..]) {
            self.end_with(Ending::BackendFatal);
        }
        let frame = match answer.on_frame(frame) {
            Read::More => return HiddenStep::More,
            Read::Done(answered) => {
                if let Some(status) = answered.status {
                    self.tx.status = status;
                }
                return HiddenStep::Done(answered.result);
            }
            Read::Aside(frame) => frame,
        };
        match frame[0] {
            be::PARAMETER_STATUS if !self.tells_client(&frame) => return HiddenStep::More,
            be::PARAMETER_STATUS => self.note_status(&frame),
            be::NOTIFICATION => {
                if let Link::Pooled(link) = &mut self.link
                    && !link.listens.admits(&frame)
                {
                    return HiddenStep::More;
                }
            }
            // A notice the query itself caused.
            _ => return HiddenStep::More,
        }
        // Before the client's first ReadyForQuery, pgcache is still
        // greeting it (transaction mode, a pool connection set up for
        // it): a ParameterStatus now would come before its
        // AuthenticationOk, and the greeting reports the parameters
        // itself.
        if self.logged_in() {
            return HiddenStep::ToClient(frame);
        }
        HiddenStep::More
    }
}

impl Engine {
    /// Asks one of pgcache's own queries, after those asked before.
    pub(super) fn ask(&mut self, purpose: Purpose, sql: &str) {
        self.own.queue.push_back(Asked::new(purpose, sql));
    }

    /// Own queries wait to be sent or answered.
    pub(super) fn own_pending(&self) -> bool {
        !self.own.queue.is_empty()
    }

    /// The next own query's request, to send now; `None` while the one in
    /// flight is not answered, or none waits.
    pub fn own_request(&mut self) -> Option<BytesMut> {
        self.own.queue.front_mut()?.request.take()
    }

    /// The next own query puts the client's settings on the connection
    /// ([`Purpose::Apply`]): the server's to answer, in a test whatever
    /// answers the rest.
    #[cfg(test)]
    pub(super) fn own_applies(&self) -> bool {
        let next = self.own.queue.front();
        next.is_some_and(|asked| matches!(asked.purpose, Purpose::Apply) && asked.request.is_some())
    }

    /// An own query was sent and its answer is still to come: the
    /// backend's frames are its.
    pub(super) fn own_in_flight(&self) -> bool {
        self.own
            .queue
            .front()
            .is_some_and(|asked| asked.request.is_none())
    }

    /// One frame of the answer to the own query in flight.
    pub(super) fn on_own_frame(&mut self, ctx: &Ctx, frame: BytesMut) -> OwnStep {
        let Some(mut asked) = self.own.queue.pop_front() else {
            return OwnStep::Read;
        };
        match self.on_hidden_frame(&mut asked.answer, frame) {
            HiddenStep::More => {
                self.own.queue.push_front(asked);
                OwnStep::Read
            }
            HiddenStep::ToClient(frame) => {
                self.own.queue.push_front(asked);
                OwnStep::ToClient(frame)
            }
            HiddenStep::Done(result) => {
                self.answered(ctx, asked.purpose, result);
                OwnStep::Answered
            }
        }
    }

    /// The own query in flight could not be sent (no connection came):
    /// what waited on it goes on without its answer.
    pub fn own_unanswered(&mut self, ctx: &Ctx) {
        if let Some(asked) = self.own.queue.pop_front() {
            self.forgo(ctx, asked.purpose);
        }
    }

    /// Own queries wait, or what becomes of the connection after them is
    /// still to be said.
    pub(super) fn own_unsettled(&self) -> bool {
        !self.own.queue.is_empty() || self.own.verdict.is_some()
    }

    /// What becomes of the connection, once the own queries are over.
    pub(super) fn take_verdict(&mut self) -> Option<Verdict> {
        self.own.verdict.take()
    }

    /// How many own queries are asked: a decision given up ([`Engine::whole_batch`])
    /// withdraws what it asked after this many ([`Engine::withdraw_asked`]).
    pub(super) fn asked(&self) -> usize {
        self.own.queue.len()
    }

    /// Withdraws the own queries asked after the first `kept`, not sent
    /// yet: the decision that asked them was given up, and the one that
    /// replaces it asks again. The names a lookup took are wanted again.
    pub(super) fn withdraw_asked(&mut self, kept: usize) {
        while self.own.queue.len() > kept {
            let Some(asked) = self.own.queue.pop_back() else {
                break;
            };
            match asked.purpose {
                Purpose::Settings { .. } => self.found.asked = None,
                Purpose::Facts(lookup) => {
                    self.found.facts = false;
                    self.db.catalog.abandon(&lookup.0);
                }
                _ => {}
            }
        }
    }

    /// Transaction mode: reads back the settings the client may have
    /// changed, before the connection goes back ([`LinkStep::ReadBack`]).
    ///
    /// [`LinkStep::ReadBack`]: super::LinkStep::ReadBack
    pub(super) fn read_back(&mut self) {
        self.ask(Purpose::ReadBack, CAPTURE);
    }

    /// The answer to an own query, taken as its purpose says.
    fn answered(&mut self, ctx: &Ctx, purpose: Purpose, result: Result<Rows, Option<BytesMut>>) {
        match purpose {
            Purpose::Settings { generation } => {
                ctx.instance.metrics().settings_queries.inc();
                self.on_settings(ctx, generation, result.ok());
            }
            Purpose::Facts(mut lookup) => {
                let Ok(rows) = result else {
                    return self.db.catalog.abandon(&lookup.0);
                };
                lookup.1.add(&rows);
                match lookup.1.next_query() {
                    Some(sql) => self.ask_next(Purpose::Facts(lookup), &sql),
                    None => {
                        let (wanted, lookup) = *lookup;
                        self.db.catalog.install(&wanted, lookup.finish());
                    }
                }
            }
            Purpose::Apply => {
                if let Err(error) = result {
                    let e = match error {
                        Some(frame) => SessionError::from_server_error(&frame),
                        None => SessionError::BackendIo(std::io::ErrorKind::InvalidData.into()),
                    };
                    self.give_up(ctx, Verdict::Fail(e));
                }
            }
            Purpose::ReadBack => {
                let (Ok(rows), Link::Pooled(link)) = (result, &mut self.link) else {
                    return self.give_up(ctx, Verdict::Close);
                };
                let (state, reset) =
                    ClientState::captured(rows, self.startup.user(), &link.startup);
                if reset.is_empty() {
                    tracing::debug!(settings = ?state.settings, "session settings read back");
                    link.settled(state);
                } else {
                    tracing::debug!(?reset, "startup parameters set again after a reset");
                    self.ask_next(Purpose::SetAgain(state), &set_config_sql(&reset));
                }
            }
            Purpose::SetAgain(state) => match (result, &mut self.link) {
                (Ok(_), Link::Pooled(link)) => link.settled(state),
                _ => self.give_up(ctx, Verdict::Close),
            },
            Purpose::Reported(missing) => {
                let (Ok(rows), Link::Pooled(link)) = (result, &self.link) else {
                    return;
                };
                for ((name, value), row) in missing.iter().zip(rows) {
                    if let Some(Some(reported)) = row.into_iter().next() {
                        let lesson = Lesson::Reported {
                            name,
                            value,
                            reported: &reported,
                        };
                        ctx.instance.teach_pool(&link.pool, lesson);
                    }
                }
            }
            Purpose::Qualify => {
                // No such table: the statement fails on its own.
                let row = result.ok().and_then(|rows| rows.into_iter().next());
                let name = row.and_then(|row| row.into_iter().next().flatten());
                if let (Some(name), Some(needs)) = (name, &mut self.found.needs) {
                    needs.unpublish.push(name);
                }
            }
        }
    }

    /// Asks `sql` next, before anything asked earlier.
    fn ask_next(&mut self, purpose: Purpose, sql: &str) {
        self.own.queue.push_front(Asked::new(purpose, sql));
    }

    /// Ends the own queries with `verdict` on the connection: what else
    /// waited goes on without its answer.
    fn give_up(&mut self, ctx: &Ctx, verdict: Verdict) {
        self.own.verdict = Some(verdict);
        while let Some(asked) = self.own.queue.pop_front() {
            self.forgo(ctx, asked.purpose);
        }
    }

    /// An own query that will not be answered: what waited on it goes on
    /// without it.
    fn forgo(&mut self, ctx: &Ctx, purpose: Purpose) {
        match purpose {
            Purpose::Settings { generation } => self.on_settings(ctx, generation, None),
            Purpose::Facts(lookup) => self.db.catalog.abandon(&lookup.0),
            Purpose::Qualify
            | Purpose::Apply
            | Purpose::ReadBack
            | Purpose::SetAgain(_)
            | Purpose::Reported(_) => {}
        }
    }

    /// Transaction mode: the client's settings go on a connection just
    /// taken (`request`), before anything else is sent on it.
    pub(super) fn apply_first(&mut self, request: BytesMut) {
        let asked = Asked::with_request(Purpose::Apply, request);
        self.own.queue.push_front(asked);
    }
}

/// The query naming `table` as the session resolves it, schema first.
pub(super) fn qualify_sql(table: &str) -> String {
    format!(
        "SELECT pg_catalog.format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.oid = pg_catalog.to_regclass({})",
        quote_literal(table)
    )
}

impl Asked {
    fn new(purpose: Purpose, sql: &str) -> Self {
        Self::with_request(purpose, messages::hidden_query(sql))
    }

    fn with_request(purpose: Purpose, request: BytesMut) -> Self {
        Self {
            purpose,
            request: Some(request),
            answer: Answer::default(),
        }
    }
}
