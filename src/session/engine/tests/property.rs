//! The engine between a client and the model backend ([`super::model`]),
//! on generated programs. What the client sees through the engine must be
//! what the model backend would have sent it directly (a hit's rows are
//! the same rows); nothing incomplete, failed or suspended is stored; no
//! hit follows a write in its transaction; nothing panics. The table read
//! and written is keyed by row: reads by key stay cached past writes of
//! other keys, through pgcache, by a trigger and by another session (the
//! last two known through the replication stream). A second session
//! through pgcache, on the same instance, reads and writes between the
//! first one's requests: what it is served must be what the model answers
//! it, and what it writes must not be served stale to the first. Each
//! step's frames come in one read, as the driver hands its buffer over:
//! a run of a named statement may be decided whole
//! ([`Engine::whole_batch`](crate::session::engine::Engine)); in
//! transaction mode every other step's come one read each, the server
//! answering what went out between them (an error may come before the
//! rest of its batch). With
//! caching off the same programs run, and nothing may be served.
//! `tests/model.rs` checks the model against PostgreSQL.

use std::cell::RefCell;
use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use super::model::{self, Backend, Exec, Program, Seen, Sql, Step};
use super::pooled::{PoolConn, client, pump};
use super::{Action, Flow, Rig, store_whole};
use crate::cache::{Bumps, rowkey};

/// How often a run met what the invariants are about.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) fills: usize,
    hits: usize,
    /// Hits of a row-limited Execute.
    limited_hits: usize,
    /// Hits of a run of a named statement (Bind first, no Parse): what the
    /// engine may decide whole, in the read buffer.
    prepared_hits: usize,
    /// Parses and Binds refused for their name: prepared already (42P05),
    /// or not prepared (26000).
    name_refusals: usize,
    suspended: usize,
    errors_mid_batch: usize,
    copies: usize,
    cancels: usize,
    pipelines: usize,
    /// Hits of a read by key with a write of another key of its table
    /// since its last read: kept by row.
    hits_past_other_writes: usize,
    /// Rows another session changed, known from the replication stream.
    direct_writes: usize,
    /// Reads of the second session through pgcache served from the cache.
    other_hits: usize,
    /// Writes of the second session through pgcache.
    other_writes: usize,
    /// Transaction mode: connections taken from the pool and given back.
    checkouts: usize,
    give_backs: usize,
    read_backs: usize,
    /// Client settings put on the pool's connection.
    applies: usize,
    /// `application_name` shown as the first session set it.
    names_shown: usize,
}

/// Where the sessions' server connections come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Each its own, for its whole life.
    Session,
    /// The pool's one, which they take in turns.
    Transaction,
}

/// Whether the sessions cache: with caching off, pass-through is the
/// policy, and every request must go to the backend as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Caching {
    On,
    Off,
}

/// Per key of `items`: whether another key was written since it was last
/// read.
#[derive(Default)]
struct Writes(BTreeMap<u8, bool>);

impl Writes {
    /// `step` was sent (and `hit`: answered from the cache): whether it was
    /// a read by key of a key another write passed since its last read.
    fn step(&mut self, step: &Step, hit: bool) -> bool {
        let sqls: Vec<Sql> = match step {
            Step::Query(sql) => vec![*sql],
            Step::Batch(execs) => execs.iter().map(|e| e.sql).collect(),
            // Another session's write of a key, as this one's.
            Step::Direct(k) => vec![Sql::Write(*k)],
            Step::Other(sql @ (Sql::Write(_) | Sql::Touch(_))) => vec![*sql],
            _ => Vec::new(),
        };
        let mut survived = false;
        for sql in sqls {
            match sql {
                Sql::ReadOne(k) => {
                    survived |= hit && self.0.get(&k) == Some(&true);
                    self.0.insert(k, false);
                }
                Sql::Write(j) | Sql::Touch(j) => {
                    for k in 1..=4 {
                        if k != j {
                            self.0.entry(k).and_modify(|w| *w = true);
                        }
                    }
                    self.0.remove(&j);
                }
                _ => {}
            }
        }
        survived
    }
}

/// The model backend's answers to each step of `program`, sent directly:
/// the answer, whether the transaction block wrote before it, and the
/// step with what its runs of named statements run ([`Backend::resolve`]).
pub(super) fn direct(program: &Program) -> Vec<(Vec<u8>, bool, Step)> {
    let mut backend = Backend::default();
    let mut answers = Vec::new();
    for step in program.0.iter().flatten() {
        let step = backend.resolve(step);
        let wrote = backend.block_wrote();
        if let Step::Direct(k) = step {
            backend.direct_write(k);
        }
        if let Step::Other(sql) = step
            && let Some(mut theirs) = backend.other()
        {
            theirs.receive(&Step::Query(sql).frames()[0]);
            backend.rejoin(theirs);
        }
        let mut answer = Vec::new();
        for frame in step.frames() {
            answer.extend(backend.receive(&frame));
        }
        let readies = model::seen(&answer).iter().filter(|m| m.tag == 'Z').count();
        assert_eq!(readies, step.readies(), "{step:?}");
        answers.push((answer, wrote, step));
    }
    answers
}

/// Runs `program` through an engine in front of the model backend.
pub(super) fn through_engine(
    program: &Program,
    counts: &mut Counts,
    mode: Mode,
    caching: Caching,
) -> Result<(), TestCaseError> {
    let answers = direct(program);
    let mut run = Run::new(mode, caching, counts);
    let mut steps = answers.iter();
    for group in &program.0 {
        run.counts.pipelines += usize::from(group.len() > 1);
        let mut closed = false;
        for _ in group {
            let (_, wrote, step) = steps.next().expect("an answer per step");
            closed = run.step(step, *wrote)?;
            if closed {
                break;
            }
        }
        run.forward()?;
        if closed {
            break;
        }
    }
    let seen = run.finish();
    let expected: Vec<u8> = answers.iter().flat_map(|(a, ..)| a.clone()).collect();
    if seen != expected {
        let (seen, expected) = (model::seen(&seen), model::seen(&expected));
        let at = seen
            .iter()
            .zip(&expected)
            .take_while(|(a, b)| a == b)
            .count();
        return Err(TestCaseError::fail(format!(
            "the client saw other messages from message {at}: {:?} where the backend sends {:?}",
            &seen[at.min(seen.len())..],
            &expected[at.min(expected.len())..],
        )));
    }
    count(&answers, counts);
    Ok(())
}

/// One program's run: the two sessions through pgcache, their server
/// side, and what the first session's client was sent.
struct Run<'c> {
    mode: Mode,
    rig: Rig,
    /// The second session, on the same instance.
    beside: Rig,
    /// The first session's server session; in transaction mode, the
    /// pool's one connection's, which both sessions take in turns.
    backend: Backend,
    conn: PoolConn,
    /// Transaction mode: the next step's frames come one read each, the
    /// server answering what went out between them (every other step).
    split: bool,
    seen: Vec<u8>,
    writes: Writes,
    counts: &'c mut Counts,
}

impl<'c> Run<'c> {
    fn new(mode: Mode, caching: Caching, counts: &'c mut Counts) -> Self {
        let mut rig = match mode {
            Mode::Session => Rig::logged_in(),
            Mode::Transaction => Rig::new().in_transaction_mode(),
        }
        .keying();
        rig.knows_table("log");
        rig.knows_table("other");
        rig.engine.caching = caching == Caching::On;
        let mut beside = rig.beside();
        // Caching is the instance's: on or off for every session.
        beside.engine.caching = rig.engine.caching;
        Self {
            mode,
            rig,
            beside,
            backend: Backend::default(),
            conn: PoolConn::default(),
            split: true,
            seen: Vec::new(),
            writes: Writes::default(),
            counts,
        }
    }

    /// One step of the program (`wrote`: the first session's transaction
    /// block wrote before it); returns whether its client ended the
    /// session.
    fn step(&mut self, step: &Step, wrote: bool) -> Result<bool, TestCaseError> {
        match step {
            Step::Direct(k) => {
                if self.backend.direct_write(*k) == Some(true) {
                    replicate(&mut self.rig, *k);
                    self.counts.direct_writes += 1;
                    self.writes.step(step, false);
                }
                Ok(false)
            }
            Step::Other(sql) => {
                if let Some(theirs) = self.backend.other() {
                    self.other(theirs, *sql)?;
                    self.writes.step(step, false);
                }
                Ok(false)
            }
            _ => self.client(step, wrote),
        }
    }

    /// The first session's client sends `step`: what is served from the
    /// cache is checked against the transaction's writes.
    fn client(&mut self, step: &Step, wrote: bool) -> Result<bool, TestCaseError> {
        // The step's frames come in one read, or in transaction mode one
        // read each, the server answering what went out between them.
        let mut bytes = step.frames().concat();
        let flow = match self.mode {
            Mode::Session => self.rig.client_data_then(&bytes, |_, _| {}),
            Mode::Transaction => {
                let split = self.split;
                self.split = !split;
                let frames = step.frames();
                if split {
                    bytes = frames.last().expect("a frame").clone();
                    for frame in &frames[..frames.len() - 1] {
                        let server = (&mut self.conn, &mut self.backend);
                        client(&mut self.rig, 0, server, frame)?;
                        let (conn, backend, seen) =
                            (&mut self.conn, &mut self.backend, &mut self.seen);
                        pump(
                            &mut self.rig,
                            0,
                            conn,
                            backend,
                            seen,
                            &mut self.counts.fills,
                        )?;
                    }
                }
                let server = (&mut self.conn, &mut self.backend);
                client(&mut self.rig, 0, server, &bytes)?
            }
        };
        let closed = flow == Flow::Close;
        let staged = self.rig.sent_to_client();
        let served = model::seen(&staged);
        let hit = served.iter().any(|m| m.tag == 'D' || m.tag == 'C');
        self.counts.hits_past_other_writes += usize::from(self.writes.step(step, hit));
        if hit {
            self.counts.hits += 1;
            if let Step::Batch(execs) = step {
                self.counts.limited_hits += usize::from(execs.iter().any(|e| e.max_rows > 0));
                self.counts.prepared_hits += usize::from(execs[0].named.is_some());
            }
            prop_assert!(
                !wrote && !writes_then_reads(step),
                "{step:?} was served from the cache after a write in its transaction"
            );
        }
        self.seen.extend(staged);
        Ok(closed)
    }

    /// [`Step::Other`]: the second session sends `sql` through its
    /// engine, and must see what a session of its own (`theirs`) is
    /// answered directly. In session mode it runs on that session, whose
    /// commits the first then sees; in transaction mode on the pool's
    /// connection, in its turn.
    fn other(&mut self, mut theirs: Backend, sql: Sql) -> Result<(), TestCaseError> {
        let query = Step::Query(sql).frames().remove(0);
        let expected = theirs.clone().receive(&query);
        let flow = match self.mode {
            Mode::Session => self.beside.client(&query),
            Mode::Transaction => {
                let server = (&mut self.conn, &mut self.backend);
                client(&mut self.beside, 1, server, &query)?
            }
        };
        prop_assert_eq!(flow, Flow::Continue);
        let mut seen = self.beside.sent_to_client();
        self.counts.other_hits += usize::from(!seen.is_empty());
        self.counts.other_writes += usize::from(!sql.is_read());
        match self.mode {
            Mode::Session => {
                answer_forwarded(&mut self.beside, &mut theirs, &mut seen, self.counts)?;
                self.backend.rejoin(theirs);
            }
            Mode::Transaction => {
                let (conn, backend) = (&mut self.conn, &mut self.backend);
                let fills = &mut self.counts.fills;
                pump(&mut self.beside, 1, conn, backend, &mut seen, fills)?;
                replicate_touched(&mut self.beside, &mut self.backend);
            }
        }
        prop_assert_eq!(
            model::seen(&seen),
            model::seen(&expected),
            "the second session's {:?}",
            sql
        );
        Ok(())
    }

    /// The server answers what the first session forwarded.
    fn forward(&mut self) -> Result<(), TestCaseError> {
        let (rig, backend, seen) = (&mut self.rig, &mut self.backend, &mut self.seen);
        match self.mode {
            Mode::Session => answer_forwarded(rig, backend, seen, self.counts),
            Mode::Transaction => {
                pump(
                    rig,
                    0,
                    &mut self.conn,
                    backend,
                    seen,
                    &mut self.counts.fills,
                )?;
                replicate_touched(rig, backend);
                Ok(())
            }
        }
    }

    /// What the first session's client was sent, with the pool's counts
    /// added.
    fn finish(self) -> Vec<u8> {
        self.counts.checkouts += self.conn.checkouts;
        self.counts.give_backs += self.conn.give_backs;
        self.counts.read_backs += self.conn.read_backs;
        self.counts.applies += self.backend.applied;
        self.seen
    }
}

/// The backend answers whatever the engine forwarded, until nothing is;
/// the stores the engine asks for are checked and carried out.
pub(super) fn answer_forwarded(
    rig: &mut Rig,
    backend: &mut Backend,
    seen: &mut Vec<u8>,
    counts: &mut Counts,
) -> Result<(), TestCaseError> {
    loop {
        let sent = rig.sent_to_backend();
        if sent.is_empty() {
            return Ok(());
        }
        let answer = backend.receive(&sent);
        seen.extend(rig.backend(&[answer]));
        replicate_touched(rig, backend);
        for action in std::mem::take(&mut rig.engine.actions) {
            match action {
                Action::Store(fill, bytes) => {
                    store_whole(rig, *fill, &bytes)?;
                    counts.fills += 1;
                }
                Action::Fetch => rig.fetched(),
                _ => {}
            }
        }
    }
}

/// What the replication stream reports of the trigger's committed writes:
/// the rows of `items` they changed.
pub(super) fn replicate_touched(rig: &mut Rig, backend: &mut Backend) {
    for k in std::mem::take(&mut backend.touched) {
        replicate(rig, k);
    }
}

/// What the replication stream reports of a committed change of row `k`
/// of `items` pgcache did not see go out, applied as the stream applies it.
/// With the table's facts forgotten (a statement pgcache cannot know the
/// effects of), the change is the whole table's.
fn replicate(rig: &mut Rig, k: u8) {
    let db = &rig.engine.db;
    let identity = db
        .catalog
        .relation("items")
        .and_then(|facts| facts.identity);
    let stripe = identity.map(|id| {
        let key = [rowkey::Canonical::Int(k.into())];
        (id.signature, [rowkey::stripe(id.signature, &key)])
    });
    let mut bumps = Bumps::default();
    let row = stripe
        .as_ref()
        .map(|(signature, stripes)| (*signature, &stripes[..]));
    db.relation_changed("items", row, &mut bumps);
    db.apply_local(&bumps);
}

/// A batch with a read after a write: the read sees the write.
fn writes_then_reads(step: &Step) -> bool {
    let Step::Batch(execs) = step else {
        return false;
    };
    let first_write = execs
        .iter()
        .position(|e| matches!(e.sql, Sql::Write(_) | Sql::Touch(_)));
    first_write.is_some_and(|w| execs[w..].iter().any(|e: &Exec| e.sql.is_read()))
}

fn count(answers: &[(Vec<u8>, bool, Step)], counts: &mut Counts) {
    for (answer, _, step) in answers {
        let answer: Vec<Seen> = model::seen(answer);
        let has = |tag: char, what: &str| {
            answer
                .iter()
                .any(|m| m.tag == tag && (what.is_empty() || m.what == what))
        };
        counts.suspended += answer.iter().filter(|m| m.tag == 's').count();
        counts.name_refusals += answer
            .iter()
            .filter(|m| m.tag == 'E' && (m.what == "42P05" || m.what == "26000"))
            .count();
        counts.copies += usize::from(has('G', ""));
        match step {
            Step::Query(Sql::Sleep) => counts.cancels += usize::from(has('E', "57014")),
            Step::Query(Sql::ShowName) => {
                counts.names_shown +=
                    usize::from(answer.iter().any(|m| m.tag == 'D' && !m.what.is_empty()))
            }
            Step::Batch(_) => {
                let error = answer.iter().position(|m| m.tag == 'E');
                counts.errors_mid_batch += usize::from(error.is_some_and(|at| at > 0));
            }
            _ => {}
        }
    }
}

/// Runs `cases` generated programs in `mode`: the same programs every run,
/// so that the counts hold and a failure comes back.
fn run(mode: Mode, caching: Caching, cases: u32) -> Counts {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let counts = RefCell::new(Counts::default());
    let result = runner.run(&model::program(), |program| {
        through_engine(&program, &mut counts.borrow_mut(), mode, caching)
    });
    if let Err(e) = result {
        panic!("{mode:?}, {caching:?}: {e}");
    }
    let c = counts.into_inner();
    eprintln!("{mode:?}, {caching:?}: {c:?}");
    c
}

/// What the protocol's invariants are about, with caching on or off.
fn protocol_events(c: &Counts) -> [(&'static str, usize); 7] {
    [
        ("statement names refused", c.name_refusals),
        ("suspended portals", c.suspended),
        ("errors mid-batch", c.errors_mid_batch),
        ("COPYs", c.copies),
        ("cancels", c.cancels),
        ("pipelines", c.pipelines),
        ("writes of the second session", c.other_writes),
    ]
}

/// Not vacuous: every kind of event the invariants are about happened,
/// many times.
fn often(c: &Counts, also: &[(&str, usize)]) {
    let cache = [
        ("fills", c.fills),
        ("hits", c.hits),
        ("hits of a row-limited Execute", c.limited_hits),
        ("hits of a prepared statement's run", c.prepared_hits),
        (
            "hits by key past writes of other keys",
            c.hits_past_other_writes,
        ),
        ("rows another session changed", c.direct_writes),
        ("hits of the second session", c.other_hits),
        ("settings shown as set", c.names_shown),
    ];
    for (what, n) in protocol_events(c).iter().chain(&cache).chain(also) {
        assert!(*n >= 20, "only {n} {what}: {c:?}");
    }
}

#[test]
fn the_engine_answers_as_the_model_backend_does() {
    often(&run(Mode::Session, Caching::On, 1_200), &[]);
}

#[test]
fn in_transaction_mode_the_engine_answers_as_the_model_backend_does() {
    let c = run(Mode::Transaction, Caching::On, 1_200);
    let pool = [
        ("checkouts", c.checkouts),
        ("give-backs", c.give_backs),
        ("settings read back", c.read_backs),
        ("settings put on the connection", c.applies),
    ];
    often(&c, &pool);
}

#[test]
fn with_caching_off_every_request_is_answered_by_the_model_backend() {
    for mode in [Mode::Session, Mode::Transaction] {
        let c = run(mode, Caching::Off, 300);
        assert_eq!(
            (c.hits, c.other_hits, c.fills),
            (0, 0, 0),
            "{mode:?}: {c:?}"
        );
        for (what, n) in protocol_events(&c) {
            assert!(n >= 10, "{mode:?}: only {n} {what}: {c:?}");
        }
        if mode == Mode::Transaction {
            assert!(c.checkouts >= 10 && c.give_backs >= 10, "{c:?}");
        }
    }
}
