//! `pgcache uninstall`: what pgcache leaves in a database, and its removal,
//! run as a user would run it.

mod common;

use std::time::Duration;

use common::*;

/// pgcache's objects in `db`: publication, schema, event triggers.
fn traces(pg: &Pg, db: &str) -> String {
    pg.psql_db(
        db,
        "SELECT (SELECT count(*) FROM pg_publication WHERE pubname = 'pgcache') || ',' || \
                (SELECT count(*) FROM pg_namespace WHERE nspname = 'pgcache') || ',' || \
                (SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE 'pgcache%')",
    )
    .trim()
    .to_owned()
}

async fn uninstall(pg: &Pg, extra: &[&str]) -> std::process::Output {
    let upstream = format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port);
    // As the README writes it: global options after the subcommand too.
    let mut args = vec!["uninstall", "--upstream", upstream.as_str()];
    args.extend_from_slice(extra);
    run_tool(std::path::Path::new(env!("CARGO_BIN_EXE_pgcache")), &args).await
}

fn active_slots(pg: &Pg) -> String {
    pg.psql_admin("SELECT count(*) FROM pg_replication_slots WHERE active")
        .trim()
        .to_owned()
}

#[tokio::test]
async fn uninstall_removes_every_trace_refuses_while_streaming_and_can_run_twice() {
    // A server of its own: uninstall visits every database, and other
    // tests' pgcaches stream from the shared one.
    let pg = Pg::dedicated();
    pg.psql_admin("CREATE DATABASE app");
    pg.psql_db("app", "CREATE TABLE t (id int PRIMARY KEY)");
    let mut config = pg.proxy_config();
    config.upstream.url = format!("postgres://postgres@127.0.0.1:{}", pg.port);
    let proxy = Proxy::start(config.clone()).await;
    let client = proxy.connect("app").await;
    client.simple_query("SELECT id FROM t").await.unwrap();
    assert_eq!(traces(&pg, "app"), "1,1,2", "what pgcache installs");

    let refused = uninstall(&pg, &[]).await;
    let out = String::from_utf8_lossy(&refused.stdout);
    assert!(!refused.status.success(), "{out}");
    assert!(
        out.contains("app: refused: a pgcache is streaming"),
        "{out}{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert_eq!(
        traces(&pg, "app"),
        "1,1,2",
        "nothing removed while streaming"
    );

    drop(client);
    drop(proxy);
    eventually(Duration::from_secs(20), "pgcache's slot to go", || {
        let gone = active_slots(&pg) == "0";
        async move { gone.then_some(()) }
    })
    .await;
    for round in 0..2 {
        let done = uninstall(&pg, &[]).await;
        let out = String::from_utf8_lossy(&done.stdout);
        assert!(done.status.success(), "round {round}: {out}");
        let said = ["app: removed", "app: nothing to remove"][round];
        assert!(out.contains(said), "round {round}: {out}");
        assert!(
            out.contains("template1: nothing to remove"),
            "round {round}: {out}"
        );
        // Only its answer: PostgreSQL's NOTICEs ("... does not exist,
        // skipping") to pgcache's own connection are not the user's.
        assert!(!out.contains("NOTICE"), "round {round}: {out}");
        assert_eq!(traces(&pg, "app"), "0,0,0", "round {round}");
    }
    // The database works as before, DDL included.
    pg.psql_db(
        "app",
        "ALTER TABLE t ADD COLUMN v text; INSERT INTO t VALUES (1, 'x')",
    );

    // --force removes them under a running pgcache.
    let proxy = Proxy::start(config).await;
    let client = proxy.connect("app").await;
    client.simple_query("SELECT id FROM t").await.unwrap();
    assert_eq!(traces(&pg, "app"), "1,1,2");
    let forced = uninstall(&pg, &["--force"]).await;
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stdout)
    );
    assert_eq!(traces(&pg, "app"), "0,0,0");
}
