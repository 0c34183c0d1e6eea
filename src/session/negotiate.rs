//! The first packets of a connection, before any tagged message, decided
//! without I/O: TLS (SSLRequest, or PostgreSQL 17's direct TLS),
//! GSSENCRequest, a CancelRequest, or the StartupMessage. The driver
//! ([`super::serve`]) reads the bytes, writes the answers and does the TLS
//! handshake.

use bytes::BytesMut;

use super::SessionError;
use crate::protocol::startup::{self, Startup, StartupPacket};

/// A StartupMessage, as received and as parsed.
pub(super) struct Negotiated {
    pub raw: BytesMut,
    pub startup: Startup,
}

/// What the connection's next packet asks.
pub(super) enum Opening {
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
pub(super) const TLS_HANDSHAKE: u8 = 0x16;

/// Takes the next whole packet from `buf` and says what it asks.
/// `offer_tls`: TLS is configured and the connection is not TLS yet.
pub(super) fn next_packet(buf: &mut BytesMut, offer_tls: bool) -> Result<Opening, SessionError> {
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
pub(super) fn direct_tls_agreed(alpn: Option<&[u8]>) -> Result<(), SessionError> {
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
