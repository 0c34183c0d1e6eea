//! pgcache's login to PostgreSQL for a client it authenticated itself
//! (terminate mode), or for a pool: PostgreSQL's authentication requests
//! in, pgcache's answers out, up to AuthenticationOk. [`BackendLogin`]
//! decides and does no I/O: the session's engine feeds it the frames its
//! connection reads, and [`login_backend`] runs it on a connection of its
//! own for the pools.

use bytes::BytesMut;
use pgwire::messages::startup::{Password, SASLInitialResponse, SASLResponse};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{AUTH_CLEARTEXT, AUTH_MD5, AUTH_OK, AUTH_SASL, AUTH_SASL_CONTINUE, AUTH_SASL_FINAL};
use crate::protocol::backend as be;
use crate::protocol::codec::HEADER_LEN;
use crate::protocol::messages::encode;
use crate::protocol::stream::{FramedStream, ReadError};
use crate::scram::{ClientExchange, ClientSecret, MECHANISM, ScramError};

/// A login to PostgreSQL as `user`, answered with a client's secret.
pub struct BackendLogin {
    user: String,
    secret: ClientSecret,
    scram: Option<ClientExchange>,
}

/// What a frame of PostgreSQL's during the login asks for.
#[derive(Debug)]
pub enum LoginStep {
    /// This answer goes to PostgreSQL.
    Answer(BytesMut),
    /// Nothing to send: the next frame is awaited.
    Wait,
    /// AuthenticationOk: the login is over. The frame, and what follows
    /// it, are the session's.
    Done,
}

impl BackendLogin {
    pub fn new(user: &str, secret: ClientSecret) -> Self {
        Self {
            user: user.to_owned(),
            secret,
            scram: None,
        }
    }

    /// The user logging in.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// One whole frame PostgreSQL sent before the login is over.
    pub fn on_frame(&mut self, frame: &[u8]) -> Result<LoginStep, LoginError> {
        match frame[0] {
            be::AUTHENTICATION => {}
            be::ERROR_RESPONSE => return Err(LoginError::Server(BytesMut::from(frame))),
            // Informational here.
            be::NEGOTIATE_PROTOCOL_VERSION => return Ok(LoginStep::Wait),
            other => {
                return Err(LoginError::Failed(format!(
                    "unexpected message {:?} during authentication",
                    other as char
                )));
            }
        }
        let body = &frame[HEADER_LEN..];
        let code = i32::from_be_bytes(
            body.get(..4)
                .and_then(|b| b.try_into().ok())
                .unwrap_or([0xff; 4]),
        );
        if code == AUTH_OK {
            return Ok(LoginStep::Done);
        }
        let data = body.get(4..).unwrap_or_default();
        Ok(
            match answer(code, data, &self.user, &self.secret, &mut self.scram)? {
                Some(reply) => LoginStep::Answer(reply),
                None => LoginStep::Wait,
            },
        )
    }
}

/// Logs in to PostgreSQL on a connection of pgcache's own: sends the
/// StartupMessage and answers the server's authentication requests.
/// Leaves the AuthenticationOk and everything after it in the stream's
/// buffer, for the caller to read.
pub async fn login_backend<B>(
    backend: &mut FramedStream<B>,
    startup_raw: &[u8],
    user: &str,
    secret: &ClientSecret,
) -> Result<(), LoginError>
where
    B: AsyncRead + AsyncWrite + Unpin,
{
    backend.write_all(startup_raw).await?;
    let mut login = BackendLogin::new(user, secret.clone());
    loop {
        let len = backend.wait_frame().await?.ok_or(LoginError::Failed(
            "PostgreSQL closed the connection during authentication".into(),
        ))?;
        match login.on_frame(&backend.buffered()[..len])? {
            LoginStep::Done => return Ok(()),
            LoginStep::Wait => backend.consume(len),
            LoginStep::Answer(reply) => {
                backend.consume(len);
                backend.write_all(&reply).await?;
            }
        }
    }
}

/// The answer to PostgreSQL's authentication request `code`; `None` when
/// none is due (SASLFinal, checked here).
fn answer(
    code: i32,
    data: &[u8],
    user: &str,
    secret: &ClientSecret,
    scram: &mut Option<ClientExchange>,
) -> Result<Option<BytesMut>, LoginError> {
    let mut reply = BytesMut::new();
    match (code, secret) {
        (AUTH_CLEARTEXT, ClientSecret::Password(password)) => {
            encode(&mut reply, Password::new(password.clone()));
        }
        (AUTH_MD5, ClientSecret::Password(password)) => {
            let salt = data
                .get(..4)
                .ok_or(LoginError::Failed("short MD5 salt".into()))?;
            encode(
                &mut reply,
                Password::new(md5_response(user, password, salt)),
            );
        }
        (AUTH_CLEARTEXT | AUTH_MD5, ClientSecret::Key { .. }) => {
            return Err(LoginError::Failed(format!(
                "PostgreSQL asks for user \"{user}\"'s password in {}, but pgcache holds only \
                 its SCRAM verifier: give the password in auth.users, or use scram-sha-256 \
                 in pg_hba.conf",
                if code == AUTH_MD5 {
                    "MD5"
                } else {
                    "clear text"
                }
            )));
        }
        (AUTH_SASL, _) => {
            let offered = data.split(|b| *b == 0).any(|m| m == MECHANISM.as_bytes());
            if !offered {
                return Err(LoginError::Failed(
                    "PostgreSQL offers no SASL mechanism pgcache knows".into(),
                ));
            }
            let (exchange, first) = ClientExchange::start(secret.clone());
            *scram = Some(exchange);
            encode(
                &mut reply,
                SASLInitialResponse::new(MECHANISM.to_owned(), Some(first.into())),
            );
        }
        (AUTH_SASL_CONTINUE, _) => {
            let exchange = scram
                .as_mut()
                .ok_or(LoginError::Failed("SASLContinue out of order".into()))?;
            let last = exchange.respond(&String::from_utf8_lossy(data))?;
            encode(&mut reply, SASLResponse::new(last.into()));
        }
        (AUTH_SASL_FINAL, _) => {
            scram
                .as_ref()
                .ok_or(LoginError::Failed("SASLFinal out of order".into()))?
                .verify(&String::from_utf8_lossy(data))?;
            return Ok(None);
        }
        (other, _) => {
            return Err(LoginError::Failed(format!(
                "PostgreSQL asks for authentication method {other}, which pgcache cannot \
                 answer for a client"
            )));
        }
    }
    Ok(Some(reply))
}

/// How logging in to PostgreSQL failed.
#[derive(Debug)]
pub enum LoginError {
    /// PostgreSQL's ErrorResponse, to relay.
    Server(BytesMut),
    Failed(String),
}

impl From<std::io::Error> for LoginError {
    fn from(e: std::io::Error) -> Self {
        LoginError::Failed(format!("connection to PostgreSQL: {e}"))
    }
}

impl From<ScramError> for LoginError {
    fn from(e: ScramError) -> Self {
        LoginError::Failed(e.to_string())
    }
}

impl From<ReadError> for LoginError {
    fn from(e: ReadError) -> Self {
        LoginError::Failed(format!("from PostgreSQL: {e}"))
    }
}

/// libpq's MD5 answer: "md5" + md5(md5(password + user) + salt), in hex.
fn md5_response(user: &str, password: &str, salt: &[u8]) -> String {
    use md5::{Digest, Md5};
    let inner = hex(&Md5::digest(format!("{password}{user}")));
    let mut outer = Md5::new();
    outer.update(inner.as_bytes());
    outer.update(salt);
    format!("md5{}", hex(&outer.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_answer_is_libpqs() {
        // PostgreSQL 15: SELECT 'md5' || md5(md5('pu') || 'abcd')
        assert_eq!(
            md5_response("u", "p", b"abcd"),
            "md5fa55bd30a96b8d5bd8215eee7c50a918"
        );
    }
}
