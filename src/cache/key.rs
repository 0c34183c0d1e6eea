//! Cache keys: a 128-bit xxh3 hash over every input that can change a
//! result, each length-prefixed so that no two inputs can run together.
//!
//! | part | why |
//! | --- | --- |
//! | format version | an entry written by another layout is never read |
//! | session prefix | database, startup parameters (but `application_name`), `current_user`, `session_user`, every setting in `pg_settings` (search_path, TimeZone, DateStyle, IntervalStyle, client_encoding, extra_float_digits, bytea_output, lc_*, ...), and the custom settings RLS policies read |
//! | flavour | simple and extended responses differ in shape |
//! | statement | the exact SQL bytes (hashed) |
//! | extended only | message shape, parameter type OIDs, parameter formats and values (NULL distinct from empty), result formats |
//! | epoch, versions | the database epoch and the version of every table read, read before the query is forwarded: the `local` counters for the local tier, the `shared` ones (mirrored from Redis) for the shared tier |

use std::sync::Arc;

use super::versions::{Family, Version};
use xxhash_rust::xxh3::{Xxh3, xxh3_128};

const KEY_FORMAT: u8 = 2;

pub const SIMPLE: u8 = b'Q';
pub const EXTENDED: u8 = b'X';

pub fn sql_hash(sql: &[u8]) -> u128 {
    xxh3_128(sql)
}

/// The hash of the text a statement's key is made of (`hash`, its text's):
/// an explained statement (`explained`) reads the entry of the same text
/// without its hint.
pub fn keyed_text(explained: bool, hash: u128, sql: &[u8]) -> u128 {
    if !explained {
        return hash;
    }
    std::str::from_utf8(sql)
        .ok()
        .and_then(crate::hints::unexplained)
        .map_or(hash, |text| sql_hash(text.as_bytes()))
}

/// Digests a session's settings as the server reported them. Taken once
/// per answer and kept with it: the answer spells out every setting, and
/// hashing it was most of what a new session's first key cost.
pub fn settings_digest<'a>(settings: impl IntoIterator<Item = &'a Option<String>>) -> u128 {
    let mut h = Xxh3::new();
    for s in settings {
        put_opt(&mut h, s.as_deref().map(str::as_bytes));
    }
    h.digest128()
}

/// Hashes the session's identity: computed when its settings are read
/// (`settings`: their [`settings_digest`]).
pub fn session_prefix<'a>(
    database: &str,
    startup: impl Iterator<Item = (&'a str, &'a str)>,
    settings: u128,
) -> u128 {
    let mut h = Xxh3::new();
    h.update(&[KEY_FORMAT]);
    put(&mut h, database.as_bytes());
    let mut params: Vec<(&str, &str)> = startup.filter(|(k, _)| *k != "application_name").collect();
    params.sort_unstable();
    for (k, v) in params {
        put(&mut h, k.as_bytes());
        put(&mut h, v.as_bytes());
    }
    h.update(&[0xff]);
    h.update(&settings.to_le_bytes());
    h.digest128()
}

/// The request key, `L` and the epoch: the local key's bytes before the
/// tables' versions.
const LOCAL_HEAD: usize = 16 + 1 + 8;

/// What one request key's bytes nearly always fit in: a statement's
/// prefix and hash, and a few parameters.
const INLINE_KEY: usize = 128;

/// Builds one request's key. Its bytes are gathered on the stack and
/// hashed in one go: the streaming hasher's state (600 bytes, its secret
/// copied in) cost more to set up and feed than hashing a short key.
/// Longer keys spill into it, which gives the same digest for the same
/// bytes.
pub struct KeyBuilder {
    inline: [u8; INLINE_KEY],
    len: usize,
    spilled: Option<Box<Xxh3>>,
}

impl KeyBuilder {
    #[inline]
    pub fn new(prefix: u128, flavour: u8, sql_hash: u128) -> Self {
        let mut k = Self {
            inline: [0; INLINE_KEY],
            len: 0,
            spilled: None,
        };
        k.update(&prefix.to_le_bytes());
        k.update(&[flavour]);
        k.update(&sql_hash.to_le_bytes());
        k
    }

    /// Inlined, so that the fixed-size parts are copied as words.
    #[inline]
    fn update(&mut self, b: &[u8]) {
        let end = self.len + b.len();
        if end <= INLINE_KEY && self.spilled.is_none() {
            self.inline[self.len..end].copy_from_slice(b);
            self.len = end;
        } else {
            self.spill(b);
        }
    }

    #[cold]
    #[inline(never)]
    fn spill(&mut self, b: &[u8]) {
        let h = self.spilled.get_or_insert_with(|| {
            let mut h = Box::new(Xxh3::new());
            h.update(&self.inline[..self.len]);
            h
        });
        h.update(b);
    }

    #[inline]
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.update(&(b.len() as u64).to_le_bytes());
        self.update(b);
        self
    }

    #[inline]
    pub fn value(&mut self, v: Option<&[u8]>) -> &mut Self {
        match v {
            Some(b) => self.bytes(b),
            None => {
                self.update(&u64::MAX.to_le_bytes());
                self
            }
        }
    }

    #[inline]
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.update(&v.to_le_bytes());
        self
    }

    /// The request's identity, without versions.
    pub fn finish(&self) -> RequestKey {
        RequestKey(match &self.spilled {
            Some(h) => h.digest128(),
            None => xxh3_128(&self.inline[..self.len]),
        })
    }
}

/// A request's identity; combined with the versions of what it reads, read
/// at the moment of lookup, it makes the key of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestKey(pub u128);

impl RequestKey {
    /// The local tier's key: the epoch and table versions, `local` counters.
    pub fn local(self, epoch: &Version, families: &[Arc<Family>]) -> u128 {
        // A statement reads a few tables: their words are hashed in one go
        // from the stack, as the streaming hasher's state (600 bytes, the
        // default secret copied in) cost more to set up than the hashing.
        const ROOM: usize = LOCAL_HEAD + 8 * 12;
        let len = LOCAL_HEAD + 8 * families.len();
        if len <= ROOM {
            let mut buf = [0u8; ROOM];
            buf[..16].copy_from_slice(&self.0.to_le_bytes());
            buf[16] = b'L';
            buf[17..LOCAL_HEAD].copy_from_slice(&epoch.local().to_le_bytes());
            for (word, f) in buf[LOCAL_HEAD..len].chunks_exact_mut(8).zip(families) {
                word.copy_from_slice(&f.version.local().to_le_bytes());
            }
            return xxh3_128(&buf[..len]);
        }
        self.local_streamed(epoch, families)
    }

    /// [`Self::local`] for statements that read many tables: the same
    /// bytes, through the streaming hasher (which gives the same digest).
    fn local_streamed(self, epoch: &Version, families: &[Arc<Family>]) -> u128 {
        let mut h = Xxh3::new();
        h.update(&self.0.to_le_bytes());
        h.update(b"L");
        h.update(&epoch.local().to_le_bytes());
        for f in families {
            h.update(&f.version.local().to_le_bytes());
        }
        h.digest128()
    }

    /// The shared tier's key, from the counters mirrored from Redis, with
    /// the versions it was made from (stored in the entry, checked on read).
    pub fn shared(self, epoch: &Version, families: &[Arc<Family>]) -> (u128, Vec<u64>) {
        let mut stamp = Vec::with_capacity(families.len() + 1);
        stamp.push(epoch.shared());
        stamp.extend(families.iter().map(|f| f.version.shared()));
        let mut h = Xxh3::new();
        h.update(&self.0.to_le_bytes());
        h.update(b"S");
        for v in &stamp {
            h.update(&v.to_le_bytes());
        }
        (h.digest128(), stamp)
    }
}

fn put(h: &mut Xxh3, b: &[u8]) {
    h.update(&(b.len() as u64).to_le_bytes());
    h.update(b);
}

fn put_opt(h: &mut Xxh3, b: Option<&[u8]>) {
    match b {
        Some(b) => put(h, b),
        None => h.update(&u64::MAX.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_the_same_whether_it_fits_on_the_stack_or_spills() {
        // The same bytes through the streaming hasher, as keys were made
        // before: entries in a shared Redis stay readable across versions.
        for n in [0usize, 1, 16, 60, 80, 95, 96, 200, 300, 1000] {
            let value: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let mut k = KeyBuilder::new(7, EXTENDED, 9);
            k.bytes(b"BE").u64(1).value(Some(&value)).value(None);
            let mut h = Xxh3::new();
            h.update(&7u128.to_le_bytes());
            h.update(&[EXTENDED]);
            h.update(&9u128.to_le_bytes());
            put(&mut h, b"BE");
            h.update(&1u64.to_le_bytes());
            put_opt(&mut h, Some(&value));
            put_opt(&mut h, None);
            assert_eq!(k.finish().0, h.digest128(), "{n} bytes of value");
        }
    }

    fn prefix(db: &str, user: &str, settings: &[&str]) -> u128 {
        let s: Vec<Option<String>> = settings.iter().map(|s| Some(s.to_string())).collect();
        session_prefix(
            db,
            [("user", user), ("application_name", "x")].into_iter(),
            settings_digest(&s),
        )
    }

    #[test]
    fn every_session_input_changes_the_prefix() {
        let base = prefix("db", "alice", &["TimeZone=UTC"]);
        assert_eq!(base, prefix("db", "alice", &["TimeZone=UTC"]));
        assert_ne!(base, prefix("db2", "alice", &["TimeZone=UTC"]));
        assert_ne!(base, prefix("db", "bob", &["TimeZone=UTC"]));
        assert_ne!(base, prefix("db", "alice", &["TimeZone=Asia/Tokyo"]));
        let only_app_name = session_prefix(
            "db",
            [("user", "alice"), ("application_name", "other")].into_iter(),
            settings_digest(&[Some("TimeZone=UTC".into())]),
        );
        assert_eq!(
            base, only_app_name,
            "application_name does not change results"
        );
    }

    #[test]
    fn null_empty_and_boundaries_are_distinct() {
        let key = |f: &dyn Fn(&mut KeyBuilder)| {
            let mut k = KeyBuilder::new(1, EXTENDED, 2);
            f(&mut k);
            k.finish()
        };
        let null = key(&|k| {
            k.value(None);
        });
        let empty = key(&|k| {
            k.value(Some(b""));
        });
        assert_ne!(null, empty);
        let ab_c = key(&|k| {
            k.bytes(b"ab").bytes(b"c");
        });
        let a_bc = key(&|k| {
            k.bytes(b"a").bytes(b"bc");
        });
        assert_ne!(ab_c, a_bc);
    }

    fn family() -> Arc<Family> {
        Arc::new(Family::new("t"))
    }

    #[test]
    fn a_version_bump_changes_the_key() {
        let (epoch, f) = (Version::default(), family());
        let fs = std::slice::from_ref(&f);
        let req = KeyBuilder::new(1, SIMPLE, 2).finish();
        let before = req.local(&epoch, fs);
        f.version.bump_local();
        assert_ne!(before, req.local(&epoch, fs));
        assert_ne!(req.local(&epoch, fs), req.local(&epoch, &[]));
        epoch.bump_local();
        assert_ne!(before, req.local(&epoch, fs));
        assert_ne!(
            KeyBuilder::new(1, SIMPLE, 2).finish(),
            KeyBuilder::new(1, EXTENDED, 2).finish()
        );
    }

    #[test]
    fn the_local_key_is_one_digest_however_many_tables_are_read() {
        let epoch = Version::default();
        epoch.bump_local();
        let req = KeyBuilder::new(1, SIMPLE, 2).finish();
        for n in [0, 1, 3, 12, 13, 40] {
            let fs: Vec<_> = (0..n).map(|_| family()).collect();
            for (i, f) in fs.iter().enumerate() {
                for _ in 0..i {
                    f.version.bump_local();
                }
            }
            assert_eq!(
                req.local(&epoch, &fs),
                req.local_streamed(&epoch, &fs),
                "{n} tables"
            );
        }
    }

    #[test]
    fn shared_keys_follow_only_the_redis_counters() {
        let (epoch, f) = (Version::default(), family());
        let fs = std::slice::from_ref(&f);
        let req = KeyBuilder::new(1, SIMPLE, 2).finish();
        let (before, stamp) = req.shared(&epoch, fs);
        assert_eq!(stamp, vec![0, 0]);
        f.version.bump_local();
        assert_eq!(
            req.shared(&epoch, fs).0,
            before,
            "a local bump is not Redis's"
        );
        let local = req.local(&epoch, fs);
        assert!(f.version.raise_shared(5));
        assert!(!f.version.raise_shared(4), "never backwards");
        let (after, stamp) = req.shared(&epoch, fs);
        assert_ne!(after, before);
        assert_eq!(stamp, vec![0, 5]);
        assert_ne!(
            req.local(&epoch, fs),
            local,
            "news from Redis moves the local key too"
        );
    }
}
