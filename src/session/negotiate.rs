//! The first packets of a connection, before any tagged message: TLS
//! (SSLRequest, or PostgreSQL 17's direct TLS), GSSENCRequest, a
//! CancelRequest, or the StartupMessage.

use bytes::BytesMut;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use super::SessionError;
use crate::App;
use crate::cancel::CancelTarget;
use crate::protocol::startup::{self, Startup, StartupPacket};
use crate::protocol::stream::FramedStream;
use crate::tls::ClientStream;

/// A StartupMessage, as received and as parsed.
pub(super) struct Negotiated {
    pub raw: BytesMut,
    pub startup: Startup,
}

/// What one round of negotiation ended with.
enum Round {
    Startup(Negotiated),
    /// The client asked for TLS and was told 'S': handshake next.
    StartTls,
    /// A cancel request was handled, or the client went away.
    Done,
}

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// Negotiates the startup, switching to TLS when the client asks (after an
/// SSLRequest) or starts with a TLS handshake (direct TLS). `Ok(None)`:
/// the connection has nothing more to do.
pub(super) async fn negotiate(
    app: &App,
    client: &mut FramedStream<ClientStream>,
) -> Result<Option<Negotiated>, SessionError> {
    let acceptor = app.tls.acceptor();
    if let (Some(acceptor), ClientStream::Plain(socket)) = (&acceptor, client.get_ref()) {
        // Direct TLS: the first byte is a TLS handshake record, not the
        // length of a startup packet. Then ALPN must be "postgresql".
        let mut first = [0u8; 1];
        let peeked = socket
            .peek(&mut first)
            .await
            .map_err(SessionError::ClientIo)?;
        if peeked == 1 && first[0] == TLS_HANDSHAKE {
            upgrade(client, acceptor).await?;
            let alpn_ok = match client.get_ref() {
                ClientStream::Tls(tls) => {
                    tls.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_POSTGRESQL)
                }
                _ => false,
            };
            if !alpn_ok {
                return Err(SessionError::Dropped(
                    "direct TLS without ALPN \"postgresql\"",
                ));
            }
        }
    }
    loop {
        let offer = acceptor.as_ref().filter(|_| !client.get_ref().is_tls());
        match round(app, client, offer.is_some()).await? {
            Round::Startup(s) => return Ok(Some(s)),
            Round::Done => return Ok(None),
            Round::StartTls => {
                let acceptor = offer.expect("TLS is offered only with an acceptor");
                upgrade(client, acceptor).await?;
            }
        }
    }
}

async fn upgrade(
    client: &mut FramedStream<ClientStream>,
    acceptor: &TlsAcceptor,
) -> Result<(), SessionError> {
    let stream = client.get_mut();
    let ClientStream::Plain(socket) = std::mem::replace(stream, ClientStream::Detached) else {
        return Err(SessionError::Dropped("TLS requested twice"));
    };
    let tls = acceptor
        .accept(socket)
        .await
        .map_err(SessionError::ClientIo)?;
    *stream = ClientStream::Tls(Box::new(tls));
    Ok(())
}

/// Reads first packets until a StartupMessage, answering SSLRequest and
/// GSSENCRequest and routing a CancelRequest.
async fn round(
    app: &App,
    client: &mut FramedStream<ClientStream>,
    offer_tls: bool,
) -> Result<Round, SessionError> {
    loop {
        let len = loop {
            if let Some(len) = startup::packet_len(client.buffered())? {
                break len;
            }
            if client.fill().await.map_err(SessionError::ClientIo)? == 0 {
                return Ok(Round::Done);
            }
        };
        // A copy: the session keeps it, and a view would keep the whole
        // read buffer alive with it.
        let raw = BytesMut::from(&client.buffered()[..len]);
        client.consume(len);
        match startup::parse(&raw)? {
            packet @ (StartupPacket::SslRequest | StartupPacket::GssEncRequest) => {
                // GSS encryption is never offered, TLS when configured;
                // declined, libpq goes on in plain text if its sslmode allows.
                if !client.buffered().is_empty() {
                    // Bytes after an SSLRequest before our answer would be a
                    // TLS ClientHello sent blind: refuse rather than misread.
                    return Err(SessionError::Dropped(
                        "data sent before the SSLRequest answer",
                    ));
                }
                let tls = offer_tls && packet == StartupPacket::SslRequest;
                client
                    .write_all(if tls { b"S" } else { b"N" })
                    .await
                    .map_err(SessionError::ClientIo)?;
                if tls {
                    return Ok(Round::StartTls);
                }
            }
            StartupPacket::Cancel { pid, secret } => {
                forward_cancel(app, pid, &secret).await;
                return Ok(Round::Done);
            }
            StartupPacket::Startup(startup) => {
                return Ok(Round::Startup(Negotiated { raw, startup }));
            }
        }
    }
}

/// Sends a client's CancelRequest on to the backend its key names, if the
/// key is one pgcache handed out.
async fn forward_cancel(app: &App, pid: u32, secret: &[u8]) {
    let Some(target) = app.cancel.lookup(pid, secret) else {
        debug!(pid, "cancel request with an unknown key ignored");
        return;
    };
    let CancelTarget {
        addr,
        backend_pid,
        backend_secret,
    } = &*target;
    if let Err(e) =
        crate::backend::send_cancel(&app.upstream, addr, *backend_pid, backend_secret).await
    {
        warn!(error = %e, "could not forward cancel request");
    }
}
