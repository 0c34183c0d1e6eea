//! The answer to one of pgcache's own queries on the client's backend
//! connection ("hidden queries": the session's settings, catalog facts),
//! read frame by frame as the driver reads it.

use bytes::BytesMut;

use super::Engine;
use crate::cache::catalog::fetch::Rows;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{TxStatus, backend as be, extended, messages};
use crate::session::link::Link;

/// A hidden query's answer so far.
#[derive(Debug, Default)]
pub struct HiddenAnswer {
    rows: Rows,
    /// PostgreSQL's ErrorResponse, or `Some(None)`: a row could not be read.
    failed: Option<Option<BytesMut>>,
}

/// What to do after a frame of a hidden query's answer.
#[derive(Debug)]
pub enum HiddenStep {
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
    pub fn on_hidden_frame(&mut self, answer: &mut HiddenAnswer, frame: BytesMut) -> HiddenStep {
        let body = &frame[HEADER_LEN..];
        match frame[0] {
            be::DATA_ROW => match extended::data_row(body) {
                Some(row) => answer.rows.push(row),
                None => answer.failed = Some(None),
            },
            be::ERROR_RESPONSE => {
                self.backend_fatal |= messages::is_fatal(body);
                answer.failed = Some(Some(frame));
            }
            be::READY_FOR_QUERY => {
                if let Some(status) = body.first().and_then(|b| TxStatus::from_byte(*b)) {
                    self.tx.status = status;
                }
                return HiddenStep::Done(match answer.failed.take() {
                    None => Ok(std::mem::take(&mut answer.rows)),
                    Some(error) => Err(error),
                });
            }
            be::PARAMETER_STATUS | be::NOTIFICATION => {
                if frame[0] == be::PARAMETER_STATUS {
                    self.note_status(&frame);
                }
                if let Link::Pooled(link) = &mut self.link
                    && frame[0] == be::NOTIFICATION
                    && !link.listens.admits(&frame)
                {
                    return HiddenStep::More;
                }
                // Before the client's first ReadyForQuery, pgcache is still
                // greeting it (transaction mode, a pool connection set up
                // for it): a ParameterStatus now would come before its
                // AuthenticationOk, and the greeting reports the
                // parameters itself.
                if self.ready {
                    return HiddenStep::ToClient(frame);
                }
            }
            _ => {}
        }
        HiddenStep::More
    }
}
