//! TLS towards clients: offered after SSLRequest, required, verified by
//! psql, PostgreSQL 17's direct TLS, and certificates reloaded live.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgcache::config::SslMode;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn tls_config(mode: SslMode, cert: &Path, key: &Path) -> pgcache::Config {
    let mut config = pg().proxy_config();
    config.tls.ssl_mode = mode;
    config.tls.cert_file = cert.to_owned();
    config.tls.key_file = key.to_owned();
    config
}

/// psql with a connection string; returns (success, stdout, stderr).
async fn psql(conninfo: &str, command: &str) -> (bool, String, String) {
    let out = run_tool(
        &pg().bin("psql"),
        &["-X", "-At", "-d", conninfo, "-c", command],
    )
    .await;
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_offers_tls_and_still_takes_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_certificate(dir.path(), "server");
    let proxy = Proxy::start(tls_config(SslMode::Allow, &cert, &key)).await;
    let port = proxy.addr.port();
    let base = format!("host=localhost port={port} user=postgres dbname=postgres");
    let (ok, out, err) = psql(&format!("{base} sslmode=require"), "\\conninfo").await;
    assert!(ok, "{err}");
    assert!(out.contains("SSL connection (protocol: TLSv1.3"), "{out}");
    // The certificate verifies against its CA and the host name.
    let verified = format!("{base} sslmode=verify-full sslrootcert={}", ca.display());
    let (ok, out, err) = psql(&verified, "SELECT 40 + 2").await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "42");
    let (ok, out, err) = psql(&format!("{base} sslmode=disable"), "\\conninfo").await;
    assert!(ok, "{err}");
    assert!(!out.contains("SSL connection"), "{out}");
    // SCRAM relayed over a TLS client leg: the backend leg is plain text, so
    // no channel binding is offered, and libpq (channel_binding=prefer)
    // goes on without it.
    let scram = format!(
        "host=localhost port={port} user={SCRAM_USER} password={SCRAM_PASSWORD} dbname=postgres sslmode=require"
    );
    let (ok, out, err) = psql(&scram, "SELECT current_user").await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), SCRAM_USER);
    let (ok, _, err) = psql(&format!("{scram} channel_binding=require"), "SELECT 1").await;
    assert!(!ok, "channel binding cannot pass through pgcache's TLS");
    assert!(err.contains("channel binding"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_refuses_plain_text_with_28000() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, key) = tls_certificate(dir.path(), "server");
    let proxy = Proxy::start(tls_config(SslMode::Require, &cert, &key)).await;
    let base = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.addr.port()
    );
    let (ok, _, err) = psql(&format!("{base} sslmode=disable"), "SELECT 1").await;
    assert!(!ok);
    assert!(err.contains("pgcache requires TLS"), "{err}");
    let (ok, out, err) = psql(&format!("{base} sslmode=require"), "SELECT 1").await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "1");
}

/// A TLS client of our own that trusts `ca` and offers `alpn`.
async fn tls_connect(
    port: u16,
    ca: &Path,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// Sends a StartupMessage and returns the tag of the first reply, if any.
async fn first_reply<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
) -> Option<u8> {
    let startup = pgcache::protocol::startup::encode_startup(&[("user", "postgres")]);
    s.write_all(&startup).await.ok()?;
    let mut tag = [0u8; 1];
    match s.read(&mut tag).await {
        Ok(1) => Some(tag[0]),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_tls_needs_the_postgresql_alpn() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_certificate(dir.path(), "server");
    let proxy = Proxy::start(tls_config(SslMode::Require, &cert, &key)).await;
    let port = proxy.addr.port();
    let mut direct = tls_connect(port, &ca, &[b"postgresql"]).await.unwrap();
    // Authentication (trust: AuthenticationOk) comes back through TLS.
    assert_eq!(first_reply(&mut direct).await, Some(b'R'));
    // Without the ALPN PostgreSQL requires for direct TLS: no session.
    let refused = match tls_connect(port, &ca, &[]).await {
        Ok(mut s) => first_reply(&mut s).await,
        Err(_) => None,
    };
    assert_eq!(refused, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_switches_to_a_new_certificate_for_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_certificate(dir.path(), "server");
    let config = tls_config(SslMode::Require, &cert, &key);
    let file = dir.path().join("pgcache.toml");
    std::fs::write(
        &file,
        format!(
            "[upstream]\nurl = \"{}\"\n[server]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
             [tls]\nssl_mode = \"require\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            config.upstream.url,
            cert.display(),
            key.display()
        ),
    )
    .unwrap();
    let proxy = Proxy::start(config).await;
    proxy.app.set_config_source(Some(file), Default::default());
    let port = proxy.addr.port();
    assert!(tls_connect(port, &ca, &[b"postgresql"]).await.is_ok());
    // A renewal from another CA replaces the files in place.
    let (new_ca, new_cert, new_key) = tls_certificate(dir.path(), "renewed");
    std::fs::copy(&new_cert, &cert).unwrap();
    std::fs::copy(&new_key, &key).unwrap();
    // Until RELOAD, the old certificate is served.
    assert!(tls_connect(port, &new_ca, &[b"postgresql"]).await.is_err());
    proxy.app.reload().expect("reload");
    let mut s = tls_connect(port, &new_ca, &[b"postgresql"]).await.unwrap();
    assert_eq!(first_reply(&mut s).await, Some(b'R'));
    assert!(tls_connect(port, &ca, &[b"postgresql"]).await.is_err());
    // A broken key file fails the reload and keeps the certificate in force.
    std::fs::write(&key, "not a key").unwrap();
    assert!(proxy.app.reload().is_err());
    assert!(tls_connect(port, &new_ca, &[b"postgresql"]).await.is_ok());
}

/// pgcache pointed at `pg` with these `upstream.url` query parameters.
fn upstream_config(pg: &Pg, host: &str, params: &str) -> pgcache::Config {
    let mut config = pg.proxy_config();
    config.upstream.url = format!("postgres://postgres@{host}:{}/postgres?{params}", pg.port);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_cancels_and_replication_reach_a_tls_only_postgresql() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_certificate(dir.path(), "pg");
    let pg = Pg::dedicated_tls(&cert, &key);
    pg.psql_admin(
        "CREATE TABLE t_tls (id int PRIMARY KEY, v text); INSERT INTO t_tls VALUES (1, 'one')",
    );
    let params = format!("sslmode=verify-full&sslrootcert={}", ca.display());
    let proxy = Proxy::start(upstream_config(&pg, "localhost", &params)).await;
    // The replication stream is up: it logged in over TLS, since the server
    // refuses plain-text TCP for replication too.
    let client = proxy.connect("postgres").await;
    assert_eq!(
        pg.psql_admin(
            "SELECT count(*) FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid) WHERE s.ssl"
        )
        .trim(),
        "1"
    );
    let in_tls = scalar(
        &client,
        "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await;
    assert_eq!(in_tls.as_deref(), Some("true"));
    // psql on a plain client leg, SCRAM relayed to the TLS backend leg:
    // libpq sees no TLS of its own, so it does not ask for channel binding.
    let scram = format!(
        "host=127.0.0.1 port={} user={SCRAM_USER} password={SCRAM_PASSWORD} dbname=postgres sslmode=disable",
        proxy.addr.port()
    );
    let (ok, out, err) = psql(
        &scram,
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "t");

    let read = "SELECT v FROM t_tls WHERE id = 1";
    assert_eq!(scalar(&client, read).await.as_deref(), Some("one"));
    let hits = proxy.hits();
    assert_eq!(scalar(&client, read).await.as_deref(), Some("one"));
    assert_eq!(proxy.hits(), hits + 1, "the second read is a hit");
    // A write made on PostgreSQL directly arrives through the TLS stream.
    pg.psql_admin("UPDATE t_tls SET v = 'uno' WHERE id = 1");
    eventually(
        Duration::from_secs(10),
        "the direct write to be seen",
        || async { (scalar(&client, read).await.as_deref() == Some("uno")).then_some(()) },
    )
    .await;

    // A cancel request reaches the backend over TLS too.
    let token = client.cancel_token();
    let sleeper = tokio::spawn(async move { client.batch_execute("SELECT pg_sleep(60)").await });
    eventually(Duration::from_secs(10), "the sleep to start", || async {
        let n = pg.psql_admin(
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)'",
        );
        (n.trim() == "1").then_some(())
    })
    .await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancel ends the sleep")
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
    );
}

/// The error a client gets when pgcache cannot log in to `pg` this way.
async fn login_error(config: pgcache::Config) -> String {
    let mut config = config;
    config.replication.enabled = false;
    let proxy = Proxy::start(config).await;
    match connect_dsn(&proxy.dsn("postgres", "postgres")).await {
        Ok(_) => panic!("the login should fail"),
        Err(e) => e
            .as_db_error()
            .map_or(e.to_string(), |db| db.message().to_owned()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_sslmodes_check_what_libpq_checks() {
    let dir = tempfile::tempdir().unwrap();
    // A certificate for another name than the one pgcache connects to.
    let (ca, cert, key) = tls_certificate_for(dir.path(), "pg", "DNS:db.example");
    let (other_ca, _, _) = tls_certificate(dir.path(), "other");
    let tls_pg = Pg::dedicated_tls(&cert, &key);
    let query = |params: &str| upstream_config(&tls_pg, "127.0.0.1", params);

    // verify-ca checks the chain only; require and prefer check nothing.
    for params in [
        format!("sslmode=verify-ca&sslrootcert={}", ca.display()),
        "sslmode=require".to_owned(),
        "sslmode=prefer".to_owned(),
        String::new(),
    ] {
        let mut config = query(&params);
        config.replication.enabled = false;
        let proxy = Proxy::start(config).await;
        let client = connect_dsn(&proxy.dsn("postgres", "postgres"))
            .await
            .unwrap_or_else(|e| panic!("{params}: {e}"));
        assert_eq!(scalar(&client, "SELECT 1").await.as_deref(), Some("1"));
    }
    // verify-full also checks the name.
    let err = login_error(query(&format!(
        "sslmode=verify-full&sslrootcert={}",
        ca.display()
    )))
    .await;
    assert!(
        err.contains("TLS to upstream server") && err.contains("not valid for name"),
        "{err}"
    );
    // Another CA: refused by verify-ca, and by require once a CA file is given.
    for mode in ["verify-ca", "require"] {
        let err = login_error(query(&format!(
            "sslmode={mode}&sslrootcert={}",
            other_ca.display()
        )))
        .await;
        // Both test CAs have one name: the signature is what fails.
        assert!(err.contains("invalid peer certificate"), "{mode}: {err}");
    }
    // disable: PostgreSQL itself refuses plain text, and says so.
    let err = login_error(query("sslmode=disable")).await;
    assert!(err.contains("no encryption"), "{err}");
    // A server without TLS and a mode that needs it.
    let err = login_error(upstream_config(pg(), "127.0.0.1", "sslmode=require")).await;
    assert!(
        err.contains("does not accept TLS, but upstream.url has sslmode=require"),
        "{err}"
    );

    // With replication required, a TLS failure stops pgcache at start-up.
    let mut config = query(&format!(
        "sslmode=verify-full&sslrootcert={}",
        other_ca.display()
    ));
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    let err = match pgcache::App::start(config).await {
        Ok(_) => panic!("pgcache should refuse to start"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("TLS to PostgreSQL failed") && err.contains("sslrootcert"),
        "{err}"
    );
}
