//! Transaction mode for the property test: the pool's one server
//! connection, which the sessions take in turns, and the driver's loop
//! over [`Engine::poll_io`] run in memory, with the model backend
//! answering at once. Checkout, the settings applied, the give-back and a
//! connection closed are the engine's to ask; this carries them out as
//! the driver does.

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::model::Backend;
use super::{Action, Engine, Flow, Rig, ctx_at, store_whole};
use crate::cancel::CancelTarget;
use crate::pool::transaction::Lent;
use crate::session::engine::{Held, Io, Parting};
use crate::upstream::UpstreamAddr;

/// The pool's one connection, as the sessions see it: who holds it, its
/// books while nobody does, and what it sent not read yet. The model
/// backend is its server session.
pub(super) struct PoolConn {
    holder: Option<usize>,
    books: Option<Lent>,
    buf: BytesMut,
    /// The server's answer on its way: it is read once what was read
    /// before it is relayed (pgcache's answers in the server's place
    /// among it), as a driver reads the socket only then.
    incoming: Vec<u8>,
    /// The answer to pgcache's own query, read at [`Io::Own`].
    owed: Vec<u8>,
    addr: UpstreamAddr,
    key: Arc<CancelTarget>,
    /// How often it was taken, and given back.
    pub checkouts: usize,
    pub give_backs: usize,
    /// The client's settings read back before it went back.
    pub read_backs: usize,
}

impl Default for PoolConn {
    fn default() -> Self {
        let addr = UpstreamAddr::Tcp {
            host: "db".into(),
            port: 5432,
        };
        Self {
            holder: None,
            books: Some(Lent::default()),
            buf: BytesMut::new(),
            incoming: Vec::new(),
            owed: Vec::new(),
            key: Arc::new(CancelTarget {
                addr: addr.clone(),
                backend_pid: 1,
                backend_secret: vec![0; 4],
            }),
            addr,
            checkouts: 0,
            give_backs: 0,
            read_backs: 0,
        }
    }
}

/// Polls session `who`'s engine as the driver does until it asks nothing
/// more; what the client is sent goes to `seen`, what the engine asks to
/// store is checked and stored. `backend` is the connection's server
/// session.
pub(super) fn pump(
    rig: &mut Rig,
    who: usize,
    conn: &mut PoolConn,
    backend: &mut Backend,
    seen: &mut Vec<u8>,
    stored: &mut usize,
) -> Result<(), TestCaseError> {
    for _ in 0..1_000 {
        if conn.buf.is_empty() && !conn.incoming.is_empty() {
            conn.buf
                .extend_from_slice(&std::mem::take(&mut conn.incoming));
            feed(rig, conn)?;
        }
        let attached = conn.holder == Some(who);
        let held = Held {
            attached,
            unread: attached && !conn.buf.is_empty(),
            client: false,
        };
        match rig.engine.poll_io(&*rig.app, held) {
            Io::Idle if !conn.incoming.is_empty() => {
                conn.buf
                    .extend_from_slice(&std::mem::take(&mut conn.incoming));
                feed(rig, conn)?;
            }
            Io::Idle => {
                prop_assert!(
                    !attached || rig.engine.link_step(true, false).is_none(),
                    "idle while it holds a connection it should let go"
                );
                return Ok(());
            }
            Io::CheckOut { queued } => check_out(&mut rig.engine, who, conn, queued)?,
            Io::Staged => write_staged(rig, conn, backend)?,
            Io::ToServer(bytes) => {
                conn.read_backs += 1;
                conn.owed.extend(backend.receive(&bytes));
            }
            Io::Own => {
                conn.buf.extend_from_slice(&std::mem::take(&mut conn.owed));
                feed(rig, conn)?;
            }
            Io::Relay(_, relayed) => {
                seen.extend_from_slice(rig.engine.for_client(&conn.buf, &relayed));
                rig.engine.client_sent();
                conn.buf.advance(relayed.end);
            }
            Io::ToClient => {
                seen.extend_from_slice(rig.engine.out());
                rig.engine.client_sent();
            }
            Io::Act(Action::Store(fill, bytes)) => {
                store_whole(rig, *fill, &bytes)?;
                *stored += 1;
            }
            Io::Act(Action::Fetch) => rig.fetched(),
            Io::Act(_) => {}
            Io::Part(parting) => let_go(rig, conn, backend, parting)?,
            Io::Drop(error) => {
                return Err(TestCaseError::fail(format!(
                    "the connection was dropped: {error:?}"
                )));
            }
            Io::TakeClient | Io::Replica | Io::ReplicaDone(_) => {
                return Err(TestCaseError::fail(
                    "no client bytes are buffered and no replica is set up",
                ));
            }
        }
    }
    Err(TestCaseError::fail("the engine asks again and again"))
}

/// Feeds session `who`'s client bytes, one read's, as
/// [`Rig::client_data_then`] does, but as in transaction mode: pgcache's own query takes the pool's connection
/// first, if the session holds none, and the client's settings put on it
/// go to its server session (`backend`); the rig answers the rest.
pub(super) fn client(
    rig: &mut Rig,
    who: usize,
    (conn, backend): (&mut PoolConn, &mut Backend),
    bytes: &[u8],
) -> Result<Flow, TestCaseError> {
    let mut taken = Ok(());
    let flow = rig.client_data_then(bytes, |engine, ctx| {
        before_own(engine, ctx, who, (&mut *conn, &mut *backend), &mut taken);
    });
    taken.map(|()| flow)
}

/// What transaction mode does before pgcache's own query of session
/// `who`: the pool's connection taken (`taken`: whether it could be), and
/// the client's settings put on it by its server session (`backend`).
pub(super) fn before_own(
    engine: &mut Engine,
    ctx: &super::Ctx,
    who: usize,
    (conn, backend): (&mut PoolConn, &mut Backend),
    taken: &mut Result<(), TestCaseError>,
) {
    if conn.holder != Some(who) && taken.is_ok() {
        *taken = check_out(engine, who, conn, false);
    }
    while engine.own_applies() {
        let request = engine.own_request().expect("the settings to put");
        let mut answer = BytesMut::from(&backend.receive(&request)[..]);
        let relayed = engine.on_backend(ctx, &mut answer);
        assert!(relayed.is_ok_and(|r| r.end == answer.len()), "read whole");
    }
}

/// The pool's connection granted to session `who`, with the books it
/// keeps between sessions.
fn check_out(
    engine: &mut Engine,
    who: usize,
    conn: &mut PoolConn,
    queued: bool,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(conn.holder, None, "the other session holds the connection");
    let books = conn.books.take().expect("books while nobody holds it");
    conn.holder = Some(who);
    conn.checkouts += 1;
    engine.attach_server(&conn.addr, Arc::clone(&conn.key));
    engine.granted(books, queued);
    Ok(())
}

/// The requests staged go to the connection; pgcache's answers in the
/// server's place come after what the server sent before, its answer to
/// the requests later.
fn write_staged(
    rig: &mut Rig,
    conn: &mut PoolConn,
    backend: &mut Backend,
) -> Result<(), TestCaseError> {
    let (staged, answers) = rig.engine.staged(&*rig.app);
    let request = staged.split();
    if !answers.is_empty() {
        rig.engine.splice(&mut conn.buf, &answers);
        feed(rig, conn)?;
    }
    conn.incoming.extend(backend.receive(&request));
    Ok(())
}

/// The session lets the connection go: back to the pool with its books,
/// or closed (the pool's next is a new one).
fn let_go(
    rig: &mut Rig,
    conn: &mut PoolConn,
    backend: &mut Backend,
    parting: Parting,
) -> Result<(), TestCaseError> {
    prop_assert!(conn.buf.is_empty(), "let go with bytes unread");
    conn.books = Some(match parting {
        Parting::Back(books, _) => {
            conn.give_backs += 1;
            books
        }
        _ => {
            *backend = backend.reconnected();
            Lent::default()
        }
    });
    conn.holder = None;
    rig.engine.detach_server();
    Ok(())
}

/// Hands the engine what the connection sent.
fn feed(rig: &mut Rig, conn: &mut PoolConn) -> Result<(), TestCaseError> {
    let ctx = ctx_at(&rig.app, &rig.entry, rig.clock);
    let leg = crate::session::engine::Leg::Primary;
    rig.engine
        .on_server_data(&ctx, leg, &mut conn.buf)
        .map_err(|e| TestCaseError::fail(format!("the server's answer: {e}")))
}
