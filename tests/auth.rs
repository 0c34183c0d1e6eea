//! Authentication across TLS: SCRAM relayed where it can be, refused with a
//! clear message where it cannot, and pgcache's own SCRAM (terminate mode,
//! with channel binding) logging in to PostgreSQL with a password from the
//! config or with the key a client's proof yields (auth_query).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use pgcache::config::{AuthMode, SslMode};

/// A PostgreSQL taking TLS only, pgcache's certificate files, and the CA
/// that signed both.
struct Setup {
    pg: Pg,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    _dir: tempfile::TempDir,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (ca, pg_cert, pg_key) = tls_certificate(dir.path(), "pg");
    let pg = Pg::dedicated_tls(&pg_cert, &pg_key);
    Setup {
        pg,
        ca,
        cert: pg_cert,
        key: pg_key,
        _dir: dir,
    }
}

impl Setup {
    /// TLS on both legs (verify-full towards PostgreSQL), in `mode`.
    fn config(&self, mode: AuthMode) -> pgcache::Config {
        let mut config = self.pg.proxy_config();
        config.upstream.url = format!(
            "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
            self.pg.port,
            self.ca.display()
        );
        config.tls.ssl_mode = SslMode::Allow;
        config.tls.cert_file = self.cert.clone();
        config.tls.key_file = self.key.clone();
        config.auth.mode = mode;
        config
    }
}

/// psql through pgcache; returns (success, stdout, stderr).
async fn psql(
    proxy: &Proxy,
    user: &str,
    password: &str,
    options: &str,
    sql: &str,
) -> (bool, String, String) {
    let conninfo = format!(
        "host=localhost port={} user={user} password={password} dbname=postgres {options}",
        proxy.addr.port()
    );
    let out = run_tool(
        &pg().bin("psql"),
        &["-X", "-At", "-d", &conninfo, "-c", sql],
    )
    .await;
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A tokio-postgres login through pgcache that must fail; its error.
async fn refused(proxy: &Proxy, user: &str, password: &str) -> tokio_postgres::Error {
    connect_dsn(&format!(
        "{} password={password}",
        proxy.dsn(user, "postgres")
    ))
    .await
    .expect_err("the login is refused")
}

fn ca_option(ca: &Path) -> String {
    format!("sslmode=verify-full sslrootcert={}", ca.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_relays_scram_and_explains_when_binding_cannot_cross() {
    let s = setup();
    let proxy = Proxy::start(s.config(AuthMode::Passthrough)).await;
    let tls = ca_option(&s.ca);
    // libpq on TLS defaults to channel_binding=prefer and would bind to
    // pgcache's certificate, which PostgreSQL cannot check.
    let (ok, _, err) = psql(&proxy, SCRAM_USER, SCRAM_PASSWORD, &tls, "SELECT 1").await;
    assert!(!ok);
    assert!(
        err.contains("SCRAM channel binding cannot pass through pgcache"),
        "{err}"
    );
    assert!(err.contains("auth.mode = \"terminate\""), "{err}");
    assert_eq!(proxy.app.metrics.auth_failures.relay.get(), 1);
    // Without binding, SCRAM is relayed over both TLS legs.
    let (ok, out, err) = psql(
        &proxy,
        SCRAM_USER,
        SCRAM_PASSWORD,
        &format!("{tls} channel_binding=disable"),
        "SELECT current_user",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), SCRAM_USER);
    // MD5 has no binding: relayed as ever. A wrong password gets
    // PostgreSQL's own answer.
    let (ok, out, err) = psql(&proxy, MD5_USER, MD5_PASSWORD, &tls, "SELECT current_user").await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), MD5_USER);
    let (ok, _, err) = psql(&proxy, MD5_USER, "wrong", &tls, "SELECT 1").await;
    assert!(!ok);
    assert!(err.contains("password authentication failed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_mode_binds_to_pgcaches_certificate_and_logs_in_with_configured_passwords() {
    let s = setup();
    let mut config = s.config(AuthMode::Terminate);
    config
        .auth
        .users
        .insert(SCRAM_USER.into(), SCRAM_PASSWORD.into());
    config
        .auth
        .users
        .insert(MD5_USER.into(), MD5_PASSWORD.into());
    let proxy = Proxy::start(config).await;
    let tls = ca_option(&s.ca);
    // SCRAM-SHA-256-PLUS towards pgcache, then SCRAM (PostgreSQL asks for
    // it) with the configured password towards PostgreSQL.
    let (ok, out, err) = psql(
        &proxy,
        SCRAM_USER,
        SCRAM_PASSWORD,
        &format!("{tls} channel_binding=require"),
        "SELECT current_user || ' ' || ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), format!("{SCRAM_USER} true"));
    // PostgreSQL asks md5user for MD5: pgcache answers with the password.
    let (ok, out, err) = psql(
        &proxy,
        MD5_USER,
        MD5_PASSWORD,
        &format!("{tls} channel_binding=require"),
        "SELECT current_user",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), MD5_USER);
    // Plain text towards pgcache: SCRAM without binding.
    let (ok, out, err) = psql(
        &proxy,
        SCRAM_USER,
        SCRAM_PASSWORD,
        "sslmode=disable",
        "SELECT 7",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "7");
    // A wrong password and an unknown user get the same answer.
    for (user, password) in [(SCRAM_USER, "wrong"), ("nobody", "x")] {
        let (ok, _, err) = psql(&proxy, user, password, &tls, "SELECT 1").await;
        assert!(!ok);
        assert!(
            err.contains(&format!(
                "password authentication failed for user \"{user}\""
            )),
            "{err}"
        );
    }
    // tokio-postgres gets 28P01.
    let err = refused(&proxy, SCRAM_USER, "wrong").await;
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD)
    );
    let failures = &proxy.app.metrics.auth_failures;
    assert_eq!((failures.client.get(), failures.backend.get()), (3, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_mode_with_auth_query_logs_in_with_no_password_stored_anywhere() {
    let s = setup();
    s.pg.psql_admin("CREATE TABLE t_auth (id int PRIMARY KEY, v text); INSERT INTO t_auth VALUES (1, 'x'); GRANT SELECT ON t_auth TO scramuser");
    let mut config = s.config(AuthMode::Terminate);
    config.auth.auth_query =
        "SELECT rolpassword FROM pg_catalog.pg_authid WHERE rolname = $1".into();
    // Another verifier of the same password (another salt) than the one
    // PostgreSQL holds, for a user of its own.
    s.pg.psql_admin("SET password_encryption = 'scram-sha-256'; CREATE ROLE salty LOGIN PASSWORD 'pepper'; GRANT SELECT ON t_auth TO salty");
    let hba = s.pg.dir.join("data/pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(
        &hba,
        format!("hostssl all salty 127.0.0.1/32 scram-sha-256\n{rules}"),
    )
    .unwrap();
    s.pg.psql_admin("SELECT pg_reload_conf()");
    // The reload is asynchronous: wait until salty needs a password.
    let direct = format!(
        "host=127.0.0.1 port={} user=salty dbname=postgres sslmode=require",
        s.pg.port
    );
    eventually(Duration::from_secs(10), "pg_hba.conf reloaded", || async {
        let out = run_tool(
            &pg().bin("psql"),
            &["-X", "-w", "-d", &direct, "-c", "SELECT 1"],
        )
        .await;
        (!out.status.success()).then_some(())
    })
    .await;
    let other = pgcache::scram::Verifier::random("pepper");
    config.auth.users.insert("salty".into(), other.to_text());
    let proxy = Proxy::start(config).await;

    // pgcache holds no password of scramuser: it logs in to PostgreSQL with
    // the key the client's proof yielded, checked against pg_authid.
    let dsn = format!(
        "{} password={SCRAM_PASSWORD}",
        proxy.dsn(SCRAM_USER, "postgres")
    );
    let client = connect_dsn(&dsn).await.expect("login through auth_query");
    assert_eq!(
        scalar(&client, "SELECT current_user").await.as_deref(),
        Some(SCRAM_USER)
    );
    proxy.wait_streaming("postgres").await;
    let read = "SELECT v FROM t_auth WHERE id = 1";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("x"));
    let hits = proxy.hits();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("x"));
    assert_eq!(proxy.hits(), hits + 1, "cached as usual");

    let err = refused(&proxy, SCRAM_USER, "wrong").await;
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_PASSWORD)
    );
    // pg_authid holds an MD5 hash for md5user: pgcache cannot check a SCRAM
    // login against it, and says so (28000), without telling why.
    let err = refused(&proxy, MD5_USER, MD5_PASSWORD).await;
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION)
    );
    // The client's password is right for pgcache's verifier, but the key
    // does not fit PostgreSQL's: a clear refusal, not a wrong-password one.
    let err = refused(&proxy, "salty", "pepper").await;
    let db = err.as_db_error().expect("a server error");
    assert_eq!(
        db.code(),
        &tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    );
    assert!(db.message().contains("verifier"), "{}", db.message());
    let failures = &proxy.app.metrics.auth_failures;
    assert_eq!((failures.client.get(), failures.backend.get()), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_mode_relays_postgresqls_refusal_and_gives_up_on_a_login_that_never_ends() {
    // Every connection pgcache opens as "slow" goes nowhere: its startup
    // packet never reaches PostgreSQL.
    let faults = Faults {
        freeze: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
        frozen_marker: b"user\0slow\0",
        ..Faults::default()
    };
    let port = relay(pg().port, faults).await;
    let mut config = pg().proxy_config();
    config.upstream.url = format!("postgres://postgres@127.0.0.1:{port}");
    config.upstream.connect_timeout_ms = 300;
    config.auth.mode = AuthMode::Terminate;
    // Not md5user's password in PostgreSQL.
    for user in [MD5_USER, "slow"] {
        config.auth.users.insert(user.into(), "pw".into());
    }
    let proxy = Proxy::start(config).await;

    // PostgreSQL refuses the password pgcache answers with: its own FATAL
    // reaches the client.
    let err = refused(&proxy, MD5_USER, "pw").await;
    let db = err.as_db_error().expect("a server error");
    assert_eq!(
        db.code(),
        &tokio_postgres::error::SqlState::INVALID_PASSWORD
    );
    assert!(
        db.message().contains("password authentication failed"),
        "{}",
        db.message()
    );

    // PostgreSQL never answers: the login fails at pgcache's deadline.
    let err = refused(&proxy, "slow", "pw").await;
    let db = err.as_db_error().expect("a server error");
    assert_eq!(
        db.code(),
        &tokio_postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
    );
    assert!(
        db.message()
            .contains("did not finish authentication in time"),
        "{}",
        db.message()
    );
    let failures = &proxy.app.metrics.auth_failures;
    assert_eq!((failures.client.get(), failures.backend.get()), (0, 2));
}
