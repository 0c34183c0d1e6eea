//! Extended-protocol messages held until Sync, so that a batch of the shape
//! drivers send for one query can be answered from the cache, Sync and all.
//! The query is read out of the held frames at Sync
//! ([`Batch::single_query`]), or out of the read buffer where a whole batch
//! came in one read ([`WholeBatch`]), and decided the same way from the
//! one view of it ([`OneQuery`]); a batch that cannot be held any longer is
//! forwarded and the rest of it goes straight through.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::known::Statement;
use super::plan::Plan;
use crate::cache::key::{self, KeyBuilder, RequestKey};
use crate::cache::rowkey::Bound;
use crate::classify::{BypassReason, is_time_literal_text};
use crate::protocol::codec::{HEADER_LEN, checked_frames};
use crate::protocol::extended;
use crate::protocol::frontend as fe;

const MAX_HELD_MESSAGES: usize = 8;
const MAX_HELD_BYTES: usize = 256 * 1024;

/// Reused from batch to batch, so its buffers keep their memory.
#[derive(Default)]
pub(super) struct Batch {
    raw: BytesMut,
    /// Tags (and Describe kinds) of the held messages, for the key.
    shape: Vec<u8>,
    /// The held messages; boxed, and given up while the session idles
    /// ([`Batch::release_memory`]), as most sessions hold none most of the
    /// time.
    held: Option<Box<Held>>,
    /// Part of the batch already went to the backend: nothing more is held.
    pub forwarded: bool,
    /// What the batch's statements change, applied at its ReadyForQuery.
    pub effects: crate::cache::Bumps,
    /// What a run of the portal the last Bind made moves, worked out at
    /// the Bind from its parameters for a keyed write: the portal, the
    /// plan (to be the one its Execute finds), and the bumps. See
    /// [`crate::session::keyed`].
    pub bound: Option<(Bytes, Arc<Plan>, crate::cache::Bumps)>,
    /// Statements the batch defines: forgotten if it fails.
    pub parsed: Vec<Bytes>,
}

/// The messages a batch holds, one of each kind.
#[derive(Default)]
struct Held {
    /// The held Parse: (statement name, frame).
    parse: Option<(Bytes, Bytes)>,
    bind: Option<Bytes>,
    describe: Option<(u8, Bytes)>,
    /// The held Execute: its portal, row limit and the plan of the
    /// statement it runs.
    execute: Option<(Bytes, i32, Arc<Plan>)>,
    /// Where the held Execute frame is in `raw`.
    execute_at: Option<std::ops::Range<usize>>,
}

/// The one query of a batch of the shape drivers send for one, `[Parse]
/// Bind [Describe] Execute` on the unnamed portal, read where its frames
/// are: held ([`Batch::single_query`]) or whole in the client's read
/// buffer ([`WholeBatch::query`]). Either way it is decided by the one
/// function that makes its key.
pub(super) struct OneQuery<'a> {
    pub bind_body: &'a [u8],
    /// The Describe's kind and name, if the batch has one.
    pub describe: Option<(u8, &'a [u8])>,
    /// The Execute's portal and row limit.
    pub execute: (&'a [u8], i32),
    /// The tags (and Describe kind) of the batch's frames, for the key.
    pub shape: &'a [u8],
}

impl<'a> OneQuery<'a> {
    /// The statement the Bind names, if the frames run one query: the
    /// unnamed portal bound and run, a Describe of what the Bind made.
    pub fn statement(&self) -> Result<&'a [u8], BypassReason> {
        let (portal, statement) =
            extended::bind_names(self.bind_body).ok_or(BypassReason::UnsupportedShape)?;
        let describe_ok = self
            .describe
            .is_none_or(|(kind, name)| describes_the_bound(kind, name, portal, statement));
        match portal.is_empty() && self.execute.0 == portal && describe_ok {
            true => Ok(statement),
            false => Err(BypassReason::UnsupportedShape),
        }
    }

    /// The Execute's row limit; 0: none (PostgreSQL takes zero or less as
    /// no limit).
    pub fn row_limit(&self) -> u32 {
        self.execute.1.max(0) as u32
    }
}

/// The most tags (and Describe kinds) a batch holds.
const MAX_SHAPE: usize = MAX_HELD_MESSAGES + 1;

/// A held batch's one query, its frames' parts taken out of the batch (so
/// that the engine may decide while the batch stays held), with the plan
/// its Execute found.
pub(super) struct SingleQuery {
    bind_frame: Bytes,
    describe: Option<(u8, Bytes)>,
    portal: Bytes,
    max_rows: i32,
    shape: ([u8; MAX_SHAPE], usize),
    pub plan: Arc<Plan>,
}

impl SingleQuery {
    pub fn view(&self) -> OneQuery<'_> {
        OneQuery {
            bind_body: &self.bind_frame[HEADER_LEN..],
            describe: self
                .describe
                .as_ref()
                .map(|(kind, name)| (*kind, &name[..])),
            execute: (&self.portal, self.max_rows),
            shape: &self.shape.0[..self.shape.1],
        }
    }
}

/// A Describe of `kind` and `name` asks about what the Bind made: its
/// portal, or the statement it bound.
pub(super) fn describes_the_bound(kind: u8, name: &[u8], portal: &[u8], statement: &[u8]) -> bool {
    match kind {
        fe::TARGET_PORTAL => name == portal,
        _ => name == statement,
    }
}

/// A driver's one-query batch found whole at the start of the client's
/// read buffer: `Bind [Describe] Execute Sync`, what every run of a
/// prepared statement sends. The read buffer itself holds it while the
/// cache decides ([`Engine::whole_batch`](super::engine::Engine::whole_batch)): no
/// frame is split off, dispatched or copied into [`Batch`] one by one.
pub(super) struct WholeBatch {
    /// Where each frame ends: Bind, Describe (if any), Execute, Sync.
    bind_end: usize,
    describe_end: Option<usize>,
    execute_end: usize,
    pub len: usize,
}

impl WholeBatch {
    /// The batch at the start of `buf`, if it is whole there; frames past
    /// `max_frame` or malformed headers are left to the frame-by-frame
    /// path, which reports them.
    pub fn at_start(buf: &[u8], max_frame: usize) -> Option<Self> {
        if buf.first() != Some(&fe::BIND) {
            return None;
        }
        // Each frame's tag and where it ends.
        let mut frames =
            checked_frames(buf, max_frame)
                .map_while(Result::ok)
                .scan(0, |end, frame| {
                    *end += frame.len();
                    Some((frame[0], *end))
                });
        let (_, bind_end) = frames.next()?;
        let (mut tag, mut end) = frames.next()?;
        let describe_end = if tag == fe::DESCRIBE {
            let describe_end = end;
            (tag, end) = frames.next()?;
            Some(describe_end)
        } else {
            None
        };
        let execute_end = end;
        if tag != fe::EXECUTE {
            return None;
        }
        let (tag, len) = frames.next()?;
        (tag == fe::SYNC && len <= MAX_HELD_BYTES).then_some(Self {
            bind_end,
            describe_end,
            execute_end,
            len,
        })
    }

    /// The batch's one query, read in `buf` (`tags` holds its shape);
    /// `None` if a frame is malformed, for the frame-by-frame path to
    /// report.
    pub fn query<'a>(&self, buf: &'a [u8], tags: &'a mut [u8; 4]) -> Option<OneQuery<'a>> {
        let describe = match self.describe_end {
            Some(end) => Some(extended::target(&buf[self.bind_end + HEADER_LEN..end])?),
            None => None,
        };
        let execute_start = self.describe_end.unwrap_or(self.bind_end);
        let execute = extended::execute(&buf[execute_start + HEADER_LEN..self.execute_end])?;
        *tags = [fe::BIND, fe::DESCRIBE, 0, fe::EXECUTE];
        let shape: &'a [u8] = match describe {
            Some((kind, _)) => {
                tags[2] = kind;
                &tags[..]
            }
            None => {
                tags[1] = fe::EXECUTE;
                &tags[..2]
            }
        };
        Some(OneQuery {
            bind_body: &buf[HEADER_LEN..self.bind_end],
            describe,
            execute,
            shape,
        })
    }
}

impl Batch {
    pub fn holds(&self) -> bool {
        !self.shape.is_empty()
    }

    /// Whether another frame of `len` bytes may be held.
    pub fn has_room(&self, len: usize) -> bool {
        !self.forwarded
            && self.shape.len() < MAX_HELD_MESSAGES
            && self.raw.len() + len <= MAX_HELD_BYTES
    }

    pub fn holds_tag(&self, tag: u8) -> bool {
        let Some(held) = &self.held else {
            return !matches!(tag, fe::PARSE | fe::BIND | fe::DESCRIBE | fe::EXECUTE);
        };
        match tag {
            fe::PARSE => held.parse.is_some(),
            fe::BIND => held.bind.is_some(),
            fe::DESCRIBE => held.describe.is_some(),
            fe::EXECUTE => held.execute.is_some(),
            _ => true,
        }
    }

    fn held(&mut self) -> &mut Held {
        self.held.get_or_insert_with(Box::default)
    }

    pub fn hold_parse(&mut self, name: Bytes, frame: &Bytes) {
        self.held().parse = Some((name, frame.clone()));
        self.hold(frame);
    }

    /// Takes the held Parse out: (statement name, frame).
    pub fn take_parse(&mut self) -> Option<(Bytes, Bytes)> {
        self.held.as_mut().and_then(|h| h.parse.take())
    }

    pub fn hold_bind(&mut self, frame: &Bytes) {
        self.held().bind = Some(frame.clone());
        self.hold(frame);
    }

    pub fn hold_describe(&mut self, kind: u8, name: Bytes, frame: &Bytes) {
        self.held().describe = Some((kind, name));
        self.hold(frame);
        self.shape.push(kind);
    }

    pub fn hold_execute(&mut self, portal: Bytes, max_rows: i32, plan: Arc<Plan>, frame: &Bytes) {
        let at = self.raw.len()..self.raw.len() + frame.len();
        let held = self.held();
        held.execute = Some((portal, max_rows, plan));
        held.execute_at = Some(at);
        self.hold(frame);
    }

    /// Where the held Execute frame is in the frames [`Batch::release`]
    /// returns.
    pub fn execute_at(&self) -> Option<std::ops::Range<usize>> {
        self.held.as_ref().and_then(|h| h.execute_at.clone())
    }

    fn hold(&mut self, frame: &Bytes) {
        self.raw.extend_from_slice(frame);
        self.shape.push(frame[0]);
    }

    /// Takes the held frames out, to forward them: from now on the batch
    /// holds nothing more. The buffer comes back with [`Batch::give_back`].
    pub fn release(&mut self) -> Option<BytesMut> {
        let raw = (!self.raw.is_empty()).then(|| std::mem::take(&mut self.raw));
        if self.holds() {
            self.forwarded = true;
        }
        raw
    }

    /// Gives back the memory of batches past while nothing is held.
    pub fn release_memory(&mut self) {
        if !self.holds() {
            *self = Batch::default();
        }
    }

    /// Returns the buffer [`Batch::release`] took, emptied, for reuse.
    pub fn give_back(&mut self, mut raw: BytesMut) {
        raw.clear();
        self.raw = raw;
    }

    /// Ends the batch; returns its effects and the statements it parsed.
    /// An Execute of `portal` under `plan`: its effects join the batch's,
    /// by the rows the last Bind named if it made that portal.
    pub fn executed(&mut self, portal: &[u8], plan: &Arc<Plan>) {
        match self.bound.take() {
            Some((bound, planned, effects)) if bound == portal && Arc::ptr_eq(&planned, plan) => {
                self.effects.merge(&effects)
            }
            _ => self.effects.merge(&plan.effects),
        }
    }

    pub fn reset(&mut self) -> (crate::cache::Bumps, Vec<Bytes>) {
        self.raw.clear();
        self.shape.clear();
        if let Some(held) = &mut self.held {
            **held = Held::default();
        }
        self.forwarded = false;
        self.bound = None;
        (
            std::mem::take(&mut self.effects),
            std::mem::take(&mut self.parsed),
        )
    }

    /// The batch's query, if it holds a Bind and an Execute: whether they
    /// run one query is [`OneQuery::statement`]'s to say.
    pub fn single_query(&self) -> Result<SingleQuery, BypassReason> {
        let Some(held) = &self.held else {
            return Err(BypassReason::UnsupportedShape);
        };
        let (Some(bind_frame), Some((portal, max_rows, plan))) = (&held.bind, &held.execute) else {
            return Err(BypassReason::UnsupportedShape);
        };
        let mut shape = [0; MAX_SHAPE];
        shape[..self.shape.len()].copy_from_slice(&self.shape);
        Ok(SingleQuery {
            bind_frame: bind_frame.clone(),
            describe: held.describe.clone(),
            portal: portal.clone(),
            max_rows: *max_rows,
            shape: (shape, self.shape.len()),
            plan: Arc::clone(plan),
        })
    }
}

/// Whether a text-format parameter of a Bind may be a time literal
/// (`now`, `today`...): its answer changes with the clock. `None` if the
/// Bind is malformed.
pub(super) fn binds_time_literal(body: &[u8]) -> Option<bool> {
    let mut clock = false;
    // The result formats are not needed, only the check that they are whole.
    let _results =
        extended::walk_bind(body, |format, value| clock |= may_tell_time(format, value))?;
    Some(clock)
}

fn may_tell_time(format: i16, value: Option<&[u8]>) -> bool {
    format == 0 && value.is_some_and(|v| v.len() <= 16 && is_time_literal_text(v))
}

/// The key of a bound statement run in a batch of `shape` (the tags and
/// Describe kind of its frames), hashed as its Bind's `body` is read.
/// Refused if a parameter may be a time literal, or the Bind is malformed.
/// With `by_row` (a read by key), the parameters read are kept for its
/// rows' stripes; without, none are (a Bind of many would be a heap
/// allocation for nothing).
/// `text`: the hash of the statement's text as keyed.
pub(super) fn extended_key<'b>(
    (prefix, text): (u128, u128),
    stmt: &Statement,
    shape: &[u8],
    (body, by_row): (&'b [u8], bool),
) -> Result<(RequestKey, Bound<'b>), BypassReason> {
    let mut k = KeyBuilder::new(prefix, key::EXTENDED, text);
    k.bytes(shape).bytes(&stmt.param_types);
    let mut clock = false;
    let mut bound = Bound::default();
    let results = extended::walk_bind(body, |format, value| {
        clock |= may_tell_time(format, value);
        k.u64(format as u64).value(value);
        if by_row {
            bound.push(&stmt.param_types, format, value);
        }
    })
    .ok_or(BypassReason::UnsupportedShape)?;
    if clock {
        return Err(BypassReason::TimeLiteral);
    }
    for f in results {
        k.u64(f as u64);
    }
    // The row limit stays out of the key: a result that completed within
    // one limit is the whole result, for any limit it fits.
    Ok((k.finish(), bound))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::analysis::Analyses;
    use crate::cache::stats::StatsRegistry;
    use crate::cache::versions::Versions;
    use crate::config::CacheConfig;
    use crate::policy::Policy;
    use bytes::BufMut;

    fn frame(tag: u8, body: &[u8]) -> Bytes {
        let mut f = BytesMut::new();
        f.put_u8(tag);
        f.put_u32(body.len() as u32 + 4);
        f.put_slice(body);
        f.freeze()
    }

    fn bind(portal: &str, statement: &str) -> Bytes {
        let mut body = Vec::new();
        body.extend_from_slice(portal.as_bytes());
        body.push(0);
        body.extend_from_slice(statement.as_bytes());
        body.push(0);
        // No parameter formats, no parameters, no result formats.
        body.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        frame(fe::BIND, &body)
    }

    fn plan() -> Arc<Plan> {
        let analyzed = Analyses::new(1).get(1, b"SELECT 1", &StatsRegistry::new(1));
        let policy = Policy::new(&CacheConfig::default(), 1);
        Arc::new(Plan::new(
            &analyzed,
            &Default::default(),
            &Versions::default(),
            0,
            &policy,
        ))
    }

    fn held(portal: &str, describe: Option<(u8, &str)>, max_rows: i32) -> Batch {
        let mut b = Batch::default();
        b.hold_bind(&bind(portal, "s1"));
        if let Some((kind, name)) = describe {
            let f = frame(fe::DESCRIBE, &[&[kind], name.as_bytes(), &[0]].concat());
            b.hold_describe(kind, Bytes::copy_from_slice(name.as_bytes()), &f);
        }
        let exec = frame(
            fe::EXECUTE,
            &[portal.as_bytes(), &[0], &max_rows.to_be_bytes()].concat(),
        );
        b.hold_execute(
            Bytes::copy_from_slice(portal.as_bytes()),
            max_rows,
            plan(),
            &exec,
        );
        b
    }

    #[test]
    fn the_drivers_shape_is_one_query() {
        let b = held("", Some((fe::TARGET_PORTAL, "")), 0);
        let q = b.single_query().unwrap();
        assert_eq!(
            q.view().shape,
            [fe::BIND, fe::DESCRIBE, fe::TARGET_PORTAL, fe::EXECUTE]
        );
        assert_eq!(q.view().statement(), Ok(&b"s1"[..]));
        let one = |b: Batch| b.single_query().unwrap().view().statement().is_ok();
        assert!(one(held("", Some((fe::TARGET_STATEMENT, "s1")), 0)));
        assert!(one(held("", None, 0)));
        let limit = |b: Batch| b.single_query().unwrap().view().row_limit();
        assert_eq!(limit(held("", None, 1)), 1);
        assert_eq!(limit(held("", None, -1)), 0);
    }

    #[test]
    fn other_shapes_are_forwarded() {
        let named_portal = held("p1", None, 0);
        let wrong_describe = held("", Some((fe::TARGET_STATEMENT, "other")), 0);
        for b in [named_portal, wrong_describe] {
            let q = b.single_query().unwrap();
            assert_eq!(q.view().statement(), Err(BypassReason::UnsupportedShape));
        }
        assert_eq!(
            Batch::default().single_query().err(),
            Some(BypassReason::UnsupportedShape)
        );
    }

    #[test]
    fn a_whole_batch_is_found_only_when_all_of_it_is_there() {
        let bind = bind("", "s1");
        let describe = frame(fe::DESCRIBE, b"P\0");
        let execute = frame(fe::EXECUTE, &[0, 0, 0, 0, 0]);
        let sync = frame(fe::SYNC, &[]);
        let whole = [&bind[..], &describe, &execute, &sync].concat();
        let at = WholeBatch::at_start(&whole, 1 << 20).expect("found");
        assert_eq!(at.len, whole.len());
        let mut tags = [0; 4];
        let q = at.query(&whole, &mut tags).expect("well formed");
        assert_eq!(q.bind_body, &bind[HEADER_LEN..]);
        assert_eq!(q.describe, Some((fe::TARGET_PORTAL, &b""[..])));
        assert_eq!(q.execute, (&b""[..], 0));
        assert_eq!(
            q.shape,
            [fe::BIND, fe::DESCRIBE, fe::TARGET_PORTAL, fe::EXECUTE]
        );
        assert_eq!(q.statement(), Ok(&b"s1"[..]));
        // What follows the Sync is left for later.
        let more = [&whole[..], &bind].concat();
        assert_eq!(
            WholeBatch::at_start(&more, 1 << 20).unwrap().len,
            whole.len()
        );
        let bare = [&bind[..], &execute, &sync].concat();
        let at = WholeBatch::at_start(&bare, 1 << 20).expect("no Describe");
        let mut tags = [0; 4];
        let q = at.query(&bare, &mut tags).expect("well formed");
        assert_eq!((q.describe, q.execute), (None, (&b""[..], 0)));
        assert_eq!(q.shape, [fe::BIND, fe::EXECUTE]);

        let parse = frame(fe::PARSE, b"s1\0SELECT 1\0\0\0");
        for (case, buf) in [
            ("cut short", whole[..whole.len() - 1].to_vec()),
            ("no Sync", [&bind[..], &execute].concat()),
            ("a Parse first", [&parse[..], &whole].concat()),
            (
                "two Describes",
                [&bind[..], &describe, &describe, &execute, &sync].concat(),
            ),
            (
                "Flush for Sync",
                [&bind[..], &execute, &frame(fe::FLUSH, &[])].concat(),
            ),
        ] {
            assert!(WholeBatch::at_start(&buf, 1 << 20).is_none(), "{case}");
        }
        // A frame over the limit is the frame-by-frame path's to refuse.
        assert!(WholeBatch::at_start(&whole, 10).is_none());
    }

    #[test]
    fn a_released_batch_holds_nothing_more_until_reset() {
        let mut b = held("", None, 0);
        assert!(b.holds() && b.has_room(10));
        let raw = b.release().expect("frames to forward");
        assert!(raw.starts_with(&[fe::BIND]));
        assert!(b.forwarded && !b.has_room(10));
        b.give_back(raw);
        assert!(b.release().is_none(), "nothing is held twice");
        b.reset();
        assert!(!b.holds() && b.has_room(10));
    }
}
