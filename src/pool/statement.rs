//! A prepared statement as pgcache names it on server connections, and the
//! statements each server connection holds (see [`super::prepared`] for
//! how a client's statements are translated).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use bytes::{Bytes, BytesMut};

use crate::protocol::codec::{HEADER_LEN, frame_of};
use crate::protocol::{backend as be, frontend as fe};

/// Statements prepared on one server connection, by content hash, with
/// when each was last used.
#[derive(Default)]
pub struct ServerStatements {
    /// Looked up at every Bind: a fast hash.
    used: HashMap<u128, u64, foldhash::fast::RandomState>,
    tick: u64,
    /// Which Parse made its unnamed statement, if pgcache knows it.
    pub(super) unnamed: Option<u128>,
}

impl ServerStatements {
    pub fn len(&self) -> usize {
        self.used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }

    /// Whether `hash` is prepared.
    pub fn contains(&self, hash: u128) -> bool {
        self.used.contains_key(&hash)
    }

    /// Whether `hash` is prepared; marks it used.
    pub fn touch(&mut self, hash: u128) -> bool {
        self.tick += 1;
        match self.used.get_mut(&hash) {
            Some(at) => {
                *at = self.tick;
                true
            }
            None => false,
        }
    }

    pub fn insert(&mut self, hash: u128) {
        self.tick += 1;
        self.used.insert(hash, self.tick);
    }

    pub fn remove(&mut self, hash: u128) {
        self.used.remove(&hash);
    }

    /// The least recently used statement, to close once past `max`.
    pub fn over(&self, max: usize) -> Option<u128> {
        if self.used.len() <= max {
            return None;
        }
        self.used.iter().min_by_key(|(_, at)| **at).map(|(h, _)| *h)
    }

    pub fn clear(&mut self) {
        self.used.clear();
        self.unnamed = None;
    }

    /// A simple Query ran: it replaced the unnamed statement.
    pub fn forget_unnamed(&mut self) {
        self.unnamed = None;
    }
}

/// pgcache's name for a statement on server connections,
/// `__pgcache_<hash in 32 hex digits>`: made for every Bind, so on the stack.
pub struct ServerName([u8; 42]);

impl ServerName {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

pub fn server_name(hash: u128) -> ServerName {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut name = [0u8; 42];
    name[..10].copy_from_slice(b"__pgcache_");
    for (i, digit) in name[10..].iter_mut().enumerate() {
        *digit = HEX[((hash >> (4 * (31 - i))) & 0xf) as usize];
    }
    ServerName(name)
}

/// Numbers unnamed Parses. Only an identity source: shared by instances
/// in one process, it still never hands out a number twice.
pub(super) static UNNAMED: AtomicU64 = AtomicU64::new(1);

/// The client's unnamed statement and the Parse that prepares it.
pub(super) struct Unnamed {
    /// The number of its Parse.
    pub(super) token: u128,
    pub(super) parse: Bytes,
    /// The client's statement its SQL text names (`EXECUTE s`).
    pub(super) named: Option<Named>,
}

/// A client's named statement: its text and parameter types, and the
/// server name it goes by.
#[derive(Clone)]
pub(super) struct Statement {
    pub(super) query: Bytes,
    pub(super) param_types: Bytes,
    /// Its text and parameter types, hashed once.
    pub(super) content: u128,
    /// The schema generation its server name belongs to.
    pub(super) generation: u64,
    /// Its server name's hash: `content` in `generation`.
    pub(super) hash: u128,
    /// Its SQL text names another statement of the client's (`EXECUTE
    /// s`): `query` has that one's server name in its place.
    pub(super) refers: Option<Arc<Refers>>,
}

/// A named statement's text that names another statement of the client's,
/// as the client wrote it.
pub(super) struct Refers {
    pub(super) query: Bytes,
    /// Where the name is in `query`, in bytes.
    pub(super) span: Range<usize>,
    /// The statement it names, as the client knows it.
    pub(super) name: Bytes,
    /// The text is a `DEALLOCATE`.
    pub(super) frees: bool,
}

impl Refers {
    /// The text with `name` in place of the client's name; as the client
    /// wrote it with none.
    pub(super) fn text(&self, name: Option<&[u8]>) -> Bytes {
        match name {
            Some(name) => Bytes::from(
                [
                    &self.query[..self.span.start],
                    name,
                    &self.query[self.span.end..],
                ]
                .concat(),
            ),
            None => self.query.clone(),
        }
    }
}

impl Statement {
    pub(super) fn new(query: &[u8], param_types: &[u8], generation: u64) -> Self {
        let mut content = crate::cache::key::KeyBuilder::new(0, 0, 0);
        content.bytes(query).bytes(param_types);
        let content = content.finish().0;
        Self {
            query: Bytes::copy_from_slice(query),
            param_types: Bytes::copy_from_slice(param_types),
            content,
            generation,
            hash: server_hash(content, generation),
            refers: None,
        }
    }

    /// Gives it the name it has in `generation`.
    pub(super) fn renew(&mut self, generation: u64) {
        self.generation = generation;
        self.hash = server_hash(self.content, generation);
    }

    /// The Parse that prepares it under its server name.
    pub(super) fn parse(&self) -> BytesMut {
        let mut parse = BytesMut::new();
        frame_of(
            &mut parse,
            fe::PARSE,
            &[
                server_name(self.hash).as_bytes(),
                &[0],
                &self.query,
                &[0],
                &self.param_types,
            ],
        );
        parse
    }
}

/// A statement's identity on every server connection: its content in one
/// schema generation.
fn server_hash(content: u128, generation: u64) -> u128 {
    let mut key = crate::cache::key::KeyBuilder::new(0, 0, 0);
    key.bytes(&content.to_le_bytes())
        .bytes(&generation.to_le_bytes());
    key.finish().0
}

/// A client's statement named in what is sent (SQL text, a Bind, a
/// Describe, a Parse refused), sent under its server name.
#[derive(Debug, Clone)]
pub(super) struct Named {
    /// Its server name's hash.
    pub(super) hash: u128,
    /// Its name as the client knows it.
    pub(super) name: Bytes,
    /// The SQL is a `DEALLOCATE`: both names are freed once it is done.
    pub(super) frees: bool,
}

impl Named {
    /// Whether a server's `frame` names the statement by its server name.
    pub(super) fn named_in(&self, frame: &[u8]) -> bool {
        memchr::memmem::find(frame, server_name(self.hash).as_bytes()).is_some()
    }

    /// The client's statement `name`, prepared on the server as `hash`.
    pub(super) fn of(hash: u128, name: &[u8]) -> Self {
        Self {
            hash,
            name: Bytes::copy_from_slice(name),
            frees: false,
        }
    }
}

/// An ErrorResponse about the statement `named` (`prepared statement
/// "__pgcache_..." already exists`), with the client's name for it.
pub(super) fn renamed(frame: &[u8], named: &Named) -> BytesMut {
    let server = server_name(named.hash);
    let from = server.as_bytes();
    let body = &frame[HEADER_LEN.min(frame.len())..];
    let mut renamed = Vec::with_capacity(body.len());
    let mut at = 0;
    while let Some(found) = memchr::memmem::find(&body[at..], from) {
        renamed.extend_from_slice(&body[at..at + found]);
        renamed.extend_from_slice(&named.name);
        at += found + from.len();
    }
    renamed.extend_from_slice(&body[at..]);
    let mut out = BytesMut::with_capacity(renamed.len() + HEADER_LEN);
    frame_of(&mut out, be::ERROR_RESPONSE, &[&renamed]);
    out
}
