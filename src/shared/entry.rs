//! The layout of a value in Redis.
//!
//! ```text
//! "PGC" | format u8 | xxh3-64 of everything after it | key u128
//!       | n u16 | n × version u64 (epoch first) | payload
//! ```
//!
//! The payload is the backend's response frames, exactly as the local tier
//! keeps them. A value is served only if every check passes: the format is
//! this one, the checksum matches (corruption, truncation, a value written
//! by hand), it is the value of the key it was read from (a value copied to
//! another key), and its versions are the ones the reader's key was made
//! from. Integers are little-endian.
//!
//! The checksum is not a MAC: whoever can write to Redis can forge an entry
//! with a valid one. Redis must be as trusted as the cache itself (see the
//! README).

use bytes::{BufMut, Bytes, BytesMut};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 3] = b"PGC";
const FORMAT: u8 = 1;
/// Magic, format, checksum.
const HEAD: usize = 3 + 1 + 8;

/// Why a value was not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    Format,
    Checksum,
    Key,
    Versions,
}

pub fn encode(key: u128, versions: &[u64], payload: &[u8]) -> Vec<u8> {
    let body_len = 16 + 2 + versions.len() * 8 + payload.len();
    let mut out = BytesMut::with_capacity(HEAD + body_len);
    out.put_slice(MAGIC);
    out.put_u8(FORMAT);
    out.put_u64_le(0); // checksum, filled in below
    out.put_u128_le(key);
    out.put_u16_le(versions.len() as u16);
    for v in versions {
        out.put_u64_le(*v);
    }
    out.put_slice(payload);
    let sum = xxh3_64(&out[HEAD..]);
    out[4..HEAD].copy_from_slice(&sum.to_le_bytes());
    out.into()
}

/// The payload of `value` if it is a sound entry for `key` made under
/// `versions`.
pub fn decode(value: Bytes, key: u128, versions: &[u64]) -> Result<Bytes, Rejection> {
    if value.len() < HEAD + 18 || &value[..3] != MAGIC || value[3] != FORMAT {
        return Err(Rejection::Format);
    }
    let sum = u64::from_le_bytes(value[4..HEAD].try_into().expect("8 bytes"));
    if xxh3_64(&value[HEAD..]) != sum {
        return Err(Rejection::Checksum);
    }
    let stored_key = u128::from_le_bytes(value[HEAD..HEAD + 16].try_into().expect("16 bytes"));
    if stored_key != key {
        return Err(Rejection::Key);
    }
    let n = u16::from_le_bytes([value[HEAD + 16], value[HEAD + 17]]) as usize;
    let start = HEAD + 18;
    let end = start + n * 8;
    if value.len() < end {
        return Err(Rejection::Format);
    }
    let same = n == versions.len()
        && value[start..end]
            .chunks_exact(8)
            .zip(versions)
            .all(|(b, v)| u64::from_le_bytes(b.try_into().expect("8 bytes")) == *v);
    if !same {
        return Err(Rejection::Versions);
    }
    Ok(value.slice(end..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v = Bytes::from(encode(7, &[1, 2], b"frames"));
        assert_eq!(decode(v, 7, &[1, 2]).unwrap().as_ref(), b"frames");
    }

    #[test]
    fn every_check_can_fail() {
        let good = encode(7, &[1, 2], b"frames");
        let check = |v: Vec<u8>, key, versions: &[u64]| decode(Bytes::from(v), key, versions);
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(check(flipped, 7, &[1, 2]), Err(Rejection::Checksum));
        let mut truncated = good.clone();
        truncated.pop();
        assert_eq!(check(truncated, 7, &[1, 2]), Err(Rejection::Checksum));
        assert_eq!(check(good.clone(), 8, &[1, 2]), Err(Rejection::Key));
        assert_eq!(check(good.clone(), 7, &[1, 3]), Err(Rejection::Versions));
        assert_eq!(check(good.clone(), 7, &[1]), Err(Rejection::Versions));
        let mut other_format = good.clone();
        other_format[3] = 2;
        assert_eq!(check(other_format, 7, &[1, 2]), Err(Rejection::Format));
        assert_eq!(check(b"hello".to_vec(), 7, &[]), Err(Rejection::Format));
        assert_eq!(check(Vec::new(), 7, &[]), Err(Rejection::Format));
    }

    #[test]
    fn version_count_beyond_the_value_is_a_format_error() {
        let mut v = encode(7, &[], b"");
        v[HEAD + 16] = 0xff;
        let sum = xxh3_64(&v[HEAD..]);
        v[4..HEAD].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(Bytes::from(v), 7, &[]), Err(Rejection::Format));
    }
}
