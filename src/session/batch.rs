//! Extended-protocol messages held until Sync, so that a batch of the shape
//! drivers send for one query can be answered from the cache, Sync and all.
//! The decision is made once, at Sync ([`Batch::single_query`]); a batch
//! that cannot be held any longer is forwarded and the rest of it goes
//! straight through.

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

/// The one query of a held batch: its Bind, plan and row limit.
pub(super) struct SingleQuery {
    bind_frame: Bytes,
    pub plan: Arc<Plan>,
    /// The Execute's row limit; 0: none.
    pub row_limit: u32,
}

impl SingleQuery {
    pub fn bind_body(&self) -> &[u8] {
        &self.bind_frame[HEADER_LEN..]
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
/// cache decides ([`Session::whole_batch`](super::relay::Session::whole_batch)): no
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

    pub fn bind_body<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[HEADER_LEN..self.bind_end]
    }

    pub fn describe_body<'a>(&self, buf: &'a [u8]) -> Option<&'a [u8]> {
        self.describe_end
            .map(|end| &buf[self.bind_end + HEADER_LEN..end])
    }

    pub fn execute_body<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        let start = self.describe_end.unwrap_or(self.bind_end);
        &buf[start + HEADER_LEN..self.execute_end]
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

    /// The tags (and Describe kinds) of what is held.
    pub fn shape(&self) -> &[u8] {
        &self.shape
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

    /// The batch's query, if the batch has the shape drivers send for one:
    /// `[Parse] Bind [Describe] Execute` on the unnamed portal, with the
    /// Describe naming what the Bind names. A row limit is kept for the
    /// lookup ([`crate::cache::Request::row_limit`]).
    pub fn single_query(&self) -> Result<SingleQuery, BypassReason> {
        let Some(held) = &self.held else {
            return Err(BypassReason::UnsupportedShape);
        };
        let (Some(bind_frame), Some((portal, max_rows, plan))) = (&held.bind, &held.execute) else {
            return Err(BypassReason::UnsupportedShape);
        };
        let (bound_portal, statement) = extended::bind_names(&bind_frame[HEADER_LEN..])
            .ok_or(BypassReason::UnsupportedShape)?;
        let describe_ok = held
            .describe
            .as_ref()
            .is_none_or(|(kind, name)| describes_the_bound(*kind, name, bound_portal, statement));
        if !bound_portal.is_empty() || portal.as_ref() != bound_portal || !describe_ok {
            return Err(BypassReason::UnsupportedShape);
        }
        Ok(SingleQuery {
            bind_frame: bind_frame.clone(),
            plan: Arc::clone(plan),
            // PostgreSQL takes zero or less as no limit.
            row_limit: (*max_rows).max(0) as u32,
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
        assert_eq!(
            b.shape(),
            [fe::BIND, fe::DESCRIBE, fe::TARGET_PORTAL, fe::EXECUTE]
        );
        let q = b.single_query().unwrap();
        assert_eq!(extended::bind_names(q.bind_body()).unwrap().1, b"s1");
        assert!(
            held("", Some((fe::TARGET_STATEMENT, "s1")), 0)
                .single_query()
                .is_ok()
        );
        assert!(held("", None, 0).single_query().is_ok());
        assert_eq!(held("", None, 1).single_query().unwrap().row_limit, 1);
        assert_eq!(held("", None, -1).single_query().unwrap().row_limit, 0);
    }

    #[test]
    fn other_shapes_are_forwarded() {
        let named_portal = held("p1", None, 0);
        let wrong_describe = held("", Some((fe::TARGET_STATEMENT, "other")), 0);
        for b in [named_portal, wrong_describe] {
            assert_eq!(b.single_query().err(), Some(BypassReason::UnsupportedShape));
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
        assert_eq!(at.bind_body(&whole), &bind[HEADER_LEN..]);
        assert_eq!(at.describe_body(&whole), Some(&b"P\0"[..]));
        assert_eq!(at.execute_body(&whole), &[0, 0, 0, 0, 0]);
        // What follows the Sync is left for later.
        let more = [&whole[..], &bind].concat();
        assert_eq!(
            WholeBatch::at_start(&more, 1 << 20).unwrap().len,
            whole.len()
        );
        let bare = [&bind[..], &execute, &sync].concat();
        let at = WholeBatch::at_start(&bare, 1 << 20).expect("no Describe");
        assert_eq!(at.describe_body(&bare), None);
        assert_eq!(at.execute_body(&bare), &[0, 0, 0, 0, 0]);

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
