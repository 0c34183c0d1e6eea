//! Executes with a row limit (asyncpg's `fetchrow`/`fetchval`, JDBC's fetch
//! size), answered exactly as PostgreSQL would. PostgreSQL completes the
//! portal (CommandComplete) when it runs out of rows before the limit, and
//! suspends it (PortalSuspended) when it reaches the limit, even if no row
//! is left. A suspended portal of the unnamed kind is gone at the batch's
//! Sync, so a batch `[Parse] Bind [Describe] Execute(n) Sync` can be
//! answered from a whole stored result: its first `n` rows, then
//! PortalSuspended if it has `n` or more.
//!
//! To have a whole result to store, a missed Execute(n) goes to PostgreSQL
//! as Execute(n + 1): if that completes, the result is whole (and stored),
//! and the client sees it cut back to `n` ([`RowCut`]).

use bytes::BytesMut;

use crate::protocol::backend as be;
use crate::protocol::codec::HEADER_LEN;

/// PortalSuspended.
pub(super) const PORTAL_SUSPENDED: [u8; 5] = [be::PORTAL_SUSPENDED, 0, 0, 0, 4];

/// What the client is shown of a forwarded Execute(n + 1).
#[derive(Debug)]
pub(super) struct RowCut {
    limit: u32,
    rows: u32,
}

/// What to do with one frame of the answer.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Cut {
    Keep,
    Drop,
    /// Stands in for this frame.
    Replace(&'static [u8]),
    /// Goes to the client just before this frame, which is kept.
    Before(&'static [u8]),
}

impl Cut {
    /// The bytes the client gets in the frame's place or before it, and
    /// whether the frame itself goes on.
    pub fn parts(&self) -> (&'static [u8], bool) {
        match self {
            Cut::Keep => (&[], true),
            Cut::Drop => (&[], false),
            Cut::Replace(bytes) => (bytes, false),
            Cut::Before(bytes) => (bytes, true),
        }
    }
}

impl RowCut {
    pub fn new(limit: u32) -> Self {
        Self { limit, rows: 0 }
    }

    pub fn frame(&mut self, tag: u8) -> Cut {
        match tag {
            be::DATA_ROW => {
                self.rows += 1;
                if self.rows > self.limit {
                    Cut::Drop
                } else {
                    Cut::Keep
                }
            }
            // Exactly `limit` rows: PostgreSQL, asked for `limit`, would
            // have suspended the portal.
            be::COMMAND_COMPLETE if self.rows >= self.limit => Cut::Replace(&PORTAL_SUSPENDED),
            _ => Cut::Keep,
        }
    }
}

/// The Execute frame `frame` with its row limit set to `rows`.
pub(super) fn set_row_limit(frame: &mut [u8], rows: u32) {
    let at = frame.len() - 4;
    frame[at..].copy_from_slice(&rows.to_be_bytes());
}

/// A stored whole result as an Execute limited to `limit` rows answers it:
/// `None` if it has fewer rows (it is replayed as it is), else its frames
/// up to the `limit`th row, then PortalSuspended.
pub(super) fn cut_stored(frames: &[u8], limit: u32) -> Option<BytesMut> {
    let mut rows = 0;
    let mut pos = 0;
    while pos + HEADER_LEN <= frames.len() {
        let len = u32::from_be_bytes([
            frames[pos + 1],
            frames[pos + 2],
            frames[pos + 3],
            frames[pos + 4],
        ]) as usize;
        let end = pos + 1 + len;
        if frames[pos] == be::DATA_ROW {
            rows += 1;
            if rows == limit {
                let mut out = BytesMut::with_capacity(end + PORTAL_SUSPENDED.len());
                out.extend_from_slice(&frames[..end]);
                out.extend_from_slice(&PORTAL_SUSPENDED);
                return Some(out);
            }
        }
        pos = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut f = vec![tag];
        f.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn stored(rows: usize) -> Vec<u8> {
        let mut out = frame(b'2', b"");
        out.extend(frame(b'T', b"desc"));
        for i in 0..rows {
            out.extend(frame(b'D', &[i as u8]));
        }
        out.extend(frame(b'C', format!("SELECT {rows}\0").as_bytes()));
        out
    }

    #[test]
    fn a_stored_result_answers_any_limit_as_postgresql_would() {
        // Fewer rows than the limit: as stored, ending in CommandComplete.
        assert_eq!(cut_stored(&stored(2), 3), None);
        // As many or more: the first `limit` rows, then PortalSuspended.
        for (rows, limit) in [(1, 1), (3, 1), (3, 2)] {
            let cut = cut_stored(&stored(rows), limit).unwrap();
            let mut want = frame(b'2', b"");
            want.extend(frame(b'T', b"desc"));
            for i in 0..limit {
                want.extend(frame(b'D', &[i as u8]));
            }
            want.extend(PORTAL_SUSPENDED);
            assert_eq!(&cut[..], &want[..], "{rows} rows, limit {limit}");
        }
    }

    #[test]
    fn a_forwarded_answer_is_cut_back_to_the_clients_limit() {
        // Execute(2) sent as Execute(3); two rows came and the portal
        // completed: the client expects them, then PortalSuspended.
        let mut cut = RowCut::new(2);
        assert_eq!(cut.frame(be::ROW_DESCRIPTION), Cut::Keep);
        assert_eq!(cut.frame(be::DATA_ROW), Cut::Keep);
        assert_eq!(cut.frame(be::DATA_ROW), Cut::Keep);
        assert_eq!(
            cut.frame(be::COMMAND_COMPLETE),
            Cut::Replace(&PORTAL_SUSPENDED)
        );
        // Three rows came (and PortalSuspended): the third is not shown.
        let mut cut = RowCut::new(2);
        for want in [Cut::Keep, Cut::Keep, Cut::Drop] {
            assert_eq!(cut.frame(be::DATA_ROW), want);
        }
        assert_eq!(cut.frame(be::PORTAL_SUSPENDED), Cut::Keep);
        // One row: the portal completed within the limit, as asked.
        let mut cut = RowCut::new(2);
        assert_eq!(cut.frame(be::DATA_ROW), Cut::Keep);
        assert_eq!(cut.frame(be::COMMAND_COMPLETE), Cut::Keep);
    }

    #[test]
    fn the_limit_is_the_execute_frames_last_four_bytes() {
        let mut f = frame(b'E', b"\0\0\0\0\x01");
        set_row_limit(&mut f, 2);
        assert_eq!(&f[f.len() - 4..], &[0, 0, 0, 2]);
    }
}
