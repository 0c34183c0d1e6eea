//! TLS towards clients (rustls, ring provider): the certificate and key
//! from `[tls]`, offered after an SSLRequest or directly (PostgreSQL 17's
//! direct TLS, ALPN `postgresql`), and reloaded by RELOAD and SIGHUP.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::{SslMode, TlsConfig};

/// The ALPN protocol of PostgreSQL's direct TLS.
pub const ALPN_POSTGRESQL: &[u8] = b"postgresql";

/// The acceptor in force, replaced by a reload.
pub struct ClientTls {
    pub mode: SslMode,
    acceptor: RwLock<Option<Served>>,
}

/// Why the certificate and key cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls.cert_file {path}: {reason}")]
    Certificate { path: String, reason: String },
    #[error("tls.key_file {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("tls.cert_file and tls.key_file do not make a pair: {0}")]
    Pair(rustls::Error),
    #[error(transparent)]
    Rustls(#[from] rustls::Error),
}

#[derive(Clone)]
struct Served {
    acceptor: TlsAcceptor,
    /// `tls-server-end-point` channel-binding data of the certificate.
    end_point: Option<Arc<[u8]>>,
}

impl ClientTls {
    /// Loads the certificate and key when TLS is on.
    pub fn new(config: &TlsConfig) -> Result<Self, TlsError> {
        let acceptor = match config.ssl_mode {
            SslMode::Disable => None,
            _ => Some(acceptor(&config.cert_file, &config.key_file)?),
        };
        Ok(Self {
            mode: config.ssl_mode,
            acceptor: RwLock::new(acceptor),
        })
    }

    pub fn acceptor(&self) -> Option<TlsAcceptor> {
        self.served().map(|s| s.acceptor)
    }

    /// The `tls-server-end-point` data (RFC 5929) of the certificate in
    /// force, for SCRAM-SHA-256-PLUS; `None` when its signature algorithm
    /// names no hash (Ed25519). A reload between a client's handshake and
    /// its SCRAM exchange fails that one login's binding check.
    pub fn end_point(&self) -> Option<Arc<[u8]>> {
        self.served().and_then(|s| s.end_point)
    }

    fn served(&self) -> Option<Served> {
        self.acceptor
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Re-reads the certificate and key (the mode itself needs a restart).
    pub fn reload(&self, config: &TlsConfig) -> Result<(), TlsError> {
        if self.mode == SslMode::Disable {
            return Ok(());
        }
        let fresh = acceptor(&config.cert_file, &config.key_file)?;
        *self.acceptor.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh);
        Ok(())
    }
}

/// The certificate's hash under its signature's hash algorithm, SHA-256
/// for MD5 and SHA-1 (RFC 5929, section 4.1), as PostgreSQL computes it.
fn end_point(cert: &CertificateDer<'_>) -> Option<Arc<[u8]>> {
    use sha2::{Digest, Sha256, Sha384, Sha512};
    use x509_cert::der::Decode;
    use x509_cert::der::oid::db::rfc5912::{
        ECDSA_WITH_SHA_256, ECDSA_WITH_SHA_384, ECDSA_WITH_SHA_512, ID_SHA_1, ID_SHA_256,
        ID_SHA_384, ID_SHA_512, MD_5_WITH_RSA_ENCRYPTION, SHA_1_WITH_RSA_ENCRYPTION,
        SHA_256_WITH_RSA_ENCRYPTION, SHA_384_WITH_RSA_ENCRYPTION, SHA_512_WITH_RSA_ENCRYPTION,
    };
    let parsed = x509_cert::Certificate::from_der(cert.as_ref()).ok()?;
    let data: &[u8] = cert.as_ref();
    Some(match parsed.signature_algorithm.oid {
        ID_SHA_1
        | ID_SHA_256
        | MD_5_WITH_RSA_ENCRYPTION
        | SHA_1_WITH_RSA_ENCRYPTION
        | SHA_256_WITH_RSA_ENCRYPTION
        | ECDSA_WITH_SHA_256 => Sha256::digest(data).to_vec().into(),
        ID_SHA_384 | SHA_384_WITH_RSA_ENCRYPTION | ECDSA_WITH_SHA_384 => {
            Sha384::digest(data).to_vec().into()
        }
        ID_SHA_512 | SHA_512_WITH_RSA_ENCRYPTION | ECDSA_WITH_SHA_512 => {
            Sha512::digest(data).to_vec().into()
        }
        _ => return None,
    })
}

fn acceptor(cert_file: &Path, key_file: &Path) -> Result<Served, TlsError> {
    let certificate = |reason: String| TlsError::Certificate {
        path: cert_file.display().to_string(),
        reason,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect())
        .map_err(|e| certificate(e.to_string()))?;
    if certs.is_empty() {
        return Err(certificate("no certificate in it".to_owned()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| TlsError::Key {
        path: key_file.display().to_string(),
        reason: e.to_string(),
    })?;
    let end_point = end_point(&certs[0]);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TlsError::Pair)?;
    config.alpn_protocols = vec![ALPN_POSTGRESQL.to_vec()];
    Ok(Served {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        end_point,
    })
}

/// A client connection, in plain text or TLS.
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
    /// Between plain text and TLS, during the handshake.
    Detached,
}

fn detached() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "connection is being upgraded to TLS",
    )
}

impl ClientStream {
    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }

    /// The protocol agreed on by ALPN, on a TLS connection.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        match self {
            ClientStream::Tls(tls) => tls.get_ref().1.alpn_protocol(),
            _ => None,
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            ClientStream::Detached => Poll::Ready(Err(detached())),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            ClientStream::Detached => Poll::Ready(Err(detached())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            ClientStream::Detached => Poll::Ready(Err(detached())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            ClientStream::Detached => Poll::Ready(Err(detached())),
        }
    }
}
