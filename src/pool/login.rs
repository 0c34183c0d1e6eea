//! How pgcache logs in to a pool's connections: with a secret of a client
//! it authenticated, or as a trusted user, then reads the login to its
//! first ReadyForQuery and runs [`super::CHECK`].

use bytes::BytesMut;

use super::PoolError;
use super::Statuses;
use crate::auth::{self, AUTH_OK, LoginError};
use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::protocol::answer::read_answer;
use crate::protocol::codec::{HEADER_LEN, MAX_BACKEND_FRAME, read_i32};
use crate::protocol::startup::encode_startup;
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::protocol::{backend as be, messages, sqlstate};
use crate::scram::ClientSecret;
use crate::upstream::{Upstream, UpstreamAddr};

/// How pgcache logs in for a pool's connections.
#[derive(Clone, Default)]
pub(super) enum Credentials {
    #[default]
    Unknown,
    /// PostgreSQL let a client of this pool in without a password.
    Trusted,
    /// A secret of a client pgcache authenticated itself.
    Secret(ClientSecret),
}

/// A connection logged in and checked.
pub(super) struct LoggedIn {
    pub addr: UpstreamAddr,
    pub key: CancelTarget,
    pub statuses: Statuses,
    /// Its answer to [`super::CHECK`].
    pub check: Box<str>,
    pub stream: FramedStream<BackendStream>,
}

/// Opens a connection to `database` and logs in as `user` with
/// `credentials`.
pub(super) async fn log_in(
    upstream: &Upstream,
    user: &str,
    database: &str,
    credentials: &Credentials,
) -> Result<LoggedIn, PoolError> {
    let (stream, addr) = crate::backend::connect(upstream).await?;
    let buf = BytesMut::with_capacity(READ_CHUNK);
    let mut stream = FramedStream::new(stream, buf, MAX_BACKEND_FRAME);
    let options = upstream.origin.options();
    let mut params = vec![("user", user), ("database", database)];
    if let Some(options) = &options {
        params.push(("options", options));
    }
    let startup = encode_startup(&params);
    match &credentials {
        Credentials::Secret(secret) => {
            auth::login_backend(&mut stream, &startup, user, secret)
                .await
                .map_err(|e| match e {
                    LoginError::Server(frame) => server_error(&frame),
                    LoginError::Failed(reason) => PoolError::Login(reason),
                })?;
        }
        Credentials::Trusted => {
            stream.write_all(&startup).await.map_err(io_error)?;
        }
        Credentials::Unknown => {
            return Err(PoolError::Login(
                "no client of this user and database has logged in yet".into(),
            ));
        }
    }
    let (key, statuses) = read_login(&mut stream, &addr).await?;
    let answer = check(&mut stream).await?;
    Ok(LoggedIn {
        addr,
        key,
        statuses,
        check: answer,
        stream,
    })
}

fn io_error(e: std::io::Error) -> PoolError {
    PoolError::Login(format!("connection to PostgreSQL: {e}"))
}

fn server_error(frame: &[u8]) -> PoolError {
    let fallback = (sqlstate::CONNECTION_FAILURE, "PostgreSQL refused the login");
    let (code, message) = messages::error_parts(frame, fallback);
    PoolError::Server { code, message }
}

/// Reads a login from AuthenticationOk to the first ReadyForQuery: the
/// backend's key and the parameters it reported.
/// The next frame of a connection logging in.
async fn login_frame(stream: &mut FramedStream<BackendStream>) -> Result<BytesMut, PoolError> {
    match stream.read_frame().await {
        Ok(Some(frame)) => Ok(frame),
        Ok(None) => Err(PoolError::Login("PostgreSQL closed the connection".into())),
        Err(e) => Err(PoolError::Login(e.to_string())),
    }
}

async fn read_login(
    stream: &mut FramedStream<BackendStream>,
    addr: &UpstreamAddr,
) -> Result<(CancelTarget, Statuses), PoolError> {
    let mut statuses = Statuses::default();
    let mut key = None;
    loop {
        let frame = login_frame(stream).await?;
        let body = &frame[HEADER_LEN..];
        match frame[0] {
            be::AUTHENTICATION => {
                let mut p = 0;
                if read_i32(body, &mut p) != Some(AUTH_OK) {
                    return Err(PoolError::Login(
                        "PostgreSQL asked for a password: set auth.mode = \"terminate\" to pool \
                         connections of users that need one"
                            .into(),
                    ));
                }
            }
            be::PARAMETER_STATUS => statuses.note(&frame),
            be::BACKEND_KEY_DATA if body.len() >= 8 => {
                let mut p = 0;
                key = Some(CancelTarget {
                    addr: addr.clone(),
                    backend_pid: read_i32(body, &mut p).unwrap_or(0) as u32,
                    backend_secret: body[4..].to_vec(),
                });
            }
            be::ERROR_RESPONSE => return Err(server_error(&frame)),
            be::READY_FOR_QUERY => {
                let key = key
                    .ok_or_else(|| PoolError::Login("PostgreSQL sent no BackendKeyData".into()))?;
                return Ok((key, statuses));
            }
            _ => {}
        }
    }
}

/// Runs [`super::CHECK`] on a new connection: its answer as one text.
async fn check(stream: &mut FramedStream<BackendStream>) -> Result<Box<str>, PoolError> {
    let answered = read_answer(stream, &messages::query(super::CHECK), drop).await;
    let answered = answered.map_err(|e| PoolError::Login(e.to_string()))?;
    let answered =
        answered.ok_or_else(|| PoolError::Login("PostgreSQL closed the connection".into()))?;
    let rows = match answered.result {
        Ok(rows) => rows,
        Err(Some(frame)) => return Err(server_error(&frame)),
        Err(None) => return Err(PoolError::Login("an unreadable row".into())),
    };
    let mut answer = String::new();
    for value in rows.into_iter().flatten() {
        answer.push_str(value.as_deref().unwrap_or("\\N"));
        answer.push('\n');
    }
    Ok(answer.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_login_keeps_the_servers_sqlstate() {
        let refused = server_error(&{
            let mut f = BytesMut::new();
            messages::error_response(&mut f, "FATAL", "53300", "too many");
            f
        });
        assert_eq!(refused.sqlstate(), "53300");
        assert_eq!(refused.to_string(), "too many");
    }
}
