//! A session's reads on a replica (`replicas.routing`): the replica its
//! connection goes to, the client state applied there, and the book of a
//! read routed to it.
//!
//! A read goes to a replica only while nothing else is in flight, outside
//! a transaction block, and the session then waits for its answer before
//! it reads its client or the primary again: answers never overtake one
//! another. Just before the read, in the same write, pgcache asks the
//! replica where it has replayed to ([`PROBE`]). If that is behind what the
//! session needs (its instance's writes, what it has observed), or if the
//! replica fails the read before any of its answer reached the client,
//! the read goes to the primary instead. Its answer is stored only if the
//! replica had replayed past the last change of every table it read.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::known::Statement;
use crate::cache::key::KeyBuilder;
use crate::pool::prepared::ServerStatements;
use crate::protocol::codec::{self, HEADER_LEN, frame_of};
use crate::protocol::{backend as be, extended, frontend as fe, messages};
use crate::replica::{Replica, parse_lsn};

/// pgcache's own question to a replica before a read: how far it has
/// replayed. Sent in the same write as the read, so the answer holds for
/// the read's snapshot, which can only be later.
pub(super) const PROBE: &str = "SELECT pg_catalog.pg_last_wal_replay_lsn()::text";

/// Statements kept prepared on one replica connection: past it, the one
/// least recently used is closed.
pub(super) const MAX_PREPARED: usize = 256;

/// Where a session's read on a replica stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadState {
    /// None is under way.
    Idle,
    /// Routed there: the driver is to get a connection, and the engine to
    /// stage the read for it ([`super::engine::Engine::stage_replica`]).
    Chosen,
    /// Written to the connection; its answer is awaited.
    Sent,
    /// Answered (or sent to the primary instead): the driver lets the
    /// connection go before the session goes on.
    Answered,
}

/// The session's leg to a replica, as the engine sees it: the server, the
/// read under way, and the books of the connection the read is on (the
/// session's own in session mode; in transaction mode the pooled one's,
/// moved here while the session holds it).
pub(super) struct ReplicaLeg {
    pub server: Arc<Replica>,
    /// The id of the client state applied on the connection (0: as it
    /// logged in).
    pub applied: u64,
    /// The statements prepared on the connection, by [`replica_key`].
    pub prepared: ServerStatements,
    /// Frames for it, written by the driver.
    pub staged: BytesMut,
    pub read: ReadState,
    /// What the probe before the read in flight answered, or the position
    /// known without one ([`Replica::known_since`]).
    pub replayed: Option<u64>,
    /// When the connection logged in; `None` while in doubt.
    pub opened: Option<Instant>,
    /// When the probe of the read in flight was staged; `None` if it had
    /// none.
    pub asked: Option<Instant>,
}

impl ReplicaLeg {
    pub fn new(server: Arc<Replica>) -> Self {
        Self {
            server,
            applied: 0,
            prepared: ServerStatements::default(),
            staged: BytesMut::new(),
            read: ReadState::Idle,
            replayed: None,
            opened: None,
            asked: None,
        }
    }

    /// The session's leg to `server` in `slot`, a new one if it had
    /// another, with a read chosen for it.
    pub fn choose(slot: &mut Option<Box<ReplicaLeg>>, server: &Arc<Replica>) {
        if slot
            .as_ref()
            .is_some_and(|leg| !Arc::ptr_eq(&leg.server, server))
        {
            *slot = None;
        }
        let leg = slot.get_or_insert_with(|| Box::new(ReplicaLeg::new(Arc::clone(server))));
        leg.read = ReadState::Chosen;
        leg.replayed = None;
    }

    /// A read is chosen or in flight: the session reads neither its client
    /// nor the primary until it is answered.
    pub fn busy(&self) -> bool {
        self.read != ReadState::Idle
    }

    /// The read's connection is another one: in the state of `applied`,
    /// with `prepared`, logged in at `opened` (`None`: in doubt).
    pub fn on_connection(
        &mut self,
        applied: u64,
        prepared: ServerStatements,
        opened: Option<Instant>,
    ) {
        self.applied = applied;
        self.prepared = prepared;
        self.opened = opened;
    }

    /// The replica's position the read in flight will find without asking:
    /// known to be at least `needed` and `floor` since the connection
    /// logged in ([`Replica::known_since`]).
    pub fn known(&self, needed: u64, floor: Option<u64>) -> Option<u64> {
        let known = self.server.known_since(self.opened?)?;
        (known >= needed && floor.is_none_or(|f| known >= f)).then_some(known)
    }

    /// Stages `request` for the replica, as an extended batch for
    /// `statement` if one is given, after the probe if `probe`: how many
    /// requests of pgcache's own it staged after the probe (their answers
    /// are pgcache's).
    pub fn stage(&mut self, request: &[u8], statement: Option<&Statement>, probe: bool) -> usize {
        self.read = ReadState::Sent;
        if probe {
            self.staged.extend_from_slice(&messages::query(PROBE));
        }
        match statement {
            None => {
                self.staged.extend_from_slice(request);
                0
            }
            Some(statement) => self.stage_batch(request, statement),
        }
    }

    /// Stages an extended batch, `request` (Bind, Describe,
    /// Execute and Sync, without the client's Parse), naming `statement`
    /// as the replica knows it; prepared there first, behind a Close of
    /// its name and with a Sync of its own, unless the connection has it.
    /// Past [`MAX_PREPARED`], the statement least recently used is closed.
    fn stage_batch(&mut self, request: &[u8], statement: &Statement) -> usize {
        let key = replica_key(statement);
        let name = replica_name(key);
        let mut own = 0;
        if !self.prepared.touch(key) {
            own += 1;
            self.prepared.insert(key);
            let target = [fe::TARGET_STATEMENT];
            if let Some(old) = self.prepared.over(MAX_PREPARED) {
                self.prepared.remove(old);
                frame_of(
                    &mut self.staged,
                    fe::CLOSE,
                    &[&target, &replica_name(old), &[0]],
                );
            }
            frame_of(&mut self.staged, fe::CLOSE, &[&target, &name, &[0]]);
            let text = [
                &name[..],
                &[0],
                &statement.sql,
                &[0],
                &statement.param_types,
            ];
            frame_of(&mut self.staged, fe::PARSE, &text);
            self.staged.extend_from_slice(&messages::SYNC);
        }
        renamed(&mut self.staged, request, &name);
        own
    }

    /// A DataRow of the probe's answer.
    pub fn probed(&mut self, frame: &[u8]) {
        if frame[0] != be::DATA_ROW {
            return;
        }
        self.replayed = extended::data_row(&frame[HEADER_LEN..])
            .and_then(|row| row.into_iter().next().flatten())
            .and_then(|lsn| parse_lsn(&lsn));
    }
}

/// A statement's identity on replica connections: its text and parameter
/// types, whatever the client named it and however often it named another
/// the same.
pub(super) fn replica_key(statement: &Statement) -> u128 {
    let mut key = KeyBuilder::new(0, 0, statement.hash);
    key.bytes(&statement.param_types);
    key.finish().0
}

/// A statement's name on replica connections.
pub(super) fn replica_name(key: u128) -> Bytes {
    Bytes::from(format!("pgcache_r{key:032x}"))
}

/// The frames of an extended batch without its Parse, and whether it had
/// one.
pub(super) fn without_parse(request: &[u8]) -> (BytesMut, bool) {
    let mut rest = BytesMut::with_capacity(request.len());
    let mut parsed = false;
    for frame in codec::frames(request) {
        match frame[0] {
            fe::PARSE => parsed = true,
            _ => rest.extend_from_slice(frame),
        }
    }
    (rest, parsed)
}

/// The frames of `request` with the statement a Bind or a Describe names
/// replaced by `name`.
fn renamed(out: &mut BytesMut, request: &[u8], name: &[u8]) {
    for frame in codec::frames(request) {
        let body = &frame[HEADER_LEN..];
        match (frame[0], extended::bind_names(body), extended::target(body)) {
            (fe::BIND, Some((portal, statement)), _) => {
                let rest = &body[portal.len() + statement.len() + 2..];
                frame_of(out, fe::BIND, &[portal, &[0], name, &[0], rest]);
            }
            (fe::DESCRIBE, _, Some((fe::TARGET_STATEMENT, _))) => {
                frame_of(out, fe::DESCRIBE, &[&[fe::TARGET_STATEMENT], name, &[0]]);
            }
            _ => out.extend_from_slice(frame),
        }
    }
}

/// What the session has seen of the database, as a WAL position: it never
/// reads from a replica behind it (monotonic reads).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Observed {
    /// The highest position known: a replica's probe before a read there,
    /// or the state a hit showed (the last change of every table it read).
    at: u64,
    /// A hit showed a change whose position is not known yet: it is at or
    /// before the first heartbeat sent after this instant.
    pending: Option<Instant>,
}

impl Observed {
    /// The session saw the database as of `at`.
    pub fn saw(&mut self, at: u64) {
        self.at = self.at.max(at);
    }

    /// The session saw a change of unknown position, at `now` or before.
    pub fn saw_pending(&mut self, now: Instant) {
        self.pending.get_or_insert(now);
    }

    /// The position a replica must be at for the session to read there;
    /// `None` while a change it saw is not placed yet. `covering` gives
    /// the position of the first heartbeat back sent after an instant.
    pub fn needed(&mut self, covering: impl Fn(Instant) -> Option<u64>) -> Option<u64> {
        if let Some(since) = self.pending {
            self.saw(covering(since)?);
            self.pending = None;
        }
        Some(self.at)
    }
}

/// The book of a read routed to a replica, kept with its request in flight.
pub(super) struct Routed {
    pub server: Arc<Replica>,
    /// The request, sent to the primary if the replica cannot answer it.
    pub request: Bytes,
    /// The statement an extended batch binds, prepared on the replica
    /// under its own name; `None`: a simple Query.
    pub statement: Option<Arc<Statement>>,
    /// The position the session needs the replica at.
    pub needed: u64,
    /// The position the replica must have replayed past for the answer to
    /// be stored; `None`: it is not stored.
    pub fill_floor: Option<u64>,
    /// The client's Parse of the batch (statement name, frame), kept from
    /// the replica: answered by pgcache once the replica's answer stands,
    /// and replayed to the primary later; or sent there with the read.
    pub parse: Option<(Bytes, Bytes)>,
    pub verdict: Verdict,
}

/// What becomes of a routed read's answer, decided at its first frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Its first frame has not come.
    Awaited,
    /// The replica's answer goes to the client: the read can no longer go
    /// to the primary.
    Relayed,
    /// The replica's answer is dropped; the read goes to the primary once
    /// it ends.
    ToPrimary,
}

impl Routed {
    pub fn new(
        server: Arc<Replica>,
        (request, statement): (Bytes, Option<Arc<Statement>>),
        needed: u64,
        fill_floor: Option<u64>,
    ) -> Self {
        Self {
            server,
            request,
            statement,
            needed,
            fill_floor,
            parse: None,
            verdict: Verdict::Awaited,
        }
    }

    /// The request as the primary is to have it, the client's Parse first
    /// if it was kept from the replica: answered there, error and all.
    pub fn for_primary(&self) -> BytesMut {
        let parse = self.parse.as_ref().map_or(&[][..], |(_, raw)| &raw[..]);
        let mut request = BytesMut::with_capacity(parse.len() + self.request.len());
        request.extend_from_slice(parse);
        request.extend_from_slice(&self.request);
        request
    }

    /// The first frame of the replica's answer: whether the read stands
    /// (else it goes to the primary), given where the probe said the
    /// replica had replayed to.
    pub fn first_frame(&mut self, frame: &[u8], replayed: Option<u64>) -> bool {
        let behind = replayed.is_none_or(|r| r < self.needed);
        let failed = frame[0] == be::ERROR_RESPONSE && retried(&frame[HEADER_LEN..]);
        self.verdict = match behind || failed {
            true => Verdict::ToPrimary,
            false => Verdict::Relayed,
        };
        self.verdict == Verdict::Relayed
    }

    /// Its answer is dropped and it goes to the primary.
    pub fn to_primary(&self) -> bool {
        self.verdict == Verdict::ToPrimary
    }

    /// The answer may be stored: the replica had replayed past every
    /// change it depends on.
    pub fn may_store(&self, replayed: Option<u64>) -> bool {
        matches!((self.fill_floor, replayed), (Some(floor), Some(r)) if r >= floor)
    }
}

/// A replica's error that the primary may not give: a conflict with
/// recovery or a serialization failure (`40001`), a deadlock (`40P01`), a
/// read-only or hot standby's refusal (`25006`, `0A000`), too many
/// connections (`53300`), shutdown (`57P0x`), a lost connection (`08xxx`),
/// a statement the connection lacks (`26000`: its preparation failed).
fn retried(body: &[u8]) -> bool {
    messages::error_code(body).is_some_and(|code| {
        matches!(
            code,
            "40001" | "40P01" | "25006" | "0A000" | "53300" | "26000"
        ) || code.starts_with("57P0")
            || code.starts_with("08")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut f = vec![tag];
        f.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        f.extend_from_slice(body);
        f
    }

    fn error(code: &str) -> Vec<u8> {
        let mut f = BytesMut::new();
        messages::error_response(&mut f, "ERROR", code, "no");
        f.to_vec()
    }

    /// A replica of a configuration that lists one.
    fn server() -> Arc<Replica> {
        let config = crate::Config::from_toml(
            "[upstream]\nreplicas = [\"postgres://a:1\"]\n",
            "t".as_ref(),
        )
        .expect("config");
        let replicas = crate::replica::Replicas::new(&config, &crate::metrics::Metrics::new())
            .expect("replicas");
        Arc::clone(&replicas.servers[0])
    }

    fn routed(needed: u64, fill_floor: Option<u64>) -> Routed {
        Routed::new(server(), (Bytes::new(), None), needed, fill_floor)
    }

    #[test]
    fn the_probe_reads_the_position_the_replica_replayed_to() {
        let mut leg = ReplicaLeg::new(server());
        assert_eq!(leg.stage(&messages::query("SELECT 1"), None, true), 0);
        assert!(leg.busy());
        assert_eq!(
            crate::protocol::codec::frames(&leg.staged).count(),
            2,
            "the probe, then the read"
        );
        let mut row = 1i16.to_be_bytes().to_vec();
        row.extend_from_slice(&10i32.to_be_bytes());
        row.extend_from_slice(b"0/16B37480");
        leg.probed(&frame(be::ROW_DESCRIPTION, &[0, 0]));
        leg.probed(&frame(be::DATA_ROW, &row));
        assert_eq!(leg.replayed, Some(0x16B3_7480));
    }

    fn cstr(s: &[u8]) -> Vec<u8> {
        let mut v = s.to_vec();
        v.push(0);
        v
    }

    fn statement(sql: &'static [u8], types: &'static [u8]) -> Statement {
        Statement {
            hash: crate::cache::key::sql_hash(sql),
            sql: Bytes::from_static(sql),
            param_types: Bytes::from_static(types),
        }
    }

    #[test]
    fn a_batch_names_the_statement_as_the_replica_has_it_prepared_once() {
        let statement = statement(b"SELECT $1", &[0, 1, 0, 0, 0, 23]);
        let name = replica_name(replica_key(&statement));
        let mut bind = [cstr(b""), cstr(b"s0")].concat();
        bind.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, b'7', 0, 0]);
        let mut request = frame(fe::BIND, &bind);
        request.extend(frame(fe::DESCRIBE, &[&[b'S'][..], &cstr(b"s0")].concat()));
        request.extend(frame(fe::EXECUTE, &[0, 0, 0, 0, 0]));
        request.extend(frame(fe::SYNC, &[]));
        let mut leg = ReplicaLeg::new(server());
        assert_eq!(
            leg.stage(&request, Some(&statement), true),
            1,
            "prepared first"
        );
        assert_eq!(leg.read, ReadState::Sent);
        let tags: Vec<u8> = codec::frames(&leg.staged).map(|f| f[0]).collect();
        assert_eq!(tags, b"QCPSBDES", "probe; Close, Parse, Sync; the batch");
        let frames: Vec<&[u8]> = codec::frames(&leg.staged).collect();
        let parse = extended::parse(&frames[2][HEADER_LEN..]).expect("a Parse");
        assert_eq!(
            (parse.name, parse.query, parse.param_types),
            (&name[..], &b"SELECT $1"[..], &statement.param_types[..])
        );
        let (portal, bound) = extended::bind_names(&frames[4][HEADER_LEN..]).expect("a Bind");
        assert_eq!((portal, bound), (&b""[..], &name[..]));
        assert!(frames[4].ends_with(&bind[4..]), "its parameters unchanged");
        assert_eq!(
            extended::target(&frames[5][HEADER_LEN..]),
            Some((b'S', &name[..]))
        );
        // Prepared now: the next batch goes alone.
        leg.staged.clear();
        assert_eq!(leg.stage(&request, Some(&statement), true), 0);
        let tags: Vec<u8> = codec::frames(&leg.staged).map(|f| f[0]).collect();
        assert_eq!(tags, b"QBDES");
        // Another parameter type is another statement there.
        let other_types = self::statement(b"SELECT $1", &[0, 1, 0, 0, 0, 25]);
        assert_ne!(replica_key(&other_types), replica_key(&statement));
        // Past the limit, the statement least recently used is closed.
        for i in 0..MAX_PREPARED as u128 - 1 {
            leg.prepared.insert(i);
        }
        leg.staged.clear();
        assert_eq!(leg.stage(&request, Some(&statement), true), 0, "used last");
        let other = self::statement(b"SELECT 2", &[0, 0]);
        leg.staged.clear();
        assert_eq!(leg.stage(&request, Some(&other), true), 1);
        assert_eq!(leg.prepared.len(), MAX_PREPARED);
        assert!(!leg.prepared.contains(0), "the oldest went");
        assert!(leg.prepared.contains(replica_key(&statement)));
        let frames: Vec<&[u8]> = codec::frames(&leg.staged).collect();
        let tags: Vec<u8> = frames.iter().map(|f| f[0]).collect();
        assert_eq!(tags, b"QCCPSBDES");
        assert_eq!(
            extended::target(&frames[1][HEADER_LEN..]),
            Some((b'S', &replica_name(0)[..]))
        );
        // A connection of the pool's comes with its own books.
        leg.on_connection(7, ServerStatements::default(), None);
        leg.staged.clear();
        assert_eq!(leg.stage(&request, Some(&statement), true), 1);
        assert_eq!(leg.applied, 7);
    }

    #[test]
    fn what_a_session_saw_is_what_a_replica_must_have_replayed() {
        let mut seen = Observed::default();
        assert_eq!(seen.needed(|_| None), Some(0));
        seen.saw(300);
        seen.saw(200);
        assert_eq!(seen.needed(|_| None), Some(300), "never goes back");
        // A change not placed yet: no replica until a heartbeat after it.
        let hit = Instant::now();
        seen.saw_pending(hit);
        seen.saw_pending(hit + std::time::Duration::from_secs(1));
        assert_eq!(seen.needed(|_| None), None);
        let asked = std::cell::Cell::new(None);
        let placed = seen.needed(|at| {
            asked.set(Some(at));
            Some(250)
        });
        assert_eq!(asked.get(), Some(hit), "the earliest pending instant");
        assert_eq!(placed, Some(300), "placed before what a probe showed");
        seen.saw_pending(hit);
        assert_eq!(seen.needed(|_| Some(400)), Some(400));
        assert_eq!(seen.needed(|_| None), Some(400), "placed once");
    }

    #[test]
    fn a_replica_behind_or_failing_sends_the_read_to_the_primary() {
        let row = frame(be::ROW_DESCRIPTION, &[0, 0]);
        let mut ok = routed(100, Some(50));
        assert!(ok.first_frame(&row, Some(100)));
        assert_eq!(ok.verdict, Verdict::Relayed);
        assert!(ok.may_store(Some(100)));
        let mut behind = routed(100, Some(50));
        assert!(
            !behind.first_frame(&row, Some(99)),
            "behind what the session needs"
        );
        assert!(behind.to_primary());
        let mut unknown = routed(0, None);
        assert!(!unknown.first_frame(&row, None), "the probe did not answer");
        for (code, retry) in [
            ("40001", true),
            ("40P01", true),
            ("25006", true),
            ("0A000", true),
            ("53300", true),
            ("57P01", true),
            ("08006", true),
            ("26000", true),
            ("42P01", false),
            ("22012", false),
        ] {
            let mut r = routed(0, None);
            assert_eq!(!r.first_frame(&error(code), Some(1)), retry, "{code}");
        }
        // Stored only past every change it depends on.
        let r = routed(0, Some(200));
        assert!(!r.may_store(Some(199)));
        assert!(r.may_store(Some(200)));
        assert!(
            !routed(0, None).may_store(Some(1_000)),
            "a change of unknown position"
        );
    }
}
