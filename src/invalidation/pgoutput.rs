//! The few pgoutput (protocol version 1) messages invalidation needs:
//! which relation a change touched, and the values of its replica-identity
//! columns (the key of the row an insert, update or delete touched, before
//! and after). No other column is decoded. Every read is bounds-checked: a
//! short message is `None`, never a panic.

use crate::cache::rowkey::{Canonical, KeyType, signature};
use crate::protocol::codec::{read_cstr, read_i32};

/// pgoutput message tags (the first byte of each XLogData payload).
const RELATION: u8 = b'R';
const INSERT: u8 = b'I';
const UPDATE: u8 = b'U';
const DELETE: u8 = b'D';
const TRUNCATE: u8 = b'T';

/// How a relation's rows are told apart in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    /// By the columns at these places (of the relation's columns), of
    /// these kinds, under this [`signature`].
    Columns {
        places: Vec<(usize, KeyType)>,
        signature: u64,
    },
    /// Not by anything keys by row know here: REPLICA IDENTITY FULL or
    /// NOTHING, or a key column of another type.
    Unknown,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Change<'a> {
    /// Relation: maps an OID to its name and key; sent before its first
    /// change in a stream and again after it changes.
    Relation {
        oid: u32,
        namespace: String,
        name: String,
        key: Key,
    },
    /// Insert, Update or Delete on one relation; `tuples`: the rest of the
    /// message (its tuples, read with the relation's [`Key`] by
    /// [`row_keys`]).
    Row { oid: u32, tuples: Tuples<'a> },
    /// TRUNCATE of several relations.
    Truncate { oids: Vec<u32> },
    /// Begin, Commit, Type, Origin, Message...: nothing to invalidate by.
    Other,
}

/// The tuples of one row change, still encoded.
#[derive(Debug, PartialEq, Eq)]
pub struct Tuples<'a>(&'a [u8]);

pub fn decode(data: &[u8]) -> Option<Change<'_>> {
    let (&tag, body) = data.split_first()?;
    let mut pos = 0;
    match tag {
        RELATION => {
            let oid = read_i32(body, &mut pos)? as u32;
            let namespace = String::from_utf8_lossy(read_cstr(body, &mut pos)?).into_owned();
            let name = String::from_utf8_lossy(read_cstr(body, &mut pos)?).into_owned();
            let key = relation_key(body, pos)?;
            Some(Change::Relation {
                oid,
                namespace,
                name,
                key,
            })
        }
        INSERT | UPDATE | DELETE => Some(Change::Row {
            oid: read_i32(body, &mut pos)? as u32,
            tuples: Tuples(&body[pos..]),
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

fn read_u8(buf: &[u8], pos: &mut usize) -> Option<u8> {
    let b = *buf.get(*pos)?;
    *pos += 1;
    Some(b)
}

fn read_i16(buf: &[u8], pos: &mut usize) -> Option<i16> {
    let b = buf.get(*pos..*pos + 2)?;
    *pos += 2;
    Some(i16::from_be_bytes([b[0], b[1]]))
}

/// After a Relation's names: its replica identity setting, then each
/// column's flags (1: part of the key), name, type and modifier.
fn relation_key(body: &[u8], mut pos: usize) -> Option<Key> {
    let identity = read_u8(body, &mut pos)?;
    let columns = read_i16(body, &mut pos)?;
    let mut places = Vec::new();
    let mut named = Vec::new();
    let mut known = true;
    for place in 0..usize::try_from(columns).ok()? {
        let flags = read_u8(body, &mut pos)?;
        let name = read_cstr(body, &mut pos)?;
        let oid = read_i32(body, &mut pos)? as u32;
        let _typmod = read_i32(body, &mut pos)?;
        if flags & 1 == 1 {
            match KeyType::of_oid(oid) {
                Some(kind) => {
                    places.push((place, kind));
                    named.push((name, kind));
                }
                None => known = false,
            }
        }
    }
    // 'd': the primary key, 'i': an index; FULL and NOTHING key nothing.
    if !known || places.is_empty() || !matches!(identity, b'd' | b'i') {
        return Some(Key::Unknown);
    }
    Some(Key::Columns {
        signature: signature(named.iter().map(|(n, k)| (*n, *k))),
        places,
    })
}

/// The keys of the rows one change touched, by `key`'s columns: an
/// insert's new row, an update's old key (when the key changed) and new
/// row, a delete's old key. `None` if a key cannot be read (a value of a
/// form [`KeyType::from_text`] does not take, a malformed message): then
/// the change is taken as one of the whole table.
pub fn row_keys(tuples: &Tuples<'_>, key: &Key) -> Option<Vec<Vec<Canonical>>> {
    let Key::Columns { places, .. } = key else {
        return None;
    };
    let body = tuples.0;
    let mut pos = 0;
    let mut keys = Vec::with_capacity(2);
    while pos < body.len() {
        match read_u8(body, &mut pos)? {
            // New row, old key, old row: each a tuple holding the key.
            b'N' | b'K' | b'O' => keys.push(tuple_key(body, &mut pos, places)?),
            _ => return None,
        }
    }
    (!keys.is_empty()).then_some(keys)
}

/// One TupleData: the values at `places`.
fn tuple_key(body: &[u8], pos: &mut usize, places: &[(usize, KeyType)]) -> Option<Vec<Canonical>> {
    let columns = usize::try_from(read_i16(body, pos)?).ok()?;
    let mut values = Vec::with_capacity(places.len());
    let mut wanted = places.iter().peekable();
    for place in 0..columns {
        let kind = read_u8(body, pos)?;
        let text = match kind {
            b't' | b'b' => {
                let len = usize::try_from(read_i32(body, pos)?).ok()?;
                let text = body.get(*pos..*pos + len)?;
                *pos += len;
                Some((kind, text))
            }
            b'n' | b'u' => None,
            _ => return None,
        };
        if let Some(&&(at, key_type)) = wanted.peek()
            && at == place
        {
            wanted.next();
            // A key column is never NULL nor an unchanged TOAST value.
            let (kind, text) = text?;
            let value = match kind {
                b't' => key_type.from_written_text(text)?,
                _ => key_type.from_binary(text)?,
            };
            values.push(value);
        }
    }
    (wanted.peek().is_none()).then_some(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation(identity: u8, columns: &[(u8, &str, u32)]) -> Vec<u8> {
        let mut rel = vec![b'R'];
        rel.extend(16384u32.to_be_bytes());
        rel.extend(b"public\0items\0");
        rel.push(identity);
        rel.extend((columns.len() as i16).to_be_bytes());
        for (flags, name, oid) in columns {
            rel.push(*flags);
            rel.extend(name.as_bytes());
            rel.push(0);
            rel.extend(oid.to_be_bytes());
            rel.extend((-1i32).to_be_bytes());
        }
        rel
    }

    fn tuple(values: &[Option<&str>]) -> Vec<u8> {
        let mut t = (values.len() as i16).to_be_bytes().to_vec();
        for v in values {
            match v {
                Some(v) => {
                    t.push(b't');
                    t.extend((v.len() as i32).to_be_bytes());
                    t.extend(v.as_bytes());
                }
                None => t.push(b'n'),
            }
        }
        t
    }

    fn row(tag: u8, parts: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend(16384u32.to_be_bytes());
        for (kind, t) in parts {
            m.push(*kind);
            m.extend(t);
        }
        m
    }

    fn key_of(rel: &[u8]) -> Key {
        match decode(rel) {
            Some(Change::Relation { key, .. }) => key,
            other => panic!("{other:?}"),
        }
    }

    fn keys(message: &[u8], key: &Key) -> Option<Vec<Vec<Canonical>>> {
        match decode(message) {
            Some(Change::Row { tuples, .. }) => row_keys(&tuples, key),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rows_give_their_keys_before_and_after() {
        let key = key_of(&relation(
            b'd',
            &[(1, "id", 23), (0, "v", 25), (1, "k", 25)],
        ));
        let Key::Columns {
            places,
            signature: sig,
        } = &key
        else {
            panic!("{key:?}")
        };
        assert_eq!(places, &[(0, KeyType::Int), (2, KeyType::Text)]);
        assert_eq!(
            *sig,
            signature([(&b"id"[..], KeyType::Int), (b"k", KeyType::Text)])
        );
        let int = |i| Canonical::Int(i);
        let text = |t: &str| Canonical::Text(t.as_bytes().to_vec());
        let insert = row(b'I', &[(b'N', tuple(&[Some("7"), Some("x"), Some("a")]))]);
        assert_eq!(keys(&insert, &key), Some(vec![vec![int(7), text("a")]]));
        // An update that moved the key: the old key ('K', other columns
        // null), then the new row.
        let moved = row(
            b'U',
            &[
                (b'K', tuple(&[Some("7"), None, Some("a")])),
                (b'N', tuple(&[Some("8"), Some("x"), Some("a")])),
            ],
        );
        assert_eq!(
            keys(&moved, &key),
            Some(vec![vec![int(7), text("a")], vec![int(8), text("a")]])
        );
        let delete = row(b'D', &[(b'K', tuple(&[Some("-3"), None, Some("b")]))]);
        assert_eq!(keys(&delete, &key), Some(vec![vec![int(-3), text("b")]]));
        // A key that cannot be read: the whole table.
        let null_key = row(b'I', &[(b'N', tuple(&[None, Some("x"), Some("a")]))]);
        assert_eq!(keys(&null_key, &key), None);
        assert_eq!(keys(&row(b'I', &[(b'N', vec![0, 9])]), &key), None, "short");
    }

    #[test]
    fn relations_without_a_usable_key_are_table_wide() {
        let full = key_of(&relation(b'f', &[(1, "id", 23), (1, "v", 25)]));
        assert_eq!(full, Key::Unknown);
        let numeric = key_of(&relation(b'd', &[(1, "id", 1700)]));
        assert_eq!(numeric, Key::Unknown);
        let nothing = key_of(&relation(b'n', &[(0, "v", 25)]));
        assert_eq!(nothing, Key::Unknown);
        let insert = row(b'I', &[(b'N', tuple(&[Some("1"), Some("x")]))]);
        assert_eq!(keys(&insert, &full), None);
    }

    #[test]
    fn truncate_and_short_messages() {
        let mut tr = vec![b'T'];
        tr.extend(2u32.to_be_bytes());
        tr.push(0);
        tr.extend(5u32.to_be_bytes());
        tr.extend(6u32.to_be_bytes());
        assert_eq!(decode(&tr), Some(Change::Truncate { oids: vec![5, 6] }));
        assert_eq!(decode(b"B........"), Some(Change::Other));
        assert_eq!(decode(b""), None);
        assert_eq!(decode(b"I\0\0"), None);
        assert_eq!(decode(b"R\0\0\0\x01public"), None);
        let mut tr = vec![b'T'];
        tr.extend(3u32.to_be_bytes());
        tr.push(0);
        tr.extend(5u32.to_be_bytes());
        assert_eq!(decode(&tr), None);
        // A Relation cut short in its columns.
        let rel = relation(b'd', &[(1, "id", 23)]);
        assert_eq!(decode(&rel[..rel.len() - 3]), None);
    }
}
