//! The client's buffered bytes, as the engine takes them
//! ([`Engine::on_client_data`]): relayed untouched while caching is off or
//! a login's exchange is relayed; else a whole extended batch at once
//! when the engine can decide on it, and frame by frame otherwise. The
//! driver hands over its read buffer and does what the answer says; a
//! decision that waits keeps its frame here until it is met.

use bytes::{Buf, Bytes, BytesMut};

use super::{Ctx, Engine, Need, ReadyBatch};
use crate::protocol::codec::split_frame;
use crate::session::SessionError;
use crate::session::pipeline::Flow;

/// What the engine made of the client's buffered bytes.
pub(in crate::session) enum Taken {
    /// Every complete frame is taken, or the rest waits (a read on a
    /// replica holds the client's next frames until it is answered).
    Done(Flow),
    /// A frame was decided and left the driver work (actions, bytes for
    /// the client): carry it out ([`super::Upto::Decided`]), then hand
    /// the buffer over again.
    Settle,
    /// The frame being decided waits for this: meet it, then hand the
    /// buffer over again.
    Need(Need),
}

/// A decision that waits on a [`Need`], to take up again.
pub(super) enum Waiting {
    /// A whole batch, its bytes still at the start of the buffer.
    Batch(ReadyBatch),
    /// A frame taken out of the buffer.
    Frame(Bytes),
}

impl Engine {
    /// Takes the complete frames at the start of `buf` (the client's read
    /// buffer; a frame over `max_frame` bytes is an error), as far as the
    /// driver has to step in.
    pub fn on_client_data(
        &mut self,
        ctx: &Ctx,
        buf: &mut BytesMut,
        max_frame: usize,
    ) -> Result<Taken, SessionError> {
        if self.relaying_login() || !self.caching {
            let run = self.relay_client(ctx, buf, max_frame)?;
            buf.advance(run.taken);
            return match run.violation {
                Some(e) => Err(SessionError::ClientFrame(e)),
                None => Ok(Taken::Done(run.flow)),
            };
        }
        loop {
            let decided = match self.waiting.take() {
                Some(Waiting::Batch(ready)) => self.take_batch(ctx, buf, ready),
                Some(Waiting::Frame(frame)) => self.take_frame(ctx, frame),
                None if self.replica_busy() => return Ok(Taken::Done(Flow::Continue)),
                None => match self.whole_batch(ctx, buf, max_frame) {
                    Some(ready) => self.take_batch(ctx, buf, ready),
                    None => match split_frame(buf, max_frame)? {
                        Some(frame) => self.take_frame(ctx, frame.freeze()),
                        None => return Ok(Taken::Done(Flow::Continue)),
                    },
                },
            };
            match decided {
                Ok(Flow::Close) => return Ok(Taken::Done(Flow::Close)),
                Ok(Flow::Continue) if !self.actions.is_empty() || !self.out.is_empty() => {
                    return Ok(Taken::Settle);
                }
                Ok(Flow::Continue) => {}
                Err(need) => return Ok(Taken::Need(need)),
            }
        }
    }

    /// A whole batch, decided (its bytes then dropped from `buf`) or kept
    /// waiting.
    fn take_batch(
        &mut self,
        ctx: &Ctx,
        buf: &mut BytesMut,
        ready: ReadyBatch,
    ) -> Result<Flow, Need> {
        match self.on_whole_batch(ctx, &ready, &buf[..ready.len]) {
            Ok(()) => {
                buf.advance(ready.len);
                Ok(Flow::Continue)
            }
            Err(need) => {
                self.waiting = Some(Waiting::Batch(ready));
                Err(need)
            }
        }
    }

    /// One frame, decided or kept waiting.
    fn take_frame(&mut self, ctx: &Ctx, frame: Bytes) -> Result<Flow, Need> {
        let decided = self.on_client_frame(ctx, &frame);
        if decided.is_err() {
            self.waiting = Some(Waiting::Frame(frame));
        }
        decided
    }
}
