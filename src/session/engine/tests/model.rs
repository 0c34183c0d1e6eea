//! A model of PostgreSQL for the engine's property test: programs of
//! client messages (simple, extended and pipelined requests, COPY, errors,
//! cancels, Terminate) on two tables, and what PostgreSQL answers them.
//!
//! It uses nothing of pgcache's, so `tests/model.rs` replays the same
//! programs against a real PostgreSQL and checks the model against it.
//! The tables: `items (k int primary key, v text)` holding `(1,'a')`,
//! `(2,'b')`, `(3,'c')`, and `log (line text)`.

use std::collections::BTreeMap;
use std::fmt;

use bytes::{BufMut, BytesMut};
use proptest::prelude::*;

/// What a program sets up before it runs, on a fresh session (of a real
/// PostgreSQL: the model starts so).
#[allow(dead_code, reason = "the replay against PostgreSQL runs it")]
pub const SETUP: &str = "DROP TABLE IF EXISTS items, log, other; \
     CREATE TABLE items (k int PRIMARY KEY, v text); \
     INSERT INTO items VALUES (1, 'a'), (2, 'b'), (3, 'c'); \
     CREATE TABLE log (line text); \
     CREATE TABLE other (k int PRIMARY KEY, n int); \
     INSERT INTO other VALUES (1, 0), (2, 0), (3, 0); \
     CREATE OR REPLACE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS \
     'BEGIN UPDATE items SET v = v || ''y'' WHERE k = NEW.k; RETURN NEW; END'; \
     CREATE TRIGGER touch AFTER UPDATE ON other FOR EACH ROW EXECUTE FUNCTION touch()";

/// One statement of a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sql {
    /// The row of key `k` (4 has none).
    ReadOne(u8),
    ReadAll,
    /// Appends `x` to the value of key `k`.
    Write(u8),
    /// Writes `other`'s row `k`, whose trigger appends `y` to the value of
    /// key `k` of `items`: a write pgcache cannot see the tables of.
    Touch(u8),
    Begin,
    Commit,
    Rollback,
    /// Fails at parse analysis (42703).
    Bad,
    /// Runs until cancelled (57014).
    Sleep,
    /// COPY-in, followed by its data in [`Step::Copy`].
    Copy,
}

impl Sql {
    pub fn text(self) -> String {
        match self {
            Sql::ReadOne(k) => format!("SELECT v FROM items WHERE k = {k}"),
            Sql::ReadAll => "SELECT k, v FROM items ORDER BY k".into(),
            Sql::Write(k) => format!("UPDATE items SET v = v || 'x' WHERE k = {k}"),
            Sql::Touch(k) => format!("UPDATE other SET n = n + 1 WHERE k = {k}"),
            Sql::Begin => "BEGIN".into(),
            Sql::Commit => "COMMIT".into(),
            Sql::Rollback => "ROLLBACK".into(),
            Sql::Bad => "SELECT nosuch FROM items".into(),
            Sql::Sleep => "SELECT pg_sleep(60)".into(),
            Sql::Copy => "COPY log FROM STDIN".into(),
        }
    }

    fn of(text: &str) -> Option<Sql> {
        let all = [
            Sql::ReadAll,
            Sql::Begin,
            Sql::Commit,
            Sql::Rollback,
            Sql::Bad,
            Sql::Sleep,
            Sql::Copy,
        ];
        let keyed = (1..=4).flat_map(|k| [Sql::ReadOne(k), Sql::Write(k), Sql::Touch(k)]);
        all.into_iter().chain(keyed).find(|sql| sql.text() == text)
    }

    pub fn is_read(self) -> bool {
        matches!(self, Sql::ReadOne(_) | Sql::ReadAll)
    }
}

/// One statement of an extended batch: Parse, Bind, a Describe of the
/// portal if `describe`, and an Execute of at most `max_rows` (0: all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exec {
    pub sql: Sql,
    pub describe: bool,
    pub max_rows: u8,
}

/// One request of a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A simple Query.
    Query(Sql),
    /// COPY-in of `lines` lines, ended by CopyDone, or by CopyFail if
    /// `fail`.
    Copy {
        lines: u8,
        fail: bool,
    },
    /// Extended statements, then one Sync.
    Batch(Vec<Exec>),
    /// A Sync on its own.
    Sync,
    Terminate,
}

impl Step {
    /// The client's frames for this step.
    pub fn frames(&self) -> Vec<Vec<u8>> {
        match self {
            Step::Query(sql) => vec![frame(b'Q', &cstr(&sql.text()))],
            Step::Copy { lines, fail } => {
                let mut out = vec![frame(b'Q', &cstr(&Sql::Copy.text()))];
                for i in 0..*lines {
                    out.push(frame(b'd', format!("line {i}\n").as_bytes()));
                }
                out.push(match fail {
                    true => frame(b'f', &cstr("given up")),
                    false => frame(b'c', &[]),
                });
                out
            }
            Step::Batch(execs) => {
                let mut out = Vec::new();
                for exec in execs {
                    let mut parse = cstr("");
                    parse.extend(cstr(&exec.sql.text()));
                    parse.extend([0, 0]);
                    out.push(frame(b'P', &parse));
                    // Unnamed portal and statement, no parameters, text.
                    out.push(frame(b'B', &[0, 0, 0, 0, 0, 0, 0, 0]));
                    if exec.describe {
                        out.push(frame(b'D', b"P\0"));
                    }
                    let mut execute = cstr("");
                    execute.put_i32(i32::from(exec.max_rows));
                    out.push(frame(b'E', &execute));
                }
                out.push(frame(b'S', &[]));
                out
            }
            Step::Sync => vec![frame(b'S', &[])],
            Step::Terminate => vec![frame(b'X', &[])],
        }
    }

    /// How many ReadyForQuery messages answer it.
    pub fn readies(&self) -> usize {
        usize::from(*self != Step::Terminate)
    }
}

/// Groups of steps; a group's steps are sent together, before any answer
/// is read (a pipeline).
#[derive(Clone, PartialEq, Eq)]
pub struct Program(pub Vec<Vec<Step>>);

impl fmt::Debug for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, group) in self.0.iter().enumerate() {
            writeln!(f)?;
            write!(f, "  {i}:")?;
            for step in group {
                write!(f, " {step:?};")?;
            }
        }
        Ok(())
    }
}

/// Few distinct reads, so that they repeat: a row, no row, all rows.
fn read() -> impl Strategy<Value = Sql> {
    prop_oneof![
        2 => Just(Sql::ReadOne(1)),
        1 => Just(Sql::ReadOne(4)),
        2 => Just(Sql::ReadAll),
    ]
}

fn statement() -> impl Strategy<Value = Sql> {
    prop_oneof![
        8 => read(),
        2 => (1u8..=4).prop_map(Sql::Write),
        1 => (1u8..=3).prop_map(Sql::Touch),
        1 => Just(Sql::Bad),
    ]
}

fn exec() -> impl Strategy<Value = Exec> {
    let max_rows = prop_oneof![3 => Just(0u8), 2 => 1u8..=3];
    (statement(), any::<bool>(), max_rows).prop_map(|(sql, describe, max_rows)| Exec {
        sql,
        describe,
        max_rows,
    })
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => statement().prop_map(Step::Query),
        2 => prop_oneof![Just(Sql::Begin), Just(Sql::Commit), Just(Sql::Rollback)]
            .prop_map(Step::Query),
        1 => Just(Step::Query(Sql::Sleep)),
        1 => (0u8..3, any::<bool>()).prop_map(|(lines, fail)| Step::Copy { lines, fail }),
        // One statement a batch is what the cache answers whole.
        8 => prop_oneof![
            3 => proptest::collection::vec(exec(), 1..2),
            1 => proptest::collection::vec(exec(), 2..4),
        ]
        .prop_map(Step::Batch),
        1 => Just(Step::Sync),
    ]
}

/// Programs of up to 19 groups of 1 to 3 steps, ending in a Terminate
/// one time in four. Reads repeat often, so the cache has work.
pub fn program() -> impl Strategy<Value = Program> {
    // Most requests wait for their answer; one group in four is a
    // pipeline.
    let group = prop_oneof![
        3 => proptest::collection::vec(step(), 1..2),
        1 => proptest::collection::vec(step(), 2..4),
    ];
    let groups = proptest::collection::vec(group, 1..20);
    (groups, prop_oneof![3 => Just(false), 1 => Just(true)]).prop_map(|(mut groups, end)| {
        if end {
            groups.push(vec![Step::Terminate]);
        }
        Program(groups)
    })
}

/// The model: one PostgreSQL session, fed the client's bytes.
#[derive(Debug)]
pub struct Backend {
    items: BTreeMap<u8, String>,
    tx: Option<Tx>,
    /// The extended batch's implicit transaction: its writes, and
    /// whether it failed.
    implicit: Option<Tx>,
    /// After an error in an extended batch: frames are skipped until Sync.
    skipping: bool,
    /// COPY-in under way: the lines received.
    copying: Option<u32>,
    statement: Option<Sql>,
    /// The bound portal: its statement, and the rows it has left.
    portal: Option<(Sql, Vec<Vec<String>>)>,
    pub ended: bool,
    /// Commits that changed `items` through `other`'s trigger: what
    /// pgcache learns of from its replication stream only.
    pub touched: bool,
}

#[derive(Debug, Clone)]
struct Tx {
    items: BTreeMap<u8, String>,
    failed: bool,
    wrote: bool,
    touched: bool,
}

impl Default for Backend {
    fn default() -> Self {
        let items = [(1, "a"), (2, "b"), (3, "c")];
        Self {
            items: items.into_iter().map(|(k, v)| (k, v.to_owned())).collect(),
            tx: None,
            implicit: None,
            skipping: false,
            copying: None,
            statement: None,
            portal: None,
            ended: false,
            touched: false,
        }
    }
}

impl Backend {
    /// Answers every frame in `input`.
    pub fn receive(&mut self, input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = input;
        while rest.len() >= 5 && !self.ended {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let (frame, tail) = rest.split_at(1 + len);
            rest = tail;
            self.on_frame(frame[0], &frame[5..], &mut out);
        }
        out
    }

    fn on_frame(&mut self, tag: u8, body: &[u8], out: &mut Vec<u8>) {
        if let Some(lines) = &mut self.copying {
            match tag {
                b'd' => *lines += 1,
                b'c' => {
                    let tag = format!("COPY {lines}");
                    self.copying = None;
                    self.wrote();
                    out.extend(complete(&tag));
                    out.extend(self.ready());
                }
                b'f' => {
                    self.copying = None;
                    out.extend(self.error("57014"));
                    out.extend(self.ready());
                }
                _ => {}
            }
            return;
        }
        match tag {
            b'Q' => self.query(&text(body), out),
            b'S' => {
                self.skipping = false;
                self.portal = None;
                if let Some(tx) = self.implicit.take()
                    && !tx.failed
                {
                    self.items = tx.items;
                    self.touched |= tx.touched;
                }
                out.extend(self.ready());
            }
            b'X' => self.ended = true,
            _ if self.skipping => {}
            b'P' => {
                let body = &body[body.iter().position(|b| *b == 0).unwrap_or(0) + 1..];
                let sql = Sql::of(&text(body)).expect("a program's statement");
                if self.failed() {
                    self.fail("25P02", out);
                } else if sql == Sql::Bad {
                    self.fail("42703", out);
                } else {
                    self.begin_implicit();
                    self.statement = Some(sql);
                    out.extend(frame(b'1', &[]));
                }
            }
            b'B' => {
                let sql = self.statement.expect("a statement to bind");
                let rows = if sql.is_read() {
                    self.rows(sql)
                } else {
                    Vec::new()
                };
                self.portal = Some((sql, rows));
                out.extend(frame(b'2', &[]));
            }
            b'D' => {
                let (sql, _) = self.portal.as_ref().expect("a portal");
                out.extend(match sql.is_read() {
                    true => description(*sql),
                    false => frame(b'n', &[]),
                });
            }
            b'E' => {
                let max = i32::from_be_bytes(body[1..5].try_into().expect("max rows"));
                self.execute(max, out);
            }
            _ => {}
        }
    }

    fn execute(&mut self, max: i32, out: &mut Vec<u8>) {
        let (sql, rows) = self.portal.as_mut().expect("a portal");
        let sql = *sql;
        if !sql.is_read() {
            self.portal = None;
            let tag = self.write(sql);
            out.extend(complete(&tag));
            return;
        }
        let take = match max {
            0 => rows.len(),
            max => rows.len().min(max as usize),
        };
        for row in rows.drain(..take) {
            out.extend(data_row(&row));
        }
        if max > 0 && take == max as usize {
            out.extend(frame(b's', &[]));
        } else {
            out.extend(complete(&format!("SELECT {take}")));
        }
    }

    fn query(&mut self, text: &str, out: &mut Vec<u8>) {
        let sql = Sql::of(text).expect("a program's statement");
        self.portal = None;
        self.statement = None;
        if self.failed() && !matches!(sql, Sql::Commit | Sql::Rollback) {
            out.extend(self.error("25P02"));
            out.extend(self.ready());
            return;
        }
        match sql {
            Sql::Begin => {
                if self.tx.is_some() {
                    out.extend(notice("25001"));
                } else {
                    self.tx = Some(Tx::of(&self.items));
                }
                out.extend(complete("BEGIN"));
            }
            Sql::Commit | Sql::Rollback => {
                let tag = match self.tx.take() {
                    None => {
                        out.extend(notice("25P01"));
                        if sql == Sql::Commit {
                            "COMMIT"
                        } else {
                            "ROLLBACK"
                        }
                    }
                    Some(tx) if tx.failed || sql == Sql::Rollback => "ROLLBACK",
                    Some(tx) => {
                        self.items = tx.items;
                        self.touched |= tx.touched;
                        "COMMIT"
                    }
                };
                out.extend(complete(tag));
            }
            Sql::Bad => out.extend(self.error("42703")),
            Sql::Sleep => {
                // Described before it runs, then cancelled.
                out.extend(description(sql));
                out.extend(self.error("57014"));
            }
            Sql::Copy => {
                self.copying = Some(0);
                out.extend(frame(b'G', &[0, 0, 1, 0, 0]));
                return;
            }
            Sql::Write(_) | Sql::Touch(_) => {
                let tag = self.write(sql);
                out.extend(complete(&tag));
            }
            Sql::ReadOne(_) | Sql::ReadAll => {
                let rows = self.rows(sql);
                out.extend(description(sql));
                for row in &rows {
                    out.extend(data_row(row));
                }
                out.extend(complete(&format!("SELECT {}", rows.len())));
            }
        }
        out.extend(self.ready());
    }

    /// The items as the session sees them now.
    fn visible(&self) -> &BTreeMap<u8, String> {
        match (&self.implicit, &self.tx) {
            (Some(tx), _) | (None, Some(tx)) => &tx.items,
            (None, None) => &self.items,
        }
    }

    fn rows(&self, sql: Sql) -> Vec<Vec<String>> {
        let items = self.visible();
        match sql {
            Sql::ReadOne(k) => items.get(&k).map(|v| vec![v.clone()]).into_iter().collect(),
            _ => items
                .iter()
                .map(|(k, v)| vec![k.to_string(), v.clone()])
                .collect(),
        }
    }

    /// Runs a write; returns its command tag.
    fn write(&mut self, sql: Sql) -> String {
        let (k, suffix, rows) = match sql {
            Sql::Write(k) => (k, 'x', None),
            Sql::Touch(k) => (k, 'y', Some(3)),
            _ => unreachable!("a write"),
        };
        let (items, touched) = match (&mut self.implicit, &mut self.tx) {
            (Some(tx), _) | (None, Some(tx)) => (&mut tx.items, &mut tx.touched),
            (None, None) => (&mut self.items, &mut self.touched),
        };
        let mut n = 0;
        if let Some(v) = items.get_mut(&k) {
            v.push(suffix);
            n = 1;
        }
        if let Some(rows) = rows {
            // `other`'s rows are 1 to 3, as are `items`'.
            n = u8::from(k <= rows);
            *touched |= n == 1;
        }
        self.wrote();
        format!("UPDATE {n}")
    }

    fn wrote(&mut self) {
        if let Some(tx) = &mut self.tx {
            tx.wrote = true;
        }
    }

    fn begin_implicit(&mut self) {
        if self.tx.is_none() && self.implicit.is_none() {
            self.implicit = Some(Tx::of(&self.items));
        }
    }

    /// The transaction block under way wrote: no hit may follow in it.
    pub fn block_wrote(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.wrote)
    }

    fn failed(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.failed)
    }

    /// An error in an extended batch: the rest is skipped until Sync.
    fn fail(&mut self, code: &str, out: &mut Vec<u8>) {
        out.extend(self.error(code));
        self.skipping = true;
        if let Some(tx) = &mut self.implicit {
            tx.failed = true;
        }
    }

    /// An ErrorResponse; the transaction block, if any, fails.
    fn error(&mut self, code: &str) -> Vec<u8> {
        if let Some(tx) = &mut self.tx {
            tx.failed = true;
        }
        notice_like(b'E', "ERROR", code)
    }

    fn ready(&self) -> Vec<u8> {
        let status = match &self.tx {
            None => b'I',
            Some(tx) if tx.failed => b'E',
            Some(_) => b'T',
        };
        frame(b'Z', &[status])
    }
}

impl Tx {
    fn of(items: &BTreeMap<u8, String>) -> Self {
        Tx {
            items: items.clone(),
            failed: false,
            wrote: false,
            touched: false,
        }
    }
}

pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = BytesMut::with_capacity(5 + body.len());
    f.put_u8(tag);
    f.put_i32(4 + body.len() as i32);
    f.put_slice(body);
    f.to_vec()
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn text(body: &[u8]) -> String {
    let end = body.iter().position(|b| *b == 0).unwrap_or(body.len());
    String::from_utf8_lossy(&body[..end]).into_owned()
}

fn complete(tag: &str) -> Vec<u8> {
    frame(b'C', &cstr(tag))
}

fn notice(code: &str) -> Vec<u8> {
    notice_like(b'N', "WARNING", code)
}

fn notice_like(tag: u8, severity: &str, code: &str) -> Vec<u8> {
    let mut body = Vec::new();
    for (field, value) in [
        (b'S', severity),
        (b'V', severity),
        (b'C', code),
        (b'M', code),
    ] {
        body.push(field);
        body.extend(cstr(value));
    }
    body.push(0);
    frame(tag, &body)
}

fn description(sql: Sql) -> Vec<u8> {
    let columns: &[(&str, u32)] = match sql {
        Sql::ReadOne(_) => &[("v", 25)],
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

fn data_row(values: &[String]) -> Vec<u8> {
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
fn field(body: &[u8], wanted: u8) -> String {
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
