//! The few pgoutput (protocol version 1) messages invalidation needs: which
//! relation a change touched. Row contents are never decoded. Every read is
//! bounds-checked: a short message is `None`, never a panic.

use crate::protocol::codec::{read_cstr, read_i32};

/// pgoutput message tags (the first byte of each XLogData payload).
const RELATION: u8 = b'R';
const INSERT: u8 = b'I';
const UPDATE: u8 = b'U';
const DELETE: u8 = b'D';
const TRUNCATE: u8 = b'T';

#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// Relation: maps an OID to its name; sent before its first change in a
    /// stream and again after it changes.
    Relation {
        oid: u32,
        namespace: String,
        name: String,
    },
    /// Insert, Update or Delete on one relation.
    Row { oid: u32 },
    /// TRUNCATE of several relations.
    Truncate { oids: Vec<u32> },
    /// Begin, Commit, Type, Origin, Message...: nothing to invalidate by.
    Other,
}

pub fn decode(data: &[u8]) -> Option<Change> {
    let (&tag, body) = data.split_first()?;
    let mut pos = 0;
    match tag {
        RELATION => {
            let oid = read_i32(body, &mut pos)? as u32;
            let namespace = String::from_utf8_lossy(read_cstr(body, &mut pos)?).into_owned();
            let name = String::from_utf8_lossy(read_cstr(body, &mut pos)?).into_owned();
            Some(Change::Relation {
                oid,
                namespace,
                name,
            })
        }
        INSERT | UPDATE | DELETE => Some(Change::Row {
            oid: read_i32(body, &mut pos)? as u32,
        }),
        TRUNCATE => {
            let n = read_i32(body, &mut pos)?;
            pos += 1; // option bits
            let mut oids = Vec::with_capacity(n.clamp(0, 1024) as usize);
            for _ in 0..n.max(0) {
                oids.push(read_i32(body, &mut pos)? as u32);
            }
            Some(Change::Truncate { oids })
        }
        _ => Some(Change::Other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relation_rows_and_truncate() {
        let mut rel = vec![b'R'];
        rel.extend(16384u32.to_be_bytes());
        rel.extend(b"public\0items\0");
        rel.extend([b'd', 0, 0]);
        assert_eq!(
            decode(&rel),
            Some(Change::Relation {
                oid: 16384,
                namespace: "public".into(),
                name: "items".into()
            })
        );
        let mut ins = vec![b'I'];
        ins.extend(7u32.to_be_bytes());
        ins.extend(b"N\0\0");
        assert_eq!(decode(&ins), Some(Change::Row { oid: 7 }));
        let mut tr = vec![b'T'];
        tr.extend(2u32.to_be_bytes());
        tr.push(0);
        tr.extend(5u32.to_be_bytes());
        tr.extend(6u32.to_be_bytes());
        assert_eq!(decode(&tr), Some(Change::Truncate { oids: vec![5, 6] }));
        assert_eq!(decode(b"B........"), Some(Change::Other));
    }

    #[test]
    fn short_messages_are_none() {
        assert_eq!(decode(b""), None);
        assert_eq!(decode(b"I\0\0"), None);
        assert_eq!(decode(b"R\0\0\0\x01public"), None);
        let mut tr = vec![b'T'];
        tr.extend(3u32.to_be_bytes());
        tr.push(0);
        tr.extend(5u32.to_be_bytes());
        assert_eq!(decode(&tr), None);
    }
}
