//! A row's identity, for invalidation by row: the values of its table's
//! replica-identity columns, brought to one form whichever side they come
//! from (a literal or a parameter of a read or a write through pgcache, or
//! a change in the replication stream), and the stripe of the table's row
//! versions they fall in.
//!
//! Only types whose equality is their canonical form take part:
//! integers (`int2`, `int4`, `int8`, compared as numbers whatever their
//! width), `text` and `varchar` in ASCII (whose bytes are the same in every
//! client and server encoding), and `uuid`. A value of another type, or
//! one this module cannot bring to that form, makes the read or the write
//! table-wide: a read keyed wrongly would miss an invalidation.

use std::sync::Arc;

use smallvec::SmallVec;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::classify::pins::{KeySource, literal_text};

/// Row versions per table. A change of row `k` moves stripe
/// `hash(k) % STRIPES`: a read of another row in the same stripe misses
/// once for nothing, never hits stale. With 1,024, a 1 % share of writes
/// to random rows leaves a hot row's entry some hundred reads on average.
pub const STRIPES: usize = 1024;

/// A table's replica identity, as the catalog gives it: where reads and
/// writes of the table may be keyed by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Its key columns, in the table's column order.
    pub columns: Vec<KeyColumn>,
    /// [`signature`] of them.
    pub signature: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyColumn {
    pub name: String,
    pub kind: KeyType,
}

impl Identity {
    /// From the catalog's `name` US `type oid` RS ... (see
    /// `cache::catalog::fetch`); `None` if a column's type cannot key rows.
    pub fn parse(text: &str) -> Option<Identity> {
        let columns = text
            .split('\u{1e}')
            .map(|column| {
                let (name, oid) = column.split_once('\u{1f}')?;
                let kind = KeyType::of_oid(oid.parse().ok()?)?;
                Some(KeyColumn {
                    name: name.to_owned(),
                    kind,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Identity::new(columns))
    }

    pub fn new(columns: Vec<KeyColumn>) -> Identity {
        let signature = signature(columns.iter().map(|c| (c.name.as_bytes(), c.kind)));
        Identity { columns, signature }
    }
}

/// The rows of one table a statement reads or writes, by key: for each
/// row, where the value of each identity column comes from.
#[derive(Debug)]
pub struct RowSet {
    pub identity: Arc<Identity>,
    pub rows: Vec<Vec<KeySource>>,
    /// Some value is a literal: the rows differ from text to text of the
    /// statement's shape.
    pub literal: bool,
}

/// At most this many rows (an IN list, VALUES, or their product over the
/// columns of a composite key) are keyed by row; more are table-wide.
const MAX_ROWS: usize = 64;

/// The stripes of a statement's rows: most name one.
pub type Stripes = SmallVec<[usize; 4]>;

/// One parameter of a Bind: its declared type, format and value.
pub type Param<'a> = (u32, i16, Option<&'a [u8]>);

/// The parameters of one Bind: each one's declared type (0: left to the
/// server) and format, and its value.
#[derive(Debug, Default)]
pub struct Bound<'a> {
    pub params: SmallVec<[Param<'a>; 4]>,
}

impl Bound<'_> {
    /// The parameters of Bind `body` for a statement whose Parse declared
    /// `param_types` (its count and OIDs); `None` if malformed.
    pub fn read<'b>(param_types: &[u8], body: &'b [u8]) -> Option<Bound<'b>> {
        let mut bound = Bound::default();
        // The parameters are walked eagerly; the result formats are not
        // needed.
        let _results = crate::protocol::extended::walk_bind(body, |format, value| {
            bound.push(param_types, format, value);
        })?;
        Some(bound)
    }
}

impl<'b> Bound<'b> {
    /// The next parameter, as a walk of the Bind gives it, of a statement
    /// whose Parse declared `param_types`.
    pub fn push(&mut self, param_types: &[u8], format: i16, value: Option<&'b [u8]>) {
        let types = param_types.get(2..).unwrap_or_default();
        let n = self.params.len();
        let oid = types
            .get(4 * n..4 * n + 4)
            .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
        self.params.push((oid, format, value));
    }
}

/// What a text's values are read from: its literals (a text of the
/// statement's shape) and its parameters.
#[derive(Debug, Default, Clone, Copy)]
pub struct Values<'a, 'b> {
    pub literals: &'a [crate::hints::Literal<'a>],
    pub bound: Option<&'a Bound<'b>>,
}

impl RowSet {
    /// From a statement's pins: a row set if `pinned` (column name, its
    /// values) pins every column of `identity`; the rows are the product
    /// of the values over the columns.
    pub fn pinned(identity: &Arc<Identity>, pinned: &[(String, Vec<KeySource>)]) -> Option<RowSet> {
        let mut rows: Vec<Vec<KeySource>> = vec![Vec::new()];
        for column in &identity.columns {
            let (_, values) = pinned.iter().find(|(name, _)| *name == column.name)?;
            if rows.len() * values.len() > MAX_ROWS {
                return None;
            }
            rows = rows
                .iter()
                .flat_map(|row| {
                    values.iter().map(move |v| {
                        let mut row = row.clone();
                        row.push(*v);
                        row
                    })
                })
                .collect();
        }
        RowSet::new(identity, rows)
    }

    /// From the rows of an INSERT's VALUES, by its `columns`.
    pub fn values(
        identity: &Arc<Identity>,
        columns: &[String],
        values: &[Vec<Option<KeySource>>],
    ) -> Option<RowSet> {
        if values.len() > MAX_ROWS {
            return None;
        }
        let places = identity
            .columns
            .iter()
            .map(|c| columns.iter().position(|name| *name == c.name))
            .collect::<Option<Vec<usize>>>()?;
        let rows = values
            .iter()
            .map(|row| {
                places
                    .iter()
                    .map(|&p| row.get(p).copied().flatten())
                    .collect()
            })
            .collect::<Option<Vec<Vec<KeySource>>>>()?;
        RowSet::new(identity, rows)
    }

    fn new(identity: &Arc<Identity>, rows: Vec<Vec<KeySource>>) -> Option<RowSet> {
        let literal = rows
            .iter()
            .flatten()
            .any(|s| matches!(s, KeySource::Literal { .. }));
        (!rows.is_empty()).then(|| RowSet {
            identity: Arc::clone(identity),
            rows,
            literal,
        })
    }

    /// The stripes of the rows, with `values`; `written`: for a write
    /// (a text value outside ASCII still has a stripe). `None` where a
    /// value cannot be read as the server will: then the statement is
    /// taken as one of the whole table.
    pub fn stripes(&self, values: Values<'_, '_>, written: bool) -> Option<Stripes> {
        let mut stripes = Stripes::new();
        let mut row_values: SmallVec<[Canonical; 2]> = SmallVec::new();
        for row in &self.rows {
            row_values.clear();
            for (source, column) in row.iter().zip(&self.identity.columns) {
                row_values.push(value(*source, column.kind, values, written)?);
            }
            stripes.push(stripe(self.identity.signature, &row_values));
        }
        Some(stripes)
    }
}

fn value(
    source: KeySource,
    kind: KeyType,
    values: Values<'_, '_>,
    written: bool,
) -> Option<Canonical> {
    match source {
        KeySource::Literal { ordinal, negative } => {
            let text = literal_text(values.literals, ordinal, negative)?;
            match written {
                true => kind.from_written_text(text.as_bytes()),
                false => kind.from_text(text.as_bytes()),
            }
        }
        KeySource::Param(n) => {
            let &(oid, format, value) = values.bound?.params.get(n)?;
            if !kind.takes_param(oid) {
                return None;
            }
            match (format, value?) {
                (0, text) if written => kind.from_written_text(text),
                (0, text) => kind.from_text(text),
                (1, bytes) if written && kind == KeyType::Text => {
                    Some(Canonical::Text(bytes.to_vec()))
                }
                (1, bytes) => kind.from_binary(bytes),
                _ => None,
            }
        }
    }
}

/// The kinds of key column this module knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyType {
    Int,
    Text,
    Uuid,
}

impl KeyType {
    /// The kind of a column of type `oid`, if it may key rows.
    pub fn of_oid(oid: u32) -> Option<KeyType> {
        match oid {
            20 | 21 | 23 => Some(KeyType::Int),
            25 | 1043 => Some(KeyType::Text),
            2950 => Some(KeyType::Uuid),
            _ => None,
        }
    }

    /// Whether a parameter declared with type `oid` (0: left to the
    /// server, which then takes the column's) is compared as this kind.
    pub fn takes_param(self, oid: u32) -> bool {
        oid == 0
            || match self {
                KeyType::Int => matches!(oid, 20 | 21 | 23),
                // `unknown`, as some drivers declare strings.
                KeyType::Text => matches!(oid, 25 | 1043 | 705),
                KeyType::Uuid => oid == 2950,
            }
    }

    /// The canonical form of a value in text, as PostgreSQL's output
    /// writes it or a client may: `None` where this module cannot be sure
    /// the server reads it as the same value.
    pub fn from_text(self, text: &[u8]) -> Option<Canonical> {
        match self {
            KeyType::Int => {
                let text = std::str::from_utf8(text).ok()?;
                // PostgreSQL also takes spaces, `+` and underscores: left
                // table-wide.
                if !text
                    .bytes()
                    .enumerate()
                    .all(|(i, b)| b.is_ascii_digit() || (i == 0 && b == b'-'))
                {
                    return None;
                }
                text.parse::<i64>().ok().map(Canonical::Int)
            }
            KeyType::Text => text.is_ascii().then(|| Canonical::Text(text.to_vec())),
            KeyType::Uuid => parse_uuid(text).map(Canonical::Uuid),
        }
    }

    /// The form of a value a write gave a row (in the stream, or a write
    /// through pgcache): as [`Self::from_text`], but text in any bytes.
    /// No keyed read takes a value outside ASCII, so the stripe of such a
    /// key may be any, and the change need not be taken as table-wide.
    pub fn from_written_text(self, text: &[u8]) -> Option<Canonical> {
        match self {
            KeyType::Text => Some(Canonical::Text(text.to_vec())),
            _ => self.from_text(text),
        }
    }

    /// The canonical form of a value in binary (a parameter).
    pub fn from_binary(self, bytes: &[u8]) -> Option<Canonical> {
        match self {
            KeyType::Int => match *bytes {
                [a, b] => Some(i64::from(i16::from_be_bytes([a, b]))),
                [a, b, c, d] => Some(i64::from(i32::from_be_bytes([a, b, c, d]))),
                [..] if bytes.len() == 8 => Some(i64::from_be_bytes(bytes.try_into().ok()?)),
                _ => None,
            }
            .map(Canonical::Int),
            KeyType::Text => bytes.is_ascii().then(|| Canonical::Text(bytes.to_vec())),
            KeyType::Uuid => <[u8; 16]>::try_from(bytes).ok().map(Canonical::Uuid),
        }
    }
}

/// One key column's value in its canonical form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Canonical {
    Int(i64),
    Text(Vec<u8>),
    Uuid([u8; 16]),
}

/// `8-4-4-4-12` hex digits, in either case, with or without the hyphens
/// (and braces), as `uuid_in` takes them; `None` for anything else.
fn parse_uuid(text: &[u8]) -> Option<[u8; 16]> {
    let text = text
        .strip_prefix(b"{")
        .and_then(|t| t.strip_suffix(b"}"))
        .unwrap_or(text);
    let digits: Vec<u8> = text.iter().copied().filter(|b| *b != b'-').collect();
    if digits.len() != 32 || text.first() == Some(&b'-') || text.last() == Some(&b'-') {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        let hex = |b: u8| (b as char).to_digit(16);
        out[i] = (hex(pair[0])? * 16 + hex(pair[1])?) as u8;
    }
    Some(out)
}

/// The stripe of the row whose key columns (in the table's column order)
/// hold `values`, under the table's identity signature `signature` (see
/// [`signature`]).
pub fn stripe(signature: u64, values: &[Canonical]) -> usize {
    // Hashed at once from a buffer on the stack: a streaming hasher's set
    // up cost more than the few bytes of a key. The digest is the same.
    let mut bytes: SmallVec<[u8; 64]> = SmallVec::new();
    bytes.extend_from_slice(&signature.to_le_bytes());
    for value in values {
        match value {
            Canonical::Int(v) => {
                bytes.push(b'i');
                bytes.extend_from_slice(&v.to_le_bytes());
            }
            Canonical::Text(t) => {
                bytes.push(b't');
                bytes.extend_from_slice(&(t.len() as u64).to_le_bytes());
                bytes.extend_from_slice(t);
            }
            Canonical::Uuid(u) => {
                bytes.push(b'u');
                bytes.extend_from_slice(u);
            }
        }
    }
    (xxh3_64(&bytes) % STRIPES as u64) as usize
}

/// What a table's replica identity is, as one number: its key columns'
/// names and kinds in column order. The stream and the reads hash rows
/// under it, and a stream that sees another one for a table (the identity
/// changed, and pgcache's facts of it are older) invalidates the table
/// whole rather than by row.
pub fn signature<'a>(columns: impl IntoIterator<Item = (&'a [u8], KeyType)>) -> u64 {
    let mut h = Xxh3::new();
    for (name, kind) in columns {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name);
        h.update(&[kind as u8]);
    }
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_one_value_whatever_their_width_or_form() {
        let int = KeyType::Int;
        let seven = Some(Canonical::Int(7));
        assert_eq!(int.from_text(b"7"), seven);
        assert_eq!(int.from_binary(&7i16.to_be_bytes()), seven);
        assert_eq!(int.from_binary(&7i32.to_be_bytes()), seven);
        assert_eq!(int.from_binary(&7i64.to_be_bytes()), seven);
        assert_eq!(int.from_text(b"-12"), Some(Canonical::Int(-12)));
        assert_eq!(
            int.from_binary(&(-12i32).to_be_bytes()),
            Some(Canonical::Int(-12))
        );
        // Forms the server reads but this module does not: table-wide.
        for odd in [
            &b" 7"[..],
            b"+7",
            b"7.0",
            b"1_000",
            b"",
            b"-",
            b"99999999999999999999",
        ] {
            assert_eq!(int.from_text(odd), None, "{odd:?}");
        }
        assert_eq!(int.from_binary(&[0, 0, 7]), None);
    }

    #[test]
    fn text_keys_are_their_ascii_bytes() {
        assert_eq!(
            KeyType::Text.from_text(b"abc"),
            Some(Canonical::Text(b"abc".to_vec()))
        );
        assert_eq!(
            KeyType::Text.from_binary(b"abc"),
            KeyType::Text.from_text(b"abc")
        );
        assert_eq!(
            KeyType::Text.from_text("é".as_bytes()),
            None,
            "encodings differ"
        );
    }

    #[test]
    fn uuids_are_read_in_every_form_uuid_in_takes() {
        let canonical = KeyType::Uuid.from_text(b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11");
        assert!(canonical.is_some());
        for form in [
            &b"A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11"[..],
            b"{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
            b"a0eebc999c0b4ef8bb6d6bb9bd380a11",
            b"a0ee-bc99-9c0b4ef8-bb6d6bb9-bd380a11",
        ] {
            assert_eq!(KeyType::Uuid.from_text(form), canonical, "{form:?}");
        }
        let Some(Canonical::Uuid(bytes)) = canonical else {
            unreachable!()
        };
        assert_eq!(KeyType::Uuid.from_binary(&bytes), canonical);
        assert_eq!(KeyType::Uuid.from_text(b"a0eebc99"), None);
        assert_eq!(
            KeyType::Uuid.from_text(b"-a0eebc999c0b4ef8bb6d6bb9bd380a11"),
            None
        );
    }

    #[test]
    fn a_row_falls_in_one_stripe_under_one_identity() {
        let sig = signature([(&b"id"[..], KeyType::Int)]);
        let row = [Canonical::Int(42)];
        assert_eq!(stripe(sig, &row), stripe(sig, &row));
        assert!(stripe(sig, &row) < STRIPES);
        let other = signature([(&b"key"[..], KeyType::Int)]);
        assert_ne!(sig, other);
        // Rows spread over the stripes.
        let used: std::collections::HashSet<usize> = (0..10_000)
            .map(|i| stripe(sig, &[Canonical::Int(i)]))
            .collect();
        assert!(used.len() > STRIPES * 9 / 10, "{} stripes used", used.len());
        // Composite keys take every column, in order.
        let ab = [Canonical::Int(1), Canonical::Text(b"x".to_vec())];
        let ba = [Canonical::Text(b"x".to_vec()), Canonical::Int(1)];
        assert_ne!(stripe(sig, &ab), stripe(sig, &ba));
    }

    #[test]
    fn an_identity_reads_as_the_catalog_writes_it() {
        let id = Identity::parse("a\u{1f}23\u{1e}b\u{1f}25").expect("int and text");
        assert_eq!(id.columns.len(), 2);
        assert_eq!(
            (id.columns[1].name.as_str(), id.columns[1].kind),
            ("b", KeyType::Text)
        );
        assert_eq!(
            id.signature,
            signature([(&b"a"[..], KeyType::Int), (b"b", KeyType::Text)])
        );
        assert_eq!(Identity::parse("a\u{1f}1700"), None, "numeric");
        assert_eq!(Identity::parse("garbage"), None);
    }

    #[test]
    fn column_kinds_by_type_and_the_parameters_they_take() {
        assert_eq!(KeyType::of_oid(23), Some(KeyType::Int));
        assert_eq!(KeyType::of_oid(1700), None, "numeric: not a key here");
        assert!(KeyType::Int.takes_param(0) && KeyType::Int.takes_param(20));
        assert!(!KeyType::Int.takes_param(701), "float8 compares as float");
        assert!(!KeyType::Text.takes_param(23));
    }
}
