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

use std::collections::HashSet;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::known::Statement;
use crate::cache::key;
use crate::protocol::codec::{self, HEADER_LEN, frame_of};
use crate::protocol::{backend as be, extended, frontend as fe, messages};
use crate::replica::{Replica, parse_lsn};

/// pgcache's own question to a replica before a read: how far it has
/// replayed. Sent in the same write as the read, so the answer holds for
/// the read's snapshot, which can only be later.
pub(super) const PROBE: &str = "SELECT pg_catalog.pg_last_wal_replay_lsn()::text";

/// Statements kept prepared on one replica connection.
pub(super) const MAX_PREPARED: usize = 256;

/// The session's connection to a replica, as the engine sees it.
pub(super) struct ReplicaLeg {
    pub server: Arc<Replica>,
    /// The id of the client state applied on the connection; `None`: a
    /// new connection, with nothing applied.
    pub applied: Option<u64>,
    /// Frames for it, written by the driver.
    pub staged: BytesMut,
    /// A read is in flight there.
    pub busy: bool,
    /// What the probe before the read in flight answered.
    pub replayed: Option<u64>,
    /// The statements prepared on the connection, by their names there
    /// ([`replica_name`]).
    pub prepared: HashSet<Bytes>,
}

impl ReplicaLeg {
    pub fn new(server: Arc<Replica>) -> Self {
        Self {
            server,
            applied: None,
            staged: BytesMut::new(),
            busy: false,
            replayed: None,
            prepared: HashSet::new(),
        }
    }

    /// A new connection, or one whose statements are in doubt: nothing is
    /// applied there, and statements are prepared again.
    pub fn reset(&mut self) {
        self.applied = None;
        self.prepared.clear();
    }

    /// The session's leg to `server` in `slot` (a new one if it had
    /// another), with `request` staged there behind the probe, as an
    /// extended batch for `statement` if one is given: how many requests
    /// of pgcache's own follow the probe ([`Self::stage_batch`]).
    pub fn stage_on(
        slot: &mut Option<Box<ReplicaLeg>>,
        server: &Arc<Replica>,
        request: &[u8],
        statement: Option<&Statement>,
    ) -> usize {
        if slot
            .as_ref()
            .is_some_and(|leg| !Arc::ptr_eq(&leg.server, server))
        {
            *slot = None;
        }
        let leg = slot.get_or_insert_with(|| Box::new(ReplicaLeg::new(Arc::clone(server))));
        match statement {
            None => {
                leg.stage(request);
                0
            }
            Some(statement) => leg.stage_batch(request, statement),
        }
    }

    /// Stages the probe and `request` for the replica.
    pub fn stage(&mut self, request: &[u8]) {
        self.staged.extend_from_slice(&messages::query(PROBE));
        self.staged.extend_from_slice(request);
        self.busy = true;
        self.replayed = None;
    }

    /// Stages the probe and an extended batch, `request` (Bind, Describe,
    /// Execute and Sync, without the client's Parse), naming `statement`
    /// as the replica knows it; prepared there first, behind a Close of
    /// its name and with a Sync of its own, unless the connection has it.
    /// Returns how many requests of pgcache's own it staged after the
    /// probe (their answers are pgcache's): at most [`MAX_PREPARED`]
    /// statements are kept there, then all are deallocated.
    pub fn stage_batch(&mut self, request: &[u8], statement: &Statement) -> usize {
        let name = replica_name(statement);
        self.staged.extend_from_slice(&messages::query(PROBE));
        let mut own = 0;
        if self.prepared.len() >= MAX_PREPARED && !self.prepared.contains(&name) {
            self.staged
                .extend_from_slice(&messages::query("DEALLOCATE ALL"));
            self.prepared.clear();
            own += 1;
        }
        if self.prepared.insert(name.clone()) {
            own += 1;
            let target = [fe::TARGET_STATEMENT];
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
        self.busy = true;
        self.replayed = None;
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

/// A statement's name on replica connections, made from its text and
/// parameter types: one name there always means one statement, whatever
/// the client named it and however often it named another the same.
pub(super) fn replica_name(statement: &Statement) -> Bytes {
    let types = key::sql_hash(&statement.param_types) as u32;
    Bytes::from(format!("pgcache_r{:032x}{types:08x}", statement.hash))
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

/// The book of a read routed to a replica, kept with its request in flight.
pub(super) struct Routed {
    pub server: Arc<Replica>,
    /// The request, sent to the primary if the replica cannot answer it.
    pub request: Bytes,
    /// The position the session needs the replica at.
    pub needed: u64,
    /// The position the replica must have replayed past for the answer to
    /// be stored; `None`: it is not stored.
    pub fill_floor: Option<u64>,
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
    pub fn new(server: Arc<Replica>, request: Bytes, needed: u64, fill_floor: Option<u64>) -> Self {
        Self {
            server,
            request,
            needed,
            fill_floor,
            verdict: Verdict::Awaited,
        }
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
        Routed::new(server(), Bytes::new(), needed, fill_floor)
    }

    #[test]
    fn the_probe_reads_the_position_the_replica_replayed_to() {
        let mut leg = ReplicaLeg::new(server());
        leg.stage(&messages::query("SELECT 1"));
        assert!(leg.busy);
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

    #[test]
    fn a_batch_names_the_statement_as_the_replica_has_it_prepared_once() {
        let statement = Statement {
            hash: key::sql_hash(b"SELECT $1"),
            sql: Bytes::from_static(b"SELECT $1"),
            param_types: Bytes::from_static(&[0, 1, 0, 0, 0, 23]),
        };
        let name = replica_name(&statement);
        let mut bind = [cstr(b""), cstr(b"s0")].concat();
        bind.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 1, b'7', 0, 0]);
        let mut request = frame(fe::BIND, &bind);
        request.extend(frame(fe::DESCRIBE, &[&[b'S'][..], &cstr(b"s0")].concat()));
        request.extend(frame(fe::EXECUTE, &[0, 0, 0, 0, 0]));
        request.extend(frame(fe::SYNC, &[]));
        let mut leg = ReplicaLeg::new(server());
        assert_eq!(leg.stage_batch(&request, &statement), 1, "prepared first");
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
        assert_eq!(leg.stage_batch(&request, &statement), 0);
        let tags: Vec<u8> = codec::frames(&leg.staged).map(|f| f[0]).collect();
        assert_eq!(tags, b"QBDES");
        // Past the limit, every statement is deallocated first.
        for i in 0..MAX_PREPARED {
            leg.prepared.insert(Bytes::from(format!("other{i}")));
        }
        let other = Statement {
            hash: key::sql_hash(b"SELECT 2"),
            sql: Bytes::from_static(b"SELECT 2"),
            param_types: Bytes::from_static(&[0, 0]),
        };
        leg.staged.clear();
        assert_eq!(leg.stage_batch(&request, &other), 2);
        assert_eq!(leg.prepared.len(), 1);
        let tags: Vec<u8> = codec::frames(&leg.staged).map(|f| f[0]).collect();
        assert_eq!(tags, b"QQCPSBDES");
        assert_ne!(replica_name(&other), name);
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
