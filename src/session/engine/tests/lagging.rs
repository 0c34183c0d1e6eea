//! A lagging replica, under the injected clock, in session and in
//! transaction mode (where the replica pool's connection keeps its books
//! between reads, and both sessions route). The property test's
//! programs run with `replicas.routing = "misses"` and a standby that
//! replays each commit of the model backend [`LAG`] after it was made,
//! the clock moving on [`TICK`] a step: the engine routes the reads it
//! may there, behind a probe of where it has replayed to, and takes the
//! primary for the rest. Whatever the standby answers, the client must see
//! what the model backend would have sent it directly, hits of what the
//! standby answered included. Another session's direct writes are left
//! out: read-your-writes covers writes through pgcache, and a write made
//! elsewhere may be read from a standby that has not replayed it yet (that
//! such an answer is never stored is `replica::Routed::may_store`'s, tested
//! with a real standby in `tests/replicas.rs`). `tests/model.rs` replays
//! the same programs through pgcache and a lagging standby of a real
//! PostgreSQL.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use super::model::{self, Backend, Program, Step};
use super::pooled::{PoolConn, before_own, pump};
use super::property::{Counts, Mode, answer_forwarded, direct, replicate_touched};
use super::{Action, Rig, complete, ctx_at, description, rfq, row, store_whole};
use crate::pool::prepared::ServerStatements;
use crate::protocol::TxStatus;
use crate::replica::{Replica, format_lsn};
use crate::session::engine::{Need, ReplicaStep};
use crate::session::link::{Link, SessionLink};
use crate::session::pipeline::Flow;

/// How long after a commit the standby replays it.
const LAG: Duration = Duration::from_millis(50);
/// How far the clock moves between two steps of a program.
const TICK: Duration = Duration::from_millis(20);
/// Every how many steps the monitor reads the standby's position.
const POLL_EVERY: usize = 5;

/// The standby: the commits of the model backend it replays, and the
/// connection pgcache has there (the session's own, or in transaction
/// mode the replica pool's one, with the books it keeps between reads).
struct Standby {
    server: Arc<Replica>,
    /// Every state the primary committed, with when: a WAL position is
    /// an index here, plus one.
    commits: Vec<(Instant, BTreeMap<u8, String>)>,
    /// The connection's server session, once there is one.
    session: Option<Backend>,
    /// The session holds the connection.
    held: bool,
    /// Transaction mode: the books of the pool's connection between
    /// reads (the client state applied, the statements it has).
    books: Option<(u64, ServerStatements)>,
}

impl Standby {
    /// Where it has replayed to at `now`.
    fn position(&self, now: Instant) -> usize {
        self.commits
            .iter()
            .filter(|(at, _)| *at + LAG <= now)
            .count()
    }

    /// Answers `bytes` as of `now`: pgcache's probe of its position, then
    /// the read (and the statements it prepares first).
    fn answer(&mut self, bytes: &[u8], now: Instant) -> Vec<u8> {
        let at = self.position(now);
        let mut out = Vec::new();
        let mut rest = bytes;
        let probe = crate::protocol::messages::query(crate::session::replica::PROBE);
        if let Some(tail) = rest.strip_prefix(&probe[..]) {
            let position = format_lsn(at as u64);
            out.extend([description(), row(&position), complete("SELECT 1")].concat());
            out.extend(rfq(TxStatus::Idle));
            rest = tail;
        }
        let session = self.session.get_or_insert_with(Backend::default);
        session.replayed(&self.commits[at - 1].1);
        out.extend(session.receive(rest));
        out
    }
}

/// How often the runs met what the invariants are about.
#[derive(Debug, Default)]
struct Routed {
    /// Reads the standby answered.
    answered: u64,
    /// Reads it was too far behind to be given, or found behind by its
    /// probe.
    kept: u64,
    /// Reads whose position was probed before them.
    probed: u64,
    /// Answers the standby gave that were stored.
    fills: u64,
    /// Hits, after reads and writes on both servers.
    hits: u64,
}

/// Runs `program` through an engine in front of the model backend and a
/// lagging standby of it, its server connections as `mode` has them.
fn through_engine(program: &Program, routed: &mut Routed, mode: Mode) -> Result<(), TestCaseError> {
    let program = without_direct_writes(program);
    let answers = direct(&program);
    let start = Instant::now();
    let (mut rig, server) = routing(start, mode);
    let mut beside = rig.beside();
    let mut backend = Backend::default();
    let mut conn = PoolConn::default();
    let mut standby = Standby {
        server,
        commits: vec![(start - LAG, backend.committed().clone())],
        session: None,
        held: false,
        books: None,
    };
    let db = Arc::clone(&rig.engine.db);
    db.stream.heartbeat_applied(Instant::now(), 1);
    let mut seen = Vec::new();
    let mut steps = answers.iter();
    let mut now = start;
    let mut counts = Counts::default();
    for (n, group) in program.0.iter().enumerate() {
        let mut closed = false;
        for _ in group {
            let (_, _, step) = steps.next().expect("an answer per step");
            now += TICK;
            rig.clock = Some(now);
            beside.clock = Some(now);
            if n % POLL_EVERY == 0 {
                // The monitor's poll.
                let at = standby.position(now) as u64;
                standby.server.replayed_past(at);
                standby.server.observed(at, now);
            }
            if let Step::Other(sql) = step {
                let server = (&mut conn, &mut backend);
                let standby = (&mut standby, &mut *routed);
                other(&mut beside, server, standby, *sql, mode, &mut counts)?;
            } else {
                let bytes = step.frames().concat();
                let server = (&mut conn, &mut backend);
                let flow = client((&mut rig, 0), &mut standby, server, &bytes, mode, routed)?;
                closed = flow == Flow::Close;
                let staged = rig.sent_to_client();
                let served = model::seen(&staged);
                routed.hits += u64::from(served.iter().any(|m| m.tag == 'D' || m.tag == 'C'));
                seen.extend(staged);
            }
            if closed {
                break;
            }
        }
        match mode {
            Mode::Session => answer_forwarded(&mut rig, &mut backend, &mut seen, &mut counts)?,
            Mode::Transaction => {
                let fills = &mut counts.fills;
                pump(&mut rig, 0, &mut conn, &mut backend, &mut seen, fills)?;
            }
        }
        replicate_touched(&mut rig, &mut backend);
        if standby.commits.last().map(|(_, items)| items) != Some(backend.committed()) {
            standby.commits.push((now, backend.committed().clone()));
        }
        // The stream's heartbeat, sent after every commit so far.
        db.stream
            .heartbeat_applied(Instant::now(), standby.commits.len() as u64);
        if closed {
            break;
        }
    }
    let expected: Vec<u8> = answers.iter().flat_map(|(a, ..)| a.clone()).collect();
    prop_assert_eq!(model::seen(&seen), model::seen(&expected));
    let metrics = &standby.server.metrics;
    let retries = metrics.retries.get();
    routed.answered += metrics.routed.get() - retries;
    routed.kept += rig.app.replicas.to_primary.routed.get() + retries;
    Ok(())
}

/// `program` without the direct writer's steps.
fn without_direct_writes(program: &Program) -> Program {
    let groups = program.0.iter().map(|group| {
        let kept = group.iter().filter(|s| !matches!(s, Step::Direct(_)));
        kept.cloned().collect::<Vec<_>>()
    });
    Program(groups.filter(|group| !group.is_empty()).collect())
}

/// [`Step::Other`]: the second session sends `sql` through its engine
/// (in session mode it routes nothing: pgcache cannot log in for it; in
/// transaction mode it may, as the first does), and
/// must see what a session of its own is answered directly: in session
/// mode on a session of its own, in transaction mode on the pool's
/// connection, in its turn.
fn other(
    beside: &mut Rig,
    (conn, backend): (&mut PoolConn, &mut Backend),
    (standby, routed): (&mut Standby, &mut Routed),
    sql: model::Sql,
    mode: Mode,
    counts: &mut Counts,
) -> Result<(), TestCaseError> {
    let Some(mut theirs) = backend.other() else {
        return Ok(());
    };
    let query = Step::Query(sql).frames().remove(0);
    let expected = theirs.clone().receive(&query);
    let mut seen = Vec::new();
    match mode {
        Mode::Session => {
            prop_assert_eq!(beside.client(&query), Flow::Continue);
            seen = beside.sent_to_client();
            answer_forwarded(beside, &mut theirs, &mut seen, counts)?;
            backend.rejoin(theirs);
        }
        Mode::Transaction => {
            let server = (&mut *conn, &mut *backend);
            let flow = client((beside, 1), standby, server, &query, mode, routed)?;
            prop_assert_eq!(flow, Flow::Continue);
            seen.extend(beside.sent_to_client());
            pump(beside, 1, conn, backend, &mut seen, &mut counts.fills)?;
            replicate_touched(beside, backend);
        }
    }
    prop_assert_eq!(model::seen(&seen), model::seen(&expected));
    Ok(())
}

/// A session at `start` that may route reads to the one standby of its
/// instance, in rotation: pgcache can log in there for it.
fn routing(start: Instant, mode: Mode) -> (Rig, Arc<Replica>) {
    let config = crate::Config::from_toml(
        "[upstream]\nreplicas = [\"postgres://standby:1\"]\n",
        Path::new("shop"),
    )
    .expect("config");
    let app = crate::App::new(config).expect("app");
    let entry = crate::session::fuzz::arrived(&app, "alice", "shop");
    let mut rig = Rig::on(app, entry);
    rig.clock = Some(start);
    let pool = rig.app.pool.pooled.pool("shop", "alice");
    pool.learn_trusted();
    let mut rig = match mode {
        Mode::Session => {
            let mut rig = rig.logged_in_now();
            rig.engine.link = Link::Session(SessionLink {
                checks: Some(pool),
                ..SessionLink::default()
            });
            rig
        }
        Mode::Transaction => rig.in_transaction_mode(),
    }
    .keying();
    rig.knows_table("log");
    rig.knows_table("other");
    let server = Arc::clone(&rig.app.replicas.servers[0]);
    server.admit();
    (rig, server)
}

/// The client's `bytes`, in one read, as the driver hands them over: a
/// read routed to the standby is carried out there (a connection, the
/// settings, the read behind a probe) before the rest is taken. In
/// transaction mode pgcache's own query takes the pool's connection
/// first (`conn`, whose server session is `backend`).
fn client(
    (rig, who): (&mut Rig, usize),
    standby: &mut Standby,
    (conn, backend): (&mut PoolConn, &mut Backend),
    bytes: &[u8],
    mode: Mode,
    routed: &mut Routed,
) -> Result<Flow, TestCaseError> {
    let mut buf = BytesMut::from(bytes);
    let now = rig.clock.expect("the injected clock");
    let mut taken = Ok(());
    rig.engine.client_arrived();
    for turn in 0.. {
        if rig.engine.intake != super::super::intake::Intake::Fresh {
            break;
        }
        prop_assert!(turn < 1_000, "the client's bytes are taken in the end");
        if rig.engine.replica_chosen() {
            on_standby(rig, standby, now, routed);
            continue;
        }
        let ctx = ctx_at(&rig.app, &rig.entry, rig.clock);
        match rig.engine.on_client_data(&ctx, &mut buf, 1 << 20) {
            Ok(None) => {}
            Ok(Some(Need::Own)) => {
                if mode == Mode::Transaction {
                    before_own(
                        &mut rig.engine,
                        &ctx,
                        who,
                        (&mut *conn, &mut *backend),
                        &mut taken,
                    );
                }
                let answer = rig.settings.clone().map(|row| vec![row]);
                crate::session::fuzz::answer_own(&mut rig.engine, &ctx, answer.as_deref());
            }
            Ok(Some(Need::Prerequisites(_))) => rig.engine.found.prerequisites = true,
            Ok(Some(Need::Fetched { .. })) => panic!("facts are known"),
            Ok(Some(Need::Cache(_))) => panic!("no shared tier, and each fill stored at once"),
            Err(e) => panic!("the client's bytes are well formed: {e}"),
        }
    }
    taken.map(|()| rig.engine.flow())
}

/// The read routed to the standby, carried out as the driver does.
fn on_standby(rig: &mut Rig, standby: &mut Standby, now: Instant, routed: &mut Routed) {
    loop {
        let held = standby.held.then_some(&standby.server);
        match rig.engine.replica_step(held, now) {
            None => break,
            Some(ReplicaStep::Connect { pooled, .. }) => {
                standby.held = true;
                standby.session.get_or_insert_with(Backend::default);
                // A new connection is as it logged in; the pool's keeps
                // its books.
                let (applied, prepared) = match pooled {
                    true => standby.books.take().unwrap_or_default(),
                    false => (0, ServerStatements::default()),
                };
                rig.engine.replica_connected(applied, prepared, now);
            }
            Some(ReplicaStep::Apply(_)) => rig.engine.replica_settings_applied(),
            Some(ReplicaStep::Write(bytes)) => {
                let probe = crate::protocol::messages::query(crate::session::replica::PROBE);
                routed.probed += u64::from(bytes.starts_with(&probe));
                let answer = standby.answer(&bytes, now);
                let seen = rig.backend(&[answer]);
                rig.engine.out.extend_from_slice(&seen);
                assert!(rig.engine.replica_answered(), "one answer, one read");
                if let Some(books) = rig.engine.replica_books() {
                    // Transaction mode: back to the replica's pool.
                    standby.books = Some(books);
                    standby.held = false;
                }
                for action in std::mem::take(&mut rig.engine.actions) {
                    if let Action::Store(fill, bytes) = action {
                        store_whole(rig, *fill, &bytes).expect("a whole answer");
                        routed.fills += 1;
                    }
                }
            }
            Some(ReplicaStep::Fail(why)) => panic!("the standby takes the read: {why}"),
        }
    }
}

/// Runs 300 generated programs in `mode`: the same programs every run.
fn run(mode: Mode) -> Routed {
    let config = Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let routed = std::cell::RefCell::new(Routed::default());
    let result = runner.run(&model::program(), |program| {
        through_engine(&program, &mut routed.borrow_mut(), mode)
    });
    if let Err(e) = result {
        panic!("{mode:?}: {e}");
    }
    let routed = routed.into_inner();
    eprintln!("{mode:?}: {routed:?}");
    assert!(routed.answered >= 20, "{routed:?}");
    assert!(routed.kept >= 20, "{routed:?}");
    assert!(routed.probed >= 20, "{routed:?}");
    assert!(routed.fills >= 20, "{routed:?}");
    assert!(routed.hits >= 20, "{routed:?}");
    routed
}

#[test]
fn with_a_lagging_standby_the_engine_answers_as_the_model_backend_does() {
    run(Mode::Session);
}

#[test]
fn in_transaction_mode_with_a_lagging_standby_the_engine_answers_as_the_model_backend_does() {
    run(Mode::Transaction);
}
