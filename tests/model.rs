//! The engine's property test runs programs against a model of PostgreSQL
//! (`src/session/engine/tests/model/`). This test keeps the model
//! honest: it replays a few hundred generated programs against a
//! throwaway PostgreSQL, directly, and checks that the same messages come
//! back (types, rows, command tags, SQLSTATEs, transaction status). A
//! cancel is a real CancelRequest, sent once the statement runs; another
//! session's write is made on a connection of its own, and so are the
//! second session's statements, compared as the first's. The same
//! programs then run through pgcache in front of the primary and a
//! lagging standby its reads are routed to.

mod common;
#[path = "../src/session/engine/tests/model/mod.rs"]
#[allow(dead_code, reason = "the engine's property test reads the rest")]
mod model;

use std::time::Duration;

use common::Pg;
use common::wire::{raw_login, read_message};
use model::{Backend, SETUP, Seen, Sql, Step};
use pgcache::config::PoolMode;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PROGRAMS: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_answers_as_postgresql_does() {
    let pg = common::pg();
    let db = pg.create_db("model");
    let admin = pg.direct(&db).await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let messages = replay(addr, &db, &admin, Writers::WithDirect).await;
    assert!(messages > PROGRAMS * 10, "{messages} messages compared");
}

/// The same programs through pgcache, with the reads it may route sent to
/// a standby that applies each commit 50 ms late: the sessions must see
/// what PostgreSQL alone answers (the model), so no read is answered from
/// the standby's past without a write of the session's own or of the
/// second session's, both through pgcache; and no answer the standby gave
/// from below what was cached is stored. The direct writer is left out:
/// read-your-writes covers writes through pgcache, and a write made
/// elsewhere may be read from a standby that has not replayed it yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgcache_and_a_lagging_standby_the_model_answers_as_postgresql_does() {
    through_pgcache_and_a_lagging_standby(PoolMode::Session).await;
}

/// The same in transaction mode: the two sessions take the pool's server
/// connections in turns, and their reads the replica's pool's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_mode_through_pgcache_and_a_lagging_standby_the_model_answers_as_postgresql_does()
 {
    through_pgcache_and_a_lagging_standby(PoolMode::Transaction).await;
}

async fn through_pgcache_and_a_lagging_standby(mode: PoolMode) {
    let primary = Pg::dedicated();
    let db = primary.create_db("model");
    let standby = primary.standby();
    standby.psql_admin("ALTER SYSTEM SET recovery_min_apply_delay = '50ms'");
    standby.psql_admin("SELECT pg_reload_conf()");
    let mut config = primary.proxy_config();
    config.pool.mode = mode;
    config.upstream.replicas = vec![pgcache::config::ReplicaConfig::Url(format!(
        "postgres://postgres@127.0.0.1:{}",
        standby.port
    ))];
    let proxy = common::Proxy::start(config).await;
    let replica = std::sync::Arc::clone(&proxy.app.replicas.servers[0]);
    common::eventually(Duration::from_secs(30), "the standby in rotation", || {
        let in_rotation = replica.in_rotation();
        async move { in_rotation.then_some(()) }
    })
    .await;
    let admin = primary.direct(&db).await;
    let messages = replay(proxy.addr, &db, &admin, Writers::ThroughPgcache).await;
    assert!(messages > PROGRAMS * 10, "{messages} messages compared");
    let routed = replica.metrics.routed.get();
    let kept = proxy.app.replicas.to_primary.routed.get() + replica.metrics.retries.get();
    eprintln!("{mode:?}: {routed} reads routed to the standby, {kept} kept on the primary");
    assert!(routed > 0, "reads were routed to the standby");
    assert!(
        kept > 0,
        "reads the standby was behind for went to the primary"
    );
}

/// Who writes besides the program's first session.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writers {
    /// The second session, and another that writes directly to
    /// PostgreSQL.
    WithDirect,
    /// The second session alone, through the same server as the first.
    ThroughPgcache,
}

/// Replays [`PROGRAMS`] generated programs on sessions of the server at
/// `addr`, checking every answer against the model's; `admin` is a direct
/// connection to PostgreSQL. Returns how many messages were compared.
async fn replay(
    addr: std::net::SocketAddr,
    db: &str,
    admin: &tokio_postgres::Client,
    writers: Writers,
) -> usize {
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let strategy = model::program();
    let mut messages = 0;
    for n in 0..PROGRAMS {
        let program = strategy.new_tree(&mut runner).unwrap().current();
        let (mut socket, login) = raw_login(addr, db).await;
        let key = login
            .iter()
            .find(|(tag, _)| *tag == b'K')
            .map(|(_, body)| body.clone())
            .expect("BackendKeyData");
        socket
            .write_all(&model::frame(b'Q', &cstr(SETUP)))
            .await
            .unwrap();
        read_answer(&mut socket, 1).await;
        let (mut second, _) = raw_login(addr, db).await;
        let mut backend = Backend::default();
        for (i, step) in program.0.iter().flatten().enumerate() {
            if let Step::Direct(k) = step {
                // Another session's write, made when the model makes it.
                if writers == Writers::WithDirect && backend.direct_write(*k).is_some() {
                    admin.batch_execute(&Step::direct_sql(*k)).await.unwrap();
                }
                continue;
            }
            if let Step::Other(sql) = step {
                // The second session's statement, when the model runs it.
                if let Some(mut theirs) = backend.other() {
                    let query = Step::Query(*sql).frames().remove(0);
                    let expected = model::seen(&theirs.receive(&query));
                    second.write_all(&query).await.unwrap();
                    let got = read_answer(&mut second, 1).await;
                    assert_eq!(got, expected, "program {n}, step {i} ({step:?})");
                    messages += got.len();
                    backend.rejoin(theirs);
                }
                continue;
            }
            let mut expected = Vec::new();
            for frame in step.frames() {
                expected.extend(backend.receive(&frame));
                socket.write_all(&frame).await.unwrap();
            }
            let expected = model::seen(&expected);
            let cancelled = expected.iter().any(|m| m.what == "57014");
            if *step == Step::Query(Sql::Sleep) && cancelled {
                let pid = (writers == Writers::WithDirect).then_some(&key[..4]);
                cancel_when_running(admin, addr, &key, db, pid).await;
            }
            let got = read_answer(&mut socket, step.readies()).await;
            assert_eq!(
                got, expected,
                "program {n}, step {i} ({step:?}) of {program:?}"
            );
            messages += got.len();
            if *step == Step::Terminate {
                assert!(read_message(&mut socket).await.is_none(), "closed");
            }
        }
    }
    messages
}

/// Messages until `readies` ReadyForQuery messages, as [`Seen`].
async fn read_answer(socket: &mut TcpStream, readies: usize) -> Vec<Seen> {
    let mut bytes = Vec::new();
    let mut left = readies;
    while left > 0 {
        let (tag, body) = tokio::time::timeout(Duration::from_secs(30), read_message(socket))
            .await
            .expect("an answer within 30 s")
            .expect("a message");
        left -= usize::from(tag == b'Z');
        bytes.extend(model::frame(tag, &body));
    }
    model::seen(&bytes)
}

/// Cancels the statement of the session with `key` once it runs (a
/// cancel that arrives before is ignored by PostgreSQL): the sleep of the
/// backend `pid` names, or through pgcache (whose keys are its own in
/// transaction mode) the sleep in `db`.
async fn cancel_when_running(
    admin: &tokio_postgres::Client,
    addr: std::net::SocketAddr,
    key: &[u8],
    db: &str,
    pid: Option<&[u8]>,
) {
    let pid = pid.map(|p| i32::from_be_bytes(p.try_into().unwrap()));
    common::eventually(Duration::from_secs(10), "the sleep to run", || async {
        let row = admin
            .query_opt(
                "SELECT 1 FROM pg_stat_activity WHERE ($1::int IS NULL OR pid = $1) \
                 AND datname = $2 AND state = 'active' AND wait_event = 'PgSleep'",
                &[&pid, &db],
            )
            .await
            .unwrap();
        row.map(|_| ())
    })
    .await;
    let mut request = Vec::with_capacity(16);
    request.extend(16u32.to_be_bytes());
    request.extend(80_877_102u32.to_be_bytes());
    request.extend(key);
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket.write_all(&request).await.unwrap();
    // PostgreSQL signals the backend twice (the process, then its group);
    // the second must not land on a later statement. The cancel's
    // connection closes once both are sent.
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0))), "the cancel connection closes");
}

fn cstr(s: &str) -> Vec<u8> {
    [s.as_bytes(), &[0]].concat()
}
