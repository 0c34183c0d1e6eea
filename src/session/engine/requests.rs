//! The client's requests: each frame dispatched to what decides it in one
//! synchronous pass. With caching off, pass-through is the policy: every
//! request is forwarded as it is. A simple query is decided here; a
//! function call is forwarded; the extended protocol's frames are
//! [`batches`](super::batches)'.
//!
//! ```text
//! Query / Parse..Sync
//!   → plan (analysis × facts of the names it uses → read? effects)
//!   → may it be served? (single SELECT, no temp objects, nothing in flight,
//!      not after a write in this transaction, not REPEATABLE READ, settings known)
//!   → key (session prefix, statement, parameters)
//!   → cache.lookup: hit → stage the stored frames + ReadyForQuery for the client
//!                   miss → forward, tee the response into a capture
//!                   bypass → forward
//! every forwarded request carries its effects (table versions to bump,
//! epoch, schema change), applied when its ReadyForQuery arrives and again
//! when its transaction ends (answers.rs).
//! ```
//!
//! A pass that needs what only a wait can give (Redis, the session's
//! settings, catalog facts, a statement's prerequisites) stops before it
//! changes anything that matters and returns a [`Need`]. The driver meets
//! it, notes what it found in [`Found`](super::Found), and feeds the same
//! frame again: each decision is written once.

use std::sync::Arc;

use bytes::Bytes;

use super::hidden::qualify_sql;
use super::life::Ending;
use super::lookup::Answer;
use super::{Ctx, Engine, Need, Purpose};
use crate::cache::Bumps;
use crate::cache::key::{self, KeyBuilder};
use crate::classify::prerequisites::prerequisites;
use crate::pool::marks::{Marks, marks};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{extended, frontend as fe};
use crate::session::pipeline::{Flow, Inflight};

impl Engine {
    /// One complete client frame. With caching off, pass-through is the
    /// policy: every request is forwarded as it is ([`Self::on_forwarded`]).
    pub(super) fn on_client_frame(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let flow = match frame[0] {
            fe::QUERY if self.caching => self.on_query(ctx, frame)?,
            fe::PARSE if self.caching => {
                let marks = self.known.frame_marks(frame);
                self.prerequisites(ctx, marks, frame)?;
                self.on_extended(ctx, frame)?
            }
            fe::BIND | fe::DESCRIBE | fe::CLOSE | fe::EXECUTE if self.caching => {
                self.on_extended(ctx, frame)?
            }
            fe::SYNC if self.caching => {
                self.db.hold.touch_at(ctx.now);
                self.on_sync(ctx, frame)?
            }
            _ => self.on_forwarded(ctx, frame),
        };
        self.found.clear();
        Ok(flow)
    }

    /// A frame forwarded as it is: one no cache decision is made on (a
    /// function call, Terminate, Flush, COPY's data), or any request with
    /// caching off. It is still read for what it tells of the session: a
    /// statement that taints its connection or pins it, the requests
    /// PostgreSQL will answer, a Terminate that hands the connection back.
    pub(super) fn on_forwarded(&mut self, ctx: &Ctx, frame: &[u8]) -> Flow {
        let tag = frame[0];
        match tag {
            fe::FUNCTION_CALL => {
                self.release_batch();
                self.forward(frame);
                self.settings_may_have_changed();
                self.tx.wrote();
                self.pipeline.push(Inflight {
                    effects: Bumps::opaque(),
                    ..Inflight::default()
                });
                Flow::Continue
            }
            fe::TERMINATE => {
                self.end_with(Ending::ClientEnded);
                // A connection handed back to be parked, or one of the
                // pool's, outlives the client: its Terminate stays here.
                if !self.hand_back(ctx) && !self.link.is_pooled() {
                    self.forward(frame);
                }
                Flow::Close
            }
            _ => {
                if tag == fe::FLUSH {
                    self.release_batch();
                }
                if (tag == fe::QUERY || tag == fe::PARSE)
                    && (self.server.parks() || self.link.is_pooled())
                {
                    let marks = self.known.frame_marks(frame);
                    self.note_marks(ctx, marks, frame);
                }
                self.forward(frame);
                self.pipeline.note_client_frame(tag)
            }
        }
    }

    /// Notes a Query's or Parse's marks; asks for its prerequisites (a
    /// database let go of, a table out of the publication) to be met once.
    fn prerequisites(&mut self, ctx: &Ctx, marks: Marks, frame: &[u8]) -> Result<(), Need> {
        if marks.frees {
            self.known.forget_freed(frame);
        }
        if self.server.parks() || self.link.is_pooled() {
            self.note_marks(ctx, marks, frame);
        }
        if (marks.evicts || marks.unlogged)
            && !self.found.prerequisites
            && ctx.instance.cache().replication_on()
        {
            return Err(self.needs_of(frame));
        }
        Ok(())
    }

    /// What the statement in `frame` needs of pgcache before it goes out
    /// ([`crate::classify::prerequisites`]). The tables it takes out of the
    /// publication are first named as the client's session resolves them
    /// (its search_path), when its connection is idle to ask.
    pub(super) fn needs_of(&mut self, frame: &[u8]) -> Need {
        let needs = match self.found.needs.take() {
            Some(needs) => needs,
            None => {
                let text = extended::statement_text(frame);
                let sql = std::str::from_utf8(text).unwrap_or_default();
                let mut needs = Box::new(prerequisites(sql));
                if !needs.unpublish.is_empty() && self.backend_idle() {
                    for table in needs.unpublish.drain(..) {
                        self.ask(Purpose::Qualify, &qualify_sql(&table));
                    }
                    self.found.needs = Some(needs);
                    return Need::Own;
                }
                needs
            }
        };
        Need::Prerequisites(needs)
    }

    fn on_query(&mut self, ctx: &Ctx, frame: &Bytes) -> Result<Flow, Need> {
        let body = &frame[HEADER_LEN..];
        // `SELECT 1;` answers as `SELECT 1` does (psql sends the one from
        // a file, the other from -c): one text, one entry.
        let sql = statement_text(body.strip_suffix(&[0]).unwrap_or(body));
        let hash = key::sql_hash(sql);
        // One lookup gives a known text's plan and marks.
        let generation = self.db.catalog.generation();
        let (mut memo, known_marks) =
            self.known
                .text(hash, generation, ctx.instance.policy_generation());
        let marks = known_marks.unwrap_or_else(|| marks(sql));
        self.prerequisites(ctx, marks, frame)?;
        if self.found.prerequisites {
            // Meeting them may have changed the catalog.
            memo = None;
        }
        self.db.hold.touch_at(ctx.now);
        self.release_batch();
        let plan = match memo {
            Some(plan) => plan,
            None => self.plan(ctx, hash, sql)?,
        };
        if known_marks.is_none() {
            self.known.remember_marks(hash, marks);
        }
        self.before_begin(ctx, &plan)?;
        let key = self.may_serve(ctx, &plan, true)?.map(|prefix| {
            KeyBuilder::new(
                prefix,
                key::SIMPLE,
                key::keyed_text(plan.explain, hash, sql),
            )
            .finish()
        });
        self.settings_for_replica(ctx, &plan)?;
        let reads = self.keyed_reads(&plan, |known| known.keyed_reads(hash, &plan, sql));
        let looked = self.look_up(ctx, key, &plan, reads.as_ref())?;
        // Decided: nothing below waits.
        plan.stats.call();
        let mut inflight = Inflight {
            effects: plan.text_effects(&self.db.versions, sql),
            ..Inflight::default()
        };
        match self.answer(ctx, looked, reads.as_ref(), &plan, frame, 0) {
            Answer::Served { .. } => return Ok(Flow::Continue),
            Answer::Forward(capture, explain) => {
                if capture.is_some() {
                    inflight.timing = Some((Arc::clone(&plan.stats), ctx.now));
                }
                inflight.capture = capture;
                inflight.explain = explain;
            }
        }
        self.note_effects(&plan);
        self.pipeline.executed();
        if !self.route(ctx, &plan, &mut inflight, frame, None) {
            self.forward(frame);
        }
        self.pipeline.push(inflight);
        Ok(Flow::Continue)
    }
}

/// A simple query's text without the semicolons and white space that end
/// it.
fn statement_text(sql: &[u8]) -> &[u8] {
    let end = sql
        .iter()
        .rposition(|&b| b != b';' && !b.is_ascii_whitespace())
        .map_or(0, |p| p + 1);
    &sql[..end]
}

#[cfg(test)]
mod tests {
    use super::statement_text;

    #[test]
    fn a_text_ends_at_its_last_statement() {
        assert_eq!(statement_text(b"SELECT 1;"), b"SELECT 1");
        assert_eq!(statement_text(b"SELECT 1 ; ;\n"), b"SELECT 1");
        assert_eq!(statement_text(b"SELECT ';'"), b"SELECT ';'");
        assert_eq!(statement_text(b" ;"), b"");
        assert_eq!(statement_text(b"SELECT 1; SELECT 2"), b"SELECT 1; SELECT 2");
    }
}
