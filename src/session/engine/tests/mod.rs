//! The engine fed in memory: client and backend frames in; what the
//! client and the backend are sent, and what the driver is asked to do,
//! out. No socket, no runtime.

mod auth;
mod backend;
mod batches;
mod client;
mod greeting;
mod hidden;
mod lagging;
pub(crate) mod model;
mod output;
mod pooled;
mod property;
mod regressions;
mod replica_books;
mod timeouts;

use std::sync::Arc;
use std::time::Instant;

use bytes::{BufMut, Bytes, BytesMut};

use super::{Action, Ctx, Engine, Need};
use crate::App;
use crate::cache::Fill;
use crate::cache::catalog::fetch::Lookup;
use crate::pool::clients::ClientEntry;
use crate::protocol::{TxStatus, backend as be, frontend as fe, messages};
use crate::session::capture::Capture;
use crate::session::link::{ClientState, Link};
use crate::session::pipeline::Flow;
use crate::session::pipeline::Inflight;
use crate::session::row_limit::{PORTAL_SUSPENDED, RowCut};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// An engine and what it reads: a pgcache of its own, never started.
struct Rig {
    app: Arc<App>,
    entry: ClientEntry,
    engine: Engine,
    /// What the session's settings query answers (`None`: it fails).
    settings: Option<Vec<Option<String>>>,
    /// How many times the engine asked for them.
    settings_reads: usize,
    /// The time the driver passes; `None`: the clock's.
    clock: Option<Instant>,
}

impl Rig {
    fn new() -> Self {
        let (app, entry) = crate::session::fuzz::unstarted_app("alice", "shop");
        Self::on(app, entry)
    }

    /// A session of alice on shop at `app`, not logged in yet.
    fn on(app: App, entry: ClientEntry) -> Self {
        let engine = crate::session::fuzz::session_engine(&app, "alice", "shop");
        let settings = ["alice", "alice", "read committed", "a=b", "none", "{}"]
            .map(|v| Some(v.to_owned()))
            .to_vec();
        Self {
            app: Arc::new(app),
            entry,
            engine,
            settings: Some(settings),
            settings_reads: 0,
            clock: None,
        }
    }

    /// Another session of the same user and database on the rig's
    /// instance, logged in: it shares the rig's cache, versions and
    /// catalog.
    fn beside(&self) -> Self {
        let app = Arc::clone(&self.app);
        let entry = crate::session::fuzz::arrived(&app, "alice", "shop");
        let engine = crate::session::fuzz::session_engine(&app, "alice", "shop");
        let rig = Self {
            app,
            entry,
            engine,
            settings: self.settings.clone(),
            settings_reads: 0,
            clock: self.clock,
        };
        if self.engine.link.is_pooled() {
            return rig.in_transaction_mode();
        }
        rig.logged_in_now()
    }

    /// The login's ReadyForQuery seen.
    fn logged_in_now(mut self) -> Self {
        let sent = self.backend(&[rfq(TxStatus::Idle)]);
        assert_eq!(sent, rfq(TxStatus::Idle));
        self.engine.actions.clear();
        self
    }

    /// Transaction mode: a pool of the rig's database and user, holding no
    /// connection yet.
    fn pooled() -> Self {
        Self::new().in_transaction_mode()
    }

    /// Logged in in transaction mode: a pool of the rig's database and
    /// user, holding no connection yet; the client told, as PostgreSQL
    /// tells one that gave none, that its `application_name` is empty.
    fn in_transaction_mode(mut self) -> Self {
        let pool = self.app.pool.pooled.pool("shop", "alice");
        let state = ClientState::from_startup(&self.engine.startup).expect("startup");
        self.engine.link = Link::pooled(pool, state);
        if let Link::Pooled(link) = &mut self.engine.link {
            link.told.set("application_name", "");
        }
        let sent = self.backend(&[rfq(TxStatus::Idle)]);
        assert_eq!(sent, rfq(TxStatus::Idle));
        self.engine.actions.clear();
        self
    }

    /// Logged in: the login's ReadyForQuery was seen.
    fn logged_in() -> Self {
        Self::new().logged_in_now()
    }

    /// Feeds the backend's frames; returns the bytes the client is sent.
    fn backend(&mut self, frames: &[Vec<u8>]) -> Vec<u8> {
        let mut buf = BytesMut::new();
        for f in frames {
            buf.extend_from_slice(f);
        }
        let ctx = ctx_at(&self.app, &self.entry, self.clock);
        let relayed = self.engine.on_backend(&ctx, &mut buf).expect("frames");
        assert_eq!(relayed.end, buf.len(), "every complete frame is handled");
        let mut sent = std::mem::take(&mut self.engine.out).to_vec();
        sent.extend_from_slice(&buf[relayed.from..relayed.end]);
        sent
    }

    /// Feeds a client frame as the driver does: what the engine needs is
    /// met (the settings from [`settings`], prerequisites as done) and the
    /// frame fed again. Returns the flow.
    fn client(&mut self, frame: &[u8]) -> Flow {
        self.client_then(frame, |_, _| {})
    }

    /// [`Self::client`], with `before_own` done to the engine before
    /// each own query is answered (in transaction mode, a connection
    /// taken for it).
    fn client_then(&mut self, frame: &[u8], mut before_own: impl FnMut(&mut Engine, &Ctx)) -> Flow {
        let frame = Bytes::copy_from_slice(frame);
        loop {
            let ctx = ctx_at(&self.app, &self.entry, self.clock);
            match self.engine.on_client_frame(&ctx, &frame) {
                Ok(flow) => return flow,
                Err(Need::Own) => {
                    before_own(&mut self.engine, &ctx);
                    let answer = self.settings.clone().map(|row| vec![row]);
                    self.settings_reads +=
                        crate::session::fuzz::answer_own(&mut self.engine, &ctx, answer.as_deref());
                }
                Err(Need::Prerequisites(_)) => self.engine.found.prerequisites = true,
                Err(Need::Fetched { .. }) => panic!("facts are known or fetched"),
                Err(Need::Cache(_)) => panic!("no shared tier, no concurrent fill"),
            }
        }
    }

    /// Feeds `bytes` as one read of the client's, as the driver hands its
    /// buffer over ([`Engine::on_client_data`]): a whole batch may be
    /// decided at once, the rest frame by frame; what the engine needs is
    /// met as [`Self::client_then`] meets it, and the buffer handed over
    /// again until every frame is taken. Returns the flow.
    fn client_data_then(
        &mut self,
        bytes: &[u8],
        mut before_own: impl FnMut(&mut Engine, &Ctx),
    ) -> Flow {
        let mut buf = BytesMut::from(bytes);
        self.engine.client_arrived();
        while self.engine.intake == super::intake::Intake::Fresh {
            let ctx = ctx_at(&self.app, &self.entry, self.clock);
            match self.engine.on_client_data(&ctx, &mut buf, 1 << 20) {
                Ok(None) => {}
                Ok(Some(Need::Own)) => {
                    before_own(&mut self.engine, &ctx);
                    let answer = self.settings.clone().map(|row| vec![row]);
                    self.settings_reads +=
                        crate::session::fuzz::answer_own(&mut self.engine, &ctx, answer.as_deref());
                }
                Ok(Some(Need::Prerequisites(_))) => self.engine.found.prerequisites = true,
                Ok(Some(_)) => panic!("facts are known, and no shared tier"),
                Err(e) => panic!("the client's bytes are well formed: {e}"),
            }
        }
        self.engine.flow()
    }

    /// Feeds several client frames in turn.
    fn frames(&mut self, frames: &[Vec<u8>]) {
        for f in frames {
            assert_eq!(self.client(f), Flow::Continue);
        }
    }

    /// What the engine staged for the backend since last asked.
    fn sent_to_backend(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.engine.pipeline.to_backend).to_vec()
    }

    /// What the engine staged for the client since last asked.
    fn sent_to_client(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.engine.out).to_vec()
    }

    /// Carries out the stores the engine asked for, as the driver does;
    /// returns how many.
    fn store(&mut self) -> usize {
        let mut stored = 0;
        for action in self.engine.actions.drain(..) {
            if let Action::Store(fill, bytes) = action {
                self.app.cache.store(*fill, &bytes);
                stored += 1;
            }
        }
        stored
    }

    /// The database knows table `name`: readable, cached by its versions.
    fn knows_table(&mut self, name: &str) {
        self.learns_table(name, None);
    }

    /// Learns table `name`, with its replica identity as the catalog gives
    /// it (`name` US `type oid`, see `cache::catalog::fetch`).
    fn learns_table(&mut self, name: &str, identity: Option<&str>) {
        let catalog = &self.engine.db.catalog;
        let (_, queued) = catalog.facts([name], []);
        assert!(queued, "{name} was not known");
        let wanted = catalog.take_wanted();
        let mut lookup = Lookup::new(&wanted, None);
        while lookup.next_query().is_some() {
            lookup.add(&vec![table_row(name, identity)]);
        }
        catalog.install(&wanted, lookup.finish());
        assert!(catalog.knows(&[name], &[]));
    }

    /// Carries out [`Action::Fetch`] as the driver does, from what the
    /// model's database holds: `items` keyed by `k`, `log` and `other`.
    fn fetched(&mut self) {
        let catalog = &self.engine.db.catalog;
        let wanted = catalog.take_wanted();
        let mut lookup = Lookup::new(&wanted, None);
        while lookup.next_query().is_some() {
            let tables = [("items", Some(ITEMS_KEY)), ("log", None), ("other", None)];
            lookup.add(&tables.map(|(name, key)| table_row(name, key)).to_vec());
        }
        catalog.install(&wanted, lookup.finish());
    }

    /// Logged in, with table `items` known.
    fn caching() -> Self {
        let mut rig = Self::logged_in();
        rig.knows_table("items");
        rig
    }

    /// With table `items` known by its key `k` (an int4), and the
    /// database's stream up: reads and writes of `items` by key are kept
    /// by row.
    fn keying(mut self) -> Self {
        self.learns_table("items", Some(ITEMS_KEY));
        self.engine.db.stream.set_streaming(true);
        self
    }

    /// A forwarded read whose answer is to be stored under `key`.
    fn miss(&mut self, key: u128) {
        self.engine.pipeline.push(Inflight {
            capture: Some(Capture::new(Fill::local_only(key))),
            ..Inflight::default()
        });
    }

    /// The keys the driver is asked to store, in order.
    fn stored(&mut self) -> Vec<(u128, Vec<u8>)> {
        self.engine
            .actions
            .drain(..)
            .filter_map(|a| match a {
                Action::Store(fill, bytes) => Some((fill.local_key()?, bytes.to_vec())),
                _ => None,
            })
            .collect()
    }
}

/// Carries out a store the engine asked for, as the driver does, once it
/// is checked whole: nothing failed, cut short or incomplete is stored.
fn store_whole(rig: &Rig, fill: Fill, bytes: &[u8]) -> Result<(), TestCaseError> {
    let stored = model::seen(bytes);
    prop_assert!(
        stored.iter().all(|m| !matches!(m.tag, 'E' | 's')) && stored.iter().any(|m| m.tag == 'C'),
        "stored an answer that failed, was cut short or is incomplete: {stored:?}"
    );
    rig.app.cache.store(fill, bytes);
    Ok(())
}

/// `items`' replica identity as the catalog gives it: `k`, an int4.
const ITEMS_KEY: &str = "k\u{1f}23";

/// The catalog's row of facts of table `name`, readable, with its replica
/// identity (`None`: none).
fn table_row(name: &str, identity: Option<&str>) -> Vec<Option<String>> {
    let cell = |v: &str| Some(v.to_owned());
    vec![
        cell("r"),
        cell(name),
        cell("true"),
        cell("false"),
        None,
        cell("true"),
        cell("true"),
        None,
        identity.map(str::to_owned),
    ]
}

/// [`ctx`] at `clock`'s time (`None`: the clock's).
fn ctx_at<'a>(app: &'a App, entry: &'a ClientEntry, clock: Option<Instant>) -> Ctx<'a> {
    Ctx {
        now: clock.unwrap_or_else(Instant::now),
        ..ctx(app, entry)
    }
}

/// What the driver passes with each event: the rig's instance and
/// client, the clock now, and a seeded draw.
fn ctx<'a>(app: &'a App, entry: &'a ClientEntry) -> Ctx<'a> {
    Ctx {
        instance: app,
        client: &entry.client,
        now: Instant::now(),
        draw: crate::session::fuzz::seeded,
    }
}

fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = BytesMut::new();
    f.put_u8(tag);
    f.put_i32(4 + body.len() as i32);
    f.put_slice(body);
    f.to_vec()
}

fn rfq(status: TxStatus) -> Vec<u8> {
    messages::ready_for_query(status).to_vec()
}

fn row(value: &str) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_i16(1);
    body.put_i32(value.len() as i32);
    body.put_slice(value.as_bytes());
    frame(be::DATA_ROW, &body)
}

fn complete(tag: &str) -> Vec<u8> {
    frame(be::COMMAND_COMPLETE, format!("{tag}\0").as_bytes())
}

fn error(code: &str) -> Vec<u8> {
    let mut out = BytesMut::new();
    messages::error_response(&mut out, "ERROR", code, "no");
    out.to_vec()
}

fn description() -> Vec<u8> {
    frame(be::ROW_DESCRIPTION, &[0, 0])
}

fn query(sql: &str) -> Vec<u8> {
    messages::query(sql).to_vec()
}

fn parse(name: &str, sql: &str) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_slice(name.as_bytes());
    body.put_u8(0);
    body.put_slice(sql.as_bytes());
    body.put_u8(0);
    body.put_i16(0);
    frame(fe::PARSE, &body)
}

/// A Bind of the unnamed portal to `statement`, text parameters, text results.
fn bind(statement: &str, params: &[&str]) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_slice(statement.as_bytes());
    body.put_u8(0);
    body.put_i16(0);
    body.put_i16(params.len() as i16);
    for p in params {
        body.put_i32(p.len() as i32);
        body.put_slice(p.as_bytes());
    }
    body.put_i16(0);
    frame(fe::BIND, &body)
}

fn describe_portal() -> Vec<u8> {
    frame(fe::DESCRIBE, b"P\0")
}

fn execute(max_rows: i32) -> Vec<u8> {
    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_i32(max_rows);
    frame(fe::EXECUTE, &body)
}

fn sync() -> Vec<u8> {
    messages::SYNC.to_vec()
}

fn parse_complete() -> Vec<u8> {
    frame(be::PARSE_COMPLETE, &[])
}

fn bind_complete() -> Vec<u8> {
    frame(be::BIND_COMPLETE, &[])
}

/// The fuzz target's body, over its seeds and many generated inputs: the
/// engine never panics, whatever it is fed.
mod arbitrary {
    use proptest::prelude::*;

    use crate::session::fuzz::feed;

    #[test]
    fn the_fuzz_seeds_are_decided_without_a_panic() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/engine");
        let (mut fed, mut stored, mut served) = (0, 0, 0);
        for entry in std::fs::read_dir(dir).expect("the engine's fuzz seeds") {
            let seed = std::fs::read(entry.expect("a seed").path()).expect("readable");
            let whole = feed(&seed);
            (stored, served) = (stored + whole.stored, served + whole.served);
            // Every shorter prefix too: a session cut anywhere.
            for end in (0..seed.len()).step_by(7) {
                feed(&seed[..end]);
            }
            fed += 1;
        }
        assert!(fed >= 5, "seeds found: {fed}");
        // The seeds reach the engine's decisions: a fill and a hit at least.
        assert!(
            stored >= 2 && served >= 1,
            "stored {stored}, served {served}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn arbitrary_bytes_are_decided_without_a_panic(
            data in proptest::collection::vec(any::<u8>(), 0..2048),
        ) {
            feed(&data);
        }
    }
}
