//! The replication stream's events, decoded: pgoutput changes become
//! version bumps, transaction by transaction; the DDL event trigger's
//! messages name what a transaction changed; heartbeats coming back renew
//! the staleness lease.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pgwire_replication::ReplicationEvent;
use tracing::{debug, warn};

use super::DDL_MESSAGE_PREFIX;
use super::control::ObjectAddress;
use super::heartbeat::{HEARTBEAT_PREFIX, Heartbeats};
use super::pgoutput::{self, Change};
use crate::cache::rowkey::{Canonical, stripe};
use crate::cache::{Bumps, DbState, Ddl};

/// What one replication event asks of the stream.
#[derive(Default)]
pub(super) struct Step {
    /// Acknowledge this LSN as applied.
    pub(super) ack: Option<pgwire_replication::Lsn>,
    pub(super) bumps: Bumps,
    /// A transaction that ran DDL committed: its xid and what it changed.
    pub(super) ddl_committed: Option<(u32, Announced)>,
    /// A transaction whose DDL this instance's session handled committed.
    pub(super) ddl_handled: bool,
    /// A heartbeat of this instance came back: when it was sent, and its
    /// position (every change committed before it is applied once this
    /// step is handled).
    pub(super) beat: Option<(std::time::Instant, u64)>,
}

/// What the event trigger's messages of one transaction announced.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Announced {
    /// Names of what was dropped (or anything).
    pub(super) names: Ddl,
    /// Objects created or altered, to be named once the transaction is
    /// visible.
    pub(super) objects: Vec<ObjectAddress>,
    /// The pgcache instance whose session sent the DDL, if one did.
    pub(super) origin: Option<u64>,
    /// The trigger took a table out of the publication (named in `names`).
    pub(super) unpublished: bool,
    /// The trigger left out the objects a command created or altered (for
    /// the instance whose session sent it, which needs none).
    pub(super) omitted: bool,
}

impl Announced {
    fn is_empty(&self) -> bool {
        self.names.is_none() && self.objects.is_empty()
    }

    /// What `other` changed as well. Its marks (origin, unpublished,
    /// omitted) were acted on when its message arrived
    /// ([`Decoder::on_ddl`]): they do not carry over.
    fn merge(&mut self, other: Announced) {
        self.names.merge(&other.names);
        self.objects.extend(other.objects);
    }

    /// Whether instance `instance`'s own session sent the DDL, and so
    /// handled it already: it forgot what its statement's analysis names
    /// once the transaction was visible (its ReadyForQuery), before its
    /// client heard of it. What the message names (objects dropped, with
    /// those a CASCADE took) is still forgotten as it arrives; the round
    /// after DDL is left out. Not when the trigger took a table out of the
    /// publication (the round records it and forgets it once visible), nor
    /// for anything (the trigger could not say what changed).
    fn handled_by(&self, instance: u64) -> bool {
        self.origin == Some(instance) && !self.unpublished && self.names != Ddl::All
    }
}

/// DDL transactions committed and not yet handled, taken together: the
/// stream names what they changed and checks the publication once for all
/// of them.
#[derive(Debug, Default)]
pub(super) struct Committed {
    pub(super) xids: Vec<u32>,
    pub(super) announced: Announced,
}

impl Committed {
    pub(super) fn add(&mut self, (xid, announced): (u32, Announced)) {
        self.xids.push(xid);
        self.announced.merge(announced);
    }
}

/// Past this many distinct row stripes of one table in one transaction,
/// it is taken as a change of the whole table.
const MAX_STRIPES: usize = 256;

/// What one transaction changed of one relation.
#[derive(Debug, Default)]
struct Touched {
    /// The stripes of the rows it changed, under the relation's identity
    /// signature; `None`: the whole table.
    stripes: Option<(u64, HashSet<usize>)>,
}

impl Touched {
    /// A change of rows `keys` (`None`: not known) under `key`.
    fn rows(&mut self, key: &pgoutput::Key, keys: Option<Vec<Vec<Canonical>>>, first: bool) {
        let (pgoutput::Key::Columns { signature, .. }, Some(keys)) = (key, keys) else {
            self.stripes = None;
            return;
        };
        if first {
            self.stripes = Some((*signature, HashSet::new()));
        }
        let Some((sig, stripes)) = &mut self.stripes else {
            return;
        };
        if sig != signature {
            self.stripes = None;
            return;
        }
        stripes.extend(keys.iter().map(|k| stripe(*signature, k)));
        if stripes.len() > MAX_STRIPES {
            self.stripes = None;
        }
    }
}

/// Turns pgoutput events into version bumps, transaction by transaction,
/// notes heartbeats coming back, and keeps the byte lag.
pub(super) struct Decoder {
    beats: Arc<Heartbeats>,
    /// Each relation's name and key, as its Relation message said.
    relations: HashMap<u32, (String, pgoutput::Key)>,
    touched: HashMap<u32, Touched>,
    in_transaction: bool,
    current_xid: u32,
    /// The current transaction's DDL, as its messages announce it.
    ddl: Announced,
    /// The current transaction ran DDL a session of this instance handled.
    ddl_handled: bool,
    /// Server WAL position seen and position applied, for the byte lag.
    server_lsn: u64,
    applied_lsn: u64,
}

impl Decoder {
    pub(super) fn new(beats: Arc<Heartbeats>) -> Self {
        Self {
            beats,
            relations: HashMap::new(),
            touched: HashMap::new(),
            in_transaction: false,
            current_xid: 0,
            ddl: Announced::default(),
            ddl_handled: false,
            server_lsn: 0,
            applied_lsn: 0,
        }
    }

    /// `None`: the stream ended.
    pub(super) fn on_event(&mut self, db: &DbState, event: ReplicationEvent) -> Option<Step> {
        let mut step = Step::default();
        match event {
            ReplicationEvent::Begin { xid, .. } => {
                self.in_transaction = true;
                self.current_xid = xid;
                self.touched.clear();
            }
            ReplicationEvent::XLogData { data, wal_end, .. } => {
                self.server_lsn = self.server_lsn.max(wal_end.0);
                self.on_change(&db.name, &data);
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.in_transaction = false;
                for (oid, touched) in self.touched.drain() {
                    match self.relations.get(&oid) {
                        Some((name, _)) => {
                            let rows = touched.stripes.as_ref().map(|(sig, stripes)| {
                                (*sig, stripes.iter().copied().collect::<Vec<_>>())
                            });
                            let rows = rows.as_ref().map(|(sig, s)| (*sig, s.as_slice()));
                            db.relation_changed(name, rows, &mut step.bumps)
                        }
                        // A change without its Relation message cannot be
                        // attributed: assume anything changed.
                        None => step.bumps.epoch = true,
                    }
                }
                step.ack = Some(end_lsn);
                if !step.bumps.is_empty() {
                    step.bumps.lsn = Some(end_lsn.0);
                }
                self.applied_lsn = self.applied_lsn.max(end_lsn.0);
                self.server_lsn = self.server_lsn.max(end_lsn.0);
            }
            ReplicationEvent::Message {
                prefix,
                content,
                lsn,
                ..
            } if prefix == HEARTBEAT_PREFIX => {
                // Delivered in commit order: everything committed before
                // it was sent is applied once the stream has handled this
                // step (DDL waiting for a heartbeat included).
                if let Some(sent) = self.beats.back(&content) {
                    step.beat = Some((sent, lsn.0));
                }
            }
            ReplicationEvent::Message {
                prefix, content, ..
            } if prefix == DDL_MESSAGE_PREFIX => {
                let announced = ddl_message(&content);
                debug!(database = %db.name, ?announced, "DDL seen in the stream");
                step.bumps = self.on_ddl(announced);
            }
            ReplicationEvent::Message { lsn, .. } => step.ack = Some(lsn),
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.server_lsn = self.server_lsn.max(wal_end.0);
                if !self.in_transaction {
                    // Idle and told where WAL ends: caught up.
                    step.ack = Some(wal_end);
                    self.applied_lsn = self.applied_lsn.max(wal_end.0);
                }
            }
            ReplicationEvent::StoppedAt { .. } => return None,
        }
        db.stream
            .set_lag_bytes(self.server_lsn.saturating_sub(self.applied_lsn));
        db.stream.set_applied_lsn(self.applied_lsn);
        if !self.in_transaction && !self.ddl.is_empty() {
            step.ddl_committed = Some((self.current_xid, std::mem::take(&mut self.ddl)));
        }
        if !self.in_transaction {
            step.ddl_handled = std::mem::take(&mut self.ddl_handled);
        }
        Some(step)
    }

    /// A DDL message: what it names is forgotten at once (the bumps
    /// returned); the rest once the transaction is visible and its objects
    /// named, unless this instance's session sent it.
    fn on_ddl(&mut self, mut announced: Announced) -> Bumps {
        if announced.handled_by(self.beats.instance()) {
            self.ddl_handled = true;
            return match announced.names.changes_facts() {
                true => Bumps::ddl(announced.names),
                false => Bumps::default(),
            };
        }
        if announced.omitted {
            // Meant for another instance: what changed is unknown here.
            announced.names = Ddl::All;
        }
        let bumps = Bumps::ddl(announced.names.clone());
        self.ddl.merge(announced);
        bumps
    }

    fn on_change(&mut self, database: &str, data: &[u8]) {
        match pgoutput::decode(data) {
            Some(Change::Relation { oid, name, key, .. }) => {
                self.relations.insert(oid, (name, key));
            }
            Some(Change::Row { oid, tuples }) => {
                let first = !self.touched.contains_key(&oid);
                let touched = self.touched.entry(oid).or_default();
                match self.relations.get(&oid) {
                    Some((_, key)) => touched.rows(key, pgoutput::row_keys(&tuples, key), first),
                    None => touched.stripes = None,
                }
            }
            Some(Change::Truncate { oids }) => {
                for oid in oids {
                    self.touched.insert(oid, Touched::default());
                }
            }
            Some(Change::Other) => {}
            None => warn!(database, "malformed pgoutput message ignored"),
        }
    }
}

/// What the event trigger's message says a DDL command changed: a first
/// line of its tag, ` -` if the trigger took a table out of the
/// publication, ` ~` if it left out the objects a command created or
/// altered, and ` !` and the (hex) instance whose session sent it;
/// then one line per thing: a bare name, `@classid,objid,objsubid` for an
/// object to name later, `*` for anything. A message with nothing after
/// its first line (an older trigger) changed anything. Marks go on the
/// first line, where a command tag cannot be mistaken for them: a name
/// can begin with anything.
fn ddl_message(content: &[u8]) -> Announced {
    let text = String::from_utf8_lossy(content);
    let mut announced = Announced::default();
    let mut lines = text.split('\n');
    for mark in lines.next().unwrap_or_default().split(' ') {
        if mark == "-" {
            announced.unpublished = true;
        } else if mark == "~" {
            announced.omitted = true;
        } else if let Some(origin) = mark.strip_prefix('!') {
            announced.origin = u64::from_str_radix(origin, 16).ok();
        }
    }
    let mut lines = lines.peekable();
    if lines.peek().is_none() {
        announced.names = Ddl::All;
        return announced;
    }
    let mut names: Vec<&str> = Vec::new();
    for line in lines.filter(|l| !l.is_empty()) {
        if line == "*" {
            announced.names = Ddl::All;
            return announced;
        }
        match line.strip_prefix('@') {
            Some(address) => match parse_address(address) {
                Some(object) => announced.objects.push(object),
                None => {
                    announced.names = Ddl::All;
                    return announced;
                }
            },
            None => names.push(line),
        }
    }
    names.sort_unstable();
    names.dedup();
    announced.names = Ddl::objects(names);
    announced
}

fn parse_address(text: &str) -> Option<ObjectAddress> {
    let mut parts = text.split(',');
    let address = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    parts.next().is_none().then_some(address)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddl_messages_name_what_changed() {
        let names = |text: &[u8]| ddl_message(text).names;
        assert_eq!(names(b"DROP TABLE\nt"), Ddl::objects(["t"]));
        assert_eq!(names(b"DROP TABLE\nu\nt\nu\n"), Ddl::objects(["t", "u"]));
        assert_eq!(names(b"CREATE INDEX\n"), Ddl::objects(Vec::<String>::new()));
        assert_eq!(names(b"DROP SCHEMA\ns\n*"), Ddl::All);
        assert_eq!(names(b"CREATE TABLE"), Ddl::All, "an older trigger");
        assert_eq!(
            ddl_message(b"CREATE TABLE\n@1259,16384,0\n@2606,16390,0"),
            Announced {
                names: Ddl::objects(Vec::<String>::new()),
                objects: vec![(1259, 16384, 0), (2606, 16390, 0)],
                ..Announced::default()
            }
        );
        assert_eq!(names(b"ALTER TABLE\n@1259,x,0"), Ddl::All, "unreadable");
    }

    #[test]
    fn ddl_an_instance_sent_itself_needs_no_round_there() {
        let ours = 0x2a;
        let created = ddl_message(b"CREATE TABLE !000000000000002a\n@1259,16384,0");
        assert_eq!(created.origin, Some(ours));
        assert!(created.handled_by(ours));
        assert!(!created.handled_by(0x2b), "another instance names it");
        assert!(!ddl_message(b"CREATE TABLE\n@1259,16384,0").handled_by(ours));
        let dropped = ddl_message(b"DROP TABLE !2a\nt\n!v\n-w");
        assert_eq!(
            dropped.names,
            Ddl::objects(["!v", "-w", "t"]),
            "names are any text"
        );
        assert!(dropped.handled_by(ours));
        // A table the trigger took out of the publication: recorded by a
        // round, and forgotten once the transaction is visible.
        let unpublished = ddl_message(b"DROP INDEX - !2a\nt_id\nt");
        assert!(unpublished.unpublished);
        assert_eq!(unpublished.names, Ddl::objects(["t", "t_id"]));
        assert!(!unpublished.handled_by(ours));
        assert!(!ddl_message(b"DROP SCHEMA !2a\ns\n*").handled_by(ours));
        assert!(!ddl_message(b"CREATE TABLE !zz\n@1259,16384,0").handled_by(ours));
        assert!(
            !ddl_message(b"CREATE TABLE !2a").handled_by(ours),
            "an older trigger's"
        );
        // The objects left out, as when no other instance streamed.
        let alone = ddl_message(b"CREATE TABLE ~ !2a\n");
        assert!(alone.omitted && alone.objects.is_empty());
        assert!(alone.handled_by(ours));
        assert_eq!(alone.names, Ddl::objects(Vec::<String>::new()));
    }

    #[test]
    fn ddl_transactions_committed_together_are_handled_as_one() {
        let mut committed = Committed::default();
        committed.add((7, ddl_message(b"DROP TABLE\nt")));
        committed.add((9, ddl_message(b"CREATE TABLE\n@1259,16384,0")));
        committed.add((12, ddl_message(b"DROP TABLE\nu")));
        assert_eq!(committed.xids, [7, 9, 12]);
        assert_eq!(
            committed.announced,
            Announced {
                names: Ddl::objects(["t", "u"]),
                objects: vec![(1259, 16384, 0)],
                ..Announced::default()
            }
        );
        committed.add((13, ddl_message(b"DROP SCHEMA\ns\n*")));
        assert_eq!(committed.announced.names, Ddl::All);
    }
}
