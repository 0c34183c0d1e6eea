//! The engine's one output surface ([`Engine::poll_io`]): what the driver
//! does next, asked again after each step until nothing is left. The
//! order is the engine's: what the server is owed as it is and the
//! actions; a server's answer relayed, what is staged for the client, a
//! replica's connection let go once its read is answered, and pgcache's
//! own queries; the client's buffered bytes taken, all of them before
//! the requests they stage go out; those requests, for the primary and a
//! replica; last, the pooled connection let go of.

use bytes::BytesMut;

use super::answers::Relayed;
use super::{Action, Ctx, Engine, Instance, Intake, LinkStep, Parting, Verdict};
use crate::pool::prepared::ServerStatements;
use crate::session::SessionError;
use crate::session::link::Link;

/// The connections the driver holds, as a poll asks about them.
#[derive(Clone, Copy)]
pub(in crate::session) struct Held {
    /// A connection to the primary is held.
    pub attached: bool,
    /// It sent bytes not read yet.
    pub unread: bool,
    /// The client's read buffer holds bytes.
    pub client: bool,
}

/// A server leg of the session: the primary's connection, or a replica's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::session) enum Leg {
    Primary,
    Replica,
}

/// A pooled replica connection going back to its pool: the settings it
/// is in, its statements, and how long it may live.
pub(in crate::session) type ReplicaReturn = (u64, ServerStatements, std::time::Duration);

/// What the driver does next ([`Engine::poll_io`]).
pub(in crate::session) enum Io {
    /// Write these bytes to the primary, as they are.
    ToServer(BytesMut),
    /// Carry out this action.
    Act(Action),
    /// Write to the client what it is sent of the bytes buffered from
    /// this leg ([`Engine::for_client`]), then drop them from the buffer.
    Relay(Leg, Relayed),
    /// Write [`Engine::out`] to the client, then [`Engine::client_sent`].
    ToClient,
    /// The read on a replica is answered: let its connection go; in
    /// transaction mode back to the replica's pool, with the books the leg
    /// kept of it (the settings it is in, its statements) and how long it
    /// may live.
    ReplicaDone(Option<ReplicaReturn>),
    /// Hand the client's read buffer to [`Engine::on_client_data`], and
    /// meet what it needs, if anything.
    TakeClient,
    /// Transaction mode: take a connection from the pool (`queued`: for
    /// the client's requests, which may wait in the pool's queue); if
    /// none comes, tell [`Engine::checkout_failed`].
    CheckOut { queued: bool },
    /// Read the primary's answer to pgcache's own query (written as
    /// [`Io::ToServer`]) and hand it to [`Engine::on_server_data`].
    Own,
    /// Close the held connection: an own query's answer left it in doubt;
    /// the session ends with the error, if there is one.
    Drop(Option<SessionError>),
    /// Write the requests staged for the primary ([`Engine::staged`]).
    Staged,
    /// Carry out the steps of the read routed to a replica
    /// ([`Engine::replica_step`]); if it cannot be sent, tell
    /// [`Engine::on_replica_lost`].
    Replica,
    /// Let the held pooled connection go.
    Part(Parting),
    /// Nothing more: wait for input.
    Idle,
}

impl Engine {
    /// What the driver does next, with the connections it `held`. Most
    /// events leave nothing to do: that answer is a few field checks, and
    /// what carries a payload is built out of line. The client's bytes are
    /// all taken before the requests they stage go out; a session whose
    /// client ended writes what came before and asks nothing more.
    #[inline]
    pub fn poll_io(&mut self, instance: &dyn Instance, held: Held) -> Io {
        if !self.to_server.is_empty() || !self.actions.is_empty() {
            return self.owed();
        }
        if let Some((leg, relayed)) = self.relaying.take() {
            return Io::Relay(leg, relayed);
        }
        if !self.out.is_empty() {
            return Io::ToClient;
        }
        if self.replica.is_some() && self.replica_answered() {
            return self.replica_done(instance);
        }
        if self.own_unsettled() {
            return self.own_io(held);
        }
        if self.takes_client(held.client) {
            return Io::TakeClient;
        }
        if !self.pipeline.to_backend.is_empty() {
            return match held.attached || !self.link.is_pooled() {
                true => Io::Staged,
                false => Io::CheckOut { queued: true },
            };
        }
        if self.replica_chosen() {
            return Io::Replica;
        }
        if self.intake == Intake::Closed || !self.link.is_pooled() {
            return Io::Idle;
        }
        self.let_go(instance, held)
    }

    /// The client's buffered bytes (`buffered`: there are some) are to be
    /// taken now: bytes came since every frame was taken, and the engine
    /// reads its client; or a decision waits.
    #[inline]
    pub fn takes_client(&self, buffered: bool) -> bool {
        self.intake == Intake::Fresh && (self.waiting.is_some() || buffered && self.reads_client())
    }

    /// Every complete frame buffered from a server `leg` (`buf`), handled
    /// ([`Engine::on_backend`]): what the client is sent of them waits
    /// for [`Io::Relay`], after what the server is owed and the actions.
    pub fn on_server_data(
        &mut self,
        ctx: &Ctx,
        leg: Leg,
        buf: &mut bytes::BytesMut,
    ) -> Result<(), SessionError> {
        let relayed = self.on_backend(ctx, buf)?;
        if relayed.end > 0 {
            self.relaying = Some((leg, relayed));
        }
        Ok(())
    }

    /// The read on the replica is answered: what becomes of its connection.
    #[inline(never)]
    fn replica_done(&mut self, instance: &dyn Instance) -> Io {
        let Some(lifetime) = self.pooled_lifetime(instance) else {
            return Io::ReplicaDone(None);
        };
        let books = self.replica_books();
        Io::ReplicaDone(books.map(|(applied, prepared)| (applied, prepared, lifetime)))
    }

    /// What the server is owed as it is, then the actions, in order.
    #[inline(never)]
    fn owed(&mut self) -> Io {
        if let Some(bytes) = self.take_to_server() {
            return Io::ToServer(bytes);
        }
        let action = self.actions.remove(0);
        if self.actions.is_empty() {
            // Actions are a few a statement, and large: an idle session
            // keeps no room for them.
            self.actions = Vec::new();
        }
        Io::Act(action)
    }

    /// pgcache's own queries: the next to send or its answer to read (a
    /// connection taken first if none is held), then what becomes of the
    /// connection.
    #[inline(never)]
    fn own_io(&mut self, held: Held) -> Io {
        if self.own_pending() {
            return match held.attached {
                false => Io::CheckOut { queued: false },
                true => match self.own_request() {
                    Some(request) => Io::ToServer(request),
                    None => Io::Own,
                },
            };
        }
        match self.take_verdict() {
            Some(Verdict::Close) => Io::Drop(None),
            Some(Verdict::Fail(e)) => Io::Drop(Some(e)),
            None => Io::Idle,
        }
    }

    /// Transaction mode, the session idle: the held connection given back
    /// (its settings read back first if they may have changed), or closed.
    #[inline(never)]
    fn let_go(&mut self, instance: &dyn Instance, held: Held) -> Io {
        let close = match self.link_step(held.attached, held.unread) {
            Some(LinkStep::ReadBack) => {
                // Unreadable, the connection is closed, not given back.
                self.read_back();
                return self.own_io(held);
            }
            Some(LinkStep::GiveBack) => false,
            Some(LinkStep::Close) => true,
            Some(LinkStep::CheckOut) | None => return Io::Idle,
        };
        match self.part(instance, close) {
            Some(parting) => Io::Part(parting),
            None => Io::Idle,
        }
    }

    /// No connection came for what waited on one (`error`): an own query
    /// goes on without its answer, and the statement that waited fails at
    /// once with the same error; the client's requests fail as
    /// [`Engine::fail_unsent`] says. Any other error ends the session.
    pub fn checkout_failed(&mut self, ctx: &Ctx, error: SessionError) -> Result<(), SessionError> {
        let SessionError::Pool(pool) = error else {
            return Err(error);
        };
        if !self.own_pending() {
            return self.fail_unsent(pool);
        }
        if let Link::Pooled(link) = &mut self.link {
            link.no_connection = Some(Box::new(pool));
        }
        self.own_unanswered(ctx);
        Ok(())
    }
}
