//! The untagged first packets a client may send: SSLRequest, GSSENCRequest,
//! CancelRequest and StartupMessage.

use super::codec::read_cstr;

/// PostgreSQL's own limit on a startup packet (`MAX_STARTUP_PACKET_LENGTH`).
pub const MAX_STARTUP_PACKET_LEN: usize = 10_000;

pub const SSL_REQUEST_CODE: u32 = 80_877_103;
pub const GSSENC_REQUEST_CODE: u32 = 80_877_104;
pub const CANCEL_REQUEST_CODE: u32 = 80_877_102;

/// A decoded first packet. `Startup` keeps the raw bytes so they can be
/// forwarded to the backend unchanged.
#[derive(Debug, PartialEq, Eq)]
pub enum StartupPacket {
    SslRequest,
    GssEncRequest,
    Cancel { pid: u32, secret: Vec<u8> },
    Startup(Startup),
}

#[derive(Debug, PartialEq, Eq)]
pub struct Startup {
    /// Protocol version as sent (major << 16 | minor).
    pub version: u32,
    /// Parameters in the order the client sent them.
    pub params: Vec<(String, String)>,
}

impl Startup {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn user(&self) -> &str {
        self.param("user").unwrap_or("")
    }

    /// The database defaults to the user name, as in PostgreSQL.
    pub fn database(&self) -> &str {
        self.param("database").unwrap_or_else(|| self.user())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StartupError {
    #[error("invalid length of startup packet: {0}")]
    BadLength(u32),
    #[error("unsupported frontend protocol {}.{}", .0 >> 16, .0 & 0xffff)]
    UnsupportedVersion(u32),
    #[error("invalid startup packet layout: {0}")]
    BadLayout(&'static str),
}

/// Returns the length of the first packet if `buf` holds it whole.
pub fn packet_len(buf: &[u8]) -> Result<Option<usize>, StartupError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if !(8..=MAX_STARTUP_PACKET_LEN as u32).contains(&len) {
        return Err(StartupError::BadLength(len));
    }
    Ok((buf.len() >= len as usize).then_some(len as usize))
}

/// Decodes one complete first packet (length prefix included).
pub fn parse(packet: &[u8]) -> Result<StartupPacket, StartupError> {
    let Some((head, rest)) = packet.split_at_checked(8) else {
        return Err(StartupError::BadLayout("shorter than 8 bytes"));
    };
    let code = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
    match code {
        SSL_REQUEST_CODE => Ok(StartupPacket::SslRequest),
        GSSENC_REQUEST_CODE => Ok(StartupPacket::GssEncRequest),
        CANCEL_REQUEST_CODE => {
            // Protocol 3.0 keys are 4 bytes; 3.2 allows up to 256.
            if rest.len() < 8 || rest.len() > 4 + 256 {
                return Err(StartupError::BadLayout("cancel request key"));
            }
            let pid = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
            Ok(StartupPacket::Cancel {
                pid,
                secret: rest[4..].to_vec(),
            })
        }
        version if version >> 16 == 3 => {
            let mut params = Vec::new();
            let mut pos = 0;
            loop {
                let key = read_cstr(rest, &mut pos)
                    .ok_or(StartupError::BadLayout("missing terminator"))?;
                if key.is_empty() {
                    break;
                }
                let value = read_cstr(rest, &mut pos)
                    .ok_or(StartupError::BadLayout("parameter without value"))?;
                params.push((
                    String::from_utf8_lossy(key).into_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                ));
            }
            if pos != rest.len() {
                return Err(StartupError::BadLayout("bytes after the terminator"));
            }
            if !params.iter().any(|(k, _)| k == "user") {
                return Err(StartupError::BadLayout("no PostgreSQL user name specified"));
            }
            Ok(StartupPacket::Startup(Startup { version, params }))
        }
        other => Err(StartupError::UnsupportedVersion(other)),
    }
}

/// Encodes a StartupMessage (used by tests and by the cancel path's peers).
pub fn encode_startup(params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&196_608u32.to_be_bytes());
    for (k, v) in params {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut out = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    out.extend(body);
    out
}

/// The StartupMessage `raw` (whole and well formed, as [`parse`] accepted
/// it) with `-c name=value` added to its `options`, byte for byte
/// otherwise. `None` when it cannot be added: the packet would pass
/// PostgreSQL's limit, or the client's `options` ends in an escaping
/// backslash.
pub fn with_setting(raw: &[u8], name: &str, value: &str) -> Option<Vec<u8>> {
    let setting = format!("-c {name}={value}");
    let mut out = Vec::with_capacity(raw.len() + setting.len() + 16);
    out.extend_from_slice(raw.get(..8)?);
    let mut pos = 8;
    let mut added = false;
    loop {
        let key = read_cstr(raw, &mut pos)?;
        if key.is_empty() {
            break;
        }
        let value = read_cstr(raw, &mut pos)?;
        out.extend_from_slice(key);
        out.push(0);
        out.extend_from_slice(value);
        if key == b"options" && !added {
            let escapes = value.iter().rev().take_while(|b| **b == b'\\').count();
            if escapes % 2 == 1 {
                return None;
            }
            if !value.is_empty() {
                out.push(b' ');
            }
            out.extend_from_slice(setting.as_bytes());
            added = true;
        }
        out.push(0);
    }
    if !added {
        out.extend_from_slice(b"options\0");
        out.extend_from_slice(setting.as_bytes());
        out.push(0);
    }
    out.push(0);
    if out.len() > MAX_STARTUP_PACKET_LEN {
        return None;
    }
    let len = out.len() as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
    Some(out)
}

/// Encodes a CancelRequest for `pid` and `secret`.
/// An SSLRequest packet.
pub fn encode_ssl_request() -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&8i32.to_be_bytes());
    out[4..].copy_from_slice(&SSL_REQUEST_CODE.to_be_bytes());
    out
}

pub fn encode_cancel(pid: u32, secret: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + secret.len());
    out.extend_from_slice(&((12 + secret.len()) as u32).to_be_bytes());
    out.extend_from_slice(&CANCEL_REQUEST_CODE.to_be_bytes());
    out.extend_from_slice(&pid.to_be_bytes());
    out.extend_from_slice(secret);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_round_trip_keeps_parameter_order() {
        let raw = encode_startup(&[
            ("user", "alice"),
            ("database", "shop"),
            ("options", "-c x=1"),
        ]);
        assert_eq!(packet_len(&raw), Ok(Some(raw.len())));
        let StartupPacket::Startup(s) = parse(&raw).unwrap() else {
            panic!("not a startup packet")
        };
        assert_eq!(s.version, 196_608);
        assert_eq!(s.user(), "alice");
        assert_eq!(s.database(), "shop");
        assert_eq!(s.params[2], ("options".into(), "-c x=1".into()));
    }

    #[test]
    fn a_setting_joins_the_options_and_leaves_the_rest_as_sent() {
        let param = |raw: &[u8], name: &str| match parse(raw).unwrap() {
            StartupPacket::Startup(s) => s.param(name).map(str::to_owned),
            _ => panic!("not a startup packet"),
        };
        let plain = encode_startup(&[("user", "alice"), ("database", "shop")]);
        let added = with_setting(&plain, "a.b", "1").unwrap();
        assert_eq!(packet_len(&added), Ok(Some(added.len())));
        assert_eq!(param(&added, "options").as_deref(), Some("-c a.b=1"));
        assert_eq!(param(&added, "database").as_deref(), Some("shop"));
        let with = encode_startup(&[("user", "alice"), ("options", "-c x=1"), ("z", "\u{e9}")]);
        let added = with_setting(&with, "a.b", "1").unwrap();
        assert_eq!(param(&added, "options").as_deref(), Some("-c x=1 -c a.b=1"));
        assert_eq!(param(&added, "z").as_deref(), Some("\u{e9}"));
        // A trailing escape would swallow the separating space.
        let escaped = encode_startup(&[("user", "alice"), ("options", "-c x=a\\")]);
        assert_eq!(with_setting(&escaped, "a.b", "1"), None);
        let long = "v".repeat(MAX_STARTUP_PACKET_LEN - 30);
        let full = encode_startup(&[("user", "alice"), ("application_name", &long)]);
        assert_eq!(with_setting(&full, "a.b", "1"), None);
    }

    proptest::proptest! {
        /// Whatever a client sent, the packet with the setting added says
        /// the same but for `options`, which ends with the setting.
        #[test]
        fn a_setting_added_changes_only_the_options(
            params in proptest::collection::vec(("[a-z_]{1,12}", "[^\\x00]{0,40}"), 0..6),
        ) {
            let mut all: Vec<(&str, &str)> = vec![("user", "u")];
            all.extend(params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            let raw = encode_startup(&all);
            let Ok(StartupPacket::Startup(before)) = parse(&raw) else {
                return Ok(());
            };
            let Some(added) = with_setting(&raw, "a.b", "1") else {
                let options = before.param("options").unwrap_or_default();
                proptest::prop_assert!(options.ends_with('\\'));
                return Ok(());
            };
            let Ok(StartupPacket::Startup(after)) = parse(&added) else {
                return Err(proptest::test_runner::TestCaseError::fail("unparsable"));
            };
            let options = |s: &Startup| s.params.iter().filter(|(k, _)| k == "options").count();
            proptest::prop_assert_eq!(options(&after), options(&before).max(1));
            for ((k, v), (k2, v2)) in before.params.iter().zip(&after.params) {
                proptest::prop_assert_eq!(k, k2);
                if k != "options" {
                    proptest::prop_assert_eq!(v, v2);
                }
            }
            proptest::prop_assert!(after.param("options").unwrap().ends_with("-c a.b=1"));
        }
    }

    #[test]
    fn database_defaults_to_user() {
        let raw = encode_startup(&[("user", "bob")]);
        let StartupPacket::Startup(s) = parse(&raw).unwrap() else {
            panic!()
        };
        assert_eq!(s.database(), "bob");
    }

    #[test]
    fn special_requests_are_recognised() {
        let mut ssl = 8u32.to_be_bytes().to_vec();
        ssl.extend_from_slice(&SSL_REQUEST_CODE.to_be_bytes());
        assert_eq!(parse(&ssl), Ok(StartupPacket::SslRequest));
        let mut gss = 8u32.to_be_bytes().to_vec();
        gss.extend_from_slice(&GSSENC_REQUEST_CODE.to_be_bytes());
        assert_eq!(parse(&gss), Ok(StartupPacket::GssEncRequest));
        let cancel = encode_cancel(42, &[1, 2, 3, 4]);
        assert_eq!(
            parse(&cancel),
            Ok(StartupPacket::Cancel {
                pid: 42,
                secret: vec![1, 2, 3, 4]
            })
        );
    }

    #[test]
    fn malformed_packets_are_errors_not_panics() {
        assert_eq!(packet_len(&[0, 0, 0, 3]), Err(StartupError::BadLength(3)));
        assert_eq!(
            packet_len(&[0, 1, 0, 0]),
            Err(StartupError::BadLength(65536))
        );
        assert_eq!(packet_len(&[0, 0, 0]), Ok(None));
        // Found by bench/fuzz.sh (fuzz/artifacts/startup, the empty input):
        // packets shorter than their fixed header.
        for short in [&[][..], &[0, 0, 0, 8], &[0, 0, 0, 8, 0, 3, 0]] {
            assert!(matches!(parse(short), Err(StartupError::BadLayout(_))));
        }
        // Parameter without a value.
        let mut raw = 0u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&196_608u32.to_be_bytes());
        raw.extend_from_slice(b"user\0");
        assert!(matches!(parse(&raw), Err(StartupError::BadLayout(_))));
        // No user.
        let raw = encode_startup(&[("database", "x")]);
        assert!(matches!(parse(&raw), Err(StartupError::BadLayout(_))));
        // Protocol 2.
        let mut raw = 8u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&(2u32 << 16).to_be_bytes());
        assert_eq!(parse(&raw), Err(StartupError::UnsupportedVersion(2 << 16)));
        // Cancel with a short key.
        let mut raw = 12u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&CANCEL_REQUEST_CODE.to_be_bytes());
        raw.extend_from_slice(&[0, 0, 0, 1]);
        assert!(matches!(parse(&raw), Err(StartupError::BadLayout(_))));
    }
}
