//! Raw protocol frames, for tests that must send exactly what a driver
//! sends (or what PostgreSQL answers) rather than what a client library
//! chooses to.

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = BytesMut::new();
    f.put_u8(tag);
    f.put_u32(body.len() as u32 + 4);
    f.put_slice(body);
    f.to_vec()
}

pub fn cstr(s: &str) -> Vec<u8> {
    [s.as_bytes(), &[0]].concat()
}

pub fn query(sql: &str) -> Vec<u8> {
    frame(b'Q', &cstr(sql))
}

pub fn parse(name: &str, sql: &str) -> Vec<u8> {
    frame(b'P', &[cstr(name), cstr(sql), vec![0, 0]].concat())
}

/// Bind of `statement` to the unnamed portal, no parameters, text results.
pub fn bind(statement: &str) -> Vec<u8> {
    frame(
        b'B',
        &[cstr(""), cstr(statement), vec![0, 0, 0, 0, 0, 0]].concat(),
    )
}

/// Bind of `statement` to the unnamed portal with one text parameter.
pub fn bind_text(statement: &str, value: &str) -> Vec<u8> {
    let mut body = [cstr(""), cstr(statement)].concat();
    body.extend_from_slice(&0u16.to_be_bytes());
    body.extend_from_slice(&1u16.to_be_bytes());
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value.as_bytes());
    body.extend_from_slice(&0u16.to_be_bytes());
    frame(b'B', &body)
}

/// Execute of the unnamed portal, all rows.
pub fn execute() -> Vec<u8> {
    execute_limited(0)
}

/// Execute of the unnamed portal, at most `rows` rows (0: all).
pub fn execute_limited(rows: u32) -> Vec<u8> {
    frame(b'E', &[cstr(""), rows.to_be_bytes().to_vec()].concat())
}

/// Describe of the unnamed portal.
pub fn describe_portal() -> Vec<u8> {
    frame(b'D', b"P\0")
}

/// Describe of a statement.
pub fn describe_statement(name: &str) -> Vec<u8> {
    frame(b'D', &[b"S".to_vec(), cstr(name)].concat())
}

pub fn sync() -> Vec<u8> {
    frame(b'S', &[])
}

pub fn ready(status: u8) -> Vec<u8> {
    frame(b'Z', &[status])
}

pub fn complete(tag: &str) -> Vec<u8> {
    frame(b'C', &cstr(tag))
}

pub fn error(code: &str, message: &str) -> Vec<u8> {
    let body = [
        b"SERROR\0".to_vec(),
        [b"C".to_vec(), cstr(code)].concat(),
        [b"M".to_vec(), cstr(message)].concat(),
        vec![0],
    ]
    .concat();
    frame(b'E', &body)
}

/// Opens a raw connection to `addr`, completes a trust login as
/// `postgres`, and returns the socket with the login's messages.
pub async fn raw_login(addr: std::net::SocketAddr, db: &str) -> (TcpStream, Vec<(u8, Vec<u8>)>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&pgcache::protocol::startup::encode_startup(&[
        ("user", "postgres"),
        ("database", db),
    ]))
    .await
    .unwrap();
    let login = read_until_ready(&mut s).await;
    (s, login)
}

/// Reads messages until ReadyForQuery; returns (tag, body) of each.
pub async fn read_until_ready(s: &mut TcpStream) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let Some(msg) = read_message(s).await else {
            return out;
        };
        let done = msg.0 == b'Z';
        out.push(msg);
        if done {
            return out;
        }
    }
}

/// The next message: its tag and body.
pub async fn read_message<R: AsyncRead + Unpin>(s: &mut R) -> Option<(u8, Vec<u8>)> {
    let mut header = [0u8; 5];
    s.read_exact(&mut header).await.ok()?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let mut body = vec![0u8; len - 4];
    s.read_exact(&mut body).await.ok()?;
    Some((header[0], body))
}

pub fn sqlstate_of(body: &[u8]) -> Option<String> {
    pgcache::protocol::messages::error_code(body).map(str::to_owned)
}

/// The tags of `messages`, as a string ("1tZ").
pub fn tags(messages: &[(u8, Vec<u8>)]) -> String {
    messages.iter().map(|(t, _)| *t as char).collect()
}
