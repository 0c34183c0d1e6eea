//! The backend's answers, as the cache sees them: result frames teed into
//! captures, and each ReadyForQuery completing the oldest request in flight
//! (its invalidations applied, its result stored).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tracing::warn;

use super::capture::{self, Captured};
use super::relay::Session;
use super::row_limit::Cut;
use crate::cache::Bumps;
use crate::cache::stats::QueryStats;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, backend as be};

impl<C> Session<C>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    /// A response frame (not ReadyForQuery) for the oldest request in
    /// flight, at `pos..pos + len` of the backend's buffer. Returns what
    /// the client is sent of it.
    pub(super) fn on_response_frame(&mut self, pos: usize, len: usize) -> Cut {
        let frame = &self.backend.buffered()[pos..pos + len];
        let tag = frame[0];
        if tag == be::PARAMETER_STATUS {
            // The ones before the first ReadyForQuery are the login's own,
            // and pgcache's own requests (a pooled connection taking the
            // client's settings) change nothing of the client's.
            let own = self.pipeline.front().is_some_and(|f| !f.to_client);
            if self.ready && !own {
                self.known.prefix = None;
                self.server.login_state = false;
                self.link.state_dirty = true;
            }
            self.server.statuses.note(frame);
        }
        let max = self.app.cache.local.max_entry_bytes();
        let Some(front) = self.pipeline.front_mut() else {
            return Cut::Keep;
        };
        if !front.to_client {
            // pgcache's own request: a refresh keeps its answer, nobody
            // else sees it.
            if let Some(cap) = &mut front.capture {
                cap.add(frame, max);
            }
            return if matches!(tag, be::NOTIFICATION | be::PARAMETER_STATUS) {
                Cut::Keep
            } else {
                Cut::Drop
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
        match &mut front.row_cut {
            Some(cut) => cut.frame(tag),
            None => Cut::Keep,
        }
    }

    /// From `pos`, a run of plain frames (see [`capture::plain`]) of the
    /// request in front, when a capture takes them and nothing else looks
    /// at them: handed to the capture in one piece rather than frame by
    /// frame (a would-be hit's rows are compared with one comparison).
    /// Returns where the run ends.
    pub(super) fn plain_run(&mut self, pos: usize) -> Option<usize> {
        let front = self.pipeline.front_mut()?;
        if !front.to_client || front.row_cut.is_some() {
            return None;
        }
        let capture = front.capture.as_mut()?;
        let mut end = pos;
        while let Ok(Some(len)) = self.backend.frame_len_at(end) {
            if !capture::plain(self.backend.buffered()[end]) {
                break;
            }
            end += len;
        }
        if end == pos {
            return None;
        }
        let max = self.app.cache.local.max_entry_bytes();
        capture.add_plain(&self.backend.buffered()[pos..end], max);
        Some(end)
    }

    /// ReadyForQuery: the oldest request is complete. Applies its effects,
    /// stores its capture, and closes the transaction's books when it ends.
    pub(super) fn on_ready_for_query(&mut self, status: TxStatus) {
        if !self.ready {
            // Logged in: only now does the database get shared state, so
            // clients naming made-up databases cannot grow the registry.
            self.db = self.app.cache.db(self.startup.database());
            self.link
                .translator
                .follow(std::sync::Arc::clone(&self.db.versions.schema));
            if self.caching {
                self.app.streams.ensure(&self.db);
            }
            self.ready = true;
        }
        tracing::trace!(?status, inflight = self.pipeline.len(), "ready for query");
        if self.link.schema_changes && status == TxStatus::Idle {
            // Before the client hears the DDL is done.
            self.link.schema_changes = false;
            self.db.versions.schema_changed();
        }
        let (effects, result) = match self.pipeline.pop() {
            Some(done) => {
                if done.failed {
                    for name in &done.parsed {
                        self.known.statements.remove(name);
                    }
                }
                let captured = done
                    .capture
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
                        check.judge(&self.app.cache, &answer, std::time::Instant::now());
                    }
                    None => {}
                }
                if let Some((stats, started)) = &done.timing {
                    let took = started.elapsed();
                    match would_hit {
                        Some(matched) => self.shadow_checked(stats, took, matched),
                        None => {
                            stats.miss(took);
                            self.app.metrics.latency_miss.observe(took.as_secs_f64());
                        }
                    }
                }
                (done.effects, result)
            }
            None => (Bumps::default(), None),
        };
        if self.pipeline.is_quiet() {
            // The statements that needed databases free are answered.
            self.paused.clear();
        }
        let completion = self.tx.complete(status, effects, result);
        if let Some(private) = &completion.private {
            self.db.apply_local(private);
        }
        for bumps in completion.visible {
            self.invalidate(bumps);
        }
        for (fill, bytes) in completion.store {
            self.app.cache.store(*fill, &bytes);
        }
    }

    /// Shadow mode: a would-be hit was forwarded and PostgreSQL answered
    /// in `took`; `matched` says whether the stored answer was the same.
    fn shadow_checked(&self, stats: &QueryStats, took: Duration, matched: bool) {
        stats.would_hit(took, matched);
        let m = &self.app.metrics;
        m.shadow_saved.inc_by(took.as_secs_f64());
        if matched {
            m.shadow_match.inc();
        } else {
            m.shadow_mismatch.inc();
            warn!(query = %stats.text, "shadow mode: the cache would have served an answer PostgreSQL no longer gives");
        }
    }

    /// Applies invalidations others can now see: the local counters at
    /// once; Redis (and every other instance) before the client is told
    /// the statement completed, in [`Self::publish_invalidations`].
    fn invalidate(&mut self, bumps: Bumps) {
        let source = &self.app.metrics.invalidations.write;
        let publication = self.app.cache.invalidate(&self.db, bumps, source);
        self.to_publish.push(publication);
    }

    pub(super) async fn publish_invalidations(&mut self) {
        for publication in std::mem::take(&mut self.to_publish) {
            publication.send().await;
        }
    }
}
