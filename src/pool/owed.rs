//! The answers a transaction-mode client is owed by the server connection
//! it holds, in order: what each message sent (or answered by pgcache in
//! the server's place) will be answered with.

use bytes::Bytes;

use super::statement::Named;
use crate::protocol::{backend as be, messages, sqlstate};

/// What the server answers a message with, as far as the translation
/// needs to know where each answer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Ends with ParseComplete, BindComplete or CloseComplete.
    One(u8),
    /// Describe of a statement: ParameterDescription, then RowDescription
    /// or NoData.
    DescribeStatement,
    /// Describe of a portal: RowDescription or NoData.
    DescribePortal,
    /// Rows, then CommandComplete, EmptyQueryResponse or PortalSuspended.
    Execute,
    /// A Sync, simple Query or FunctionCall: ends with ReadyForQuery.
    Ready,
}

#[derive(Debug)]
pub(super) enum Origin {
    /// The client's message: its answer goes to the client.
    Client,
    /// pgcache's own (a Parse or Close it added): its answer is dropped,
    /// unless it is an error, which the client gets in place of the
    /// answer to the message the injection was for.
    Injected,
    /// No message was sent: pgcache answers in the server's place.
    Synthetic(Bytes),
    /// No simple Query was sent: pgcache refuses it with this SQLSTATE and
    /// message, in the server's place (with the transaction status of the
    /// moment it is answered).
    Refusal(&'static str, String),
}

#[derive(Debug)]
pub(super) struct Expect {
    pub(super) kind: Kind,
    pub(super) origin: Origin,
    /// A Sync sent after an Execute with no CopyDone/CopyFail between:
    /// PostgreSQL ignores it if that Execute starts COPY FROM STDIN.
    pub(super) may_be_ignored: bool,
    /// A Parse sent under pgcache's name: the statement it prepares on
    /// the server (forgotten if it fails).
    pub(super) prepares: Option<u128>,
    /// A client's Parse: the client's name of the statement it defines
    /// (forgotten if it fails).
    pub(super) defines: Option<Bytes>,
    /// A client's Bind of a named statement: its server name's hash.
    pub(super) binds: Option<u128>,
    /// SQL naming a client's statement (`EXECUTE s`), sent under the
    /// statement's server name.
    pub(super) named: Option<Named>,
    /// The client already got an error for this message (pgcache's Parse
    /// for it failed): the server's own error for it is not passed on.
    pub(super) answered: bool,
    /// That Bind is the first statement of its implicit transaction: the
    /// client's messages from it through its Sync, to send again if the
    /// server's statement was stale.
    pub(super) retry: Option<Bytes>,
}

impl Expect {
    pub(super) fn new(kind: Kind, origin: Origin) -> Self {
        Self {
            kind,
            origin,
            may_be_ignored: false,
            prepares: None,
            defines: None,
            binds: None,
            named: None,
            answered: false,
            retry: None,
        }
    }

    /// Whether a frame tagged `tag` is the last of the answer owed.
    pub(super) fn ended_by(&self, tag: u8) -> bool {
        match self.kind {
            // A Query's or Sync's error comes before its ReadyForQuery.
            Kind::Ready => tag == be::READY_FOR_QUERY,
            _ if tag == be::ERROR_RESPONSE => true,
            Kind::One(t) => tag == t,
            Kind::DescribeStatement | Kind::DescribePortal => {
                tag == be::ROW_DESCRIPTION || tag == be::NO_DATA
            }
            Kind::Execute => matches!(
                tag,
                be::COMMAND_COMPLETE | be::EMPTY_QUERY_RESPONSE | be::PORTAL_SUSPENDED
            ),
        }
    }

    /// Whether the server runs something for it (a first statement must
    /// have nothing of the kind before it).
    pub(super) fn executes(&self) -> bool {
        match self.kind {
            Kind::One(tag) => tag == be::BIND_COMPLETE,
            Kind::DescribeStatement => false,
            Kind::DescribePortal | Kind::Execute | Kind::Ready => true,
        }
    }
}

/// A Bind's retry is kept only for a batch up to this size: beyond it the
/// client gets the error, as a client of one connection would.
pub(super) const MAX_RETRY_BYTES: usize = 1 << 20;

/// Whether an error refusing a Bind says its statement is stale.
pub(super) fn stale_statement(error_body: &[u8]) -> bool {
    matches!(
        messages::error_code(error_body),
        Some(sqlstate::FEATURE_NOT_SUPPORTED | sqlstate::INTERNAL_ERROR)
    )
}
