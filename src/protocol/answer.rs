//! The answer to a simple query pgcache sends itself, read frame by frame
//! to its ReadyForQuery: its rows as text, PostgreSQL's error, and the
//! transaction status it left. [`Answer`] does no I/O: the session's
//! engine feeds it the frames of its own queries on a client's
//! connection, and [`read_answer`] is the one loop that reads one on a
//! connection no client is on.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};

use super::codec::HEADER_LEN;
use super::stream::{FramedStream, ReadError};
use super::{TxStatus, backend as be, extended};

/// Rows as text, `None` for NULL.
pub type Rows = Vec<Vec<Option<String>>>;

/// An answer being read.
#[derive(Debug, Default)]
pub struct Answer {
    rows: Rows,
    /// PostgreSQL's ErrorResponse, or `Some(None)`: a row could not be read.
    failed: Option<Option<BytesMut>>,
}

/// A whole answer.
#[derive(Debug)]
pub struct Answered {
    /// The rows, or PostgreSQL's ErrorResponse (`None` when a row could
    /// not be read).
    pub result: Result<Rows, Option<BytesMut>>,
    /// As its ReadyForQuery said.
    pub status: Option<TxStatus>,
}

impl Answered {
    /// It succeeded and left no transaction open.
    pub fn clean(&self) -> bool {
        self.result.is_ok() && self.status == Some(TxStatus::Idle)
    }
}

/// What a frame was to an answer.
#[derive(Debug)]
pub enum Read {
    /// Part of it: read on.
    More,
    /// Not part of it (a parameter change, a notification, a notice):
    /// the caller's to keep or drop, then read on.
    Aside(BytesMut),
    /// ReadyForQuery: the answer is whole.
    Done(Answered),
}

impl Answer {
    /// One frame of the answer.
    pub fn on_frame(&mut self, frame: BytesMut) -> Read {
        let body = &frame[HEADER_LEN..];
        match frame[0] {
            be::DATA_ROW => match extended::data_row(body) {
                Some(row) => self.rows.push(row),
                None => self.failed = Some(None),
            },
            be::ERROR_RESPONSE => self.failed = Some(Some(frame)),
            be::READY_FOR_QUERY => {
                let status = body.first().and_then(|b| TxStatus::from_byte(*b));
                let result = match self.failed.take() {
                    None => Ok(std::mem::take(&mut self.rows)),
                    Some(error) => Err(error),
                };
                return Read::Done(Answered { result, status });
            }
            be::PARAMETER_STATUS | be::NOTIFICATION | be::NOTICE_RESPONSE => {
                return Read::Aside(frame);
            }
            _ => {}
        }
        Read::More
    }
}

/// Sends `request` (a simple query) on `stream` and reads its answer;
/// what is not part of it goes to `aside`. `Ok(None)`: the server closed
/// the connection.
pub async fn read_answer<S>(
    stream: &mut FramedStream<S>,
    request: &[u8],
    mut aside: impl FnMut(BytesMut),
) -> Result<Option<Answered>, ReadError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(request).await?;
    let mut answer = Answer::default();
    while let Some(frame) = stream.read_frame().await? {
        match answer.on_frame(frame) {
            Read::More => {}
            Read::Aside(frame) => aside(frame),
            Read::Done(answered) => return Ok(Some(answered)),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::messages;

    fn frame(tag: u8, body: &[u8]) -> BytesMut {
        let mut f = BytesMut::from(&[tag][..]);
        f.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn row(value: &str) -> BytesMut {
        let mut body = 1i16.to_be_bytes().to_vec();
        body.extend_from_slice(&(value.len() as i32).to_be_bytes());
        body.extend_from_slice(value.as_bytes());
        frame(be::DATA_ROW, &body)
    }

    fn done(answer: &mut Answer, status: TxStatus) -> Answered {
        match answer.on_frame(BytesMut::from(&messages::ready_for_query(status)[..])) {
            Read::Done(answered) => answered,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rows_errors_and_what_is_aside_are_told_apart() {
        let mut answer = Answer::default();
        assert!(matches!(answer.on_frame(row("a")), Read::More));
        let status = frame(be::PARAMETER_STATUS, b"TimeZone\0UTC\0");
        assert!(matches!(answer.on_frame(status), Read::Aside(_)));
        let answered = done(&mut answer, TxStatus::Idle);
        assert!(answered.clean());
        assert_eq!(answered.result.unwrap(), vec![vec![Some("a".to_owned())]]);

        let mut error = BytesMut::new();
        messages::error_response(&mut error, "ERROR", "42704", "no such setting");
        assert!(matches!(answer.on_frame(error.clone()), Read::More));
        let answered = done(&mut answer, TxStatus::Idle);
        assert!(!answered.clean());
        assert_eq!(answered.result.unwrap_err(), Some(error));

        let answered = done(&mut answer, TxStatus::InTransaction);
        assert!(answered.result.is_ok(), "a new answer starts clean");
        assert!(!answered.clean(), "a transaction left open");

        assert!(matches!(
            answer.on_frame(frame(be::DATA_ROW, b"\0")),
            Read::More
        ));
        assert_eq!(done(&mut answer, TxStatus::Idle).result.unwrap_err(), None);
    }
}
