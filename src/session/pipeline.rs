//! The requests a session has sent to PostgreSQL and not yet seen answered.
//!
//! PostgreSQL answers every Query and every Sync with one ReadyForQuery, in
//! order, with one exception: Syncs sent while the backend is in copy-in
//! mode are ignored. The pipeline keeps one [`Inflight`] per expected
//! ReadyForQuery, so that whatever pgcache must do when a request completes
//! (apply its invalidations, store its result) happens at the right one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::capture::Capture;
use super::explain::Explain;
use super::replica::Routed;
use super::row_limit::RowCut;
use crate::cache::Bumps;
use crate::cache::stats::QueryStats;
use crate::protocol::frontend as fe;

/// A request the backend still owes a ReadyForQuery.
pub(super) struct Inflight {
    /// false: pgcache's own injected messages, whose answers are swallowed.
    pub to_client: bool,
    /// Made by a Sync sent after an Execute with no CopyDone/CopyFail in
    /// between: if that Execute starts COPY FROM STDIN, PostgreSQL ignores
    /// this Sync and no ReadyForQuery will answer it.
    pub may_be_ignored: bool,
    pub capture: Option<Capture>,
    /// Invalidations to apply when it completes.
    pub effects: Bumps,
    /// Prepared statements this request defined: forgotten if it fails.
    pub parsed: Vec<Bytes>,
    pub failed: bool,
    /// A miss being timed for its statement's statistics.
    pub timing: Option<(Arc<QueryStats>, Instant)>,
    /// A row-limited Execute sent with one row more: cut back for the
    /// client ([`super::row_limit`]).
    pub row_cut: Option<RowCut>,
    /// pgcache's question to a replica of where it replayed to, before a
    /// read routed there.
    pub probe: bool,
    /// A read routed to a replica.
    pub routed: Option<Box<Routed>>,
    /// `/*+ explain */`: told to the client before its ReadyForQuery.
    pub explain: Option<Box<Explain>>,
}

impl Inflight {
    /// A request of pgcache's own, answered to nobody; with a capture for
    /// a refresh.
    pub fn hidden(capture: Option<Capture>) -> Self {
        Self {
            to_client: false,
            capture,
            ..Self::default()
        }
    }

    /// Takes over the bookkeeping of a Sync PostgreSQL ignored.
    fn absorb(&mut self, ignored: Inflight) {
        self.effects.merge(&ignored.effects);
        self.parsed.extend(ignored.parsed);
        self.failed |= ignored.failed;
    }
}

impl Default for Inflight {
    fn default() -> Self {
        Self {
            to_client: true,
            may_be_ignored: false,
            capture: None,
            effects: Bumps::default(),
            parsed: Vec::new(),
            failed: false,
            timing: None,
            row_cut: None,
            probe: false,
            routed: None,
            explain: None,
        }
    }
}

/// The one protocol rule that breaks "one ReadyForQuery per Sync":
/// PostgreSQL ignores Sync messages received in copy-in mode. Drivers such
/// as tokio-postgres send `Bind, Execute, Sync` before the COPY data, then
/// `CopyDone, Sync`; only the second Sync is answered.
#[derive(Default)]
struct CopyTracker {
    /// A CopyDone/CopyFail was sent since the last Execute or Query.
    ended_since_execute: bool,
    /// The backend is in copy-in mode and the client has not ended it yet.
    active: bool,
    /// CopyDone/CopyFail frames sent before the backend announced the COPY
    /// they end (a client that writes the whole exchange at once): that
    /// many CopyInResponses to come find their COPY already ended. Not the
    /// flag above, which the next Execute or Query clears.
    ended_early: u32,
    /// Bookkeeping of ignored Syncs, for the next one that is answered;
    /// boxed, as it is rare and every idle session keeps the room.
    carry: Option<Box<Inflight>>,
}

/// What a client frame asks of the relay.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Flow {
    Continue,
    Close,
}

#[derive(Default)]
pub(super) struct Pipeline {
    /// Requests sent and still owed a ReadyForQuery, oldest first.
    inflight: VecDeque<Inflight>,
    /// Extended-protocol messages were sent since the last Sync.
    pub unsynced: bool,
    copy: CopyTracker,
    /// Client frames waiting to be written to the backend in one go.
    pub to_backend: BytesMut,
}

impl Pipeline {
    /// Nothing is asked of the backend and no extended-protocol batch is
    /// half sent: the only moment pgcache may answer from the cache or use
    /// the connection for itself.
    pub fn is_quiet(&self) -> bool {
        self.inflight.is_empty() && self.to_backend.is_empty() && !self.unsynced
    }

    /// The backend owes an answer (or has requests still to receive): the
    /// session is not waiting on its client.
    pub fn awaits_backend(&self) -> bool {
        !self.inflight.is_empty() || !self.to_backend.is_empty()
    }

    pub fn front(&self) -> Option<&Inflight> {
        self.inflight.front()
    }

    pub fn front_mut(&mut self) -> Option<&mut Inflight> {
        self.inflight.front_mut()
    }

    pub fn pop(&mut self) -> Option<Inflight> {
        let done = self.inflight.pop_front();
        if self.inflight.is_empty() {
            // Nothing owed: no CopyInResponse is to come for an early end
            // (PostgreSQL ignored a CopyDone whose COPY failed).
            self.copy.ended_early = 0;
        }
        done
    }

    pub fn len(&self) -> usize {
        self.inflight.len()
    }

    /// Gives back the memory of an empty queue and staging buffer.
    pub fn release(&mut self) {
        if self.inflight.is_empty() && self.inflight.capacity() > 0 {
            self.inflight = VecDeque::new();
        }
        if self.to_backend.is_empty() && self.to_backend.capacity() > 0 {
            self.to_backend = BytesMut::new();
        }
    }

    /// Queues a request of pgcache's own (after the client's).
    pub fn push_hidden(&mut self, request: Inflight) {
        self.inflight.push_back(request);
    }

    /// Queues a request of pgcache's own ahead of every queued one: its
    /// frames go out first (a pooled connection's settings).
    pub fn push_front(&mut self, request: Inflight) {
        self.inflight.push_front(request);
    }

    /// Forgets every request not sent yet (none has reached the backend):
    /// the ones the client is owed an answer for, with the statements
    /// they defined.
    pub fn drop_unsent(&mut self) -> Vec<Inflight> {
        self.to_backend.clear();
        self.unsynced = false;
        self.inflight.drain(..).filter(|r| r.to_client).collect()
    }

    /// Bookkeeping for a client frame forwarded as is: requests that will
    /// be answered with ReadyForQuery, and the extended-protocol sync state.
    pub fn note_client_frame(&mut self, tag: u8) -> Flow {
        match tag {
            fe::QUERY | fe::FUNCTION_CALL => {
                self.executed();
                self.push(Inflight::default());
            }
            fe::SYNC => self.push_sync(Inflight::default()),
            fe::EXECUTE => {
                self.executed();
                self.unsynced = true;
            }
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::CLOSE | fe::FLUSH => self.unsynced = true,
            fe::COPY_DONE | fe::COPY_FAIL => self.copy_ended(),
            fe::TERMINATE => return Flow::Close,
            _ => {}
        }
        Flow::Continue
    }

    /// An Execute or Query went out: a COPY it starts is not ended yet.
    pub fn executed(&mut self) {
        self.copy.ended_since_execute = false;
    }

    /// CopyDone or CopyFail went out.
    pub fn copy_ended(&mut self) {
        self.copy.ended_since_execute = true;
        if self.copy.active {
            self.copy.active = false;
        } else {
            self.copy.ended_early += 1;
        }
    }

    /// Queues the request a Sync ends, marking whether PostgreSQL may
    /// ignore that Sync.
    pub fn push_sync(&mut self, mut request: Inflight) {
        request.may_be_ignored = !self.copy.ended_since_execute;
        self.push(request);
        self.unsynced = false;
    }

    /// Queues a request that expects a ReadyForQuery, unless PostgreSQL
    /// will ignore it (a Sync in copy-in mode): then its bookkeeping waits
    /// for the next request that is answered.
    pub fn push(&mut self, mut request: Inflight) {
        if self.copy.active && request.may_be_ignored {
            match &mut self.copy.carry {
                Some(carry) => carry.absorb(request),
                None => self.copy.carry = Some(Box::new(request)),
            }
            return;
        }
        if let Some(ignored) = self.copy.carry.take() {
            request.absorb(*ignored);
        }
        self.inflight.push_back(request);
    }

    /// CopyInResponse: the backend entered copy-in mode. Syncs the client
    /// sent since the COPY's Execute (and before CopyDone/CopyFail) will
    /// never be answered: take them out of the queue.
    pub fn copy_in_started(&mut self) {
        self.copy.active = self.copy.ended_early == 0;
        self.copy.ended_early = self.copy.ended_early.saturating_sub(1);
        while self
            .inflight
            .front()
            .is_some_and(|f| f.may_be_ignored && f.to_client)
        {
            let ignored = self.inflight.pop_front().expect("checked above");
            match &mut self.copy.carry {
                Some(carry) => carry.absorb(ignored),
                None => self.copy.carry = Some(Box::new(ignored)),
            }
        }
        if let Some(carry) = self.copy.carry.take() {
            // The Sync after CopyDone may already be queued: it inherits.
            match self.inflight.front_mut() {
                Some(next) => next.absorb(*carry),
                None => self.copy.carry = Some(carry),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_effects() -> Inflight {
        Inflight {
            effects: Bumps::opaque(),
            ..Inflight::default()
        }
    }

    #[test]
    fn every_query_and_sync_expects_one_ready_for_query() {
        let mut p = Pipeline::default();
        assert!(p.is_quiet());
        p.note_client_frame(fe::PARSE);
        assert!(!p.is_quiet(), "a half-sent batch is not quiet");
        assert!(!p.awaits_backend());
        p.note_client_frame(fe::SYNC);
        p.note_client_frame(fe::QUERY);
        assert_eq!(p.len(), 2);
        assert!(p.awaits_backend());
        p.pop();
        p.pop();
        assert!(p.is_quiet());
        assert_eq!(p.note_client_frame(fe::TERMINATE), Flow::Close);
    }

    #[test]
    fn a_sync_ignored_in_copy_in_mode_hands_its_books_to_the_next_answered_one() {
        // tokio-postgres: Bind, Execute, Sync, then the data, CopyDone, Sync.
        let mut p = Pipeline::default();
        p.note_client_frame(fe::BIND);
        p.note_client_frame(fe::EXECUTE);
        p.push_sync(with_effects());
        assert_eq!(p.len(), 1);
        p.copy_in_started();
        assert_eq!(p.len(), 0, "the first Sync will not be answered");
        p.note_client_frame(fe::COPY_DATA);
        p.note_client_frame(fe::COPY_DONE);
        p.push_sync(Inflight::default());
        assert_eq!(p.len(), 1);
        let answered = p.pop().unwrap();
        assert!(
            answered.effects.epoch,
            "the ignored Sync's effects moved on"
        );
        assert!(p.is_quiet());
    }

    #[test]
    fn a_sync_sent_after_copy_done_is_answered_even_if_queued_before_copy_in() {
        // psql-style: the whole exchange written before any answer arrives.
        let mut p = Pipeline::default();
        p.note_client_frame(fe::EXECUTE);
        p.push_sync(with_effects());
        p.note_client_frame(fe::COPY_DONE);
        p.push_sync(Inflight::default());
        assert_eq!(p.len(), 2);
        p.copy_in_started();
        assert_eq!(p.len(), 1);
        assert!(p.pop().unwrap().effects.epoch);
    }

    #[test]
    fn a_copy_ended_before_it_began_leaves_later_syncs_answered() {
        // Query(COPY), CopyDone, then a batch, all written at once: the
        // batch's Execute must not make the COPY look unended.
        let mut p = Pipeline::default();
        p.note_client_frame(fe::QUERY);
        p.note_client_frame(fe::COPY_DONE);
        p.note_client_frame(fe::EXECUTE);
        p.push_sync(Inflight::default());
        p.copy_in_started();
        assert_eq!(p.len(), 2);
        p.pop();
        p.note_client_frame(fe::EXECUTE);
        p.push_sync(with_effects());
        assert_eq!(p.len(), 2, "the later Sync is answered: not carried");
    }

    #[test]
    fn a_simple_query_copy_is_answered_once() {
        let mut p = Pipeline::default();
        p.note_client_frame(fe::QUERY);
        p.copy_in_started();
        assert_eq!(p.len(), 1, "a Query is never ignored");
        p.note_client_frame(fe::COPY_DATA);
        p.note_client_frame(fe::COPY_DONE);
        assert_eq!(p.len(), 1);
        p.pop();
        assert!(p.is_quiet());
    }
}
