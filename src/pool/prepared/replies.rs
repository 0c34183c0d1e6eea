//! What a transaction-mode client gets of its server connection's
//! answers: each frame matched with what it answers ([`super::owed`]),
//! pgcache's own answers put in their place, errors about a statement
//! given the client's name for it, and a stale statement's Bind retried.

use std::sync::atomic::Ordering;

use bytes::{Bytes, BytesMut};

use super::{Answer, Reply, Translator};
use crate::pool::owed::{Expect, Kind, Origin, stale_statement};
use crate::pool::statement::{Named, ServerStatements, Statement, renamed};
use crate::protocol::codec::{HEADER_LEN, frame_of};
use crate::protocol::extended::Parse;
use crate::protocol::{TxStatus, backend as be, frontend as fe, messages, sqlstate};

/// PostgreSQL's words for a statement refused in a failed transaction.
pub(super) const FAILED: &str =
    "current transaction is aborted, commands ignored until end of transaction block";

impl Translator {
    /// The client's message just written: its answer is owed.
    pub(super) fn owe(&mut self, kind: Kind) {
        self.expect.push_back(Expect::new(kind, Origin::Client));
    }

    /// pgcache answers in the server's place, in turn.
    pub(super) fn answer(&mut self, frames: &[u8]) {
        self.expect.push_back(Expect::new(
            Kind::One(0),
            Origin::Synthetic(Bytes::copy_from_slice(frames)),
        ));
    }

    /// pgcache refuses the client's Parse in the server's place with
    /// `code` and `message`, and skips the rest of its batch to the Sync,
    /// as PostgreSQL would. The server is sent a Parse it refuses in turn
    /// (its error is not the client's), so that it fails what PostgreSQL
    /// would have failed: the transaction block, or the batch's implicit
    /// transaction with what ran in it before.
    fn refuse_parse(&mut self, code: &'static str, message: &str, out: &mut BytesMut) {
        let mut error = BytesMut::new();
        messages::error_response(&mut error, "ERROR", code, message);
        self.answer(&error);
        frame_of(
            out,
            fe::PARSE,
            &[b"__pgcache_refused\0pgcache refuses\0", &[0, 0]],
        );
        let mut refused = Expect::new(Kind::One(be::PARSE_COMPLETE), Origin::Injected);
        refused.answered = true;
        self.expect.push_back(refused);
        self.skipping = true;
    }

    /// A client's named Parse PostgreSQL would refuse, refused as it would
    /// be (true): in a failed transaction, or of a name the client has
    /// prepared.
    pub(super) fn refuses_parse(
        &mut self,
        p: &Parse<'_>,
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) -> bool {
        let failed = self.status == TxStatus::Failed && self.expect.is_empty();
        if failed && !crate::pool::marks::ends_transaction(p.query) {
            // Not a name the server has: it refuses the Parse itself. (With
            // answers owed, the status may be stale: the server decides.)
            self.refused_by_server(b"__pgcache_refused", p, None, out);
            return true;
        }
        if !self.statements.contains_key(p.name) {
            return false;
        }
        if self.parse_owed(p.name) {
            // Whether it exists is the answer still owed: as if it does.
            let message = format!(
                "prepared statement \"{}\" already exists",
                String::from_utf8_lossy(p.name)
            );
            self.refuse_parse(sqlstate::DUPLICATE_PSTATEMENT, &message, out);
            return true;
        }
        // The server is asked to prepare that statement's server name
        // again, and refuses it.
        let mut server_name = Vec::new();
        let hash = self.with_statement(p.name, server, max, out, |n, _| server_name = n.to_vec());
        let named = hash.map(|hash| Named::of(hash, p.name));
        self.refused_by_server(&server_name, p, named, out);
        true
    }

    /// A client's Parse of a statement the server has under its name,
    /// with answers owed: the server parses its text as the unnamed
    /// statement, and its answer is the client's (the one it has under
    /// its name stays; the unnamed one is prepared again when needed).
    pub(super) fn parse_as_unnamed(
        &mut self,
        statement: Statement,
        name: Bytes,
        server: &mut ServerStatements,
        out: &mut BytesMut,
    ) {
        let body = [&[0][..], &statement.query, &[0], &statement.param_types];
        frame_of(out, fe::PARSE, &body);
        server.unnamed = None;
        self.statements.insert(name.clone(), statement);
        self.expect.push_back(Expect {
            defines: Some(name),
            ..Expect::new(Kind::One(be::PARSE_COMPLETE), Origin::Client)
        });
    }

    /// A client's Parse PostgreSQL would refuse (in a failed transaction,
    /// or of a name the client has prepared) goes to the server under
    /// `name`, which the server cannot store: the server refuses it in its
    /// own words and order (a text it cannot parse first), fails its
    /// transaction as PostgreSQL's fails, and skips the rest of the batch.
    /// `named`: the statement `name` is, whose server name the error gives
    /// under the client's.
    fn refused_by_server(
        &mut self,
        name: &[u8],
        p: &Parse<'_>,
        named: Option<Named>,
        out: &mut BytesMut,
    ) {
        let body = [name, &[0], p.query, &[0], p.param_types];
        frame_of(out, fe::PARSE, &body);
        self.owe(Kind::One(be::PARSE_COMPLETE));
        if let Some(parse) = self.expect.back_mut() {
            parse.named = named;
        }
    }

    /// The answers pgcache gives that nothing sent before them holds up.
    pub(super) fn leading_synthetic(&mut self) -> BytesMut {
        let mut out = BytesMut::new();
        while let Some(front) = self.expect.front() {
            match &front.origin {
                Origin::Synthetic(frames) => out.extend_from_slice(frames),
                Origin::Refusal(code, message) => {
                    // As PostgreSQL answers a Query it refuses.
                    let (code, message) = match self.status {
                        TxStatus::Failed => (sqlstate::IN_FAILED_SQL_TRANSACTION, FAILED),
                        _ => (*code, message.as_str()),
                    };
                    messages::error_response(&mut out, "ERROR", code, message);
                    if self.status == TxStatus::InTransaction {
                        self.status = TxStatus::Failed;
                    }
                    out.extend_from_slice(&messages::ready_for_query(self.status));
                }
                _ => break,
            }
            self.expect.pop_front();
        }
        out
    }

    /// One frame from the server (header included): whether the client
    /// gets it, the answers pgcache gives right after it, and what to send
    /// the server again.
    pub fn on_frame(&mut self, frame: &[u8], server: &mut ServerStatements) -> Answer {
        let tag = frame[0];
        let answer = |reply, to_client| Answer {
            reply,
            to_client,
            to_server: BytesMut::new(),
        };
        if matches!(
            tag,
            be::NOTICE_RESPONSE | be::NOTIFICATION | be::PARAMETER_STATUS
        ) {
            return answer(Reply::Pass, BytesMut::new());
        }
        if tag == be::READY_FOR_QUERY
            && let Some(status) = frame.get(HEADER_LEN).and_then(|b| TxStatus::from_byte(*b))
        {
            self.status = status;
        }
        if tag == be::COMMAND_COMPLETE {
            self.completed(&frame[HEADER_LEN.min(frame.len())..], server);
        }
        if tag == be::COPY_IN_RESPONSE {
            // The front is what started COPY FROM STDIN: the Syncs sent
            // after it, before CopyDone, will not be answered.
            while self.expect.get(1).is_some_and(|e| e.may_be_ignored) {
                self.expect.remove(1);
            }
            return answer(Reply::Pass, BytesMut::new());
        }
        let Some(front) = self.expect.front() else {
            return answer(Reply::Pass, BytesMut::new());
        };
        let error = tag == be::ERROR_RESPONSE;
        if error
            && front.binds.is_some()
            && stale_statement(&frame[HEADER_LEN.min(frame.len())..])
            && let Some(to_server) = self.stale(server)
        {
            return Answer {
                reply: Reply::Drop,
                to_client: BytesMut::new(),
                to_server,
            };
        }
        let Some(front) = self.expect.front() else {
            return answer(Reply::Pass, BytesMut::new());
        };
        let ends = front.ended_by(tag);
        let named = front.named.as_ref();
        let (reply, renamed) = match &front.origin {
            Origin::Injected if !error => (Reply::Drop, BytesMut::new()),
            _ if error && front.answered => (Reply::Drop, BytesMut::new()),
            // The server's error names the statement as the server knows
            // it: the client gets it under its own name.
            _ if error && let Some(named) = named.filter(|n| n.named_in(frame)) => {
                (Reply::Drop, renamed(frame, named))
            }
            _ => (Reply::Pass, BytesMut::new()),
        };
        if !ends {
            return answer(reply, renamed);
        }
        let done = self.expect.pop_front().expect("front above");
        if error {
            self.skip_batch(&done, server);
            return answer(reply, renamed);
        }
        let mut to_client = renamed;
        to_client.extend_from_slice(&self.leading_synthetic());
        answer(reply, to_client)
    }

    /// `done` failed: the server skips the rest of its batch, up to a Sync;
    /// if the client has not sent that Sync yet, what it sends before it
    /// is skipped here, as the server would skip it.
    fn skip_batch(&mut self, done: &Expect, server: &mut ServerStatements) {
        self.failed(done, server);
        while let Some(next) = self.expect.front() {
            if next.kind == Kind::Ready {
                break;
            }
            let skipped = self.expect.pop_front().expect("front above");
            self.failed(&skipped, server);
        }
        if self.expect.is_empty() {
            self.skipping = true;
        }
        // A Sync of pgcache's own ended a Parse of its own: the client got
        // that error for the Query behind, whose own is not its.
        if matches!(done.origin, Origin::Injected)
            && let Some(sync) = self.expect.front()
            && matches!(sync.origin, Origin::Injected)
            && let Some(query) = self.expect.get_mut(1)
        {
            query.answered = true;
        }
    }

    /// The client's statement in front completed with `tag`: statements
    /// it freed on the server are freed here too.
    fn completed(&mut self, tag: &[u8], server: &mut ServerStatements) {
        let Some(front) = self.expect.front_mut() else {
            return;
        };
        if !matches!(front.origin, Origin::Client) {
            return;
        }
        if tag == b"DEALLOCATE ALL\0" || tag == b"DISCARD ALL\0" {
            // Every statement on the server went, the pool's others too.
            self.statements.clear();
            server.clear();
        } else if tag == b"DEALLOCATE\0"
            && let Some(named) = front.named.take_if(|n| n.frees)
        {
            server.remove(named.hash);
            self.statements.remove(&named.name);
        }
    }

    /// The server refused the Bind in front because its statement is
    /// stale. Retires the name: the client's statements under it take the
    /// current generation, and the generation moves if pgcache had not
    /// seen the DDL. Returns the messages to send again when the Bind is
    /// retried unseen; `None`: the client gets the error.
    fn stale(&mut self, server: &mut ServerStatements) -> Option<BytesMut> {
        let front = self.expect.front_mut()?;
        let stale = front.binds?;
        let retry = front.retry.take();
        let mut generation = self.generation();
        // Named in the current generation: DDL pgcache did not see.
        let unseen = self
            .statements
            .values()
            .any(|s| s.hash == stale && s.generation == generation);
        if unseen {
            generation = self.schema.fetch_add(1, Ordering::AcqRel) + 1;
        }
        for statement in self.statements.values_mut().filter(|s| s.hash == stale) {
            statement.renew(generation);
        }
        let retry = retry.filter(|_| unseen)?;
        // Only when nothing follows the batch's Sync: the answers to what
        // is sent again come last.
        let sync = self
            .expect
            .iter()
            .position(|e| e.kind == Kind::Ready && matches!(e.origin, Origin::Client))?;
        if sync + 1 != self.expect.len() {
            return None;
        }
        tracing::debug!("a Bind's statement was stale on the server: prepared again and retried");
        for skipped in self.expect.drain(..).collect::<Vec<_>>() {
            self.failed(&skipped, server);
        }
        // The server's ReadyForQuery for that Sync is not the client's.
        self.expect
            .push_back(Expect::new(Kind::Ready, Origin::Injected));
        let mut out = BytesMut::new();
        self.skipping = false;
        self.translate_frames(&retry, server, false, &mut out);
        Some(out)
    }

    /// A Parse that failed (or was skipped) prepared nothing.
    fn failed(&mut self, expect: &Expect, server: &mut ServerStatements) {
        if let Some(hash) = expect.prepares {
            server.remove(hash);
        }
        if let Some(name) = &expect.defines
            && expect
                .prepares
                .is_none_or(|hash| self.statements.get(name).is_some_and(|s| s.hash == hash))
        {
            self.statements.remove(name);
        }
    }

    /// Whether the Parse that prepared the client's statement `name` is
    /// still to be answered.
    pub(super) fn parse_owed(&self, name: &[u8]) -> bool {
        let preparing = |e: &Expect| e.defines.as_deref() == Some(name);
        self.expect.iter().any(preparing)
    }

    /// The connection is gone or changed with answers still owed (it was
    /// lost): nothing more will come.
    pub fn clear_owed(&mut self) {
        self.expect.clear();
        self.skipping = false;
    }
}
