//! Client frames relayed untouched: with caching off (pass-through is a
//! policy whose answer is "forward"), and a login's exchange while it is
//! relayed. Each frame is still read for what it tells of the session (a
//! statement that taints its connection or pins it, a Terminate that
//! hands the connection back); the run is staged in one copy.

use super::life::Ending;
use super::{Ctx, Engine};
use crate::protocol::codec::FrameError;
use crate::protocol::frontend as fe;
use crate::session::SessionError;
use crate::session::pipeline::Flow;

/// What became of a run of client frames relayed untouched
/// ([`Engine::relay_client`]).
pub(in crate::session) struct RelayedRun {
    /// How many of the buffer's bytes were taken.
    pub taken: usize,
    pub flow: Flow,
    /// The bad frame that ended the run, if one did.
    pub violation: Option<FrameError>,
}

impl Engine {
    /// Client frames relayed untouched (caching off, or a login's exchange
    /// relayed): the complete frames at the start of `buf` (each checked
    /// against `max_frame`), each noted ([`Engine::on_relayed`]) until the
    /// session ends or a bad frame, staged as they are in one copy: a
    /// login's for the server as they are ([`Engine::take_to_server`]),
    /// any other with the requests for the backend.
    pub fn relay_client(
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
            let login = self.relaying_login();
            let Some(flow) = self.on_relayed(ctx, frame)? else {
                // A Terminate not forwarded: the session ends here.
                run.flow = Flow::Close;
                break;
            };
            run.taken += frame.len();
            match login {
                true => self.to_server.extend_from_slice(frame),
                false => self.pipeline.to_backend.extend_from_slice(frame),
            }
            run.flow = flow;
            if run.flow == Flow::Close {
                break;
            }
        }
        Ok(run)
    }

    /// A client frame relayed untouched (caching off, or a login's
    /// exchange relayed): what it tells of the session. `None` for a
    /// Terminate that is not forwarded (the connection is handed back, or
    /// held for a pool): the session ends. A login's frame the engine
    /// refuses ends the session with the error.
    pub(super) fn on_relayed(
        &mut self,
        ctx: &Ctx,
        frame: &[u8],
    ) -> Result<Option<Flow>, SessionError> {
        if self.relaying_login() {
            self.on_auth_client_frame(ctx, frame)?;
            return Ok(Some(Flow::Continue));
        }
        let tag = frame[0];
        let pooled = self.link.is_pooled();
        if (self.server.parks() || pooled) && (tag == fe::QUERY || tag == fe::PARSE) {
            let marks = self.known.frame_marks(frame);
            self.note_marks(ctx, marks, frame);
        } else if tag == fe::FUNCTION_CALL {
            self.link.settings_may_have_changed();
        } else if tag == fe::TERMINATE {
            self.end_with(Ending::ClientEnded);
            if self.hand_back(ctx) || pooled {
                return Ok(None);
            }
        }
        Ok(Some(self.pipeline.note_client_frame(tag)))
    }
}
