//! Prepared statements in transaction mode. A client's named statement
//! may run on any server connection of its pool, so pgcache names each
//! statement after its text and parameter types (`__pgcache_<hash>`),
//! prepares it on a connection the first time a client there needs it,
//! and keeps it prepared for every client of the pool, as PgBouncer 1.21+
//! does. A client's Close is answered by pgcache; a connection closes its
//! least recently used statement past `pool.max_prepared_statements`.
//!
//! DDL can make a statement on the server stale: PostgreSQL then refuses
//! its Bind (`0A000 cached plan must not change result type`, or `XX000
//! cache lookup failed for type`), on every connection that has it and for
//! every client that uses it. So a server name also carries the database's
//! schema generation (`Versions::schema` in [`crate::cache`]), which DDL that
//! pgcache sees (through it, in the replication stream, from another
//! instance) moves: statements prepared afterwards get new names. A
//! client's statement keeps the name it was given on a connection that
//! still holds it, so a client that prepared before the DDL sees the error
//! as it would directly; where it must be prepared again, it takes the
//! current generation. A Bind refused this way moves the client's
//! statement to the current generation, and moves the generation itself if
//! pgcache had not seen the DDL; when the Bind is the first statement of
//! its implicit transaction and pgcache had not seen the DDL, the client
//! never learns of it: its messages are sent again from that Bind on,
//! under the new name. Names and the statements a connection holds are in
//! [`super::statement`]; the answers owed, in [`super::owed`].

mod replies;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};

use super::owed::{Expect, Kind, MAX_RETRY_BYTES, Origin};
use super::reference::{Reference, Verb, may_refer, reference};
use super::statement::{Named, Refers, Statement, UNNAMED, Unnamed};
pub use super::statement::{ServerName, ServerStatements, server_name};
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::codec::frame_of;
use crate::protocol::{TxStatus, backend as be, extended, frontend as fe, messages, sqlstate};

/// What to do with one server frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Pass,
    Drop,
}

/// What one server frame leads to.
#[derive(Debug)]
pub struct Answer {
    /// Whether the client gets the frame.
    pub reply: Reply,
    /// pgcache's answers in the server's place, right after it.
    pub to_client: BytesMut,
    /// Messages to send the server again (a Bind's retry).
    pub to_server: BytesMut,
}

/// One transaction-mode client's statements, and the translation of its
/// messages for the server connection it holds.
#[derive(Default)]
pub struct Translator {
    statements: HashMap<Bytes, Statement>,
    unnamed: Option<Arc<Unnamed>>,
    /// The answers still owed for what went to the server, in order.
    expect: VecDeque<Expect>,
    /// pgcache failed a message itself: the rest of the batch, up to
    /// Sync, is not sent (the server would skip it after an error).
    skipping: bool,
    /// An Execute went out with no CopyDone/CopyFail after it.
    copy_may_start: bool,
    /// The database's schema generation (see the module's doc).
    schema: Arc<AtomicU64>,
    /// `pool.max_prepared_statements`, as last given.
    max: usize,
    /// The session's transaction status, as the last ReadyForQuery the
    /// client got said: what an answer of pgcache's own must carry.
    status: TxStatus,
    /// The client's statement that the SQL text of the statement last
    /// bound names, for the Execute that runs it.
    bound: Option<Named>,
}

impl Translator {
    /// A translator for one request of pgcache's own on the client's
    /// behalf: the client's statements, nothing owed.
    pub fn for_request(&self) -> Translator {
        Translator {
            statements: self.statements.clone(),
            unnamed: self.unnamed.clone(),
            schema: Arc::clone(&self.schema),
            ..Translator::default()
        }
    }

    /// A translator whose server names follow the schema generation
    /// `schema` (its database's).
    pub fn following(schema: Arc<AtomicU64>) -> Translator {
        Translator {
            schema,
            ..Translator::default()
        }
    }

    /// Server names follow the schema generation `schema` from now on.
    pub fn follow(&mut self, schema: Arc<AtomicU64>) {
        self.schema = schema;
    }

    fn generation(&self) -> u64 {
        self.schema.load(Ordering::Acquire)
    }

    /// Nothing is owed: the connection may change.
    pub fn is_idle(&self) -> bool {
        self.expect.is_empty()
    }

    /// The client's messages in `frames`, for the server whose statements
    /// are `server`, appended to `out`. `idle`: the client's session is
    /// outside a transaction block, so a Bind with nothing owed before it
    /// is the first statement of its implicit transaction. Returns the
    /// answers pgcache gives at once (nothing was owed before them).
    pub fn translate(
        &mut self,
        frames: &[u8],
        server: &mut ServerStatements,
        max_prepared: usize,
        idle: bool,
        out: &mut BytesMut,
    ) -> BytesMut {
        self.max = max_prepared;
        self.translate_frames(frames, server, idle, out);
        self.leading_synthetic()
    }

    fn translate_frames(
        &mut self,
        frames: &[u8],
        server: &mut ServerStatements,
        idle: bool,
        out: &mut BytesMut,
    ) {
        let mut first = idle && !self.expect.iter().any(Expect::executes);
        // The first Bind's offset in `frames` and its place in `expect`.
        let mut retry_from: Option<(usize, usize)> = None;
        let mut offset = 0;
        for frame in crate::protocol::codec::frames(frames) {
            let owed = self.expect.len();
            self.message(frame, server, out);
            let start = offset;
            offset += frame.len();
            match frame[0] {
                fe::BIND if first => {
                    first = false;
                    let bind = self.expect.len().checked_sub(1).filter(|at| *at >= owed);
                    if let Some(at) = bind
                        && self.expect[at].binds.is_some()
                    {
                        retry_from = Some((start, at));
                    }
                }
                fe::SYNC => {
                    if let Some((start, at)) = retry_from.take()
                        && offset - start <= MAX_RETRY_BYTES
                    {
                        self.expect[at].retry =
                            Some(Bytes::copy_from_slice(&frames[start..offset]));
                    }
                }
                fe::PARSE | fe::DESCRIBE | fe::CLOSE | fe::FLUSH => {}
                _ => first = false,
            }
        }
    }

    fn message(&mut self, frame: &[u8], server: &mut ServerStatements, out: &mut BytesMut) {
        let max = self.max;
        let tag = frame[0];
        if self.skipping {
            if tag == fe::SYNC {
                self.skipping = false;
                self.send(out, frame, Kind::Ready, None);
            }
            return;
        }
        match tag {
            fe::PARSE => self.parse(frame, server, max, out),
            fe::BIND => self.bind(frame, server, out),
            fe::DESCRIBE => self.describe(frame, server, out),
            fe::CLOSE => self.close(frame, server, out),
            fe::EXECUTE => {
                self.copy_may_start = true;
                self.send(out, frame, Kind::Execute, None);
                if let Some(execute) = self.expect.back_mut() {
                    execute.named = self.bound.take();
                }
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
                // A simple Query replaces the unnamed statement.
                server.unnamed = None;
                self.query(frame, server, out);
            }
            // Flush and COPY data: no answer of their own.
            _ => out.extend_from_slice(frame),
        }
    }

    /// A Bind: the statement it names goes out under the server's name,
    /// prepared there first if the server lacks it.
    fn bind(&mut self, frame: &[u8], server: &mut ServerStatements, out: &mut BytesMut) {
        let max = self.max;
        let body = &frame[HEADER_LEN..];
        let names = extended::bind_names(body);
        self.bound = match names {
            Some((_, b"")) => self.unnamed.as_ref().and_then(|u| u.named.clone()),
            Some((_, statement)) => self.resolve(statement, server, max, out),
            None => None,
        };
        match names {
            Some((portal, statement)) => {
                let binds = self.with_statement(statement, server, max, out, |name, out| {
                    let rest = &body[portal.len() + 1 + statement.len() + 1..];
                    frame_of(out, fe::BIND, &[portal, &[0], name, &[0], rest]);
                });
                self.owe(Kind::One(be::BIND_COMPLETE));
                // The client's name, for an error that names the server's
                // (the name's own bytes: no copy).
                let named = binds.and_then(|hash| {
                    let (name, _) = self.statements.get_key_value(statement)?;
                    Some(Named {
                        hash,
                        name: name.clone(),
                        frees: false,
                    })
                });
                if let Some(bind) = self.expect.back_mut() {
                    bind.binds = binds;
                    bind.named = named;
                }
            }
            None => self.send(out, frame, Kind::One(be::BIND_COMPLETE), None),
        }
    }

    /// A Describe of a statement names it as the server knows it.
    fn describe(&mut self, frame: &[u8], server: &mut ServerStatements, out: &mut BytesMut) {
        let max = self.max;
        let body = &frame[HEADER_LEN..];
        match extended::target(body) {
            Some((fe::TARGET_STATEMENT, name)) => {
                self.resolve(name, server, max, out);
                let hash = self.with_statement(name, server, max, out, |server_name, out| {
                    frame_of(
                        out,
                        fe::DESCRIBE,
                        &[&[fe::TARGET_STATEMENT], server_name, &[0]],
                    );
                });
                self.owe(Kind::DescribeStatement);
                if let Some(describe) = self.expect.back_mut() {
                    describe.named = hash.map(|hash| Named::of(hash, name));
                }
            }
            _ => self.send(out, frame, Kind::DescribePortal, None),
        }
    }

    /// A Close of a named statement is answered here: the server keeps
    /// it for the pool's other clients.
    fn close(&mut self, frame: &[u8], server: &mut ServerStatements, out: &mut BytesMut) {
        let body = &frame[HEADER_LEN..];
        match extended::target(body) {
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
        }
    }

    fn parse(
        &mut self,
        frame: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) {
        let generation = self.generation();
        let body = &frame[HEADER_LEN..];
        let Some(p) = extended::parse(body) else {
            return self.send(out, frame, Kind::One(be::PARSE_COMPLETE), None);
        };
        if p.name.is_empty() {
            return self.parse_unnamed(frame, &p, server, max, out);
        }
        if self.refuses_parse(&p, server, max, out) {
            return;
        }
        let name = Bytes::copy_from_slice(p.name);
        let statement = match self.reference(p.query) {
            Some(r) => {
                let refers = Refers {
                    query: Bytes::copy_from_slice(p.query),
                    span: r.span,
                    name: Bytes::from(r.name),
                    frees: r.verb == Verb::Deallocate,
                };
                // The statement it names is prepared first, and the text
                // names it as the server does.
                let named = self.with_statement(&refers.name, server, max, out, |_, _| {});
                let query = refers.text(named.map(server_name).as_ref().map(ServerName::as_bytes));
                Statement {
                    refers: Some(Arc::new(refers)),
                    ..Statement::new(&query, p.param_types, generation)
                }
            }
            None => Statement::new(p.query, p.param_types, generation),
        };
        let hash = statement.hash;
        // Most Parses find their statement on the connection already.
        let parse = (!server.touch(hash)).then(|| statement.parse());
        let Some(parse) = parse else {
            if !self.expect.is_empty() {
                // PostgreSQL's answer hangs on those owed (a transaction
                // failing meanwhile refuses it): the server's is asked.
                return self.parse_as_unnamed(statement, name, server, out);
            }
            self.statements.insert(name, statement);
            self.answer(&[be::PARSE_COMPLETE, 0, 0, 0, 4]);
            return;
        };
        self.statements.insert(name.clone(), statement);
        self.close_over(server, max, out);
        server.insert(hash);
        self.send(
            out,
            &parse,
            Kind::One(be::PARSE_COMPLETE),
            Some((hash, Some(name))),
        );
    }

    /// A Parse of the unnamed statement: not shared, but a reference in
    /// its text to a named one (`EXECUTE name`) is rewritten to the name
    /// the server knows it by.
    fn parse_unnamed(
        &mut self,
        frame: &[u8],
        p: &extended::Parse<'_>,
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) {
        // Unnamed statements are not shared: a token tells this Parse
        // apart, with no hash of its text on every query.
        let token = u128::from(UNNAMED.fetch_add(1, Ordering::Relaxed));
        let mut parse = Bytes::copy_from_slice(frame);
        let mut named = None;
        if let Some(r) = self.reference(p.query) {
            let (query, types) = (p.query, p.param_types);
            let hash = self.with_statement(&r.name, server, max, out, |name, _| {
                let mut rewritten = BytesMut::new();
                let text = [&query[..r.span.start], name, &query[r.span.end..]];
                frame_of(
                    &mut rewritten,
                    fe::PARSE,
                    &[&[0], &text.concat(), &[0], types],
                );
                parse = rewritten.freeze();
            });
            named = hash.map(|hash| Named {
                hash,
                name: Bytes::from(r.name),
                frees: r.verb == Verb::Deallocate,
            });
        }
        self.unnamed = Some(Arc::new(Unnamed {
            token,
            parse: parse.clone(),
            named,
        }));
        server.unnamed = Some(token);
        self.send(out, &parse, Kind::One(be::PARSE_COMPLETE), None);
    }

    /// Statement `name` as the client defined it elsewhere (on the
    /// connection it holds in session mode), prepared where a message
    /// names it.
    pub fn define(&mut self, name: &[u8], query: &[u8], param_types: &[u8]) {
        if name.is_empty() {
            let mut parse = BytesMut::new();
            frame_of(&mut parse, fe::PARSE, &[&[0], query, &[0], param_types]);
            self.unnamed = Some(Arc::new(Unnamed {
                token: u128::from(UNNAMED.fetch_add(1, Ordering::Relaxed)),
                parse: parse.freeze(),
                named: None,
            }));
            return;
        }
        let statement = Statement::new(query, param_types, self.generation());
        self.statements
            .insert(Bytes::copy_from_slice(name), statement);
    }

    /// A simple Query. One that names a statement the client prepared
    /// through the protocol (`EXECUTE`, `DEALLOCATE`, `PREPARE`) goes out
    /// with the server's name for it, prepared there first; errors that
    /// name it are given the client's name back.
    fn query(&mut self, frame: &[u8], server: &mut ServerStatements, out: &mut BytesMut) {
        let max = self.max;
        let sql = frame[HEADER_LEN..].strip_suffix(&[0]).unwrap_or_default();
        let Some(r) = self.reference(sql) else {
            return self.send(out, frame, Kind::Ready, None);
        };
        if r.verb == Verb::Prepare && self.status == TxStatus::Idle && self.expect.is_empty() {
            // Outside a transaction block the refusal changes nothing on
            // the server: pgcache gives it. Inside one it must fail the
            // server's transaction too, so the server is asked to prepare
            // the statement's server name again (below), and refuses.
            let message = format!(
                "prepared statement \"{}\" already exists",
                String::from_utf8_lossy(&r.name)
            );
            self.expect.push_back(Expect::new(
                Kind::One(0),
                Origin::Refusal(sqlstate::DUPLICATE_PSTATEMENT, message),
            ));
            return;
        }
        let owed = self.expect.len();
        let mut query = BytesMut::new();
        let hash = self.with_statement(&r.name, server, max, out, |name, _| {
            let text = [&sql[..r.span.start], name, &sql[r.span.end..], &[0]];
            frame_of(&mut query, fe::QUERY, &text);
        });
        if self.expect.len() > owed {
            // A Parse went first: should it fail, PostgreSQL would skip
            // messages up to a Sync, the Query too.
            out.extend_from_slice(&messages::SYNC);
            self.expect
                .push_back(Expect::new(Kind::Ready, Origin::Injected));
        }
        out.extend_from_slice(&query);
        self.owe(Kind::Ready);
        if let Some(query) = self.expect.back_mut() {
            query.named = hash.map(|hash| Named {
                hash,
                name: Bytes::from(r.name),
                frees: r.verb == Verb::Deallocate,
            });
        }
    }

    /// The statement of the client's that SQL text names, if any.
    fn reference(&self, sql: &[u8]) -> Option<Reference> {
        if !may_refer(sql) {
            return None;
        }
        let r = reference(std::str::from_utf8(sql).ok()?)?;
        self.statements.contains_key(r.name.as_slice()).then_some(r)
    }

    /// Before a Bind or Describe of the client's statement `name`: if its
    /// text names another statement of the client's (a named `EXECUTE s`),
    /// that one is prepared on the server, and the text names it as the
    /// server does now (its name may have changed with the schema), or as
    /// the client wrote it once the client has freed it, for the server to
    /// refuse as it would directly. Returns the statement it names.
    fn resolve(
        &mut self,
        name: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
    ) -> Option<Named> {
        let refers = self.statements.get(name)?.refers.clone()?;
        let named = self.with_statement(&refers.name, server, max, out, |_, _| {});
        let query = refers.text(named.map(server_name).as_ref().map(ServerName::as_bytes));
        let generation = self.generation();
        let statement = self.statements.get_mut(name)?;
        if statement.query != query {
            *statement = Statement {
                refers: Some(Arc::clone(&refers)),
                ..Statement::new(&query, &statement.param_types, generation)
            };
        }
        named.map(|hash| Named {
            hash,
            name: refers.name.clone(),
            frees: refers.frees,
        })
    }

    /// Writes a message naming a statement, with pgcache's name for it,
    /// first preparing it on the server if it is not there. Returns the
    /// server name's hash, for a named statement pgcache knows.
    fn with_statement(
        &mut self,
        name: &[u8],
        server: &mut ServerStatements,
        max: usize,
        out: &mut BytesMut,
        write: impl FnOnce(&[u8], &mut BytesMut),
    ) -> Option<u128> {
        if name.is_empty() {
            if let Some(unnamed) = self.unnamed.clone()
                && server.unnamed != Some(unnamed.token)
            {
                server.unnamed = Some(unnamed.token);
                self.inject(out, &unnamed.parse, None);
            }
            write(b"", out);
            return None;
        }
        let generation = self.generation();
        let Some(statement) = self.statements.get_mut(name) else {
            // Unknown to the client: the server says so, in its words.
            write(name, out);
            return None;
        };
        // A name of an older generation is used only where it is
        // prepared: prepared again, it takes the current one.
        if statement.generation != generation && !server.contains(statement.hash) {
            statement.renew(generation);
        }
        let hash = statement.hash;
        if !server.touch(hash) {
            let parse = statement.parse();
            self.close_over(server, max, out);
            server.insert(hash);
            self.inject(out, &parse, Some(hash));
        }
        write(server_name(hash).as_bytes(), out);
        Some(hash)
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
            self.expect
                .push_back(Expect::new(Kind::One(be::CLOSE_COMPLETE), Origin::Injected));
        }
    }

    fn inject(&mut self, out: &mut BytesMut, parse: &[u8], hash: Option<u128>) {
        out.extend_from_slice(parse);
        self.expect.push_back(Expect {
            prepares: hash,
            ..Expect::new(Kind::One(be::PARSE_COMPLETE), Origin::Injected)
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
        let (prepares, defines) = prepares.map_or((None, None), |(h, name)| (Some(h), name));
        self.expect.push_back(Expect {
            prepares,
            defines,
            ..Expect::new(kind, Origin::Client)
        });
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

    fn frame(tag: u8, parts: &[&[u8]]) -> Vec<u8> {
        let mut out = BytesMut::new();
        frame_of(&mut out, tag, parts);
        out.to_vec()
    }

    fn parse(name: &str, sql: &str) -> Vec<u8> {
        frame(
            fe::PARSE,
            &[name.as_bytes(), &[0], sql.as_bytes(), &[0, 0, 0]],
        )
    }

    fn bind(statement: &str) -> Vec<u8> {
        frame(
            fe::BIND,
            &[&[0], statement.as_bytes(), &[0, 0, 0, 0, 0, 0, 0]],
        )
    }

    fn execute() -> Vec<u8> {
        frame(fe::EXECUTE, &[&[0], &[0, 0, 0, 0]])
    }

    fn sync() -> Vec<u8> {
        frame(fe::SYNC, &[])
    }

    fn stale_error() -> Vec<u8> {
        let mut out = BytesMut::new();
        messages::error_response(
            &mut out,
            "ERROR",
            "0A000",
            "cached plan must not change result type",
        );
        out.to_vec()
    }

    fn server_tags(bytes: &[u8]) -> String {
        crate::protocol::codec::frames(bytes)
            .map(|f| f[0] as char)
            .collect()
    }

    /// The server statement names in `bytes` (Parse and Bind frames).
    fn names_in(bytes: &[u8]) -> Vec<String> {
        crate::protocol::codec::frames(bytes)
            .filter_map(|f| {
                let body = &f[HEADER_LEN..];
                let name = match f[0] {
                    fe::PARSE => extended::parse(body)?.name,
                    fe::BIND => extended::bind_names(body)?.1,
                    _ => return None,
                };
                Some(String::from_utf8_lossy(name).into_owned())
            })
            .collect()
    }

    /// Translates a run of `s` (Bind, Execute, Sync) into `out`.
    fn run_s(t: &mut Translator, server: &mut ServerStatements, idle: bool, out: &mut BytesMut) {
        let run = [bind("s"), execute(), sync()].concat();
        t.translate(&run, server, 10, idle, out);
    }

    /// A translator whose client prepared `select 1` as `s`, on a server
    /// connection that has it; the schema generation it follows.
    fn prepared() -> (Translator, ServerStatements, Arc<AtomicU64>) {
        let schema = Arc::new(AtomicU64::new(0));
        let mut t = Translator::following(Arc::clone(&schema));
        let mut server = ServerStatements::default();
        let mut out = BytesMut::new();
        let batch = [parse("s", "select 1"), sync()].concat();
        t.translate(&batch, &mut server, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PS");
        for answer in [
            [be::PARSE_COMPLETE, 0, 0, 0, 4],
            [be::READY_FOR_QUERY, 0, 0, 0, 5],
        ] {
            let mut f = answer.to_vec();
            if f[0] == be::READY_FOR_QUERY {
                f.push(b'I');
            }
            assert_eq!(t.on_frame(&f, &mut server).reply, Reply::Pass);
        }
        assert!(t.is_idle());
        (t, server, schema)
    }

    #[test]
    fn the_rest_of_a_batch_sent_after_the_servers_error_is_skipped_as_the_server_skips_it() {
        let mut t = Translator::following(Arc::new(AtomicU64::new(0)));
        let mut server = ServerStatements::default();
        let mut out = BytesMut::new();
        let first = [parse("s3", "select nosuch"), bind("s3")].concat();
        t.translate(&first, &mut server, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PB");
        // The server fails the Parse before the rest of the batch comes.
        let mut error = BytesMut::new();
        messages::error_response(&mut error, "ERROR", "42703", "no such column");
        assert_eq!(t.on_frame(&error, &mut server).reply, Reply::Pass);
        let mut out = BytesMut::new();
        t.translate(
            &[execute(), sync()].concat(),
            &mut server,
            10,
            false,
            &mut out,
        );
        assert_eq!(server_tags(&out), "S", "the Execute is skipped, as there");
        let ready = [be::READY_FOR_QUERY, 0, 0, 0, 5, b'I'];
        assert_eq!(t.on_frame(&ready, &mut server).reply, Reply::Pass);
        assert!(t.is_idle(), "nothing owed past the batch's ReadyForQuery");
    }

    #[test]
    fn statements_prepared_after_ddl_get_new_server_names() {
        let (mut t, mut server, schema) = prepared();
        let mut before = BytesMut::new();
        run_s(&mut t, &mut server, true, &mut before);
        assert_eq!(server_tags(&before), "BES", "prepared there already");
        t.clear_owed();
        schema.fetch_add(1, Ordering::AcqRel);
        // Another client parses the same text after the DDL.
        let (mut other, mut fresh) = (
            Translator::following(Arc::clone(&schema)),
            ServerStatements::default(),
        );
        let mut out = BytesMut::new();
        other.translate(
            &[parse("t", "select 1"), sync()].concat(),
            &mut server,
            10,
            true,
            &mut out,
        );
        assert_eq!(server_tags(&out), "PS", "prepared again, under a new name");
        assert_ne!(names_in(&out), names_in(&before)[..1]);
        // The old client keeps its name where the server has it (and sees
        // any error as it would directly), and takes the new one elsewhere.
        let mut out = BytesMut::new();
        t.translate(
            &[bind("s"), sync()].concat(),
            &mut server,
            10,
            true,
            &mut out,
        );
        assert_eq!(names_in(&out), names_in(&before)[..1]);
        let mut out = BytesMut::new();
        t.clear_owed();
        t.translate(
            &[bind("s"), sync()].concat(),
            &mut fresh,
            10,
            true,
            &mut out,
        );
        assert_eq!(server_tags(&out), "PBS");
        assert_ne!(names_in(&out)[0], names_in(&before)[0]);
    }

    #[test]
    fn a_stale_first_bind_is_prepared_again_and_retried_unseen() {
        let (mut t, mut server, schema) = prepared();
        let mut out = BytesMut::new();
        let batch = [bind("s"), execute(), sync()].concat();
        t.translate(&batch, &mut server, 10, true, &mut out);
        let old = names_in(&out);
        // DDL pgcache did not see: the server refuses the Bind.
        let answer = t.on_frame(&stale_error(), &mut server);
        assert_eq!(answer.reply, Reply::Drop, "the client never sees it");
        assert_eq!(server_tags(&answer.to_server), "PBES");
        let new = names_in(&answer.to_server);
        assert_eq!(new[0], new[1]);
        assert_ne!(new[0], old[0], "a new name");
        assert_eq!(
            schema.load(Ordering::Acquire),
            1,
            "retired on every connection"
        );
        let ready = [be::READY_FOR_QUERY, 0, 0, 0, 5, b'I'];
        assert_eq!(
            t.on_frame(&ready, &mut server).reply,
            Reply::Drop,
            "the failed try's"
        );
        let replies: Vec<Reply> = [
            vec![be::PARSE_COMPLETE, 0, 0, 0, 4],
            vec![be::BIND_COMPLETE, 0, 0, 0, 4],
            frame(be::COMMAND_COMPLETE, &[b"SELECT 1\0"]),
            ready.to_vec(),
        ]
        .iter()
        .map(|f| t.on_frame(f, &mut server).reply)
        .collect();
        assert_eq!(
            replies,
            [Reply::Drop, Reply::Pass, Reply::Pass, Reply::Pass]
        );
        assert!(t.is_idle());
    }

    #[test]
    fn a_stale_bind_inside_a_transaction_fails_once() {
        let (mut t, mut server, schema) = prepared();
        let mut out = BytesMut::new();
        // Not idle: the client is in a transaction block.
        run_s(&mut t, &mut server, false, &mut out);
        let old = names_in(&out);
        let answer = t.on_frame(&stale_error(), &mut server);
        assert_eq!(answer.reply, Reply::Pass, "the client gets the error");
        assert!(answer.to_server.is_empty());
        assert_eq!(schema.load(Ordering::Acquire), 1);
        let ready = [be::READY_FOR_QUERY, 0, 0, 0, 5, b'E'];
        assert_eq!(t.on_frame(&ready, &mut server).reply, Reply::Pass);
        // Its next Bind prepares the statement again, under the new name.
        let mut out = BytesMut::new();
        run_s(&mut t, &mut server, false, &mut out);
        assert_eq!(server_tags(&out), "PBES");
        assert_ne!(names_in(&out)[0], old[0]);
    }

    #[test]
    fn a_stale_bind_after_ddl_pgcache_saw_fails_as_directly() {
        let (mut t, mut server, schema) = prepared();
        schema.fetch_add(1, Ordering::AcqRel);
        let mut out = BytesMut::new();
        run_s(&mut t, &mut server, true, &mut out);
        let answer = t.on_frame(&stale_error(), &mut server);
        assert_eq!(
            answer.reply,
            Reply::Pass,
            "prepared before the DDL: its error"
        );
        assert_eq!(schema.load(Ordering::Acquire), 1, "already retired");
    }

    fn query(sql: &str) -> Vec<u8> {
        frame(fe::QUERY, &[sql.as_bytes(), &[0]])
    }

    fn ready(status: u8) -> Vec<u8> {
        vec![be::READY_FOR_QUERY, 0, 0, 0, 5, status]
    }

    fn complete(tag: &str) -> Vec<u8> {
        frame(be::COMMAND_COMPLETE, &[tag.as_bytes(), &[0]])
    }

    /// The texts of the simple Queries and Parses in `bytes`.
    fn texts_in(bytes: &[u8]) -> Vec<String> {
        crate::protocol::codec::frames(bytes)
            .filter_map(|f| {
                let body = &f[HEADER_LEN..];
                let text = match f[0] {
                    fe::QUERY => body.strip_suffix(&[0])?,
                    fe::PARSE => extended::parse(body)?.query,
                    _ => return None,
                };
                Some(String::from_utf8_lossy(text).into_owned())
            })
            .collect()
    }

    #[test]
    fn sql_execute_of_a_protocol_statement_names_it_as_the_server_does() {
        let (mut t, mut server, _) = prepared();
        let name = names_in(&t.statements["s".as_bytes()].parse())[0].clone();
        for sql in [
            "EXECUTE s",
            "explain (costs off) execute S",
            "create table t as execute s with no data",
        ] {
            let mut out = BytesMut::new();
            t.translate(&query(sql), &mut server, 10, true, &mut out);
            assert_eq!(server_tags(&out), "Q", "prepared there already");
            let expected = sql.replacen(" s", &format!(" {name}"), 1);
            let expected = expected.replacen(" S", &format!(" {name}"), 1);
            assert_eq!(texts_in(&out), [expected]);
            for answer in [complete("SELECT 1"), ready(b'I')] {
                assert_eq!(t.on_frame(&answer, &mut server).reply, Reply::Pass);
            }
        }
        // On a connection without it, it is prepared first.
        let mut fresh = ServerStatements::default();
        let mut out = BytesMut::new();
        t.translate(&query("execute s"), &mut fresh, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PSQ");
        assert_eq!(
            texts_in(&out),
            ["select 1".to_owned(), format!("execute {name}")]
        );
        // Should that Parse fail (its table dropped, say), the client gets
        // its error and one ReadyForQuery, as for the Query directly.
        let mut parse_error = BytesMut::new();
        messages::error_response(
            &mut parse_error,
            "ERROR",
            "42P01",
            "relation does not exist",
        );
        let mut query_error = BytesMut::new();
        messages::error_response(&mut query_error, "ERROR", "26000", "does not exist");
        let replies: Vec<Reply> = [
            parse_error.to_vec(),
            ready(b'I'),
            query_error.to_vec(),
            ready(b'I'),
        ]
        .iter()
        .map(|f| t.on_frame(f, &mut fresh).reply)
        .collect();
        assert_eq!(
            replies,
            [Reply::Pass, Reply::Drop, Reply::Drop, Reply::Pass]
        );
        assert!(t.is_idle() && !fresh.contains(t.statements["s".as_bytes()].hash));
        // Names the client never prepared go out as written.
        let mut out = BytesMut::new();
        t.clear_owed();
        t.translate(&query("execute other"), &mut server, 10, true, &mut out);
        assert_eq!(texts_in(&out), ["execute other"]);
    }

    #[test]
    fn a_sql_deallocate_frees_the_statement_once_the_server_did() {
        let (mut t, mut server, _) = prepared();
        let hash = t.statements["s".as_bytes()].hash;
        // In a failed transaction the server refuses it: nothing is freed.
        let mut out = BytesMut::new();
        t.translate(&query("DEALLOCATE s"), &mut server, 10, false, &mut out);
        assert_eq!(
            texts_in(&out),
            [format!(
                "DEALLOCATE {}",
                String::from_utf8_lossy(server_name(hash).as_bytes())
            )]
        );
        let mut refused = BytesMut::new();
        messages::error_response(&mut refused, "ERROR", "25P02", replies::FAILED);
        // (It names no statement: the client gets it as it was.)
        let answer = t.on_frame(&refused, &mut server);
        assert_eq!(
            (answer.reply, &answer.to_client[..]),
            (Reply::Pass, &[][..])
        );
        assert_eq!(t.on_frame(&ready(b'E'), &mut server).reply, Reply::Pass);
        assert!(t.statements.contains_key("s".as_bytes()) && server.contains(hash));
        // Done: gone from the client and from the server, which prepares
        // it again for the next client that needs it.
        let mut out = BytesMut::new();
        t.translate(
            &query("deallocate prepare s"),
            &mut server,
            10,
            true,
            &mut out,
        );
        for answer in [complete("DEALLOCATE"), ready(b'I')] {
            assert_eq!(t.on_frame(&answer, &mut server).reply, Reply::Pass);
        }
        assert!(!t.statements.contains_key("s".as_bytes()));
        assert!(!server.contains(hash));
        let mut out = BytesMut::new();
        run_s(&mut t, &mut server, true, &mut out);
        assert_eq!(names_in(&out), ["s"], "unknown now: the server says so");
    }

    #[test]
    fn an_unnamed_statement_that_deallocates_frees_at_its_execute() {
        let (mut t, mut server, _) = prepared();
        let hash = t.statements["s".as_bytes()].hash;
        let batch = [parse("", "DEALLOCATE s"), bind(""), execute(), sync()].concat();
        let mut out = BytesMut::new();
        t.translate(&batch, &mut server, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PBES");
        assert_eq!(
            texts_in(&out),
            [format!(
                "DEALLOCATE {}",
                String::from_utf8_lossy(server_name(hash).as_bytes())
            )]
        );
        for answer in [
            vec![be::PARSE_COMPLETE, 0, 0, 0, 4],
            vec![be::BIND_COMPLETE, 0, 0, 0, 4],
            complete("DEALLOCATE"),
            ready(b'I'),
        ] {
            assert_eq!(t.on_frame(&answer, &mut server).reply, Reply::Pass);
        }
        assert!(!t.statements.contains_key("s".as_bytes()) && !server.contains(hash));
    }

    #[test]
    fn a_named_statement_that_executes_or_deallocates_names_the_server_statement() {
        let (mut t, mut server, _) = prepared();
        let inner = t.statements["s".as_bytes()].hash;
        let inner_name = String::from_utf8_lossy(server_name(inner).as_bytes()).into_owned();
        let parse_complete = || vec![be::PARSE_COMPLETE, 0, 0, 0, 4];
        let bind_complete = || vec![be::BIND_COMPLETE, 0, 0, 0, 4];
        // asyncpg's shape: a named Parse, then Bind, Execute, Sync.
        let run = |name: &str| [bind(name), execute(), sync()].concat();
        let mut out = BytesMut::new();
        let batch = [parse("x", "EXECUTE s"), run("x")].concat();
        t.translate(&batch, &mut server, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PBES");
        assert_eq!(texts_in(&out), [format!("EXECUTE {inner_name}")]);
        for answer in [
            parse_complete(),
            bind_complete(),
            complete("SELECT 1"),
            ready(b'I'),
        ] {
            assert_eq!(t.on_frame(&answer, &mut server).reply, Reply::Pass);
        }
        // On a connection with neither, the one it names is prepared first.
        let mut fresh = ServerStatements::default();
        let mut out = BytesMut::new();
        t.translate(&run("x"), &mut fresh, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PPBES");
        assert_eq!(
            texts_in(&out),
            ["select 1".to_owned(), format!("EXECUTE {inner_name}")]
        );
        t.clear_owed();
        // A named DEALLOCATE frees both names once the server did.
        let mut out = BytesMut::new();
        let batch = [parse("d", "DEALLOCATE s"), run("d")].concat();
        t.translate(&batch, &mut server, 10, true, &mut out);
        assert_eq!(texts_in(&out), [format!("DEALLOCATE {inner_name}")]);
        for answer in [
            parse_complete(),
            bind_complete(),
            complete("DEALLOCATE"),
            ready(b'I'),
        ] {
            assert_eq!(t.on_frame(&answer, &mut server).reply, Reply::Pass);
        }
        assert!(!t.statements.contains_key("s".as_bytes()) && !server.contains(inner));
        // The EXECUTE now names what the client freed: the server is sent
        // the client's text, and refuses it as it would directly.
        let mut out = BytesMut::new();
        t.translate(&run("x"), &mut server, 10, true, &mut out);
        assert_eq!(server_tags(&out), "PBES");
        assert_eq!(texts_in(&out), ["EXECUTE s"]);
    }

    #[test]
    fn deallocate_all_and_discard_all_free_every_statement() {
        for tag in ["DEALLOCATE ALL", "DISCARD ALL"] {
            let (mut t, mut server, _) = prepared();
            let mut out = BytesMut::new();
            t.translate(&query(tag), &mut server, 10, true, &mut out);
            assert_eq!(texts_in(&out), [tag], "the server's go too");
            t.on_frame(&complete(tag), &mut server);
            t.on_frame(&ready(b'I'), &mut server);
            assert!(t.statements.is_empty() && server.is_empty(), "{tag}");
        }
    }

    #[test]
    fn a_sql_prepare_of_a_protocol_name_is_refused_as_postgresql_would() {
        let (mut t, mut server, _) = prepared();
        let mut out = BytesMut::new();
        let now = t.translate(
            &query("PREPARE s AS select 2"),
            &mut server,
            10,
            true,
            &mut out,
        );
        assert!(out.is_empty(), "outside a block the server never sees it");
        let frames: Vec<&[u8]> = crate::protocol::codec::frames(&now).collect();
        assert_eq!(frames.len(), 2);
        assert_eq!(
            messages::error_code(&frames[0][HEADER_LEN..]),
            Some("42P05")
        );
        assert!(String::from_utf8_lossy(frames[0]).contains("\"s\" already exists"));
        assert_eq!(frames[1], ready(b'I'));
        assert!(t.is_idle());
        // In a block, the server refuses it (its transaction fails too),
        // under the name the client knows.
        t.translate(&query("BEGIN"), &mut server, 10, true, &mut out);
        t.on_frame(&complete("BEGIN"), &mut server);
        t.on_frame(&ready(b'T'), &mut server);
        let mut out = BytesMut::new();
        t.translate(
            &query("PREPARE s AS select 2"),
            &mut server,
            10,
            false,
            &mut out,
        );
        let name = server_name(t.statements["s".as_bytes()].hash);
        let name = String::from_utf8_lossy(name.as_bytes()).into_owned();
        assert_eq!(texts_in(&out), [format!("PREPARE {name} AS select 2")]);
        let mut refusal = BytesMut::new();
        let message = format!("prepared statement \"{name}\" already exists");
        messages::error_response(&mut refusal, "ERROR", "42P05", &message);
        let answer = t.on_frame(&refusal, &mut server);
        assert_eq!(answer.reply, Reply::Drop);
        let mut expected = BytesMut::new();
        let message = "prepared statement \"s\" already exists";
        messages::error_response(&mut expected, "ERROR", "42P05", message);
        assert_eq!(answer.to_client, expected);
        assert_eq!(t.on_frame(&ready(b'E'), &mut server).reply, Reply::Pass);
        assert!(t.is_idle());
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
