//! Prepared statements in transaction mode. A client's named statement
//! may run on any server connection of its pool, so pgcache names each
//! statement after its text and parameter types (`__pgcache_<hash>`),
//! prepares it on a connection the first time a client there needs it,
//! and keeps it prepared for every client of the pool, as PgBouncer 1.21+
//! does. A client's Close is answered by pgcache; a connection closes its
//! least recently used statement past `pool.max_prepared_statements`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};

use crate::protocol::codec::HEADER_LEN;
use crate::protocol::{backend as be, extended, frontend as fe, messages};

/// Statements prepared on one server connection, by content hash, with
/// when each was last used.
#[derive(Default)]
pub struct ServerStatements {
    /// Looked up at every Bind: a fast hash.
    used: HashMap<u128, u64, foldhash::fast::RandomState>,
    tick: u64,
    /// Which Parse made its unnamed statement, if pgcache knows it.
    unnamed: Option<u128>,
}

impl ServerStatements {
    pub fn len(&self) -> usize {
        self.used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
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
static UNNAMED: AtomicU64 = AtomicU64::new(1);

/// A client's statement and the Parse that prepares it under pgcache's
/// name (or unnamed).
struct Prepared {
    /// Its content hash; for an unnamed one, the number of its Parse.
    hash: u128,
    parse: Bytes,
}

impl Prepared {
    /// The Parse of a named statement under pgcache's name.
    fn named(query: &[u8], param_types: &[u8]) -> Arc<Self> {
        let hash = content_hash(query, param_types);
        let mut parse = BytesMut::new();
        let name = server_name(hash);
        frame_of(
            &mut parse,
            fe::PARSE,
            &[name.as_bytes(), &[0], query, &[0], param_types],
        );
        Arc::new(Self {
            hash,
            parse: parse.freeze(),
        })
    }
}

/// A named statement's identity on every server connection: its text and
/// parameter types.
fn content_hash(query: &[u8], param_types: &[u8]) -> u128 {
    let mut content = crate::cache::key::KeyBuilder::new(0, 0, 0);
    content.bytes(query).bytes(param_types);
    content.finish().0
}

/// What the server answers a message with, as far as the translation
/// needs to know where each answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Ends with ParseComplete, BindComplete or CloseComplete.
    One(u8),
    /// Describe of a statement: ParameterDescription, then RowDescription
    /// or NoData.
    DescribeStatement,
    /// Describe of a portal: RowDescription or NoData.
    DescribePortal,
    /// Rows, then CommandComplete, EmptyQueryResponse or PortalSuspended.
    Execute,
    /// A Sync, simple Query or FunctionCall: ends with ReadyForQuery.
    Ready,
}

#[derive(Debug)]
enum Origin {
    /// The client's message: its answer goes to the client.
    Client,
    /// pgcache's own (a Parse or Close it added): its answer is dropped,
    /// unless it is an error, which the client gets in place of the
    /// answer to the message the injection was for.
    Injected,
    /// No message was sent: pgcache answers in the server's place.
    Synthetic(Bytes),
}

#[derive(Debug)]
struct Expect {
    kind: Kind,
    origin: Origin,
    /// A Sync sent after an Execute with no CopyDone/CopyFail between:
    /// PostgreSQL ignores it if that Execute starts COPY FROM STDIN.
    may_be_ignored: bool,
    /// A Parse sent under pgcache's name: the statement it prepares on
    /// the server, and the client's name for it (forgotten if it fails).
    prepares: Option<(u128, Option<Bytes>)>,
}

/// What to do with one server frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Pass,
    Drop,
}

/// One transaction-mode client's statements, and the translation of its
/// messages for the server connection it holds.
#[derive(Default)]
pub struct Translator {
    statements: HashMap<Bytes, Arc<Prepared>>,
    unnamed: Option<Arc<Prepared>>,
    /// The answers still owed for what went to the server, in order.
    expect: VecDeque<Expect>,
    /// pgcache failed a message itself: the rest of the batch, up to
    /// Sync, is not sent (the server would skip it after an error).
    skipping: bool,
    /// An Execute went out with no CopyDone/CopyFail after it.
    copy_may_start: bool,
}

impl Translator {
    /// A translator for one request of pgcache's own on the client's
    /// behalf: the client's statements, nothing owed.
    pub fn for_request(&self) -> Translator {
        Translator {
            statements: self.statements.clone(),
            unnamed: self.unnamed.clone(),
            ..Translator::default()
        }
    }

    /// Nothing is owed: the connection may change.
    pub fn is_idle(&self) -> bool {
        self.expect.is_empty()
    }

    /// The client's messages in `frames`, for the server whose statements
    /// are `server`, appended to `out`. Returns the answers pgcache gives
    /// at once (nothing was owed before them).
    pub fn translate(
        &mut self,
        frames: &[u8],
        server: &mut ServerStatements,
        max_prepared: usize,
        out: &mut BytesMut,
    ) -> BytesMut {
        for frame in crate::protocol::codec::frames(frames) {
            self.message(frame, server, max_prepared, out);
        }
        self.leading_synthetic()
    }

    fn message(
        &mut self,
        frame: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) {
        let tag = frame[0];
        let body = &frame[HEADER_LEN..];
        if self.skipping {
            if tag == fe::SYNC {
                self.skipping = false;
                self.send(out, frame, Kind::Ready, None);
            }
            return;
        }
        match tag {
            fe::PARSE => self.parse(frame, server, max, out),
            fe::BIND => match extended::bind_names(body) {
                Some((_, statement)) => {
                    self.with_statement(statement, server, max, out, |name, out| {
                        let (portal, _) = extended::bind_names(body).expect("read above");
                        let rest = &body[portal.len() + 1 + statement.len() + 1..];
                        frame_of(out, fe::BIND, &[portal, &[0], name, &[0], rest]);
                    });
                    self.owe(Kind::One(be::BIND_COMPLETE));
                }
                None => self.send(out, frame, Kind::One(be::BIND_COMPLETE), None),
            },
            fe::DESCRIBE => match extended::target(body) {
                Some((fe::TARGET_STATEMENT, name)) => {
                    self.with_statement(name, server, max, out, |server_name, out| {
                        frame_of(
                            out,
                            fe::DESCRIBE,
                            &[&[fe::TARGET_STATEMENT], server_name, &[0]],
                        );
                    });
                    self.owe(Kind::DescribeStatement);
                }
                _ => self.send(out, frame, Kind::DescribePortal, None),
            },
            fe::CLOSE => match extended::target(body) {
                Some((fe::TARGET_STATEMENT, name)) if !name.is_empty() => {
                    // The server keeps it for the pool's other clients.
                    self.statements.remove(name);
                    self.answer(&[be::CLOSE_COMPLETE, 0, 0, 0, 4]);
                }
                Some((fe::TARGET_STATEMENT, _)) => {
                    self.unnamed = None;
                    server.unnamed = None;
                    self.send(out, frame, Kind::One(be::CLOSE_COMPLETE), None);
                }
                _ => self.send(out, frame, Kind::One(be::CLOSE_COMPLETE), None),
            },
            fe::EXECUTE => {
                self.copy_may_start = true;
                self.send(out, frame, Kind::Execute, None);
            }
            fe::SYNC => {
                self.send(out, frame, Kind::Ready, None);
                if let Some(sync) = self.expect.back_mut() {
                    sync.may_be_ignored = self.copy_may_start;
                }
            }
            fe::FUNCTION_CALL => self.send(out, frame, Kind::Ready, None),
            fe::COPY_DONE | fe::COPY_FAIL => {
                self.copy_may_start = false;
                out.extend_from_slice(frame);
            }
            fe::QUERY => {
                self.copy_may_start = false;
                // A simple Query replaces the unnamed statement; one that
                // deallocates statements takes the server's with it.
                server.unnamed = None;
                if deallocates(body) {
                    self.statements.clear();
                    self.unnamed = None;
                    server.clear();
                }
                self.send(out, frame, Kind::Ready, None);
            }
            // Flush and COPY data: no answer of their own.
            _ => out.extend_from_slice(frame),
        }
    }

    fn parse(
        &mut self,
        frame: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) {
        let body = &frame[HEADER_LEN..];
        let Some(p) = extended::parse(body) else {
            return self.send(out, frame, Kind::One(be::PARSE_COMPLETE), None);
        };
        if p.name.is_empty() {
            // Unnamed statements are not shared: a token tells this Parse
            // apart, with no hash of its text on every query.
            let token = u128::from(UNNAMED.fetch_add(1, Ordering::Relaxed));
            self.unnamed = Some(Arc::new(Prepared {
                hash: token,
                parse: Bytes::copy_from_slice(frame),
            }));
            server.unnamed = Some(token);
            return self.send(out, frame, Kind::One(be::PARSE_COMPLETE), None);
        }
        let name = Bytes::copy_from_slice(p.name);
        if self.statements.contains_key(&name) {
            let mut error = BytesMut::new();
            let message = format!(
                "prepared statement \"{}\" already exists",
                String::from_utf8_lossy(p.name)
            );
            messages::error_response(&mut error, "ERROR", "42P05", &message);
            self.answer(&error);
            self.skipping = true;
            return;
        }
        let prepared = Prepared::named(p.query, p.param_types);
        let hash = prepared.hash;
        self.statements.insert(name.clone(), Arc::clone(&prepared));
        if server.touch(hash) {
            self.answer(&[be::PARSE_COMPLETE, 0, 0, 0, 4]);
            return;
        }
        self.close_over(server, max, out);
        server.insert(hash);
        let parse = prepared.parse.clone();
        self.send(
            out,
            &parse,
            Kind::One(be::PARSE_COMPLETE),
            Some((hash, Some(name))),
        );
    }

    /// Statement `name` as the client defined it elsewhere (on the
    /// connection it holds in session mode), prepared where a message
    /// names it.
    pub fn define(&mut self, name: &[u8], query: &[u8], param_types: &[u8]) {
        if name.is_empty() {
            let mut parse = BytesMut::new();
            frame_of(&mut parse, fe::PARSE, &[&[0], query, &[0], param_types]);
            self.unnamed = Some(Arc::new(Prepared {
                hash: u128::from(UNNAMED.fetch_add(1, Ordering::Relaxed)),
                parse: parse.freeze(),
            }));
            return;
        }
        self.statements.insert(
            Bytes::copy_from_slice(name),
            Prepared::named(query, param_types),
        );
    }

    /// Writes a message naming a statement, with pgcache's name for it,
    /// first preparing it on the server if it is not there.
    fn with_statement(
        &mut self,
        name: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
        write: impl FnOnce(&[u8], &mut BytesMut),
    ) {
        if name.is_empty() {
            if let Some(unnamed) = self.unnamed.clone()
                && server.unnamed != Some(unnamed.hash)
            {
                server.unnamed = Some(unnamed.hash);
                self.inject(out, &unnamed.parse, None);
            }
            return write(b"", out);
        }
        let Some(prepared) = self.statements.get(name).cloned() else {
            // Unknown to the client: the server says so, in its words.
            return write(name, out);
        };
        if !server.touch(prepared.hash) {
            self.close_over(server, max, out);
            server.insert(prepared.hash);
            self.inject(out, &prepared.parse, Some(prepared.hash));
        }
        write(server_name(prepared.hash).as_bytes(), out);
    }

    /// Closes the server's least recently used statement past `max`.
    fn close_over(&mut self, server: &mut ServerStatements, max: usize, out: &mut BytesMut) {
        while let Some(victim) = server.over(max.saturating_sub(1)) {
            server.remove(victim);
            let name = server_name(victim);
            let mut close = BytesMut::new();
            frame_of(
                &mut close,
                fe::CLOSE,
                &[&[fe::TARGET_STATEMENT], name.as_bytes(), &[0]],
            );
            out.extend_from_slice(&close);
            self.expect.push_back(Expect {
                kind: Kind::One(be::CLOSE_COMPLETE),
                origin: Origin::Injected,
                may_be_ignored: false,
                prepares: None,
            });
        }
    }

    fn inject(&mut self, out: &mut BytesMut, parse: &[u8], hash: Option<u128>) {
        out.extend_from_slice(parse);
        self.expect.push_back(Expect {
            kind: Kind::One(be::PARSE_COMPLETE),
            origin: Origin::Injected,
            may_be_ignored: false,
            prepares: hash.map(|h| (h, None)),
        });
    }

    fn send(
        &mut self,
        out: &mut BytesMut,
        frame: &[u8],
        kind: Kind,
        prepares: Option<(u128, Option<Bytes>)>,
    ) {
        out.extend_from_slice(frame);
        self.expect.push_back(Expect {
            kind,
            origin: Origin::Client,
            may_be_ignored: false,
            prepares,
        });
    }

    /// The client's message just written: its answer is owed.
    fn owe(&mut self, kind: Kind) {
        self.expect.push_back(Expect {
            kind,
            origin: Origin::Client,
            may_be_ignored: false,
            prepares: None,
        });
    }

    /// pgcache answers in the server's place, in turn.
    fn answer(&mut self, frames: &[u8]) {
        self.expect.push_back(Expect {
            kind: Kind::One(0),
            origin: Origin::Synthetic(Bytes::copy_from_slice(frames)),
            may_be_ignored: false,
            prepares: None,
        });
    }

    /// The answers pgcache gives that nothing sent before them holds up.
    fn leading_synthetic(&mut self) -> BytesMut {
        let mut out = BytesMut::new();
        while let Some(Expect {
            origin: Origin::Synthetic(frames),
            ..
        }) = self.expect.front()
        {
            out.extend_from_slice(frames);
            self.expect.pop_front();
        }
        out
    }

    /// One frame from the server: whether the client gets it, and the
    /// answers pgcache gives right after it.
    pub fn on_frame(&mut self, tag: u8, server: &mut ServerStatements) -> (Reply, BytesMut) {
        if matches!(
            tag,
            be::NOTICE_RESPONSE | be::NOTIFICATION | be::PARAMETER_STATUS
        ) {
            return (Reply::Pass, BytesMut::new());
        }
        if tag == be::COPY_IN_RESPONSE {
            // The front is what started COPY FROM STDIN: the Syncs sent
            // after it, before CopyDone, will not be answered.
            while self.expect.get(1).is_some_and(|e| e.may_be_ignored) {
                self.expect.remove(1);
            }
            return (Reply::Pass, BytesMut::new());
        }
        let Some(front) = self.expect.front() else {
            return (Reply::Pass, BytesMut::new());
        };
        let error = tag == be::ERROR_RESPONSE;
        let ends = error
            || match front.kind {
                Kind::One(t) => tag == t,
                Kind::DescribeStatement | Kind::DescribePortal => {
                    tag == be::ROW_DESCRIPTION || tag == be::NO_DATA
                }
                Kind::Execute => matches!(
                    tag,
                    be::COMMAND_COMPLETE | be::EMPTY_QUERY_RESPONSE | be::PORTAL_SUSPENDED
                ),
                Kind::Ready => tag == be::READY_FOR_QUERY,
            };
        let reply = match front.origin {
            Origin::Injected if !error => Reply::Drop,
            _ => Reply::Pass,
        };
        if !ends {
            return (reply, BytesMut::new());
        }
        let done = self.expect.pop_front().expect("front above");
        if error && done.kind != Kind::Ready {
            self.failed(&done, server);
            // The server skips the rest of the batch, up to its Sync.
            while let Some(next) = self.expect.front() {
                if next.kind == Kind::Ready && matches!(next.origin, Origin::Client) {
                    break;
                }
                let skipped = self.expect.pop_front().expect("front above");
                self.failed(&skipped, server);
            }
            return (reply, BytesMut::new());
        }
        if error {
            self.failed(&done, server);
        }
        (reply, self.leading_synthetic())
    }

    /// A Parse that failed (or was skipped) prepared nothing.
    fn failed(&mut self, expect: &Expect, server: &mut ServerStatements) {
        if let Some((hash, name)) = &expect.prepares {
            server.remove(*hash);
            if let Some(name) = name {
                self.statements.remove(name);
            }
        }
    }

    /// The connection is gone or changed with answers still owed (it was
    /// lost): nothing more will come.
    pub fn clear_owed(&mut self) {
        self.expect.clear();
        self.skipping = false;
    }
}

/// Whether a simple Query's text deallocates prepared statements
/// (`DEALLOCATE`, `DISCARD ALL`/`PLANS`... are scanned for cheaply; a false
/// positive only costs a re-prepare).
fn deallocates(sql: &[u8]) -> bool {
    // Every simple Query passes here: memchr jumps from one 'd' to the
    // next (pgbench `-S`, pooled: 200 instructions a Query, where a walk
    // byte by byte took 500 of the transaction's 12k).
    let at = |i: usize, word: &[u8]| {
        sql.get(i..i + word.len())
            .is_some_and(|w| w.eq_ignore_ascii_case(word))
    };
    memchr::memchr2_iter(b'd', b'D', sql).any(|i| at(i, b"deallocate") || at(i, b"discard"))
}

/// Writes one message of `parts`.
fn frame_of(out: &mut BytesMut, tag: u8, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.put_u8(tag);
    out.put_u32((len + 4) as u32);
    for part in parts {
        out.put_slice(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_are_the_hash_in_hex() {
        for hash in [
            0u128,
            1,
            0xdead_beef,
            u128::MAX,
            0x0123_4567_89ab_cdef << 64,
        ] {
            assert_eq!(
                server_name(hash).as_bytes(),
                format!("__pgcache_{hash:032x}").as_bytes()
            );
        }
    }

    #[test]
    fn texts_that_may_deallocate_are_spotted_in_any_case() {
        for sql in [
            "DEALLOCATE ALL",
            "deallocate q",
            "SELECT 1; Discard All",
            "discard plans",
        ] {
            assert!(deallocates(sql.as_bytes()), "{sql}");
        }
        for sql in ["SELECT 1", "SELECT 'd'", "UPDATE t SET d = 1", "discar", ""] {
            assert!(!deallocates(sql.as_bytes()), "{sql}");
        }
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let mut s = ServerStatements::default();
        s.insert(1);
        s.insert(2);
        s.insert(3);
        assert!(s.touch(1));
        assert!(!s.touch(9));
        assert_eq!(s.over(3), None);
        assert_eq!(s.over(2), Some(2));
        s.remove(2);
        assert_eq!(s.over(1), Some(3));
    }
}
