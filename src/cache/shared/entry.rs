//! The layout of a value in Redis.
//!
//! ```text
//! "PGC" | format u8 | xxh3-64 of everything after it | key u128
//!       | created u64 (Unix ms) | n u16 | n × version u64 (epoch first) | payload
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
//! with a valid one. Redis must be as trusted as the cache itself (see
//! docs/shared-tier.md).

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

/// Key and creation time.
const FIXED: usize = 16 + 8;

pub fn encode(key: u128, created_ms: u64, versions: &[u64], payload: &[u8]) -> Vec<u8> {
    let body_len = FIXED + 2 + versions.len() * 8 + payload.len();
    let mut out = BytesMut::with_capacity(HEAD + body_len);
    out.put_slice(MAGIC);
    out.put_u8(FORMAT);
    out.put_u64_le(0); // checksum, filled in below
    out.put_u128_le(key);
    out.put_u64_le(created_ms);
    out.put_u16_le(versions.len() as u16);
    for v in versions {
        out.put_u64_le(*v);
    }
    out.put_slice(payload);
    let sum = xxh3_64(&out[HEAD..]);
    out[4..HEAD].copy_from_slice(&sum.to_le_bytes());
    out.into()
}

/// A sound entry's payload and creation time (Unix ms).
#[derive(Debug, PartialEq, Eq)]
pub struct Entry {
    pub payload: Bytes,
    pub created_ms: u64,
}

/// The entry in `value` if it is a sound one for `key` made under
/// `versions`.
pub fn decode(value: Bytes, key: u128, versions: &[u64]) -> Result<Entry, Rejection> {
    if value.len() < HEAD + FIXED + 2 || &value[..3] != MAGIC || value[3] != FORMAT {
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
    let created_ms =
        u64::from_le_bytes(value[HEAD + 16..HEAD + FIXED].try_into().expect("8 bytes"));
    let n = u16::from_le_bytes([value[HEAD + FIXED], value[HEAD + FIXED + 1]]) as usize;
    let start = HEAD + FIXED + 2;
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
    Ok(Entry {
        payload: value.slice(end..),
        created_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v = Bytes::from(encode(7, 99, &[1, 2], b"frames"));
        let e = decode(v, 7, &[1, 2]).unwrap();
        assert_eq!(e.payload.as_ref(), b"frames");
        assert_eq!(e.created_ms, 99);
    }

    #[test]
    fn every_check_can_fail() {
        let good = encode(7, 99, &[1, 2], b"frames");
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
        let mut v = encode(7, 0, &[], b"");
        v[HEAD + FIXED] = 0xff;
        let sum = xxh3_64(&v[HEAD..]);
        v[4..HEAD].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(Bytes::from(v), 7, &[]), Err(Rejection::Format));
    }
}
