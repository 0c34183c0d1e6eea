//! A connection's opening, before its StartupMessage: TLS (SSLRequest, or
//! PostgreSQL 17's direct TLS), GSSENCRequest, a CancelRequest, or the
//! StartupMessage that begins its session. What each packet asks is
//! decided without I/O ([`next_packet`]); [`serve`] reads the bytes,
//! writes the answers, does the TLS handshake and hands the session its
//! StartupMessage.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::App;
use crate::protocol::sqlstate;
use crate::protocol::startup::{self, StartupPacket};
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::session::{self, Negotiated, SessionError};
use crate::tls::ClientStream;

/// Serves one accepted connection to its end. `starting` is released once
/// its opening is over; a place under `limit` (the connection limit) is
/// taken only then ([`session::serve`]), so connections that never finish
/// their opening cost nothing but their `starting` slot.
pub async fn serve(
    app: Arc<App>,
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    (limit, sessions): (Arc<tokio::sync::Semaphore>, TaskTracker),
    starting: impl Send,
) {
    let config = app.config();
    // A chunk from the start: the first read reserves one anyway, and a
    // smaller buffer was reallocated on it.
    let mut client = FramedStream::new(
        ClientStream::Plain(socket),
        BytesMut::with_capacity(READ_CHUNK),
        config.server.max_message_bytes,
    );
    // Boxed: a large future that lives once, and the task's own future is
    // what every idle client keeps.
    let opened = tokio::time::timeout(config.startup_timeout(), Box::pin(open(&app, &mut client)));
    let opened = opened.await.unwrap_or_else(|_| {
        Err(SessionError::refused(
            sqlstate::CONNECTION_EXCEPTION,
            "timeout expired while waiting for startup packet",
        ))
    });
    drop(starting);
    match opened {
        Ok(Some(negotiated)) => {
            let session = session::serve(app, client, negotiated, peer, (limit, sessions));
            Box::pin(session).await
        }
        Ok(None) => {} // a cancel request, or the client went away
        Err(e) => session::refused(client, e, peer).await,
    }
}

/// Refuses a connection at once: too many from its address are starting.
pub async fn refuse<C>(client: C)
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut client = FramedStream::new(client, BytesMut::new(), 0);
    let e = SessionError::refused(
        sqlstate::TOO_MANY_CONNECTIONS,
        "sorry, too many connections from this address are starting up",
    );
    if let Some(msg) = e.to_fatal() {
        let _ = tokio::time::timeout(session::LINGER, client.write_all(&msg)).await;
    }
}

/// The connection's first packets, as [`next_packet`] says: switching to
/// TLS when the client asks (after an SSLRequest) or starts with a TLS
/// handshake (direct TLS). `Ok(None)`: the connection has nothing more to
/// do (a cancel request, or the client went away).
async fn open(
    app: &App,
    client: &mut FramedStream<ClientStream>,
) -> Result<Option<Negotiated>, SessionError> {
    let acceptor = app.tls.acceptor();
    if let (Some(acceptor), ClientStream::Plain(socket)) = (&acceptor, client.get_ref()) {
        let mut first = [0u8; 1];
        let peeked = socket.peek(&mut first).await;
        if peeked.map_err(SessionError::ClientIo)? == 1 && first[0] == TLS_HANDSHAKE {
            upgrade(client, acceptor).await?;
            direct_tls_agreed(client.get_ref().alpn_protocol())?;
        }
    }
    loop {
        let offer = acceptor.as_ref().filter(|_| !client.get_ref().is_tls());
        match next_packet(client.buffer_mut(), offer.is_some())? {
            Opening::More => {
                if client.fill().await.map_err(SessionError::ClientIo)? == 0 {
                    return Ok(None);
                }
            }
            Opening::Answer { tls } => {
                let answer = if tls { b"S" } else { b"N" };
                let r = client.write_all(answer).await;
                r.map_err(SessionError::ClientIo)?;
                if let (true, Some(acceptor)) = (tls, offer) {
                    upgrade(client, acceptor).await?;
                }
            }
            Opening::Cancel { pid, secret } => {
                forward_cancel(app, pid, &secret).await;
                return Ok(None);
            }
            Opening::Startup(negotiated) => return Ok(Some(negotiated)),
        }
    }
}

/// The TLS handshake, on a connection in plain text so far.
async fn upgrade(
    client: &mut FramedStream<ClientStream>,
    acceptor: &tokio_rustls::TlsAcceptor,
) -> Result<(), SessionError> {
    let stream = client.get_mut();
    let ClientStream::Plain(socket) = std::mem::replace(stream, ClientStream::Detached) else {
        return Err(SessionError::Dropped("TLS requested twice"));
    };
    let tls = acceptor.accept(socket).await;
    *stream = ClientStream::Tls(Box::new(tls.map_err(SessionError::ClientIo)?));
    Ok(())
}

/// Sends a client's CancelRequest on to the backend its key names, if the
/// key is one pgcache handed out.
async fn forward_cancel(app: &App, pid: u32, secret: &[u8]) {
    let Some(target) = app.cancel.lookup(pid, secret) else {
        debug!(pid, "cancel request with an unknown key ignored");
        return;
    };
    if let Err(e) = crate::backend::send_cancel(&app.upstream, &target).await {
        warn!(error = %e, "could not forward cancel request");
    }
}

/// What the connection's next packet asks.
enum Opening {
    /// No whole packet is buffered yet: read more.
    More,
    /// An SSLRequest or GSSENCRequest, answered 'S' with `tls` (a TLS
    /// handshake follows), else 'N'. GSS encryption is never offered;
    /// declined, libpq goes on in plain text if its sslmode allows.
    Answer {
        tls: bool,
    },
    /// A CancelRequest, to route to the backend its key names; then the
    /// connection ends.
    Cancel {
        pid: u32,
        secret: Vec<u8>,
    },
    Startup(Negotiated),
}

/// The first byte of a TLS handshake record: a connection starting with it
/// speaks TLS at once (direct TLS) rather than sending a packet's length.
const TLS_HANDSHAKE: u8 = 0x16;

/// Takes the next whole packet from `buf` and says what it asks.
/// `offer_tls`: TLS is configured and the connection is not TLS yet.
fn next_packet(buf: &mut BytesMut, offer_tls: bool) -> Result<Opening, SessionError> {
    let Some(len) = startup::packet_len(buf)? else {
        return Ok(Opening::More);
    };
    // A copy: the session keeps it, and a view would keep the whole read
    // buffer alive with it.
    let raw = BytesMut::from(&buf[..len]);
    let _ = buf.split_to(len);
    Ok(match startup::parse(&raw)? {
        packet @ (StartupPacket::SslRequest | StartupPacket::GssEncRequest) => {
            if !buf.is_empty() {
                // Bytes after an SSLRequest before our answer would be a
                // TLS ClientHello sent blind: refuse rather than misread.
                return Err(SessionError::Dropped(
                    "data sent before the SSLRequest answer",
                ));
            }
            Opening::Answer {
                tls: offer_tls && packet == StartupPacket::SslRequest,
            }
        }
        StartupPacket::Cancel { pid, secret } => Opening::Cancel { pid, secret },
        StartupPacket::Startup(startup) => Opening::Startup(Negotiated { raw, startup }),
    })
}

/// A connection that began with direct TLS must have agreed on the
/// "postgresql" protocol by ALPN (`alpn`: what it agreed on).
fn direct_tls_agreed(alpn: Option<&[u8]>) -> Result<(), SessionError> {
    match alpn == Some(crate::tls::ALPN_POSTGRESQL) {
        true => Ok(()),
        false => Err(SessionError::Dropped(
            "direct TLS without ALPN \"postgresql\"",
        )),
    }
}

#[cfg(test)]
mod tests {
    use bytes::BufMut;

    use super::*;
    use crate::protocol::startup::{CANCEL_REQUEST_CODE, GSSENC_REQUEST_CODE, SSL_REQUEST_CODE};

    fn request(code: u32, rest: &[u8]) -> BytesMut {
        let mut buf = BytesMut::new();
        buf.put_u32(8 + rest.len() as u32);
        buf.put_u32(code);
        buf.extend_from_slice(rest);
        buf
    }

    fn startup_message() -> BytesMut {
        request(196_608, b"user\0alice\0\0")
    }

    #[test]
    fn tls_is_offered_only_for_an_sslrequest_when_configured() {
        for (code, offer, tls) in [
            (SSL_REQUEST_CODE, true, true),
            (SSL_REQUEST_CODE, false, false),
            (GSSENC_REQUEST_CODE, true, false),
        ] {
            let mut buf = request(code, b"");
            match next_packet(&mut buf, offer) {
                Ok(Opening::Answer { tls: said }) => assert_eq!(said, tls, "{code} {offer}"),
                _ => panic!("an answer"),
            }
            assert!(buf.is_empty(), "the packet is taken");
        }
    }

    #[test]
    fn bytes_sent_before_the_sslrequest_is_answered_end_the_connection() {
        let mut buf = request(SSL_REQUEST_CODE, b"");
        buf.put_u8(TLS_HANDSHAKE);
        let e = next_packet(&mut buf, true).err().expect("refused");
        assert!(
            e.to_string().contains("before the SSLRequest answer"),
            "{e}"
        );
    }

    #[test]
    fn a_partial_packet_waits_and_a_whole_one_is_taken_alone() {
        let whole = startup_message();
        let mut buf = BytesMut::from(&whole[..5]);
        assert!(matches!(next_packet(&mut buf, false), Ok(Opening::More)));
        assert_eq!(buf.len(), 5, "nothing taken");
        let mut buf = whole.clone();
        buf.extend_from_slice(b"Q\0\0\0\x05");
        match next_packet(&mut buf, false) {
            Ok(Opening::Startup(n)) => {
                assert_eq!(n.raw, whole);
                assert_eq!(n.startup.user(), "alice");
            }
            _ => panic!("the StartupMessage"),
        }
        assert_eq!(&buf[..], b"Q\0\0\0\x05", "what follows is the session's");
    }

    #[test]
    fn a_cancel_request_names_its_key_and_a_bad_length_is_refused() {
        let mut key = BytesMut::new();
        key.put_u32(4242);
        key.put_u32(0xdead_beef);
        let mut buf = request(CANCEL_REQUEST_CODE, &key);
        match next_packet(&mut buf, false) {
            Ok(Opening::Cancel { pid, secret }) => {
                assert_eq!(pid, 4242);
                assert_eq!(secret, 0xdead_beef_u32.to_be_bytes());
            }
            _ => panic!("a cancel request"),
        }
        let mut buf = BytesMut::from(&[0u8, 0, 0, 3][..]);
        assert!(next_packet(&mut buf, false).is_err());
    }

    #[test]
    fn direct_tls_needs_the_postgresql_protocol_agreed() {
        assert!(direct_tls_agreed(Some(crate::tls::ALPN_POSTGRESQL)).is_ok());
        assert!(direct_tls_agreed(Some(b"http/1.1")).is_err());
        assert!(direct_tls_agreed(None).is_err());
    }
}
