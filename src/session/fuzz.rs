//! Arbitrary bytes into a session engine, as a client and a backend would
//! send them: the body of the `engine` fuzz target, and of the stable test
//! that runs it over the seeds and generated inputs. The engine must never
//! panic, whatever it is fed.

use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use bytes::{BufMut, BytesMut};

use super::engine::{Action, Ctx, Engine, Need};
use super::known::Known;
use super::link::Link;
use super::pipeline::Flow;
use super::reuse::ServerBook;
use crate::App;
use crate::cache::catalog::fetch::{Lookup, Rows};
use crate::config::Config;
use crate::pool::clients::{Arrival, ClientEntry};
use crate::protocol::startup::Startup;
use crate::upstream::UpstreamAddr;

/// A pgcache of its own, never started, shared by every input.
fn app() -> &'static (App, ClientEntry) {
    static APP: OnceLock<(App, ClientEntry)> = OnceLock::new();
    APP.get_or_init(|| unstarted_app("fuzz", "fuzz"))
}

/// A pgcache of the default configuration (the sampler on), never
/// started, and the line of one client of `user` on `database` in it.
pub(super) fn unstarted_app(user: &str, database: &str) -> (App, ClientEntry) {
    let config = Config::from_toml("", Path::new(database)).expect("the default config");
    let app = App::new(config).expect("app");
    let entry = arrived(&app, user, database);
    (app, entry)
}

/// A client of `user` on `database` arrived at `app`: its line in `SHOW
/// CLIENTS`.
pub(super) fn arrived(app: &App, user: &str, database: &str) -> ClientEntry {
    app.clients.register(Arrival {
        user,
        database,
        addr: "127.0.0.1:1".parse().expect("address"),
        tls: false,
        application_name: "",
    })
}

thread_local! {
    static DRAWS: std::cell::RefCell<rand::rngs::StdRng> = std::cell::RefCell::new(fresh());
}

fn fresh() -> rand::rngs::StdRng {
    rand::SeedableRng::seed_from_u64(0x5eed)
}

/// A draw from a generator seeded alike on every thread: what tests and
/// the fuzz target pass as [`Ctx::draw`], so that which replica takes a
/// read and which hit the sampler checks are the same on every run.
pub(in crate::session) fn seeded() -> u64 {
    DRAWS.with(|draws| rand::Rng::random(&mut *draws.borrow_mut()))
}

/// Feeds one engine `data`, read as a run of events: a control byte, a
/// length byte and that many bytes. The control byte says whose the bytes
/// are (client or backend), the tag of the frame they become, and how the
/// driver meets what the engine needs.
#[doc(hidden)]
pub fn feed(data: &[u8]) -> Fed {
    // Each input draws the same numbers, whatever ran before it.
    DRAWS.with(|draws| *draws.borrow_mut() = fresh());
    let mut fed = Fed::default();
    let (app, entry) = app();
    let mut engine = session_engine(app, "fuzz", "fuzz");
    let mut backend = BytesMut::new();
    let mut client = BytesMut::new();
    let mut rest = data;
    while let [control, len, tail @ ..] = rest {
        let len = (*len as usize).min(tail.len());
        let (chunk, tail) = tail.split_at(len);
        rest = tail;
        let ctx = Ctx {
            instance: app,
            client: &entry.client,
            now: Instant::now(),
            draw: seeded,
        };
        let mut frame = BytesMut::new();
        let (tag, body) = chunk.split_first().unwrap_or((&b'Q', &[]));
        frame.put_u8(*tag);
        frame.put_i32(4 + body.len() as i32);
        frame.put_slice(body);
        let ended = if control & 1 == 0 {
            // Client frames arrive in runs, as one read would bring them.
            client.extend_from_slice(&frame);
            control & 4 != 0 && client_data(&mut engine, &ctx, &mut client, *control)
        } else {
            backend.extend_from_slice(&frame);
            match engine.on_backend(&ctx, &mut backend) {
                Ok(relayed) => {
                    let _ = backend.split_to(relayed.end);
                    false
                }
                Err(_) => true,
            }
        };
        // What the driver would write and carry out.
        fed.served += usize::from(!engine.out().is_empty() && control & 1 == 0);
        engine.client_sent();
        engine.drop_staged();
        for action in engine.take_actions() {
            match action {
                Action::Store(fill, bytes) => {
                    app.cache.store(*fill, &bytes);
                    fed.stored += 1;
                }
                Action::Fetch => every_name_a_table(&engine),
                _ => {}
            }
        }
        if ended {
            return fed;
        }
    }
    fed
}

/// A caching session engine of `user` on `database`, in session mode, not
/// logged in yet: what the fuzz target and the engine's tests feed.
pub(super) fn session_engine(app: &App, user: &str, database: &str) -> Engine {
    let startup = Startup {
        version: 196_608,
        params: vec![
            ("user".into(), user.into()),
            ("database".into(), database.into()),
        ],
    };
    Engine::new(
        true,
        startup,
        Known::new(app.policy()),
        (Link::session(), ServerBook::new(false)),
        UpstreamAddr::Tcp {
            host: "db".into(),
            port: 5432,
        },
    )
}

/// The catalog fetcher of a database where every name asked for is a
/// readable table and no function may write.
fn every_name_a_table(engine: &Engine) {
    let catalog = &engine.db().catalog;
    let wanted = catalog.take_wanted();
    let cell = |v: &str| Some(v.to_owned());
    let mut rows: Rows = wanted
        .rels
        .iter()
        .map(|(name, _)| {
            let facts = ["r", name, "true", "false"].map(cell);
            let more = [None, cell("true"), cell("true")];
            facts.into_iter().chain(more).collect()
        })
        .collect();
    rows.extend(wanted.funcs.iter().map(|(name, _)| {
        let facts = ["f", name, "true", "false"].map(cell);
        facts.into_iter().chain([None, None, None]).collect()
    }));
    let mut lookup = Lookup::new(&wanted, None);
    while lookup.next_query().is_some() {
        lookup.add(&rows);
    }
    catalog.install(&wanted, lookup.finish());
}

/// What one input did, so that a test of [`feed`] can tell it reached
/// the engine's decisions.
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct Fed {
    /// Answers stored.
    pub stored: usize,
    /// Runs of client frames after which the client was sent something
    /// the engine staged (a hit, a warning).
    pub served: usize,
}

/// The client's buffered frames, handed to the engine as the driver hands
/// them over, with what a decision waits for met. True if the session
/// would end.
fn client_data(engine: &mut Engine, ctx: &Ctx, client: &mut BytesMut, control: u8) -> bool {
    // Needs met in a row while nothing more of the buffer was taken.
    let (mut needs, mut left) = (0, client.len());
    engine.client_arrived();
    loop {
        if !engine.takes_client(!client.is_empty()) {
            return engine.flow() == Flow::Close;
        }
        let need = match engine.on_client_data(ctx, client, 1 << 20) {
            // What the frame left is carried out after the run.
            Ok(None) => continue,
            Ok(Some(need)) => need,
            Err(_) => return true,
        };
        needs = if client.len() == left { needs + 1 } else { 1 };
        left = client.len();
        assert!(
            needs < 8,
            "the engine asked for the same need again and again"
        );
        match need {
            Need::Own => {
                let row = ["fuzz", "fuzz", "read committed", "", "none", "{}"]
                    .map(|v| Some(v.to_owned()))
                    .to_vec();
                let answer = (control & 2 == 0).then(|| vec![row]);
                answer_own(engine, ctx, answer.as_deref());
            }
            Need::Prerequisites(_) => engine.prerequisites_met(Vec::new()),
            Need::Fetched { .. } => engine.facts_met(),
            // Only Redis or another session could answer: the driver
            // would wait; this input ends here.
            Need::Cache(_) => return true,
        }
    }
}

/// Answers every own query the engine asked, as PostgreSQL would: with
/// `rows`, or an error (`None`). Returns how many it answered.
pub(in crate::session) fn answer_own(
    engine: &mut Engine,
    ctx: &Ctx,
    rows: Option<&[Vec<Option<String>>]>,
) -> usize {
    let mut answered = 0;
    while engine.own_request().is_some() {
        let mut frames = BytesMut::new();
        match rows {
            Some(rows) => rows.iter().for_each(|row| data_row(&mut frames, row)),
            None => crate::protocol::messages::error_response(
                &mut frames,
                "ERROR",
                "42501",
                "permission denied",
            ),
        }
        frames.extend_from_slice(&crate::protocol::messages::ready_for_query(
            engine.tx_status(),
        ));
        // Read as the driver reads it: through the backend's frames.
        let relayed = engine.on_backend(ctx, &mut frames).expect("an answer");
        assert_eq!(relayed.end, frames.len(), "the answer is read whole");
        answered += 1;
    }
    answered
}

/// A DataRow of text values.
pub(in crate::session) fn data_row(out: &mut BytesMut, row: &[Option<String>]) {
    use bytes::BufMut;
    let len: usize = row
        .iter()
        .map(|v| 4 + v.as_ref().map_or(0, String::len))
        .sum();
    out.put_u8(crate::protocol::backend::DATA_ROW);
    out.put_u32((4 + 2 + len) as u32);
    out.put_u16(row.len() as u16);
    for value in row {
        match value {
            Some(v) => {
                out.put_i32(v.len() as i32);
                out.put_slice(v.as_bytes());
            }
            None => out.put_i32(-1),
        }
    }
}
