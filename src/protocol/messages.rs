//! Messages pgcache writes itself, encoded with pgwire's message types.

use bytes::BytesMut;
use pgwire::error::ErrorInfo;
use pgwire::messages::Message;
use pgwire::messages::response::{ErrorResponse, NoticeResponse};

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
    use crate::protocol::codec::{HEADER_LEN, parse_frame};

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
    fn notice_uses_its_own_tag() {
        let mut buf = BytesMut::new();
        notice_response(&mut buf, "WARNING", "01000", "hm");
        assert_eq!(buf[0], b'N');
        assert_eq!(parse_frame(&buf, 1 << 20), Ok(Some(buf.len())));
        assert_eq!(error_code(&buf[HEADER_LEN..]), Some("01000"));
    }
}
