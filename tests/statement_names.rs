//! SQL that names a statement the client prepared through the protocol
//! (`EXECUTE`, `EXPLAIN EXECUTE`, `CREATE TABLE AS EXECUTE`, `PREPARE`,
//! `DEALLOCATE`, `DISCARD ALL`) answers through pgcache exactly as it does
//! directly: in session mode, and in transaction mode, where the server
//! knows the statement under pgcache's name and another client shares the
//! connection. Caching is on: a statement freed by SQL is never served
//! from the cache again. Real PostgreSQL, raw protocol.

mod common;

use std::time::Duration;

use common::*;
use pgcache::config::PoolMode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(20);

/// Sends `bytes`, reads up to the ReadyForQuery, and renders what came
/// back: tags, with SQLSTATEs, command tags, statuses and row values.
async fn exchange(s: &mut TcpStream, bytes: &[u8]) -> Vec<String> {
    s.write_all(bytes).await.unwrap();
    let mut seen = Vec::new();
    for (tag, body) in wire::read_until_ready(s).await {
        let text =
            |b: &[u8]| String::from_utf8_lossy(b.strip_suffix(&[0]).unwrap_or(b)).into_owned();
        seen.push(match tag {
            b'E' => format!("E {}", wire::sqlstate_of(&body).unwrap_or_default()),
            b'C' => format!("C {}", text(&body)),
            b'Z' => format!("Z {}", body[0] as char),
            b'D' => {
                let len = u32::from_be_bytes(body[2..6].try_into().unwrap()) as usize;
                format!("D {}", text(&body[6..6 + len]))
            }
            // Notices and parameter statuses may differ in number.
            b'N' | b'S' => continue,
            other => (other as char).to_string(),
        });
    }
    seen
}

/// The steps, each one exchange: what the client sends, and whether the
/// other client (`b`) sends it instead.
fn script(table: &str) -> Vec<(bool, Vec<u8>)> {
    let q = |sql: &str| (false, wire::query(sql));
    let run = |name: &str, value: &str| {
        (
            false,
            [
                wire::bind_text(name, value),
                wire::describe_portal(),
                wire::execute(),
                wire::sync(),
            ]
            .concat(),
        )
    };
    let mine = || {
        (
            true,
            [wire::parse("mine", "select $1::int + 1"), wire::sync()].concat(),
        )
    };
    let run_mine = || {
        (
            true,
            [wire::bind_text("mine", "1"), wire::execute(), wire::sync()].concat(),
        )
    };
    vec![
        (
            false,
            [wire::parse("_pg3_0", "select $1::int + 1"), wire::sync()].concat(),
        ),
        // The other client shares the server connection in transaction
        // mode, and a statement of the same text: what it prepares there,
        // and frees, is its own.
        mine(),
        q("EXECUTE _pg3_0(41)"),
        (true, wire::query("DISCARD ALL")),
        q("explain (costs off) EXECUTE _pg3_0(1)"),
        q(&format!("CREATE TABLE {table} AS EXECUTE _pg3_0(1)")),
        q(&format!("select * from {table}")),
        q(&format!("drop table {table}")),
        run_mine(),
        mine(),
        q("BEGIN"),
        q("select 1/0"),
        q("DEALLOCATE _pg3_0"),
        q("EXECUTE _pg3_0(1)"),
        q("ROLLBACK"),
        run("_pg3_0", "1"),
        q("DEALLOCATE _pg3_0"),
        run_mine(),
        q("EXECUTE _pg3_0(1)"),
        run("_pg3_0", "1"),
        q("DEALLOCATE nope"),
        // The name is free again.
        (
            false,
            [wire::parse("_pg3_0", "select $1::int * 2"), wire::sync()].concat(),
        ),
        run("_pg3_0", "21"),
        // As an unnamed statement of the extended protocol, as drivers
        // send it.
        (
            false,
            [
                wire::parse("", "DEALLOCATE _pg3_0"),
                wire::bind(""),
                wire::execute(),
                wire::sync(),
            ]
            .concat(),
        ),
        run("_pg3_0", "1"),
        (
            false,
            [wire::parse("d", "select $1::int * 3"), wire::sync()].concat(),
        ),
        (
            false,
            [
                wire::parse("", "EXECUTE d(7)"),
                wire::bind(""),
                wire::describe_portal(),
                wire::execute(),
                wire::sync(),
            ]
            .concat(),
        ),
        (
            false,
            [
                wire::parse("a", "select 1"),
                wire::parse("b", "select 2"),
                wire::sync(),
            ]
            .concat(),
        ),
        q("DEALLOCATE ALL"),
        (
            false,
            [wire::bind("a"), wire::execute(), wire::sync()].concat(),
        ),
        (false, [wire::parse("c", "select 3"), wire::sync()].concat()),
        q("DISCARD ALL"),
        (
            false,
            [wire::bind("c"), wire::execute(), wire::sync()].concat(),
        ),
        // Last: SQL PREPARE keeps a pooled client on its connection.
        (
            false,
            [wire::parse("_pg3_0", "select 1"), wire::sync()].concat(),
        ),
        q("PREPARE _pg3_0 AS select 1"),
        q("BEGIN"),
        q("PREPARE _pg3_0 AS select 1"),
        q("DEALLOCATE _pg3_0"),
        q("ROLLBACK"),
    ]
}

/// A statement of a cached read, run until it is a hit (through pgcache),
/// then freed by SQL: the next run is refused, as directly.
fn freed_read() -> Vec<Vec<u8>> {
    vec![
        wire::query("DEALLOCATE r"),
        [wire::bind_text("r", "1"), wire::execute(), wire::sync()].concat(),
    ]
}

fn prepare_read() -> Vec<u8> {
    [
        wire::parse("r", "select name from items where id = $1"),
        wire::sync(),
    ]
    .concat()
}

fn run_read() -> Vec<u8> {
    [wire::bind_text("r", "1"), wire::execute(), wire::sync()].concat()
}

/// What the script and the freed read give at `addr`; `proxy`: warm the
/// read until it is a hit first.
async fn transcript(
    addr: std::net::SocketAddr,
    db: &str,
    table: &str,
    proxy: Option<&Proxy>,
) -> Vec<Vec<String>> {
    let (mut a, _) = wire::raw_login(addr, db).await;
    let (mut b, _) = wire::raw_login(addr, db).await;
    let mut seen = Vec::new();
    for (other, bytes) in script(table) {
        let s = if other { &mut b } else { &mut a };
        seen.push(exchange(s, &bytes).await);
    }
    seen.push(exchange(&mut a, &prepare_read()).await);
    seen.push(exchange(&mut a, &run_read()).await);
    if let Some(proxy) = proxy {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let before = proxy.hits();
            let answer = exchange(&mut a, &run_read()).await;
            assert!(answer.contains(&"D one".to_owned()), "{answer:?}");
            if proxy.hits() > before {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the prepared read never became a hit"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for bytes in freed_read() {
        seen.push(exchange(&mut a, &bytes).await);
    }
    seen
}

async fn same_as_directly(mode: PoolMode) {
    let pg = pg();
    let db = pg.create_db(&format!("names_{mode:?}").to_lowercase());
    pg.direct(&db)
        .await
        .batch_execute("CREATE TABLE items(id int PRIMARY KEY, name text); INSERT INTO items VALUES (1, 'one')")
        .await
        .unwrap();
    let direct_addr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let direct = transcript(direct_addr, &db, "ctas_direct", None).await;
    let mut config = pg.proxy_config();
    config.pool.mode = mode;
    if mode == PoolMode::Transaction {
        // One server connection: the two clients share it.
        config.pool.default_pool_size = 1;
    }
    let proxy = Proxy::start(config).await;
    // A first client starts the database's stream.
    let first = proxy.connect(&db).await;
    proxy.wait_streaming(&db).await;
    drop(first);
    let through = transcript(proxy.addr, &db, "ctas_through", Some(&proxy)).await;
    let steps = script("t").len();
    for (i, (d, t)) in direct.iter().zip(&through).enumerate() {
        let what = if i < steps {
            format!("step {i}")
        } else {
            "the freed read".to_owned()
        };
        assert_eq!(t, d, "{mode:?}, {what}: through pgcache, then directly");
    }
    assert_eq!(direct.len(), through.len());
    // Not vacuous: the script met each answer it is about.
    let all: Vec<&String> = direct.iter().flatten().collect();
    for wanted in [
        "D 42",
        "C DEALLOCATE",
        "C DEALLOCATE ALL",
        "C DISCARD ALL",
        "E 42P05",
        "E 25P02",
        "E 26000",
        "D 21",
        "C SELECT 1",
    ] {
        assert!(
            all.iter().any(|s| s.as_str() == wanted),
            "{wanted} in {all:?}"
        );
    }
}

#[tokio::test]
async fn sql_on_protocol_statements_in_transaction_mode_answers_as_directly() {
    same_as_directly(PoolMode::Transaction).await;
}

#[tokio::test]
async fn sql_on_protocol_statements_in_session_mode_answers_as_directly() {
    same_as_directly(PoolMode::Session).await;
}

/// Parses PostgreSQL refuses, each followed by what shows the
/// transaction failed: a name the client prepared already (inside a
/// transaction block and in a batch's implicit transaction), a Parse in a
/// failed transaction (on its own, and pipelined behind the statement that
/// fails it), and a run of the statement refused.
fn refused_parses(table: &str) -> Vec<Vec<u8>> {
    let q = |sql: &str| wire::query(sql);
    let prepare = |name: &str, sql: &str| [wire::parse(name, sql), wire::sync()].concat();
    let insert = format!("INSERT INTO {table} VALUES (1)");
    vec![
        prepare("s1", "select 1"),
        q("BEGIN"),
        q(&insert),
        prepare("s1", "select 2"),
        q("COMMIT"),
        q(&format!("SELECT count(*) FROM {table}")),
        // The batch's insert is undone with it.
        [
            wire::parse("", &insert),
            wire::bind(""),
            wire::execute(),
            wire::parse("s1", "select 3"),
            wire::sync(),
        ]
        .concat(),
        q(&format!("SELECT count(*) FROM {table}")),
        q("BEGIN"),
        q("SELECT 1/0"),
        prepare("s2", "select 1"),
        q("ROLLBACK"),
        [wire::bind("s2"), wire::execute(), wire::sync()].concat(),
        q("BEGIN"),
        // Sent together: the Parse is decided before the division fails.
        [q("SELECT 1/0"), prepare("s3", "select 1")].concat(),
        Vec::new(),
        q("ROLLBACK"),
        [wire::bind("s1"), wire::execute(), wire::sync()].concat(),
    ]
}

async fn refused_transcript(addr: std::net::SocketAddr, db: &str, table: &str) -> Vec<Vec<String>> {
    let (mut a, _) = wire::raw_login(addr, db).await;
    let mut seen = Vec::new();
    for bytes in refused_parses(table) {
        seen.push(exchange(&mut a, &bytes).await);
    }
    seen
}

#[tokio::test]
async fn in_transaction_mode_a_refused_parse_fails_the_transaction_as_directly() {
    let pg = pg();
    let db = pg.create_db("refused_parses");
    pg.direct(&db)
        .await
        .batch_execute("CREATE TABLE t_direct(a int); CREATE TABLE t_through(a int)")
        .await
        .unwrap();
    let direct_addr = format!("127.0.0.1:{}", pg.port).parse().unwrap();
    let direct = refused_transcript(direct_addr, &db, "t_direct").await;
    let mut config = pg.proxy_config();
    config.pool.mode = PoolMode::Transaction;
    config.pool.default_pool_size = 1;
    let proxy = Proxy::start(config).await;
    let through = refused_transcript(proxy.addr, &db, "t_through").await;
    for (i, (d, t)) in direct.iter().zip(&through).enumerate() {
        assert_eq!(t, d, "step {i}: through pgcache, then directly");
    }
    assert_eq!(direct.len(), through.len());
    let all: Vec<&String> = direct.iter().flatten().collect();
    for wanted in ["E 42P05", "E 25P02", "E 26000", "C ROLLBACK", "D 0", "D 1"] {
        assert!(
            all.iter().any(|s| s.as_str() == wanted),
            "{wanted} in {all:?}"
        );
    }
}
