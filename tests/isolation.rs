//! No leaks between users: a result cached for one role is never served to
//! another that would get a different answer, and a revoked privilege stops
//! cached results from being served.

mod common;

use std::time::Duration;

use common::*;
use tokio_postgres::Client;

/// A database with two login roles (their names made unique per test, as
/// roles are cluster-wide), a table with row-level security, a column
/// privilege and views.
async fn setup(name: &str) -> (String, String, String, Proxy) {
    let db = pg().create_db(name);
    let suffix = rand_suffix();
    let (alice, bob) = (format!("alice_{suffix}"), format!("bob_{suffix}"));
    pg().psql_db(
        &db,
        &format!(
            "CREATE ROLE {alice} LOGIN; CREATE ROLE {bob} LOGIN;
             CREATE TABLE docs(id int PRIMARY KEY, owner text, body text);
             INSERT INTO docs VALUES (1, '{alice}', 'alice''s'), (2, '{bob}', 'bob''s');
             ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
             CREATE POLICY own ON docs USING (owner = current_user);
             GRANT SELECT ON docs TO {alice}, {bob};
             CREATE TABLE pay(id int PRIMARY KEY, name text, salary int);
             INSERT INTO pay VALUES (1, 'x', 100);
             GRANT SELECT ON pay TO {alice};
             GRANT SELECT (id, name) ON pay TO {bob};"
        ),
    );
    let proxy = Proxy::start(pg().proxy_config()).await;
    proxy.connect(&db).await;
    (db, alice, bob, proxy)
}

async fn login(proxy: &Proxy, user: &str, db: &str) -> Client {
    connect_dsn(&proxy.dsn(user, db)).await.unwrap()
}

/// Runs `sql`, returning its rows or the SQLSTATE it failed with.
async fn try_rows(client: &Client, sql: &str) -> Result<Vec<Vec<Option<String>>>, String> {
    match client.simple_query(sql).await {
        Ok(messages) => Ok(messages
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                }
                _ => None,
            })
            .collect()),
        Err(e) => Err(e
            .as_db_error()
            .map(|d| d.code().code().to_owned())
            .unwrap_or_else(|| e.to_string())),
    }
}

const DOCS: &str = "SELECT id, body FROM docs ORDER BY id";
const SALARY: &str = "SELECT salary FROM pay WHERE id = 1";

fn row(id: &str, body: &str) -> Vec<Option<String>> {
    vec![Some(id.to_owned()), Some(body.to_owned())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_results_are_never_shared_between_roles() {
    let (db, alice, bob, proxy) = setup("iso_rls").await;
    let a = login(&proxy, &alice, &db).await;
    let b = login(&proxy, &bob, &db).await;
    let hits = proxy.hits();
    for _ in 0..2 {
        assert_eq!(try_rows(&a, DOCS).await.unwrap(), vec![row("1", "alice's")]);
    }
    assert_eq!(
        proxy.hits(),
        hits + 1,
        "alice's own result is cached for her"
    );
    for _ in 0..2 {
        assert_eq!(try_rows(&b, DOCS).await.unwrap(), vec![row("2", "bob's")]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_privilege_is_not_bypassed_by_the_cache() {
    let (db, alice, bob, proxy) = setup("iso_column").await;
    let a = login(&proxy, &alice, &db).await;
    let b = login(&proxy, &bob, &db).await;
    for _ in 0..2 {
        assert_eq!(
            try_rows(&a, SALARY).await.unwrap(),
            vec![vec![Some("100".to_owned())]]
        );
    }
    assert_eq!(try_rows(&b, SALARY).await, Err("42501".to_owned()));
    assert_eq!(
        try_rows(&b, "SELECT name FROM pay WHERE id = 1")
            .await
            .unwrap(),
        vec![vec![Some("x".to_owned())]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_role_and_session_authorization_change_what_is_served() {
    let (db, alice, bob, proxy) = setup("iso_setrole").await;
    let admin = proxy.connect(&db).await;
    // The superuser sees every row (RLS does not apply to it).
    for _ in 0..2 {
        assert_eq!(try_rows(&admin, DOCS).await.unwrap().len(), 2);
        assert!(try_rows(&admin, SALARY).await.is_ok());
    }
    admin
        .batch_execute(&format!("SET ROLE {bob}"))
        .await
        .unwrap();
    assert_eq!(
        try_rows(&admin, DOCS).await.unwrap(),
        vec![row("2", "bob's")]
    );
    assert_eq!(try_rows(&admin, SALARY).await, Err("42501".to_owned()));
    admin.batch_execute("RESET ROLE").await.unwrap();
    admin
        .batch_execute(&format!("SET SESSION AUTHORIZATION {alice}"))
        .await
        .unwrap();
    assert_eq!(
        try_rows(&admin, DOCS).await.unwrap(),
        vec![row("1", "alice's")]
    );
    admin
        .batch_execute("RESET SESSION AUTHORIZATION")
        .await
        .unwrap();
    assert_eq!(try_rows(&admin, DOCS).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_through_pgcache_stops_cached_results_at_once() {
    let (db, alice, _bob, proxy) = setup("iso_revoke_proxy").await;
    let a = login(&proxy, &alice, &db).await;
    let admin = proxy.connect(&db).await;
    let hits = proxy.hits();
    for _ in 0..2 {
        assert!(try_rows(&a, SALARY).await.is_ok());
    }
    assert_eq!(proxy.hits(), hits + 1);
    admin
        .batch_execute(&format!("REVOKE SELECT ON pay FROM {alice}"))
        .await
        .unwrap();
    // The REVOKE bumped the database epoch before it was acknowledged.
    assert_eq!(try_rows(&a, SALARY).await, Err("42501".to_owned()));
}

/// Alice's salary read, cached, then `revoke` (given her role) run
/// directly: the DDL event trigger announces it in the replication stream,
/// and her cached answer stops being served within the lag.
async fn revoked_directly(name: &str, revoke: impl Fn(&str) -> String) {
    let (db, alice, _bob, proxy) = setup(name).await;
    let a = login(&proxy, &alice, &db).await;
    let hits = proxy.hits();
    for _ in 0..2 {
        assert!(try_rows(&a, SALARY).await.is_ok());
    }
    assert_eq!(proxy.hits(), hits + 1);
    pg().psql_db(&db, &revoke(&alice));
    eventually(Duration::from_secs(10), "the revoke to be seen", || async {
        (try_rows(&a, SALARY).await == Err("42501".to_owned())).then_some(())
    })
    .await;
    for _ in 0..3 {
        assert_eq!(try_rows(&a, SALARY).await, Err("42501".to_owned()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_made_directly_on_postgresql_stops_cached_results_within_the_replication_lag() {
    revoked_directly("iso_revoke_direct", |alice| {
        format!("REVOKE SELECT ON pay FROM {alice}")
    })
    .await;
}

/// DROP OWNED also revokes what was granted to the role, and drops
/// nothing of hers here: at its command's end it is announced, unlike
/// other DROPs, which the objects they dropped announce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_owned_made_directly_stops_cached_results_within_the_replication_lag() {
    revoked_directly("iso_drop_owned", |alice| format!("DROP OWNED BY {alice}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_cached_by_hint_keep_each_roles_answer() {
    let (db, alice, bob, proxy) = setup("iso_views").await;
    pg().psql_db(
        &db,
        &format!(
            "CREATE VIEW definer_docs AS SELECT id, body FROM docs;
             ALTER VIEW definer_docs OWNER TO {alice};
             CREATE VIEW invoker_docs WITH (security_invoker = true) AS SELECT id, body FROM docs;
             GRANT SELECT ON definer_docs, invoker_docs TO {alice}, {bob};"
        ),
    );
    let a = login(&proxy, &alice, &db).await;
    let b = login(&proxy, &bob, &db).await;
    proxy.learn_all(&db).await;
    // A view runs with its owner's privileges but current_user is still the
    // reader, so RLS filters by the reader; each role gets its own entry.
    let definer = "/*+ cache ttl=60s */ SELECT id, body FROM definer_docs ORDER BY id";
    let invoker = "/*+ cache ttl=60s */ SELECT id, body FROM invoker_docs ORDER BY id";
    let hits = proxy.hits();
    for sql in [definer, invoker] {
        for _ in 0..2 {
            assert_eq!(
                try_rows(&a, sql).await.unwrap(),
                vec![row("1", "alice's")],
                "{sql}"
            );
            assert_eq!(
                try_rows(&b, sql).await.unwrap(),
                vec![row("2", "bob's")],
                "{sql}"
            );
        }
    }
    assert_eq!(proxy.hits(), hits + 4, "each role's second read was a hit");
    // Revoking the view from bob through pgcache stops his cached answer.
    let admin = proxy.connect(&db).await;
    admin
        .batch_execute(&format!("REVOKE SELECT ON definer_docs FROM {bob}"))
        .await
        .unwrap();
    assert_eq!(try_rows(&b, definer).await, Err("42501".to_owned()));
    assert_eq!(
        try_rows(&a, definer).await.unwrap(),
        vec![row("1", "alice's")]
    );
}
