//! What the model PostgreSQL answers: its tables, transactions and
//! portals, and the messages it sends.

use super::*;
use std::collections::BTreeSet;

mod statements;

use statements::split_cstr;

/// The model: one PostgreSQL session, fed the client's bytes.
#[derive(Debug, Clone)]
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
    /// The unnamed statement, and the named ones.
    statement: Option<Sql>,
    statements: BTreeMap<Vec<u8>, Sql>,
    /// The bound portal: its statement, and the rows it has left.
    portal: Option<(Sql, Vec<Vec<String>>)>,
    pub ended: bool,
    /// The keys of `items` committed changes through `other`'s trigger
    /// wrote: what pgcache learns of from its replication stream only.
    pub touched: BTreeSet<u8>,
    /// The session's `application_name` ("": the default), and as it was
    /// last reported to the client.
    name: String,
    reported: String,
    /// How many times pgcache put a client's settings on this session,
    /// over its connections ([`Self::reconnected`]).
    pub applied: usize,
}

#[derive(Debug, Clone)]
struct Tx {
    items: BTreeMap<u8, String>,
    name: String,
    failed: bool,
    wrote: bool,
    touched: BTreeSet<u8>,
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
            statements: BTreeMap::new(),
            portal: None,
            ended: false,
            touched: BTreeSet::new(),
            name: String::new(),
            reported: String::new(),
            applied: 0,
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
                    self.commit(tx);
                }
                out.extend(self.ready());
            }
            b'X' => self.ended = true,
            _ if self.skipping => {}
            _ => self.on_extended(tag, body, out),
        }
    }

    /// Parse, Bind, Close, Describe or Execute, not skipped.
    fn on_extended(&mut self, tag: u8, body: &[u8], out: &mut Vec<u8>) {
        match tag {
            b'P' => self.parse(body, out),
            b'B' => {
                let (_portal, body) = split_cstr(body);
                let (name, _) = split_cstr(body);
                let Some(sql) = self.prepared(name) else {
                    return self.fail_missing(name, out);
                };
                if self.failed() {
                    self.fail("25P02", out);
                    return;
                }
                self.begin_implicit();
                let rows = if sql.is_read() {
                    self.rows(sql)
                } else {
                    Vec::new()
                };
                self.portal = Some((sql, rows));
                out.extend(frame(b'2', &[]));
            }
            b'C' => {
                let (name, _) = split_cstr(&body[1..]);
                match (body[0], name.is_empty()) {
                    (b'S', true) => self.statement = None,
                    (b'S', false) => _ = self.statements.remove(name),
                    (_, true) => self.portal = None,
                    // Only the unnamed portal is ever bound.
                    (_, false) => {}
                }
                out.extend(frame(b'3', &[]));
            }
            b'D' if body[0] == b'S' => self.describe_statement(&body[1..], out),
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
        if let Some(name) = applied_name(text) {
            self.apply(name, out);
            return;
        }
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
                    self.tx = Some(self.snapshot());
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
                        self.commit(tx);
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
            Sql::Set(n) => {
                *self.name_mut() = format!("a{n}");
                out.extend(complete("SET"));
            }
            Sql::ShowName => {
                out.extend(description(sql));
                out.extend(data_row(&[self.visible_name().to_owned()]));
                out.extend(complete("SHOW"));
            }
            Sql::ReadOne(_) | Sql::ReadAll | Sql::Settings => {
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
            Sql::Settings => {
                let name = self.visible_name();
                let set = (!name.is_empty()).then_some(("application_name", name));
                [("session_authorization", "alice"), ("role", "none")]
                    .into_iter()
                    .chain(set)
                    .map(|(name, value)| vec![name.to_owned(), value.to_owned()])
                    .collect()
            }
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
            if n == 1 {
                touched.insert(k);
            }
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
            self.implicit = Some(self.snapshot());
        }
    }

    /// A transaction's start: what it sees of the items and the
    /// settings.
    fn snapshot(&self) -> Tx {
        Tx {
            items: self.items.clone(),
            name: self.name.clone(),
            failed: false,
            wrote: false,
            touched: BTreeSet::new(),
        }
    }

    fn commit(&mut self, tx: Tx) {
        self.items = tx.items;
        self.name = tx.name;
        self.touched.extend(tx.touched);
    }

    /// `application_name` as the session sees it now: a failed
    /// transaction's settings are undone at once.
    fn visible_name(&self) -> &str {
        match (&self.implicit, &self.tx) {
            (Some(tx), _) | (None, Some(tx)) if !tx.failed => &tx.name,
            _ => &self.name,
        }
    }

    fn name_mut(&mut self) -> &mut String {
        match (&mut self.implicit, &mut self.tx) {
            (Some(tx), _) | (None, Some(tx)) => &mut tx.name,
            (None, None) => &mut self.name,
        }
    }

    /// pgcache puts a client's settings on the session: back to its login
    /// state (`RESET ALL`), then `name` as its `application_name`.
    fn apply(&mut self, name: Option<String>, out: &mut Vec<u8>) {
        self.applied += 1;
        for tag in ["SET", "RESET", "RESET"] {
            out.extend(complete(tag));
        }
        self.name = String::new();
        if let Some(name) = name {
            self.name = name;
            out.extend(frame(b'T', &[0, 0]));
            out.extend(frame(b'D', &[0, 0]));
            out.extend(complete("SELECT 1"));
        }
        out.extend(self.ready());
    }

    /// [`Step::Direct`]: another session writes key `k` and commits, if
    /// this one has no transaction open (`None`: it has, and the write is
    /// not made). `Some(true)`: a row changed.
    pub fn direct_write(&mut self, k: u8) -> Option<bool> {
        if self.tx.is_some() || self.implicit.is_some() {
            return None;
        }
        let row = self.items.get_mut(&k);
        let changed = row.is_some();
        if let Some(v) = row {
            v.push('z');
        }
        Some(changed)
    }

    /// [`Step::Other`]: another session of the same database, if this one
    /// has no transaction open (`None`: it has, and the other session
    /// runs nothing). It sees what is committed; what it commits, this one
    /// sees once it is given back ([`Self::rejoin`]).
    pub fn other(&self) -> Option<Backend> {
        if self.tx.is_some() || self.implicit.is_some() {
            return None;
        }
        Some(Backend {
            items: self.items.clone(),
            ..Backend::default()
        })
    }

    /// The same database on a new connection: what is committed, and no
    /// session state (a closed connection's transaction rolled back).
    pub fn reconnected(&self) -> Backend {
        Backend {
            items: self.items.clone(),
            touched: self.touched.clone(),
            applied: self.applied,
            ..Backend::default()
        }
    }

    /// What the other session of [`Self::other`] committed, and the rows
    /// its triggers changed.
    pub fn rejoin(&mut self, other: Backend) {
        self.items = other.items;
        self.touched.extend(other.touched);
    }

    /// The rows of `items` committed: what a standby replays.
    pub fn committed(&self) -> &BTreeMap<u8, String> {
        &self.items
    }

    /// A standby's session has replayed as far as `items`.
    pub fn replayed(&mut self, items: &BTreeMap<u8, String>) {
        self.items.clone_from(items);
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
        let error = self.error(code);
        self.failed_with(error, out);
    }

    /// [`Self::fail`], with PostgreSQL's `message`: for what pgcache may
    /// answer in the server's place, in the server's words.
    fn fail_saying(&mut self, code: &str, message: &str, out: &mut Vec<u8>) {
        let error = self.error_saying(code, message);
        self.failed_with(error, out);
    }

    fn failed_with(&mut self, error: Vec<u8>, out: &mut Vec<u8>) {
        out.extend(error);
        self.skipping = true;
        if let Some(tx) = &mut self.implicit {
            tx.failed = true;
        }
    }

    /// An ErrorResponse; the transaction block, if any, fails. Its
    /// message is its code, but where pgcache may answer in the server's
    /// place.
    fn error(&mut self, code: &str) -> Vec<u8> {
        let message = match code {
            "25P02" => {
                "current transaction is aborted, commands ignored until end of transaction block"
            }
            _ => code,
        };
        self.error_saying(code, message)
    }

    fn error_saying(&mut self, code: &str, message: &str) -> Vec<u8> {
        if let Some(tx) = &mut self.tx {
            tx.failed = true;
        }
        saying(b'E', "ERROR", code, message)
    }

    /// ReadyForQuery, after a ParameterStatus if `application_name`
    /// changed since it was last reported (as PostgreSQL reports it, even
    /// inside a transaction block that may roll it back).
    fn ready(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let name = self.visible_name().to_owned();
        if name != self.reported {
            let mut body = cstr("application_name");
            body.extend(cstr(&name));
            out.extend(frame(b'S', &body));
            self.reported = name;
        }
        let status = match &self.tx {
            None => b'I',
            Some(tx) if tx.failed => b'E',
            Some(_) => b'T',
        };
        out.extend(frame(b'Z', &[status]));
        out
    }
}

/// How pgcache's query that puts a client's settings on a connection
/// begins ([`Backend::apply`]).
const APPLY: &str = "SET SESSION AUTHORIZATION DEFAULT; RESET ROLE; RESET ALL";

/// The `application_name` pgcache's settings query sets, if `text` is one
/// (`Some(None)`: it only resets).
fn applied_name(text: &str) -> Option<Option<String>> {
    let rest = text.strip_prefix(APPLY)?;
    if rest.is_empty() {
        return Some(None);
    }
    let values = rest.split_once("VALUES ('application_name', '")?.1;
    let (name, _) = values.split_once('\'')?;
    Some(Some(name.to_owned()))
}
