//! The client's buffered bytes, as the engine takes them
//! ([`Engine::on_client_data`]): a whole extended batch at once when the
//! engine can decide on it, and frame by frame otherwise. With caching
//! off (pass-through is the policy whose answer is "forward") and while a
//! login's exchange is relayed, no decision waits: the frames are taken in
//! place, without being split off the buffer one by one. The driver hands
//! over its read buffer and does what the answer says; a decision that
//! waits keeps its frame here until it is met.

use bytes::{Buf, Bytes, BytesMut};

use super::{Ctx, Engine, Need, ReadyBatch};
use crate::protocol::codec::FrameError;
use crate::protocol::codec::split_frame;
use crate::session::SessionError;
use crate::session::pipeline::Flow;

/// Whether the client's buffered bytes are the engine's to take
/// ([`super::Io::TakeClient`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Intake {
    /// Bytes came that the engine has not taken all of, or a decision
    /// waits: the client's requests are decided before the server's go
    /// out, so that one read's frames go out in one write.
    Fresh,
    /// Every complete frame is taken; what is left is part of one.
    Taken,
    /// The client ended its session, or sent a frame that ends it:
    /// nothing more is taken, and the session ends once what came before
    /// is written.
    Closed,
}

/// What the engine made of the client's buffered bytes.
enum Taken {
    /// Every complete frame is taken, or the rest waits (a read on a
    /// replica holds the client's next frames until it is answered).
    Done(Flow),
    /// A frame was decided and left the driver work.
    Settle,
    /// The frame being decided waits for this.
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
    /// Bytes came from the client: its buffer is to be taken.
    pub fn client_arrived(&mut self) {
        if self.intake != Intake::Closed {
            self.intake = Intake::Fresh;
        }
    }

    /// The client's session ends.
    pub fn flow(&self) -> Flow {
        match self.intake {
            Intake::Closed => Flow::Close,
            _ => Flow::Continue,
        }
    }

    /// Takes the complete frames at the start of `buf` (the client's read
    /// buffer; a frame over `max_frame` bytes is an error), as far as the
    /// driver has to step in: after a frame that left it work (actions,
    /// bytes for the client), or one that waits for what it needs met.
    /// The driver is asked again ([`super::Io::TakeClient`]) until every
    /// frame is taken.
    pub fn on_client_data(
        &mut self,
        ctx: &Ctx,
        buf: &mut BytesMut,
        max_frame: usize,
    ) -> Result<Option<Need>, SessionError> {
        let taken = self.take_client(ctx, buf, max_frame);
        self.intake = match &taken {
            // A read on a replica holds the rest until it is answered.
            Ok(Taken::Done(Flow::Continue)) if self.replica_busy() => self.intake,
            Ok(Taken::Done(Flow::Continue)) => Intake::Taken,
            Ok(Taken::Done(Flow::Close)) | Err(_) => Intake::Closed,
            Ok(Taken::Settle | Taken::Need(_)) => self.intake,
        };
        match taken? {
            Taken::Need(need) => Ok(Some(need)),
            Taken::Done(_) | Taken::Settle => Ok(None),
        }
    }

    fn take_client(
        &mut self,
        ctx: &Ctx,
        buf: &mut BytesMut,
        max_frame: usize,
    ) -> Result<Taken, SessionError> {
        if self.relaying_login() || !self.caching {
            let run = self.forward_run(ctx, buf, max_frame)?;
            buf.advance(run.taken);
            return match run.violation {
                Some(e) => Err(SessionError::ClientFrame(e)),
                None => Ok(Taken::Done(run.flow)),
            };
        }
        loop {
            let decided = match self.waiting.take().map(|waiting| *waiting) {
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
                self.waiting = Some(Box::new(Waiting::Batch(ready)));
                Err(need)
            }
        }
    }

    /// One frame, decided or kept waiting.
    fn take_frame(&mut self, ctx: &Ctx, frame: Bytes) -> Result<Flow, Need> {
        let decided = self.on_client_frame(ctx, &frame);
        if decided.is_err() {
            self.waiting = Some(Box::new(Waiting::Frame(frame)));
        }
        decided
    }
}

/// What became of a run of client frames forwarded as they are
/// ([`Engine::forward_run`]).
pub(in crate::session) struct RelayedRun {
    /// How many of the buffer's bytes were taken.
    pub taken: usize,
    pub flow: Flow,
    /// The bad frame that ended the run, if one did.
    pub violation: Option<FrameError>,
}

impl Engine {
    /// Client frames no decision waits on, taken in place: the complete
    /// frames at the start of `buf` (each checked against `max_frame`) up
    /// to a bad one or the session's end. While a login's exchange is
    /// relayed, each is read for what it tells
    /// ([`Engine::on_auth_client_frame`]) and staged for the server as it
    /// is ([`Engine::take_to_server`]); with caching off, each is decided
    /// as any forwarded frame is ([`Engine::on_forwarded`]), without being
    /// taken out of the buffer first. A login's frame the engine refuses
    /// ends the session with the error.
    pub(super) fn forward_run(
        &mut self,
        ctx: &Ctx,
        buf: &[u8],
        max_frame: usize,
    ) -> Result<RelayedRun, SessionError> {
        let mut run = RelayedRun {
            taken: 0,
            flow: Flow::Continue,
            violation: None,
        };
        for frame in crate::protocol::codec::checked_frames(buf, max_frame) {
            let frame = match frame {
                Ok(frame) => frame,
                Err(e) => {
                    run.violation = Some(e);
                    break;
                }
            };
            run.taken += frame.len();
            if self.relaying_login() {
                self.on_auth_client_frame(ctx, frame)?;
                self.to_server.extend_from_slice(frame);
                continue;
            }
            run.flow = self.on_forwarded(ctx, frame);
            if run.flow == Flow::Close {
                break;
            }
        }
        Ok(run)
    }
}
