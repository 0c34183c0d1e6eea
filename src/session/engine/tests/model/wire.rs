//! The messages the model sends and reads, as bytes, and as they are
//! compared with PostgreSQL's ([`Seen`]).

use super::*;

pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = BytesMut::with_capacity(5 + body.len());
    f.put_u8(tag);
    f.put_i32(4 + body.len() as i32);
    f.put_slice(body);
    f.to_vec()
}

pub(crate) fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

pub(crate) fn text(body: &[u8]) -> String {
    let end = body.iter().position(|b| *b == 0).unwrap_or(body.len());
    String::from_utf8_lossy(&body[..end]).into_owned()
}

pub(crate) fn complete(tag: &str) -> Vec<u8> {
    frame(b'C', &cstr(tag))
}

pub(crate) fn notice(code: &str) -> Vec<u8> {
    notice_like(b'N', "WARNING", code)
}

pub(crate) fn notice_like(tag: u8, severity: &str, code: &str) -> Vec<u8> {
    saying(tag, severity, code, code)
}

/// [`notice_like`], saying `message`.
pub(crate) fn saying(tag: u8, severity: &str, code: &str, message: &str) -> Vec<u8> {
    let mut body = Vec::new();
    for (field, value) in [
        (b'S', severity),
        (b'V', severity),
        (b'C', code),
        (b'M', message),
    ] {
        body.push(field);
        body.extend(cstr(value));
    }
    body.push(0);
    frame(tag, &body)
}

pub(crate) fn description(sql: Sql) -> Vec<u8> {
    let columns: &[(&str, u32)] = match sql {
        Sql::ReadOne(_) => &[("v", 25)],
        Sql::Settings => &[("?column?", 25), ("current_setting", 25)],
        Sql::ShowName => &[("application_name", 25)],
        Sql::Sleep => &[("pg_sleep", 2278)],
        _ => &[("k", 23), ("v", 25)],
    };
    let mut body = BytesMut::new();
    body.put_i16(columns.len() as i16);
    for (name, oid) in columns {
        body.put_slice(&cstr(name));
        body.put_u32(0);
        body.put_i16(0);
        body.put_u32(*oid);
        body.put_i16(-1);
        body.put_i32(-1);
        body.put_i16(0);
    }
    frame(b'T', &body)
}

pub(crate) fn data_row(values: &[String]) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_i16(values.len() as i16);
    for v in values {
        body.put_i32(v.len() as i32);
        body.put_slice(v.as_bytes());
    }
    frame(b'D', &body)
}

/// A message as compared with PostgreSQL's: its type, and what must be
/// the same (a row's values, a command's tag, an error's SQLSTATE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub tag: char,
    pub what: String,
}

/// The messages of `bytes`, as [`Seen`].
pub fn seen(bytes: &[u8]) -> Vec<Seen> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let (frame, tail) = rest.split_at(1 + len);
        rest = tail;
        let body = &frame[5..];
        let what = match frame[0] {
            b'D' => {
                let mut values = Vec::new();
                let mut at = 2;
                while at + 4 <= body.len() {
                    let n = i32::from_be_bytes(body[at..at + 4].try_into().expect("length"));
                    at += 4;
                    let n = n.max(0) as usize;
                    values.push(String::from_utf8_lossy(&body[at..at + n]).into_owned());
                    at += n;
                }
                values.join(",")
            }
            b'C' => text(body),
            b'S' => {
                text(body)
                    + "="
                    + &text(&body[body.iter().position(|b| *b == 0).map_or(0, |at| at + 1)..])
            }
            b'E' | b'N' => field(body, b'C'),
            b'Z' => (body[0] as char).to_string(),
            _ => String::new(),
        };
        out.push(Seen {
            tag: frame[0] as char,
            what,
        });
    }
    out
}

/// A field of an ErrorResponse or NoticeResponse.
pub(crate) fn field(body: &[u8], wanted: u8) -> String {
    let mut rest = body;
    while let [code, tail @ ..] = rest {
        if *code == 0 {
            break;
        }
        let end = tail.iter().position(|b| *b == 0).unwrap_or(tail.len());
        if *code == wanted {
            return String::from_utf8_lossy(&tail[..end]).into_owned();
        }
        rest = &tail[(end + 1).min(tail.len())..];
    }
    String::new()
}
