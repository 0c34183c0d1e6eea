//! `upstream.url` and TLS towards PostgreSQL: libpq's `sslmode` and
//! `sslrootcert`, honoured alike by client sessions, cancel requests, the
//! control connections (tokio-postgres) and the replication streams.
//!
//! tokio-postgres knows only `disable`, `prefer` and `require`, and no
//! `sslrootcert`; those two parameters are taken out of the URL here, and
//! certificate checks are done by the rustls configuration built from them.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

mod conninfo;
mod verifiers;

use conninfo::split_params;
use verifiers::{AnyName, Unchecked};

/// What is wrong with `upstream.url` (or the files it names).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error(transparent)]
    Url(#[from] tokio_postgres::Error),
    #[error("sslmode {0:?}: expected disable, allow, prefer, require, verify-ca or verify-full")]
    SslMode(String),
    #[error("{0}: client certificates towards PostgreSQL are not supported")]
    ClientCertificate(String),
    #[error("sslmode={0} needs sslrootcert=<CA file> to check the server's certificate against")]
    NoRootCert(&'static str),
    #[error("{key}: {reason}")]
    Param { key: String, reason: String },
    #[error("missing \"=\" after {0:?} in connection string")]
    MissingEquals(String),
    #[error(
        "{0:?} is not a PostgreSQL URL: it must start with postgres:// or postgresql:// \
         (or be key=value pairs: host=... port=...)"
    )]
    Scheme(String),
    #[error("port {0:?}: a port is a number from 1 to 65535")]
    Port(String),
    #[error("unterminated quoted value")]
    Unterminated,
    #[error("sslrootcert {path}: {reason}")]
    RootCert { path: String, reason: String },
    #[error(transparent)]
    Tls(#[from] rustls::Error),
}

impl UpstreamError {
    fn root_cert(path: &std::path::Path, reason: impl std::fmt::Display) -> Self {
        Self::RootCert {
            path: path.display().to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Where the backend is, resolved from `upstream.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamAddr {
    Tcp { host: String, port: u16 },
    Unix { path: PathBuf },
}

impl std::fmt::Display for UpstreamAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamAddr::Tcp { host, port } => write!(f, "{host}:{port}"),
            UpstreamAddr::Unix { path } => write!(f, "{}", path.display()),
        }
    }
}

/// `upstream.url`, parsed once at start-up: the addresses to try, TLS, and
/// the settings pgcache's own connections (control, `auth_query`) start
/// from. Every connection to PostgreSQL is made from this.
#[derive(Debug)]
pub struct Upstream {
    pub addrs: Vec<UpstreamAddr>,
    pub tls: UpstreamTls,
    pub connect_timeout: Duration,
    /// This instance, as its connections (its client sessions' and its
    /// own) name it to PostgreSQL and its heartbeats name it in the stream.
    pub origin: crate::origin::Origin,
    pg: tokio_postgres::Config,
}

/// Adds `option` (`-c name=value`) to the `options` startup parameter
/// of `pg`, after those `upstream.url` gives.
pub fn add_option(pg: &mut tokio_postgres::Config, option: &str) {
    let options = match pg.get_options() {
        Some(theirs) if !theirs.is_empty() => format!("{theirs} {option}"),
        _ => option.to_owned(),
    };
    pg.options(&options);
}

impl Upstream {
    pub fn new(url: &str, connect_timeout: Duration) -> Result<Self, UpstreamError> {
        let url = UpstreamUrl::parse(url)?;
        Ok(Self {
            addrs: addrs(&url.pg),
            tls: UpstreamTls::new(&url)?,
            connect_timeout,
            origin: crate::origin::Origin::default(),
            pg: url.pg,
        })
    }

    /// Settings for a connection of pgcache's own to `database`, as the
    /// user in `upstream.url` (default `postgres`).
    pub fn control_config(&self, database: &str) -> tokio_postgres::Config {
        let mut pg = self.pg.clone();
        if pg.get_user().is_none() {
            pg.user("postgres");
        }
        pg.dbname(database);
        pg.application_name("pgcache");
        pg.connect_timeout(self.connect_timeout);
        // Its DDL (the publication's, the trigger's) is handled where it
        // is run, as a client session's is: the trigger names this
        // instance, whose stream takes no round after it.
        if let Some(origin) = self.origin.options() {
            add_option(&mut pg, &origin);
        }
        pg
    }

    /// The database named in `upstream.url` (default `postgres`).
    pub fn default_database(&self) -> &str {
        self.pg.get_dbname().unwrap_or("postgres")
    }

    /// Opens a connection of pgcache's own to `database`.
    pub async fn control(
        &self,
        database: &str,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, conn) = self
            .control_config(database)
            .connect(self.tls.make_tls())
            .await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "control connection closed");
            }
        });
        Ok(client)
    }

    /// The addresses pgcache tries, for messages.
    pub fn describe(&self) -> String {
        let addrs: Vec<String> = self.addrs.iter().map(ToString::to_string).collect();
        addrs.join(", ")
    }

    /// A name for the PostgreSQL cluster when its system identifier is
    /// unknown.
    pub fn namespace(&self) -> String {
        let text = format!("{:?}", self.addrs);
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
    }
}

/// The backend addresses to try, in order.
fn addrs(pg: &tokio_postgres::Config) -> Vec<UpstreamAddr> {
    let ports = pg.get_ports();
    let port_for = |i: usize| match ports.len() {
        0 => 5432,
        1 => ports[0],
        _ => ports.get(i).copied().unwrap_or(5432),
    };
    let mut out = Vec::new();
    for (i, host) in pg.get_hosts().iter().enumerate() {
        match host {
            tokio_postgres::config::Host::Tcp(h) => out.push(UpstreamAddr::Tcp {
                host: h.clone(),
                port: port_for(i),
            }),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(dir) => out.push(UpstreamAddr::Unix {
                path: dir.join(format!(".s.PGSQL.{}", port_for(i))),
            }),
        }
    }
    if out.is_empty() {
        out.push(UpstreamAddr::Tcp {
            host: "127.0.0.1".to_owned(),
            port: port_for(0),
        });
    }
    out
}

/// libpq's `sslmode` for the connections pgcache opens to PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UpstreamSslMode {
    Disable,
    Allow,
    /// libpq's default: TLS if the server offers it, without checking the
    /// certificate (unless `sslrootcert` is given).
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl UpstreamSslMode {
    fn parse(value: &str) -> Result<Self, UpstreamError> {
        Ok(match value {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => return Err(UpstreamError::SslMode(other.to_owned())),
        })
    }

    /// TLS is attempted at all.
    pub fn tries_tls(self) -> bool {
        !matches!(self, Self::Disable | Self::Allow)
    }

    /// A server that declines TLS is refused.
    pub fn requires_tls(self) -> bool {
        matches!(self, Self::Require | Self::VerifyCa | Self::VerifyFull)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

/// `upstream.url` split into what tokio-postgres parses and the TLS
/// parameters pgcache handles itself.
#[derive(Debug, Clone)]
pub struct UpstreamUrl {
    /// The rest of the URL, with `ssl_mode` set to the nearest
    /// tokio-postgres knows (certificate checks come from [`UpstreamTls`]).
    pub pg: tokio_postgres::Config,
    pub ssl_mode: UpstreamSslMode,
    pub root_cert: Option<PathBuf>,
}

/// Parameters taken out of the URL before tokio-postgres sees it.
const TLS_PARAMS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl UpstreamUrl {
    pub fn parse(url: &str) -> Result<Self, UpstreamError> {
        let (rest, params) = split_params(url, &TLS_PARAMS)?;
        let mut pg = tokio_postgres::Config::from_str(&rest)?;
        let mut ssl_mode = UpstreamSslMode::default();
        let mut root_cert = None;
        for (key, value) in params {
            match key.as_str() {
                "sslmode" => ssl_mode = UpstreamSslMode::parse(&value)?,
                "sslrootcert" => root_cert = Some(PathBuf::from(value)),
                _ => return Err(UpstreamError::ClientCertificate(key)),
            }
        }
        if matches!(
            ssl_mode,
            UpstreamSslMode::VerifyCa | UpstreamSslMode::VerifyFull
        ) && root_cert.is_none()
        {
            return Err(UpstreamError::NoRootCert(ssl_mode.as_str()));
        }
        pg.ssl_mode(match ssl_mode {
            UpstreamSslMode::Disable | UpstreamSslMode::Allow => {
                tokio_postgres::config::SslMode::Disable
            }
            UpstreamSslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(Self {
            pg,
            ssl_mode,
            root_cert,
        })
    }
}

/// The TLS settings of every connection to PostgreSQL.
#[derive(Clone)]
pub struct UpstreamTls {
    pub mode: UpstreamSslMode,
    pub root_cert: Option<PathBuf>,
    /// Built when TLS may be used.
    config: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .finish()
    }
}

impl UpstreamTls {
    /// Reads the CA file, if any, and builds the rustls configuration.
    pub fn new(url: &UpstreamUrl) -> Result<Self, UpstreamError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = if url.ssl_mode.tries_tls() {
            let verifier: Arc<dyn ServerCertVerifier> = match &url.root_cert {
                Some(path) => {
                    let mut roots = RootCertStore::empty();
                    let certs = CertificateDer::pem_file_iter(path)
                        .map_err(|e| UpstreamError::root_cert(path, e))?;
                    for cert in certs {
                        let cert = cert.map_err(|e| UpstreamError::root_cert(path, e))?;
                        roots
                            .add(cert)
                            .map_err(|e| UpstreamError::root_cert(path, e))?;
                    }
                    if roots.is_empty() {
                        return Err(UpstreamError::root_cert(path, "no certificate in the file"));
                    }
                    let webpki = WebPkiServerVerifier::builder_with_provider(
                        Arc::new(roots),
                        provider.clone(),
                    )
                    .build()
                    .map_err(|e| UpstreamError::root_cert(path, e))?;
                    // As in libpq, a CA file makes require check the chain.
                    if url.ssl_mode == UpstreamSslMode::VerifyFull {
                        webpki
                    } else {
                        Arc::new(AnyName(webpki))
                    }
                }
                None => Arc::new(Unchecked(provider.signature_verification_algorithms)),
            };
            let config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_no_client_auth();
            Some(Arc::new(config))
        } else {
            None
        };
        Ok(Self {
            mode: url.ssl_mode,
            root_cert: url.root_cert.clone(),
            config,
        })
    }

    pub fn connector(&self) -> Option<tokio_rustls::TlsConnector> {
        self.config.clone().map(tokio_rustls::TlsConnector::from)
    }

    /// For tokio-postgres (control connections).
    pub fn make_tls(&self) -> tokio_postgres_rustls::MakeRustlsConnect {
        let config = self.config.as_deref().cloned().unwrap_or_else(|| {
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .with_root_certificates(RootCertStore::empty())
                .with_no_client_auth()
        });
        tokio_postgres_rustls::MakeRustlsConnect::new(config)
    }

    /// For the replication client, which has TLS of its own.
    pub fn replication(&self, host: &str) -> pgwire_replication::TlsConfig {
        use pgwire_replication::{SslMode, TlsConfig};
        let mode = match (self.mode, &self.root_cert) {
            (UpstreamSslMode::Disable | UpstreamSslMode::Allow, _) => SslMode::Disable,
            (UpstreamSslMode::Prefer, _) => SslMode::Prefer,
            (UpstreamSslMode::Require, None) => SslMode::Require,
            (UpstreamSslMode::Require | UpstreamSslMode::VerifyCa, Some(_)) => SslMode::VerifyCa,
            (UpstreamSslMode::VerifyCa, None) => SslMode::VerifyCa,
            (UpstreamSslMode::VerifyFull, _) => SslMode::VerifyFull,
        };
        TlsConfig {
            mode,
            ca_pem_path: self.root_cert.clone(),
            sni_hostname: Some(host.to_owned()),
            client_cert_pem_path: None,
            client_key_pem_path: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_accepts_urls_and_key_value_strings() {
        let url = "postgres://db.example:6543/app".to_owned();
        assert_eq!(
            addrs(&UpstreamUrl::parse(&url).unwrap().pg),
            vec![UpstreamAddr::Tcp {
                host: "db.example".into(),
                port: 6543
            }]
        );
        let url = "host=/run/postgresql port=5433".to_owned();
        assert_eq!(
            addrs(&UpstreamUrl::parse(&url).unwrap().pg),
            vec![UpstreamAddr::Unix {
                path: "/run/postgresql/.s.PGSQL.5433".into()
            }]
        );
        let url = "postgres://".to_owned();
        assert_eq!(
            addrs(&UpstreamUrl::parse(&url).unwrap().pg),
            vec![UpstreamAddr::Tcp {
                host: "127.0.0.1".into(),
                port: 5432
            }]
        );
    }

    fn split(url: &str) -> (String, Vec<(String, String)>) {
        split_params(url, &TLS_PARAMS).unwrap()
    }

    #[test]
    fn a_wrong_scheme_or_port_is_named() {
        let err = |url: &str| UpstreamUrl::parse(url).err().map(|e| e.to_string());
        assert!(
            err("postgress://u@h:5432/db")
                .is_some_and(|e| e.contains("\"postgress://\" is not a PostgreSQL URL"))
        );
        assert!(err("mysql://h/db").is_some_and(|e| e.contains("postgres://")));
        for port in ["99999", "0", "54x"] {
            let e = err(&format!("postgres://u:p@h:{port}/db"));
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains(&format!("port {port:?}"))),
                "{e:?}"
            );
        }
        let e = err("postgres://u@h1:5432,[::1]:70000/db");
        assert!(e.is_some_and(|e| e.contains("\"70000\"")));
        for ok in [
            "postgres://u:p@h:5432/db",
            "postgres://h/db",
            "postgresql://[::1]:6543/db?sslmode=disable",
        ] {
            assert!(UpstreamUrl::parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn tls_parameters_leave_urls_and_key_value_strings() {
        let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        for (input, rest, taken) in [
            (
                "postgres://u:p@db:5433/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
                "postgres://u:p@db:5433/app?application_name=x",
                vec![
                    pair("sslmode", "verify-full"),
                    pair("sslrootcert", "/etc/ca.pem"),
                ],
            ),
            (
                "postgresql://db/app?sslmode=require",
                "postgresql://db/app",
                vec![pair("sslmode", "require")],
            ),
            (
                "host=db  sslmode = require password='it\\'s \\\\ y' sslrootcert='/a b/ca.pem' port=5",
                "host=db password='it\\'s \\\\ y' port=5",
                vec![
                    pair("sslmode", "require"),
                    pair("sslrootcert", "/a b/ca.pem"),
                ],
            ),
        ] {
            assert_eq!(split(input), (rest.to_owned(), taken), "{input}");
        }
        assert!(split_params("host=db sslmode", &TLS_PARAMS).is_err());
        assert!(split_params("sslrootcert='open", &TLS_PARAMS).is_err());
    }

    #[test]
    fn modes_map_to_what_each_client_knows() {
        let url = UpstreamUrl::parse("postgres://db/app").unwrap();
        assert_eq!(url.ssl_mode, UpstreamSslMode::Prefer, "libpq's default");
        let url = UpstreamUrl::parse("host=db sslmode=disable").unwrap();
        assert_eq!(
            url.pg.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        let url =
            UpstreamUrl::parse("postgres://db/app?sslmode=verify-ca&sslrootcert=/ca").unwrap();
        assert_eq!(
            url.pg.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(url.root_cert.as_deref(), Some(std::path::Path::new("/ca")));
        let err = UpstreamUrl::parse("postgres://db/app?sslmode=verify-full").unwrap_err();
        assert!(matches!(err, UpstreamError::NoRootCert("verify-full")));
        assert!(err.to_string().contains("sslrootcert"), "{err}");
        let err = UpstreamUrl::parse("postgres://db/app?sslmode=sometimes").unwrap_err();
        assert!(err.to_string().contains("verify-full"), "{err}");
        let err = UpstreamUrl::parse("postgres://db/app?sslcert=/c").unwrap_err();
        assert!(matches!(err, UpstreamError::ClientCertificate(_)));
        assert!(err.to_string().contains("client certificates"), "{err}");
    }
}
