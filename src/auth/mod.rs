//! Authentication. In `passthrough` mode (the default) PostgreSQL
//! authenticates every client through pgcache: the exchange is relayed, with
//! SCRAM's channel binding taken out, since pgcache ends each TLS leg. In
//! `terminate` mode pgcache authenticates the client itself with
//! SCRAM-SHA-256 (and `-PLUS` over TLS), against `auth.users` or
//! `auth.auth_query`, then logs in to PostgreSQL as the same user: with the
//! password when it has one, else with the `ClientKey` the client's proof
//! gave away (PostgreSQL must then hold the same verifier, as it does when
//! the verifier comes from `pg_authid`).

mod exchange;
mod login;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use bytes::BytesMut;
use pgwire::messages::startup::Authentication;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::config::AuthConfig;
use crate::protocol::codec::{read_cstr, read_i32};
use crate::protocol::messages::encode;
use crate::protocol::stream::{FramedStream, ReadError};
use crate::scram::{Credentials, MECHANISM_PLUS, ScramError, Verifier, credentials};
use crate::upstream::Upstream;
pub use exchange::{SaslServer, Turn};
pub use login::{BackendLogin, LoginError, LoginStep, login_backend};

/// Authentication request codes (the `R` message's first field).
pub const AUTH_OK: i32 = 0;
const AUTH_CLEARTEXT: i32 = 3;
const AUTH_MD5: i32 = 5;
pub const AUTH_SASL: i32 = 10;
const AUTH_SASL_CONTINUE: i32 = 11;
const AUTH_SASL_FINAL: i32 = 12;

/// The largest authentication message accepted from a client.
const MAX_AUTH_MESSAGE: usize = 16 * 1024;

/// The terminate-mode state of one instance.
pub struct Authenticator {
    upstream: Arc<Upstream>,
    users: RwLock<Arc<HashMap<String, Credentials>>>,
    /// The control connection `auth_query` runs on, opened on first use.
    query_client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    /// Keys the fake salts of unknown users.
    secret: [u8; 32],
}

impl Authenticator {
    pub fn new(config: &AuthConfig, upstream: Arc<Upstream>) -> Self {
        let mut secret = [0u8; 32];
        rand::fill(&mut secret);
        let this = Self {
            upstream,
            users: RwLock::default(),
            query_client: tokio::sync::Mutex::new(None),
            secret,
        };
        this.reload(config);
        this
    }

    /// Takes `auth.users` anew (validated already).
    pub fn reload(&self, config: &AuthConfig) {
        let users = config
            .users
            .iter()
            .filter_map(|(user, value)| Some((user.clone(), credentials(value).ok()?)))
            .collect();
        *self.users.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(users);
    }

    /// A verifier no password matches, salted as a user's own would be:
    /// an unknown user's exchange runs as any other's, and fails.
    pub fn stand_in(&self, user: &str) -> Verifier {
        Verifier::impossible(user, &self.secret)
    }

    /// The user's credentials: `auth.users` first, then `auth.auth_query`.
    /// `Ok(None)`: no such user (or no password).
    pub async fn lookup(
        &self,
        query: &str,
        user: &str,
    ) -> Result<Option<Credentials>, LookupError> {
        if let Some(found) = self
            .users
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(user)
        {
            return Ok(Some(found.clone()));
        }
        if query.is_empty() {
            return Ok(None);
        }
        let mut slot = self.query_client.lock().await;
        if slot.as_ref().is_none_or(|c| c.is_closed()) {
            let client = self
                .upstream
                .control(self.upstream.default_database())
                .await
                .map_err(LookupError::Connect)?;
            *slot = Some(client);
        }
        let client = slot.as_ref().expect("just connected");
        let rows = client
            .query(query, &[&user])
            .await
            .map_err(LookupError::Query)?;
        let value: Option<String> = match rows.first() {
            Some(row) => row.try_get(0).map_err(LookupError::Column)?,
            None => None,
        };
        match value {
            Some(value) => credentials(&value).map(Some).map_err(LookupError::Secret),
            None => Ok(None),
        }
    }
}

/// Why `auth_query` could not say what a user's password is.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("auth_query connection: {0}")]
    Connect(tokio_postgres::Error),
    #[error("auth_query failed: {0}")]
    Query(tokio_postgres::Error),
    #[error("auth_query must return one text column: {0}")]
    Column(tokio_postgres::Error),
    #[error("auth_query's password: {0}")]
    Secret(ScramError),
}

/// A SASLInitialResponse body: (mechanism, data).
pub fn initial_response(body: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut pos = 0;
    let mechanism = read_cstr(body, &mut pos)?;
    let len = read_i32(body, &mut pos)?;
    let data = match usize::try_from(len) {
        Ok(len) => body.get(pos..pos + len)?,
        Err(_) => &[], // -1: no data
    };
    Some((mechanism, data))
}

/// Why a client's SASL exchange broke off (a wrong password is not an
/// error: see [`sasl_server`]).
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("client went away")]
    Gone,
    #[error("expected a {0}")]
    Unexpected(&'static str),
    #[error(transparent)]
    Scram(#[from] ScramError),
}

/// The client's next message during an exchange, no larger than an
/// authentication message may be.
pub async fn read_auth_frame<C: AsyncRead + Unpin>(
    client: &mut FramedStream<C>,
) -> Result<BytesMut, ExchangeError> {
    let max = client.max_frame();
    client.set_max_frame(MAX_AUTH_MESSAGE);
    let frame = client.read_frame().await;
    client.set_max_frame(max);
    frame?.ok_or(ExchangeError::Gone)
}

/// Runs SCRAM-SHA-256 as the server on `client` ([`SaslServer`]).
/// `Ok(Some(client_key))` when the proof was right, `Ok(None)` when it was
/// not; `Err` for a broken exchange.
pub async fn sasl_server<C>(
    client: &mut FramedStream<C>,
    verifier: Verifier,
    end_point: Option<Arc<[u8]>>,
) -> Result<Option<[u8; 32]>, ExchangeError>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let (mut exchange, mut out) = SaslServer::start(verifier, end_point);
    loop {
        client.write_all(&out).await?;
        let frame = read_auth_frame(client).await?;
        match exchange.on_frame(&frame)? {
            Turn::Continue(next) => out = next,
            Turn::Proven(last, client_key) => {
                client.write_all(&last).await?;
                return Ok(Some(client_key));
            }
            Turn::Refused => return Ok(None),
        }
    }
}

/// Passthrough: the mechanism list of an AuthenticationSASL body (after the
/// code) without `SCRAM-SHA-256-PLUS`, which cannot cross pgcache's TLS
/// ends. `None` when there is nothing to take out.
pub fn without_plus(mechanisms: &[u8]) -> Option<BytesMut> {
    let names: Vec<&[u8]> = mechanisms
        .split(|b| *b == 0)
        .filter(|m| !m.is_empty())
        .collect();
    if !names.contains(&MECHANISM_PLUS.as_bytes()) {
        return None;
    }
    let kept = names
        .iter()
        .filter(|m| **m != MECHANISM_PLUS.as_bytes())
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .collect();
    let mut out = BytesMut::new();
    encode(&mut out, Authentication::SASL(kept));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plus_is_taken_out_of_the_mechanism_list() {
        let frame = without_plus(b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0").unwrap();
        assert_eq!(&frame[..], b"R\0\0\0\x17\0\0\0\x0aSCRAM-SHA-256\0\0");
        assert!(without_plus(b"SCRAM-SHA-256\0\0").is_none());
    }

    #[test]
    fn configured_secrets_are_checked() {
        assert!(credentials("SCRAM-SHA-256$4096:broken").is_err());
        assert!(credentials("md5d41d8cd98f00b204e9800998ecf8427e").is_err());
        let plain = credentials("hunter2").unwrap();
        assert_eq!(plain.password.as_deref(), Some("hunter2"));
    }
}
