//! The backend's answers, as the cache sees them: result frames teed into
//! captures, and each ReadyForQuery completing the oldest request in flight
//! (its invalidations applied, its result stored).

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tracing::warn;

use super::life::{Ending, Phase};
use super::{Action, Ctx, Engine, OwnStep};
use crate::cache::stats::QueryStats;
use crate::cache::{Bumps, Fill};
use crate::cancel::CancelTarget;
use crate::pool::marks::Pin;
use crate::pool::prepared::Reply;
use crate::protocol::codec::{
    HEADER_LEN, MAX_BACKEND_FRAME, checked_frames, parse_frame, read_i32,
};
use crate::protocol::{TxStatus, backend as be, messages};
use crate::session::SessionError;
use crate::session::capture::{self, Captured};
use crate::session::link::Link;
use crate::session::pipeline::Inflight;
use crate::session::replica::Verdict;
use crate::session::reuse::Settings;
use crate::session::row_limit::Cut;

/// What became of the backend's buffered frames ([`Engine::on_backend`]).
#[derive(Debug, Default, Clone, Copy)]
pub(in crate::session) struct Relayed {
    /// The buffer's first `end` bytes were handled.
    pub end: usize,
    /// The client gets the engine's staged bytes, then `buf[from..end]`:
    /// what was not rewritten goes out without a copy.
    pub from: usize,
}

impl Engine {
    /// Every complete backend frame in `buf`: the answer to pgcache's own
    /// query in flight ([`Engine::on_own_frame`]), a relayed login's
    /// exchange ([`Engine::on_login_frame`]), result frames teed into
    /// captures, the answers to pgcache's own requests in a pooled batch
    /// swallowed, cancel keys replaced, and each ReadyForQuery completing
    /// its request.
    pub fn on_backend(&mut self, ctx: &Ctx, buf: &mut BytesMut) -> Result<Relayed, SessionError> {
        let mut pos = 0;
        let mut copied = 0; // buffered bytes before this are in `out` or dropped
        // What the server is owed as it is ([`Engine::take_to_server`]).
        let mut resend = std::mem::take(&mut self.to_server);
        let pooled = self.link.is_pooled();
        let mut listened = false;
        while let Some(len) = parse_frame(&buf[pos..], MAX_BACKEND_FRAME)
            .map_err(|e| SessionError::BackendFrame(e.into()))?
        {
            if self.aside(ctx, &buf[copied..pos + len], pos - copied, &mut resend)? {
                (pos, copied) = (pos + len, pos + len);
                continue;
            }
            if !pooled
                && capture::plain(buf[pos])
                && let Some(end) = self.plain_run(ctx, buf, pos)
            {
                pos = end;
                continue;
            }
            if self.link_frame(ctx, buf, (pos, len), &mut resend, &mut listened) {
                self.out.extend_from_slice(&buf[copied..pos]);
                copied = pos + len;
                pos += len;
                continue;
            }
            let frame = &buf[pos..pos + len];
            let cut = match frame[0] {
                be::BACKEND_KEY_DATA if len >= HEADER_LEN + 8 => {
                    let replacement = self.register_cancel_key(ctx, &frame[HEADER_LEN..]);
                    self.out.extend_from_slice(&buf[copied..pos]);
                    self.out.extend_from_slice(&replacement);
                    copied = pos + len;
                    Cut::Keep
                }
                be::ERROR_RESPONSE => {
                    if messages::is_fatal(&frame[HEADER_LEN..]) {
                        self.end_with(Ending::BackendFatal);
                    }
                    self.on_response_frame(ctx, frame)
                }
                be::COPY_IN_RESPONSE => {
                    self.pipeline.copy_in_started();
                    self.on_response_frame(ctx, frame)
                }
                be::READY_FOR_QUERY => {
                    if let Some(explain) = self.pipeline.front_mut().and_then(|f| f.explain.take())
                    {
                        self.out.extend_from_slice(&buf[copied..pos]);
                        explain.notice(ctx.now, &mut self.out);
                        copied = pos;
                    }
                    let status = frame.get(HEADER_LEN).and_then(|b| TxStatus::from_byte(*b));
                    let keep = self.pipeline.front().is_none_or(|f| {
                        f.to_client && !f.routed.as_ref().is_some_and(|r| r.to_primary())
                    });
                    self.on_ready_for_query(ctx, status.unwrap_or(TxStatus::Idle));
                    if keep { Cut::Keep } else { Cut::Drop }
                }
                _ => self.on_response_frame(ctx, frame),
            };
            if cut != Cut::Keep {
                let (bytes, kept) = cut.parts();
                self.out.extend_from_slice(&buf[copied..pos]);
                self.out.extend_from_slice(bytes);
                // A frame kept goes out from the buffer, after `out`.
                copied = if kept { pos } else { pos + len };
            }
            pos += len;
        }
        self.read_through(ctx, listened, resend);
        Ok(Relayed {
            end: pos,
            from: copied,
        })
    }

    /// The frame at `at` in `run` (the bytes since the last copied to the
    /// client), if no client request's: the answer to pgcache's own query
    /// in flight (the bytes before it go to the client as they are, and
    /// what of it is the client's, [`OwnStep::ToClient`]), or a login's
    /// exchange ([`Engine::on_login_frame`]). True if it was.
    fn aside(
        &mut self,
        ctx: &Ctx,
        run: &[u8],
        at: usize,
        resend: &mut BytesMut,
    ) -> Result<bool, SessionError> {
        if self.own_in_flight() {
            self.out.extend_from_slice(&run[..at]);
            if let OwnStep::ToClient(frame) = self.on_own_frame(ctx, BytesMut::from(&run[at..])) {
                self.out.extend_from_slice(&frame);
            }
            return Ok(true);
        }
        Ok(self.relaying_login() && self.on_login_frame(ctx, &run[at..], resend)?)
    }

    /// The backend's buffer is read through: what was spliced into it is
    /// gone, a LISTEN (whatever shape carried it) keeps its connection,
    /// and what the server is owed (`resend`) waits to be sent.
    fn read_through(&mut self, ctx: &Ctx, listened: bool, resend: BytesMut) {
        self.to_server = resend;
        if let Link::Pooled(link) = &mut self.link {
            link.spliced = 0..0;
        }
        if listened {
            self.pin(ctx, Pin::Listen);
        }
    }

    /// What the transaction-mode link makes of the server frame at `at`
    /// (its start and length): true when the client is not to see it (a
    /// notification for another client, an answer to pgcache's own
    /// request). pgcache's answers in the server's place are spliced into
    /// `buf` after it; what the server is owed goes to `resend`.
    fn link_frame(
        &mut self,
        ctx: &Ctx,
        buf: &mut BytesMut,
        (pos, len): (usize, usize),
        resend: &mut BytesMut,
        listened: &mut bool,
    ) -> bool {
        let Link::Pooled(link) = &mut self.link else {
            return false;
        };
        if link.spliced.contains(&pos) {
            return false;
        }
        let frame = &buf[pos..pos + len];
        if frame[0] == be::NOTIFICATION && !link.listens.admits(frame) {
            // Another client's LISTEN on this connection: never this
            // client's to see ([`crate::pool::listens`]).
            ctx.instance.metrics().pooled.notifications_withheld.inc();
            return true;
        }
        if frame[0] == be::COMMAND_COMPLETE && frame[HEADER_LEN..].starts_with(b"LISTEN\0") {
            link.listens.completed();
            *listened = true;
        }
        let answer = link.on_server_frame(frame);
        if !answer.to_client.is_empty() {
            // pgcache's answers in the server's place come next.
            let tail = buf.split_off(pos + len);
            buf.extend_from_slice(&answer.to_client);
            buf.extend_from_slice(&tail);
            link.spliced = pos + len..buf.len() - tail.len();
        }
        resend.extend_from_slice(&answer.to_server);
        answer.reply == Reply::Drop
    }

    /// Hands the client the backend's process id with pgcache's own secret
    /// (see [`crate::cancel`]).
    fn register_cancel_key(&mut self, ctx: &Ctx, body: &[u8]) -> BytesMut {
        let mut p = 0;
        let backend_pid = read_i32(body, &mut p).unwrap_or(0) as u32;
        let target = Arc::new(CancelTarget {
            addr: self.backend_addr.clone(),
            backend_pid,
            backend_secret: body[4..].to_vec(),
        });
        self.backend_key = Some(Arc::clone(&target));
        if let Link::Pooled(_) = self.link {
            // The connection the client logged in on, for now: the client
            // gets a key of pgcache's that follows it to the next one.
            let (pid, secret, guard) = ctx.instance.register_cancel();
            guard.retarget(Some(target));
            self.cancel = Some(guard);
            return messages::backend_key_data(pid, &secret);
        }
        ctx.client.own(backend_pid);
        let (pid, secret, guard) = ctx.instance.register_cancel_for(&target);
        self.cancel = Some(guard);
        messages::backend_key_data(pid, &secret)
    }

    /// Whether a ParameterStatus tells the client something: always in
    /// session mode; in transaction mode, a value it was not told last
    /// (noted as told): what it was told beyond the pool's login, else
    /// the login's own values, which its greeting gave.
    pub(super) fn tells_client(&mut self, frame: &[u8]) -> bool {
        let Link::Pooled(link) = &mut self.link else {
            return true;
        };
        let told = match link.told.names(frame) {
            true => link.told.has_frame(frame),
            false => link.pool.statuses().is_some_and(|s| s.has_frame(frame)),
        };
        if !told {
            link.told.note(frame);
        }
        !told
    }

    /// A ParameterStatus the backend sent, kept for a connection handed
    /// back whole: session mode only (a pooled connection never is).
    pub fn note_status(&mut self, frame: &[u8]) {
        if let Link::Session(_) = self.link {
            self.server.statuses.note(frame);
        }
    }

    /// A response frame (not ReadyForQuery) for the oldest request in
    /// flight. Returns what the client is sent of it.
    fn on_response_frame(&mut self, ctx: &Ctx, frame: &[u8]) -> Cut {
        let tag = frame[0];
        if tag == be::PARAMETER_STATUS {
            // The ones before the first ReadyForQuery are the login's own,
            // and pgcache's own requests (a pooled connection taking the
            // client's settings) change nothing of the client's.
            let own = self.pipeline.front().is_some_and(|f| !f.to_client);
            if self.logged_in() && !own {
                self.known.prefix = None;
                self.server.settings = Settings::Changed;
                self.link.settings_may_have_changed();
            }
            self.note_status(frame);
        }
        // The client is told a parameter as its own requests report it,
        // and as pgcache's do only when it changed for the client.
        let tells = tag == be::PARAMETER_STATUS && self.tells_client(frame);
        let max = ctx.instance.cache().local.max_entry_bytes();
        let Some(front) = self.pipeline.front_mut() else {
            return Cut::Keep;
        };
        if front.probe
            && let Some(leg) = &mut self.replica
        {
            leg.probed(frame);
        }
        let mut owed_parse = None;
        if let Some(routed) = &mut front.routed {
            if routed.verdict == Verdict::Awaited {
                let replayed = self.replica.as_ref().and_then(|leg| leg.replayed);
                if routed.first_frame(frame, replayed) {
                    owed_parse = routed.parse.take();
                } else {
                    // Its answer is the primary's to give.
                    front.capture = None;
                }
            }
            if routed.to_primary() {
                return Cut::Drop;
            }
        }
        if !front.to_client {
            // pgcache's own request: a refresh keeps its answer, nobody
            // else sees it.
            if let Some(cap) = &mut front.capture {
                cap.add(frame, max);
            }
            return match tag {
                be::NOTIFICATION => Cut::Keep,
                be::PARAMETER_STATUS if tells => Cut::Keep,
                _ => Cut::Drop,
            };
        }
        match tag {
            be::NOTIFICATION => return Cut::Keep,
            be::ERROR_RESPONSE => {
                front.failed = true;
                self.tx.error();
            }
            be::COMMAND_COMPLETE => self.tx.command_complete(&frame[HEADER_LEN..]),
            _ => {}
        }
        if let Some(cap) = &mut front.capture {
            cap.add(frame, max);
        }
        let cut = match &mut front.row_cut {
            Some(cut) => cut.frame(tag),
            None => Cut::Keep,
        };
        match owed_parse {
            // The replica's answer stands: the client's Parse, held back
            // from it, is answered here and owed to the primary.
            Some((name, raw)) => {
                self.known.owe_parse(name, &raw);
                Cut::Before(&messages::PARSE_COMPLETE)
            }
            None => cut,
        }
    }

    /// From `pos`, a run of plain frames (see [`capture::plain`]) of the
    /// request in front, when a capture takes them and nothing else looks
    /// at them (a replica's answer is looked at until its first frame
    /// decides whether it stands): handed to the capture in one piece
    /// rather than frame by frame (a would-be hit's rows are compared with
    /// one comparison). Returns where the run ends.
    fn plain_run(&mut self, ctx: &Ctx, buf: &[u8], pos: usize) -> Option<usize> {
        let front = self.pipeline.front_mut()?;
        let undecided = front
            .routed
            .as_ref()
            .is_some_and(|r| r.verdict == Verdict::Awaited);
        if !front.to_client || front.row_cut.is_some() || undecided {
            return None;
        }
        let capture = front.capture.as_mut()?;
        let run: usize = checked_frames(&buf[pos..], MAX_BACKEND_FRAME)
            .map_while(Result::ok)
            .take_while(|frame| capture::plain(frame[0]))
            .map(<[u8]>::len)
            .sum();
        let end = pos + run;
        if end == pos {
            return None;
        }
        let max = ctx.instance.cache().local.max_entry_bytes();
        capture.add_plain(&buf[pos..end], max);
        Some(end)
    }

    /// ReadyForQuery: the oldest request is complete. Applies its effects,
    /// stores its capture, and closes the transaction's books when it ends.
    pub fn on_ready_for_query(&mut self, ctx: &Ctx, status: TxStatus) {
        if !self.logged_in() {
            // Logged in: only now does the database get shared state, so
            // clients naming made-up databases cannot grow the registry.
            self.db = ctx.instance.cache().db(self.startup.database());
            if let Link::Pooled(link) = &mut self.link {
                link.translator.follow(Arc::clone(&self.db.versions.schema));
            }
            if self.caching {
                self.actions.push(Action::Watch);
            }
            self.phase = Phase::Serving;
        }
        tracing::trace!(?status, inflight = self.pipeline.len(), "ready for query");
        if let Link::Pooled(link) = &mut self.link
            && link.schema_changes
            && status == TxStatus::Idle
        {
            // Before the client hears the DDL is done.
            link.schema_changes = false;
            self.db.versions.schema_changed();
        }
        let (effects, result) = match self.pipeline.pop() {
            Some(mut done) => {
                if done.routed.is_some() && !self.routed_done(&mut done) {
                    // Gone to the primary: it completes there.
                    self.pipeline.push(done);
                    return;
                }
                self.completed(ctx, &mut done)
            }
            None => (Bumps::default(), None),
        };
        if self.pipeline.is_quiet() {
            // The statements that needed databases free are answered.
            self.paused.clear();
        }
        let completion = self.tx.complete(status, effects, result);
        if self.pipeline.is_quiet() {
            self.tx.settle();
        }
        if completion.private.is_some() || !completion.visible.is_empty() {
            // A write through this instance: reads after it go only to
            // replicas known to have replayed it (read-your-writes).
            self.db.versions.writes.bump_local();
        }
        if let Some(private) = &completion.private {
            self.db.apply_local(private);
        }
        for bumps in completion.visible {
            self.invalidate(ctx, bumps);
        }
        for (fill, bytes) in completion.store {
            self.actions.push(Action::Store(fill, bytes));
        }
    }

    /// What a completed request leaves: its effects, and its answer to
    /// store.
    #[allow(clippy::type_complexity)]
    fn completed(
        &mut self,
        ctx: &Ctx,
        done: &mut Inflight,
    ) -> (Bumps, Option<((Box<Fill>, BytesMut), usize)>) {
        if done.failed {
            for name in &done.parsed {
                self.known.statements.remove(name);
            }
        }
        let captured = done
            .capture
            .take()
            .filter(|_| !done.failed)
            .and_then(|cap| cap.finish());
        let mut result = None;
        let mut would_hit = None;
        match captured {
            Some(Captured::Store(fill, bytes)) => {
                let size = bytes.len();
                result = Some(((fill, bytes), size));
            }
            Some(Captured::Compared { matched }) => would_hit = Some(matched),
            Some(Captured::Verified(check, answer)) => {
                self.actions.push(Action::Judge(check, answer, ctx.now));
            }
            None => {}
        }
        if let Some((stats, started)) = &done.timing {
            let took = ctx.now.saturating_duration_since(*started);
            match would_hit {
                Some(matched) => shadow_checked(ctx, stats, took, matched),
                None => {
                    stats.miss(took);
                    ctx.instance
                        .metrics()
                        .latency_miss
                        .observe(took.as_secs_f64());
                }
            }
        }
        (std::mem::take(&mut done.effects), result)
    }

    /// Applies invalidations others can now see: the local counters at
    /// once; Redis (and every other instance) before the client is told
    /// the statement completed ([`Action::Publish`]).
    fn invalidate(&mut self, ctx: &Ctx, mut bumps: Bumps) {
        bumps.watermark = true;
        let source = &ctx.instance.metrics().invalidations.write;
        let publication = ctx.instance.cache().invalidate(&self.db, bumps, source);
        self.actions.push(Action::Publish(publication));
    }
}

/// Shadow mode: a would-be hit was forwarded and PostgreSQL answered
/// in `took`; `matched` says whether the stored answer was the same.
fn shadow_checked(ctx: &Ctx, stats: &QueryStats, took: Duration, matched: bool) {
    stats.would_hit(took, matched);
    let m = &ctx.instance.metrics();
    m.shadow_saved.inc_by(took.as_secs_f64());
    if matched {
        m.shadow_match.inc();
    } else {
        m.shadow_mismatch.inc();
        warn!(query = %stats.text, "shadow mode: the cache would have served an answer PostgreSQL no longer gives");
    }
}

/// The client's side, off the path of a hit: hint warnings, and a read
/// that missed routed to a replica.
impl Engine {
    /// Tells the client, once per statement text, which of its hints were
    /// malformed or unknown (the statement runs under the policy).
    pub(super) fn warn_hints(&mut self, ctx: &Ctx, hash: u128, problems: &[String]) {
        if !self.known.first_warning(hash) {
            return;
        }
        for problem in problems {
            ctx.instance.metrics().hint_problems.inc();
            messages::notice_response(
                &mut self.out,
                "WARNING",
                crate::protocol::sqlstate::WARNING,
                &format!("pgcache: hint ignored: {problem}"),
            );
        }
    }

    /// The backend has not seen the held Parse: it is replayed before
    /// anything else the backend is sent, unless it was `sent` already.
    pub(super) fn defer_parse(&mut self, sent: bool) {
        let Some((name, raw)) = self.batch.take_parse() else {
            return;
        };
        match sent {
            true => self.known.unsent_parses.retain(|(n, _)| *n != name),
            false => self.known.owe_parse(name, &raw),
        }
    }
}
