//! A forwarded read's response, copied as it is relayed: to store in the
//! cache, or (shadow mode) to compare with what the cache would have served.

use bytes::{Bytes, BytesMut};

use crate::cache::Fill;
use crate::cache::sampler::Check;
use crate::protocol::backend as be;

pub(super) struct Capture {
    sink: Sink,
    buf: BytesMut,
    ok: bool,
}

/// Every request in flight holds an `Option<Capture>`: the sink keeps it
/// small (a fill is boxed), so queuing and completing requests moves a few
/// words, not a fill's 160 bytes.
enum Sink {
    /// Stored when complete.
    Fill(Box<Fill>),
    /// Compared with the entry the cache would have served (shadow mode),
    /// frame by frame as it arrives, never copied: `at` bytes of `stored`
    /// were compared, and were the same if `same`.
    Compare {
        stored: Bytes,
        at: usize,
        same: bool,
    },
    /// A served hit the correctness sampler checks.
    Verify(Box<Check>),
}

/// A response frame the session needs nothing from but its bytes, and
/// that a capture stores as it is: the rows of an answer and what comes
/// before them. A run of them goes to a capture at once.
pub(super) fn plain(tag: u8) -> bool {
    matches!(
        tag,
        be::DATA_ROW | be::ROW_DESCRIPTION | be::BIND_COMPLETE | be::PARSE_COMPLETE | be::NO_DATA
    )
}

/// What a complete capture comes to.
pub(super) enum Captured {
    Store(Box<Fill>, BytesMut),
    /// A would-be hit, and whether the stored answer was PostgreSQL's.
    Compared {
        matched: bool,
    },
    /// PostgreSQL's answer to a sampled hit, to judge.
    Verified(Box<Check>, BytesMut),
}

impl Capture {
    pub fn new(fill: Fill) -> Self {
        Self::with(Sink::Fill(Box::new(fill)))
    }

    /// Shadow mode: the answer is checked against `stored`.
    pub fn compare(stored: Bytes) -> Self {
        Self::with(Sink::Compare {
            stored,
            at: 0,
            same: true,
        })
    }

    /// A served hit, checked against PostgreSQL's answer.
    pub fn verify(check: Check) -> Self {
        Self::with(Sink::Verify(Box::new(check)))
    }

    /// A check of the correctness sampler.
    pub fn is_check(&self) -> bool {
        matches!(self.sink, Sink::Verify(_))
    }

    /// The fill it stores, if it is one.
    pub fn fill(&self) -> Option<&Fill> {
        match &self.sink {
            Sink::Fill(fill) => Some(fill),
            _ => None,
        }
    }

    fn with(sink: Sink) -> Self {
        // Room for a small answer (or the one expected) at once: growing
        // frame by frame reallocates on nearly every read.
        let room = match &sink {
            Sink::Fill(_) => 512,
            Sink::Compare { .. } => 0,
            Sink::Verify(check) => check.served.len(),
        };
        Self {
            sink,
            buf: BytesMut::with_capacity(room),
            ok: true,
        }
    }

    /// Copies one response frame, or gives up on it: only RowDescription,
    /// DataRow, CommandComplete and the like are replayable; anything that
    /// reports, notifies or starts a COPY is not.
    pub fn add(&mut self, frame: &[u8], max: usize) {
        let storable = !matches!(
            frame[0],
            be::ERROR_RESPONSE
                | be::NOTICE_RESPONSE
                | be::PARAMETER_STATUS
                | be::COPY_IN_RESPONSE
                | be::COPY_OUT_RESPONSE
                | be::COPY_BOTH_RESPONSE
                | be::PORTAL_SUSPENDED
                | be::COPY_DATA
                | be::COPY_DONE
        );
        self.take(frame, storable, max);
    }

    /// Copies a run of whole frames that are all replayable (see
    /// [`plain`]) at once: the same as adding them one by one.
    pub fn add_plain(&mut self, frames: &[u8], max: usize) {
        self.take(frames, true, max);
    }

    fn take(&mut self, bytes: &[u8], storable: bool, max: usize) {
        if let Sink::Compare { stored, at, same } = &mut self.sink {
            self.ok &= storable;
            *same = *same && stored.get(*at..*at + bytes.len()) == Some(bytes);
            *at += bytes.len();
            return;
        }
        if self.ok && storable && self.buf.len() + bytes.len() <= max {
            self.buf.extend_from_slice(bytes);
        } else if self.ok {
            self.ok = false;
            self.buf = BytesMut::new();
        }
    }

    /// What the complete response comes to; `None` if it could not be
    /// copied whole (then nothing is stored, nor compared).
    pub fn finish(self) -> Option<Captured> {
        if !self.ok {
            return None;
        }
        Some(match self.sink {
            Sink::Fill(fill) => Captured::Store(fill, self.buf),
            Sink::Compare { stored, at, same } => Captured::Compared {
                matched: same && at == stored.len(),
            },
            Sink::Verify(check) => Captured::Verified(check, self.buf),
        })
    }
}
