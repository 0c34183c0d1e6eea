//! Every message pgcache writes itself: encoded with pgwire's message types,
//! or, for the handful on the relay's hot path, as fixed byte arrays.

use bytes::{BufMut, BytesMut};
use pgwire::error::ErrorInfo;
use pgwire::messages::Message;
use pgwire::messages::response::{ErrorResponse, NoticeResponse};

use super::codec::HEADER_LEN;
use super::{TxStatus, backend as be, frontend as fe};

/// Sync, as the session sends it after replaying a Parse.
pub const SYNC: [u8; 5] = [fe::SYNC, 0, 0, 0, 4];
/// Terminate, as the session sends it when closing a backend.
pub const TERMINATE: [u8; 5] = [fe::TERMINATE, 0, 0, 0, 4];

pub const PARSE_COMPLETE: [u8; 5] = [super::backend::PARSE_COMPLETE, 0, 0, 0, 4];

/// ReadyForQuery with `status`.
pub fn ready_for_query(status: TxStatus) -> [u8; 6] {
    [be::READY_FOR_QUERY, 0, 0, 0, 5, status.as_byte()]
}

/// A simple-protocol Query for `sql`.
pub fn query(sql: &str) -> BytesMut {
    let mut msg = BytesMut::with_capacity(sql.len() + HEADER_LEN + 1);
    msg.put_u8(fe::QUERY);
    msg.put_u32((sql.len() + 5) as u32);
    msg.put_slice(sql.as_bytes());
    msg.put_u8(0);
    msg
}

/// Statement and portal name of pgcache's own queries on a client's
/// connection.
const HIDDEN: &str = "__pgcache_hidden";

/// pgcache's own query on a client's connection, in the extended protocol
/// under a statement and portal name of its own: a simple Query would
/// destroy the client's unnamed statement, which a driver may still Bind
/// after its next Sync. Answers: CloseComplete, ParseComplete,
/// BindComplete, rows, CommandComplete, CloseComplete ×2, ReadyForQuery.
pub fn hidden_query(sql: &str) -> BytesMut {
    use pgwire::messages::extendedquery::{Bind, Close, Execute, Parse, Sync};
    let name = || Some(HIDDEN.to_owned());
    let mut out = BytesMut::with_capacity(sql.len() + 128);
    // A statement of that name left behind by an interrupted query would
    // make the Parse fail.
    encode(&mut out, Close::new(b'S', name()));
    encode(&mut out, Parse::new(name(), sql.to_owned(), Vec::new()));
    encode(
        &mut out,
        Bind::new(name(), name(), Vec::new(), Vec::new(), Vec::new()),
    );
    encode(&mut out, Execute::new(name(), 0));
    encode(&mut out, Close::new(b'P', name()));
    encode(&mut out, Close::new(b'S', name()));
    encode(&mut out, Sync::new());
    out
}

/// BackendKeyData with `pid` and a secret of any length (protocol 3.2
/// allows up to 256 bytes).
pub fn backend_key_data(pid: u32, secret: &[u8]) -> BytesMut {
    let mut msg = BytesMut::with_capacity(HEADER_LEN + 4 + secret.len());
    msg.put_u8(be::BACKEND_KEY_DATA);
    msg.put_u32((8 + secret.len()) as u32);
    msg.put_u32(pid);
    msg.put_slice(secret);
    msg
}

/// Whether an ErrorResponse body ends the connection (FATAL or PANIC).
pub fn is_fatal(error_body: &[u8]) -> bool {
    matches!(error_field(error_body, b'S'), Some("FATAL" | "PANIC"))
}

/// Appends any pgwire message to `out`.
pub fn encode(out: &mut BytesMut, message: impl Message) {
    message
        .encode(out)
        .expect("encoding a message into memory cannot fail");
}

/// Appends an ErrorResponse with `severity` (`ERROR` or `FATAL`), SQLSTATE
/// `code` and `message` to `out`.
pub fn error_response(out: &mut BytesMut, severity: &str, code: &str, message: &str) {
    let mut info = ErrorInfo::new(severity.to_owned(), code.to_owned(), message.to_owned());
    info.severity_nonlocalized = Some(severity.to_owned());
    ErrorResponse::from(info)
        .encode(out)
        .expect("encoding an ErrorResponse into memory cannot fail");
}

/// Appends a NoticeResponse (`WARNING`, `NOTICE`...) to `out`.
pub fn notice_response(out: &mut BytesMut, severity: &str, code: &str, message: &str) {
    let mut info = ErrorInfo::new(severity.to_owned(), code.to_owned(), message.to_owned());
    info.severity_nonlocalized = Some(severity.to_owned());
    NoticeResponse::from(info)
        .encode(out)
        .expect("encoding a NoticeResponse into memory cannot fail");
}

/// A FATAL ErrorResponse as a standalone buffer.
pub fn fatal(code: &str, message: &str) -> BytesMut {
    let mut out = BytesMut::new();
    error_response(&mut out, "FATAL", code, message);
    out
}

/// The SQLSTATE and message of an ErrorResponse frame (header included),
/// with `fallback` for what it lacks.
pub fn error_parts(frame: &[u8], fallback: (&str, &str)) -> (String, String) {
    let body = &frame[HEADER_LEN.min(frame.len())..];
    (
        error_code(body).unwrap_or(fallback.0).to_owned(),
        error_field(body, b'M').unwrap_or(fallback.1).to_owned(),
    )
}

/// Reads the SQLSTATE (`C` field) of an ErrorResponse or NoticeResponse body.
pub fn error_code(body: &[u8]) -> Option<&str> {
    error_field(body, b'C')
}

/// Reads one field of an ErrorResponse or NoticeResponse body.
pub fn error_field(body: &[u8], field: u8) -> Option<&str> {
    let mut pos = 0;
    while pos < body.len() && body[pos] != 0 {
        let kind = body[pos];
        pos += 1;
        let value = super::codec::read_cstr(body, &mut pos)?;
        if kind == field {
            return std::str::from_utf8(value).ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::codec::parse_frame;

    #[test]
    fn fatal_error_is_one_well_formed_frame_with_its_sqlstate() {
        let buf = fatal("08P01", "bad message");
        assert_eq!(buf[0], b'E');
        assert_eq!(parse_frame(&buf, 1 << 20), Ok(Some(buf.len())));
        let body = &buf[HEADER_LEN..];
        assert_eq!(error_code(body), Some("08P01"));
        assert_eq!(error_field(body, b'S'), Some("FATAL"));
        assert_eq!(error_field(body, b'M'), Some("bad message"));
        assert_eq!(error_field(body, b'H'), None);
    }

    #[test]
    fn built_frames_are_well_formed() {
        let q = query("SELECT 1");
        assert_eq!(parse_frame(&q, 1 << 20), Ok(Some(q.len())));
        assert_eq!(&q[HEADER_LEN..], b"SELECT 1\0");
        let k = backend_key_data(7, &[1, 2, 3, 4]);
        assert_eq!(&k[..], &[b'K', 0, 0, 0, 12, 0, 0, 0, 7, 1, 2, 3, 4]);
        assert_eq!(ready_for_query(TxStatus::Failed), *b"Z\0\0\0\x05E");
        assert!(is_fatal(&fatal("08006", "x")[HEADER_LEN..]));
        let mut err = BytesMut::new();
        error_response(&mut err, "ERROR", "42P01", "x");
        assert!(!is_fatal(&err[HEADER_LEN..]));
    }

    #[test]
    fn notice_uses_its_own_tag() {
        let mut buf = BytesMut::new();
        notice_response(&mut buf, "WARNING", "01000", "hm");
        assert_eq!(buf[0], b'N');
        assert_eq!(parse_frame(&buf, 1 << 20), Ok(Some(buf.len())));
        assert_eq!(error_code(&buf[HEADER_LEN..]), Some("01000"));
    }
}
