//! Frame boundaries: find where one tagged message ends, check its length
//! against limits before any allocation, and never read past it.

use bytes::{BufMut, BytesMut};

/// Every tagged message has a 1-byte tag and a 4-byte length that counts
/// itself but not the tag.
pub const HEADER_LEN: usize = 5;

/// The longest frame read from a backend. The backend is trusted; this
/// only stops a corrupt length from allocating without bound. PostgreSQL's
/// own rows are at most 1 GiB.
pub const MAX_BACKEND_FRAME: usize = (1 << 30) + (1 << 20);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("invalid message length {len} for message type {:?}", char::from(*.tag))]
    BadLength { tag: u8, len: u32 },
    #[error(
        "message of type {:?} is {len} bytes, over the limit of {max} bytes",
        char::from(*.tag)
    )]
    TooLarge { tag: u8, len: usize, max: usize },
}

/// Looks at the start of `buf` and returns the total length of the first
/// message if it is complete, `Ok(None)` if more bytes are needed, or an error
/// if the header is invalid or announces more than `max_len` bytes.
///
/// The error is reported as soon as the 5-byte header is in, before the body
/// arrives, so an oversized message is refused without buffering it.
pub fn parse_frame(buf: &[u8], max_len: usize) -> Result<Option<usize>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let tag = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if len < 4 {
        return Err(FrameError::BadLength { tag, len });
    }
    let total = len as usize + 1;
    if total > max_len {
        return Err(FrameError::TooLarge {
            tag,
            len: total,
            max: max_len,
        });
    }
    Ok((buf.len() >= total).then_some(total))
}

/// Takes the first frame out of `buf`, if it is complete ([`parse_frame`]
/// says what is refused).
pub fn split_frame(buf: &mut BytesMut, max_len: usize) -> Result<Option<BytesMut>, FrameError> {
    Ok(parse_frame(buf, max_len)?.map(|len| buf.split_to(len)))
}

/// How many bytes are still missing for the frame at the start of `buf`, used
/// to reserve the read buffer once instead of growing it in steps.
pub fn missing_bytes(buf: &[u8]) -> usize {
    if buf.len() < HEADER_LEN {
        return HEADER_LEN - buf.len();
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize + 1;
    len.saturating_sub(buf.len())
}

/// Reads a NUL-terminated string starting at `*pos`, advancing past the NUL.
/// Returns `None` if there is no terminator.
/// The complete frames at the start of `buf` (a trusted buffer: the
/// lengths were checked when it was read), in order.
pub fn frames(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut pos = 0;
    std::iter::from_fn(move || {
        let header = buf.get(pos..pos + HEADER_LEN)?;
        let len = 1 + u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let frame = buf.get(pos..pos + len)?;
        pos += len;
        Some(frame)
    })
}

/// The complete frames at the start of `buf`, each checked against
/// `max_len`: `Ok(frame)` for each, then the first bad header's `Err`, if
/// any; an incomplete frame ends them.
pub fn checked_frames(
    buf: &[u8],
    max_len: usize,
) -> impl Iterator<Item = Result<&[u8], FrameError>> {
    let mut pos = 0;
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed {
            return None;
        }
        match parse_frame(&buf[pos..], max_len) {
            Ok(Some(len)) => {
                let frame = &buf[pos..pos + len];
                pos += len;
                Some(Ok(frame))
            }
            Ok(None) => None,
            Err(e) => {
                failed = true;
                Some(Err(e))
            }
        }
    })
}

pub fn read_cstr<'a>(buf: &'a [u8], pos: &mut usize) -> Option<&'a [u8]> {
    let rest = buf.get(*pos..)?;
    let end = rest.iter().position(|&b| b == 0)?;
    *pos += end + 1;
    Some(&rest[..end])
}

/// Reads a big-endian i32 at `*pos`, advancing past it.
pub fn read_i32(buf: &[u8], pos: &mut usize) -> Option<i32> {
    let bytes = buf.get(*pos..*pos + 4)?;
    *pos += 4;
    Some(i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

/// Writes one message of `parts`.
pub fn frame_of(out: &mut BytesMut, tag: u8, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.put_u8(tag);
    out.put_u32((len + 4) as u32);
    for part in parts {
        out.put_slice(part);
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn frames_stop_before_an_incomplete_one() {
        let buf = [
            b'1', 0, 0, 0, 4, b'Z', 0, 0, 0, 5, b'I', b'D', 0, 0, 0, 9, 1,
        ];
        let found: Vec<&[u8]> = frames(&buf).collect();
        assert_eq!(found, [&buf[..5], &buf[5..11]]);
    }

    #[test]
    fn checked_frames_end_at_the_first_bad_header() {
        let buf = [b'1', 0, 0, 0, 4, b'D', 0, 0, 0, 2, b'Z', 0, 0, 0, 5, b'I'];
        let found: Vec<_> = checked_frames(&buf, 1024).collect();
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].as_ref().ok(), Some(&&buf[..5]));
        assert!(matches!(
            found[1],
            Err(FrameError::BadLength { tag: b'D', len: 2 })
        ));
        let big = [b'D', 0, 0, 1, 0];
        let found: Vec<_> = checked_frames(&big, 64).collect();
        assert!(matches!(found[..], [Err(FrameError::TooLarge { .. })]));
        let incomplete = [b'Z', 0, 0, 0, 5];
        assert_eq!(checked_frames(&incomplete, 64).count(), 0);
    }

    use super::*;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn incomplete_header_needs_more() {
        assert_eq!(parse_frame(b"Q\0\0", 100), Ok(None));
        assert_eq!(missing_bytes(b"Q\0\0"), 2);
    }

    #[test]
    fn split_body_needs_more_then_completes() {
        let f = frame(b'Q', b"SELECT 1\0");
        for cut in 0..f.len() {
            assert_eq!(parse_frame(&f[..cut], 100), Ok(None), "cut at {cut}");
        }
        assert_eq!(parse_frame(&f, 100), Ok(Some(f.len())));
        assert_eq!(missing_bytes(&f[..7]), f.len() - 7);
    }

    #[test]
    fn parses_only_the_first_of_pipelined_frames() {
        let mut buf = frame(b'P', b"\0SELECT 1\0\0\0");
        let first = buf.len();
        buf.extend(frame(b'S', b""));
        assert_eq!(parse_frame(&buf, 100), Ok(Some(first)));
        assert_eq!(parse_frame(&buf[first..], 100), Ok(Some(5)));
    }

    #[test]
    fn length_below_four_is_rejected() {
        for len in 0..4u32 {
            let mut buf = vec![b'Q'];
            buf.extend_from_slice(&len.to_be_bytes());
            assert_eq!(
                parse_frame(&buf, 100),
                Err(FrameError::BadLength { tag: b'Q', len })
            );
        }
    }

    #[test]
    fn oversized_is_rejected_from_the_header_alone() {
        let mut buf = vec![b'd'];
        buf.extend_from_slice(&(1_000_000u32).to_be_bytes());
        assert_eq!(
            parse_frame(&buf, 1000),
            Err(FrameError::TooLarge {
                tag: b'd',
                len: 1_000_001,
                max: 1000
            })
        );
        // u32::MAX must not overflow on any platform.
        let mut buf = vec![b'd'];
        buf.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            parse_frame(&buf, usize::MAX - 1),
            Ok(None) | Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn cstr_and_i32_readers_stop_at_the_end() {
        let buf = b"user\0bob\0\0\0\0\x07";
        let mut pos = 0;
        assert_eq!(read_cstr(buf, &mut pos), Some(&b"user"[..]));
        assert_eq!(read_cstr(buf, &mut pos), Some(&b"bob"[..]));
        assert_eq!(read_i32(buf, &mut pos), Some(7));
        assert_eq!(read_i32(buf, &mut pos), None);
        assert_eq!(read_cstr(buf, &mut pos), None);
        let mut pos = 0;
        assert_eq!(read_cstr(b"no-terminator", &mut pos), None);
    }
}
