//! A model of PostgreSQL for the engine's property test: programs of
//! client messages (simple, extended and pipelined requests, statements
//! prepared by name and run, COPY, errors, cancels, Terminate) on two
//! tables, between which another session writes directly and a third one,
//! through pgcache, reads and writes, and what PostgreSQL answers them.
//!
//! It uses nothing of pgcache's, so `tests/model.rs` replays the same
//! programs against a real PostgreSQL and checks the model against it.
//! The tables: `items (k int primary key, v text)` holding `(1,'a')`,
//! `(2,'b')`, `(3,'c')`, and `log (line text)`.

use std::collections::BTreeMap;
use std::fmt;

use bytes::{BufMut, BytesMut};
use proptest::prelude::*;

mod backend;
mod wire;

pub use backend::*;
pub use wire::*;

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
    /// Sets `application_name` to `a{n}` for the session (transactional,
    /// as every SET is).
    Set(u8),
    /// `application_name` as the session has it: what shows whose
    /// settings a pooled connection carries.
    ShowName,
    /// What pgcache asks a pooled connection of a client's settings before
    /// it goes back to the pool: never in a program. The model's session
    /// user is `alice`, with no role, and the one setting a program makes.
    Settings,
}

/// How pgcache's query of a session's settings begins.
const SETTINGS: &str = "SELECT 'session_authorization', ";

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
            Sql::Set(n) => format!("SET application_name = 'a{n}'"),
            Sql::ShowName => "SHOW application_name".into(),
            Sql::Settings => SETTINGS.into(),
        }
    }

    fn of(text: &str) -> Option<Sql> {
        if text.starts_with(SETTINGS) {
            return Some(Sql::Settings);
        }
        let all = [
            Sql::ReadAll,
            Sql::Begin,
            Sql::Commit,
            Sql::Rollback,
            Sql::Bad,
            Sql::Sleep,
            Sql::Copy,
            Sql::ShowName,
            Sql::Set(1),
            Sql::Set(2),
        ];
        let keyed = (1..=4).flat_map(|k| [Sql::ReadOne(k), Sql::Write(k), Sql::Touch(k)]);
        all.into_iter().chain(keyed).find(|sql| sql.text() == text)
    }

    pub fn is_read(self) -> bool {
        matches!(self, Sql::ReadOne(_) | Sql::ReadAll | Sql::Settings)
    }
}

/// One statement of an extended batch: Parse, Bind, a Describe of the
/// portal if `describe`, and an Execute of at most `max_rows` (0: all).
/// With `named`, a run of the statement prepared as `s{n}`
/// ([`Step::Prepare`]), with no Parse: what a driver sends for each run of
/// a prepared statement, and what pgcache may decide whole. Its `sql` is
/// then what that statement is ([`Backend::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exec {
    pub sql: Sql,
    pub describe: bool,
    pub max_rows: u8,
    pub named: Option<u8>,
}

/// The name of prepared statement `n`.
pub fn statement_name(n: u8) -> Vec<u8> {
    format!("s{n}").into_bytes()
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
    /// `sql` prepared as statement `s{name}` (Parse, Sync); a name
    /// prepared already is refused (42P05).
    Prepare {
        name: u8,
        sql: Sql,
    },
    /// Statement `s{n}` described (Describe, Sync): refused if it is not
    /// prepared (26000).
    Describe(u8),
    /// Statement `s{n}` closed (Close, Sync), prepared or not.
    Close(u8),
    /// A Sync on its own.
    Sync,
    Terminate,
    /// Another session appends `z` to the value of key `k` of `items` and
    /// commits, between this session's requests, when this one has no
    /// transaction open: a write pgcache learns of from its replication
    /// stream only. The client sends nothing.
    Direct(u8),
    /// Another session of the same user, through pgcache, runs `sql` on
    /// its own, between this session's requests, when this one has no
    /// transaction open: it shares this one's cache, and its writes are
    /// pgcache's to see. This session sends nothing.
    Other(Sql),
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
                    let name = exec.named.map(statement_name).unwrap_or_default();
                    if exec.named.is_none() {
                        out.push(parse(&name, exec.sql));
                    }
                    // The unnamed portal, no parameters, text.
                    let mut bind = vec![0];
                    bind.extend(&name);
                    bind.extend([0, 0, 0, 0, 0, 0, 0]);
                    out.push(frame(b'B', &bind));
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
            Step::Prepare { name, sql } => {
                vec![parse(&statement_name(*name), *sql), frame(b'S', &[])]
            }
            Step::Describe(n) | Step::Close(n) => {
                let tag = if matches!(self, Step::Describe(_)) {
                    b'D'
                } else {
                    b'C'
                };
                let mut body = vec![b'S'];
                body.extend(statement_name(*n));
                body.push(0);
                vec![frame(tag, &body), frame(b'S', &[])]
            }
            Step::Sync => vec![frame(b'S', &[])],
            Step::Terminate => vec![frame(b'X', &[])],
            Step::Direct(_) | Step::Other(_) => Vec::new(),
        }
    }

    /// How many ReadyForQuery messages answer it.
    pub fn readies(&self) -> usize {
        usize::from(!matches!(
            self,
            Step::Terminate | Step::Direct(_) | Step::Other(_)
        ))
    }

    /// What the other session runs for [`Step::Direct`].
    #[allow(dead_code, reason = "the replay against PostgreSQL runs it")]
    pub fn direct_sql(k: u8) -> String {
        format!("UPDATE items SET v = v || 'z' WHERE k = {k}")
    }
}

/// A Parse of `sql` as statement `name` ("": the unnamed one), with no
/// parameter types.
fn parse(name: &[u8], sql: Sql) -> Vec<u8> {
    let mut body = name.to_vec();
    body.push(0);
    body.extend(cstr(&sql.text()));
    body.extend([0, 0]);
    frame(b'P', &body)
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
        1 => Just(Sql::ReadOne(2)),
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

/// What the other session through pgcache runs: reads, writes of one
/// key (seen by pgcache or through a trigger), and a look at its
/// settings, which it never changes.
fn others() -> impl Strategy<Value = Sql> {
    prop_oneof![
        3 => read(),
        2 => (1u8..=4).prop_map(Sql::Write),
        1 => (1u8..=3).prop_map(Sql::Touch),
        1 => Just(Sql::ShowName),
    ]
}

fn exec() -> impl Strategy<Value = Exec> {
    let max_rows = prop_oneof![1 => Just(0u8), 1 => 1u8..=3];
    // Statements 1 and 2 are prepared first, most often; 3 by a
    // program's Prepare, if any.
    let named = prop_oneof![
        4 => Just(None),
        4 => (1u8..=2).prop_map(Some),
        1 => Just(Some(3)),
    ];
    (statement(), any::<bool>(), max_rows, named).prop_map(|(sql, describe, max_rows, named)| {
        Exec {
            sql,
            describe,
            max_rows,
            named,
        }
    })
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => statement().prop_map(Step::Query),
        2 => prop_oneof![Just(Sql::Begin), Just(Sql::Commit), Just(Sql::Rollback)]
            .prop_map(Step::Query),
        1 => Just(Step::Query(Sql::Sleep)),
        // Settings as simple queries only: they change what a pooled
        // connection carries, and show which it carries.
        1 => prop_oneof![(1u8..=2).prop_map(Sql::Set), Just(Sql::ShowName)]
            .prop_map(Step::Query),
        1 => (0u8..3, any::<bool>()).prop_map(|(lines, fail)| Step::Copy { lines, fail }),
        // One statement a batch is what the cache answers whole.
        8 => prop_oneof![
            3 => proptest::collection::vec(exec(), 1..2),
            1 => proptest::collection::vec(exec(), 2..4),
        ]
        .prop_map(Step::Batch),
        1 => Just(Step::Sync),
        // A statement described, or closed: mostly the one not prepared
        // first, so that most runs still find theirs.
        1 => prop_oneof![
            2 => (1u8..=3).prop_map(Step::Describe),
            1 => prop_oneof![3 => Just(3), 1 => 1u8..=2].prop_map(Step::Close),
        ],
        // Mostly of reads, and of a name not prepared first: most runs
        // find their statement, some Parses a refusal.
        1 => (prop_oneof![3 => Just(3), 1 => 1u8..=2], prop_oneof![3 => read(), 1 => statement()])
            .prop_map(|(name, sql)| Step::Prepare { name, sql }),
    ]
}

/// Programs of up to 19 groups of 1 to 3 steps, ending in a Terminate
/// one time in four. Reads repeat often, so the cache has work.
pub fn program() -> impl Strategy<Value = Program> {
    // Most requests wait for their answer; one group in four is a
    // pipeline. pgcache answers a second Parse of a name, sent before the first is
    // answered, as if the first succeeded (docs/pooling.md): no pipeline
    // prepares a name twice.
    let pipeline = proptest::collection::vec(step(), 2..4).prop_filter("a name once", |steps| {
        let mut names = steps.iter().filter_map(|s| match s {
            Step::Prepare { name, .. } => Some(*name),
            _ => None,
        });
        let (first, second) = (names.next(), names.next());
        first.is_none() || first != second && names.next().is_none()
    });
    let group = prop_oneof![
        12 => proptest::collection::vec(step(), 1..2),
        4 => pipeline,
        1 => (1u8..=4).prop_map(|k| vec![Step::Direct(k)]),
        2 => others().prop_map(|sql| vec![Step::Other(sql)]),
    ];
    let groups = proptest::collection::vec(group, 1..20);
    // Most sessions prepare their statements first, as drivers do: most
    // runs of a named statement find it.
    let prepared = proptest::option::weighted(0.75, (read(), read()));
    let end = prop_oneof![3 => Just(false), 1 => Just(true)];
    (prepared, groups, end).prop_map(|(prepared, mut groups, end)| {
        if let Some((first, second)) = prepared {
            let prepare = |name, sql| vec![Step::Prepare { name, sql }];
            groups.splice(0..0, [prepare(1, first), prepare(2, second)]);
        }
        if end {
            groups.push(vec![Step::Terminate]);
        }
        Program(groups)
    })
}
