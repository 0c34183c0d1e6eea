//! A session's transaction bookkeeping, for the cache.
//!
//! - **Invalidations.** A write in a transaction block is visible to the
//!   writer at once but to others only at COMMIT: its bumps are applied
//!   locally at once (this session's later reads miss) and published when
//!   the transaction ends, committed or not.
//! - **Reads.** Inside a transaction a read may use the cache only before
//!   the transaction wrote and only at READ COMMITTED; its result is stored
//!   only if the transaction commits (`R` is what is held until then).

use smallvec::SmallVec;

use crate::cache::Bumps;
use crate::classify::{Begin, BypassReason, Isolation};
use crate::protocol::TxStatus;

const MAX_DEFERRED: usize = 64;
/// Bytes of results a session holds back until its transaction commits.
const MAX_DEFERRED_BYTES: usize = 4 * 1024 * 1024;

pub(super) struct Transaction<R> {
    /// As the last ReadyForQuery said.
    pub status: TxStatus,
    /// The session's default_transaction_isolation.
    pub default_isolation: Isolation,
    /// How this transaction began.
    begun: Begin,
    /// It may have written.
    wrote: bool,
    /// Bumps applied locally, to publish when it ends.
    effects: Bumps,
    deferred: Vec<R>,
    deferred_bytes: usize,
    /// The last statement to complete was a COMMIT.
    last_was_commit: bool,
}

/// What a completed request means for the cache. Made for every request:
/// inline room for the common case (a statement's own bumps, or the end
/// of a transaction's; one result) so it allocates nothing.
pub(super) struct Completion<R> {
    /// Bumps visible to every session now: invalidate (and publish).
    pub visible: SmallVec<[Bumps; 2]>,
    /// Bumps visible to this session only: apply locally.
    pub private: Option<Bumps>,
    /// Results to store now.
    pub store: SmallVec<[R; 1]>,
}

impl<R> Default for Transaction<R> {
    fn default() -> Self {
        Self {
            status: TxStatus::Idle,
            default_isolation: Isolation::PerStatement,
            begun: Begin::AtDefault,
            wrote: false,
            effects: Bumps::default(),
            deferred: Vec::new(),
            deferred_bytes: 0,
            last_was_commit: false,
        }
    }
}

impl<R> Transaction<R> {
    /// A BEGIN (or START TRANSACTION) went out.
    pub fn begin(&mut self, begun: Begin) {
        self.begun = begun;
    }

    /// The isolation the transaction runs at.
    fn isolation(&self) -> Isolation {
        match self.begun {
            Begin::AtDefault => self.default_isolation,
            Begin::At(isolation) => isolation,
        }
    }

    /// A statement that may write went out.
    pub fn wrote(&mut self) {
        self.wrote = true;
    }

    /// A CommandComplete arrived: remember whether it was a COMMIT.
    pub fn command_complete(&mut self, tag: &[u8]) {
        self.last_was_commit = tag.starts_with(b"COMMIT\0");
    }

    pub fn error(&mut self) {
        self.last_was_commit = false;
    }

    /// Whether a read may use the cache now.
    pub fn reads_may_use_cache(&self) -> Result<(), BypassReason> {
        match self.status {
            TxStatus::Idle => Ok(()),
            TxStatus::Failed => Err(BypassReason::InTransactionAfterWrite),
            TxStatus::InTransaction if self.wrote => Err(BypassReason::InTransactionAfterWrite),
            TxStatus::InTransaction if self.isolation() == Isolation::Snapshot => {
                Err(BypassReason::IsolationLevel)
            }
            TxStatus::InTransaction => Ok(()),
        }
    }

    /// A ReadyForQuery with `status` completed a request with `effects`
    /// and, for a read that may be stored, `result` of `size` bytes.
    pub fn complete(
        &mut self,
        status: TxStatus,
        effects: Bumps,
        result: Option<(R, usize)>,
    ) -> Completion<R> {
        let previous = std::mem::replace(&mut self.status, status);
        let mut done = Completion {
            visible: SmallVec::new(),
            private: None,
            store: SmallVec::new(),
        };
        if !effects.is_empty() {
            if status == TxStatus::Idle {
                done.visible.push(effects);
            } else {
                // Not visible to others before the transaction ends.
                self.effects.merge(&effects);
                done.private = Some(effects);
            }
        }
        match (status, result) {
            (TxStatus::Idle, Some((r, _))) => done.store.push(r),
            (TxStatus::InTransaction, Some((r, size)))
                if self.deferred.len() < MAX_DEFERRED
                    && self.deferred_bytes + size <= MAX_DEFERRED_BYTES =>
            {
                self.deferred_bytes += size;
                self.deferred.push(r);
            }
            _ => {}
        }
        if status == TxStatus::Idle && previous != TxStatus::Idle {
            // The transaction ended: its writes are visible (or gone) now.
            let effects = std::mem::take(&mut self.effects);
            if !effects.is_empty() {
                done.visible.push(effects);
            }
            self.deferred_bytes = 0;
            let deferred = std::mem::take(&mut self.deferred);
            if self.last_was_commit {
                done.store.extend(deferred);
            }
        }
        done
    }

    /// Idle with nothing in flight: how the last transaction began and
    /// whether it wrote are history. Not at every idle ReadyForQuery: in a
    /// pipeline, a BEGIN and a write after the request it answers were
    /// decided before it came.
    pub fn settle(&mut self) {
        if self.status == TxStatus::Idle {
            self.wrote = false;
            self.begun = Begin::AtDefault;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::versions::Versions;

    fn write_to(versions: &Versions, table: &str) -> Bumps {
        let mut b = Bumps::default();
        b.add_family(versions.family(table));
        b
    }

    #[test]
    fn outside_a_transaction_effects_are_visible_and_results_stored_at_once() {
        let v = Versions::default();
        let mut tx = Transaction::default();
        let done = tx.complete(TxStatus::Idle, write_to(&v, "t"), Some(("r", 1)));
        assert_eq!(done.visible.len(), 1);
        assert!(done.private.is_none());
        assert_eq!(done.store.as_slice(), ["r"]);
    }

    #[test]
    fn a_committed_transaction_publishes_its_writes_and_stores_its_reads_at_commit() {
        let v = Versions::default();
        let mut tx = Transaction::default();
        assert!(
            tx.complete(TxStatus::InTransaction, Bumps::default(), None)
                .visible
                .is_empty()
        );
        let read = tx.complete(
            TxStatus::InTransaction,
            Bumps::default(),
            Some(("read", 10)),
        );
        assert!(read.store.is_empty(), "held until COMMIT");
        assert!(tx.reads_may_use_cache().is_ok());
        tx.wrote();
        let write = tx.complete(TxStatus::InTransaction, write_to(&v, "t"), None);
        assert!(write.visible.is_empty() && write.private.is_some());
        assert_eq!(
            tx.reads_may_use_cache(),
            Err(BypassReason::InTransactionAfterWrite)
        );
        tx.command_complete(b"COMMIT\0");
        let commit = tx.complete(TxStatus::Idle, Bumps::default(), None);
        assert_eq!(commit.visible.len(), 1, "the write, now visible");
        assert_eq!(commit.store.as_slice(), ["read"]);
        assert!(
            tx.reads_may_use_cache().is_ok(),
            "a new transaction starts clean"
        );
    }

    #[test]
    fn a_rolled_back_transaction_publishes_but_stores_nothing() {
        let v = Versions::default();
        let mut tx = Transaction::default();
        tx.complete(TxStatus::InTransaction, Bumps::default(), Some(("read", 1)));
        tx.complete(TxStatus::InTransaction, write_to(&v, "t"), None);
        tx.error();
        let failed = tx.complete(TxStatus::Failed, Bumps::default(), None);
        assert!(failed.visible.is_empty());
        tx.command_complete(b"ROLLBACK\0");
        let end = tx.complete(TxStatus::Idle, Bumps::default(), None);
        assert_eq!(
            end.visible.len(),
            1,
            "published whether or not it committed"
        );
        assert!(end.store.is_empty());
    }

    #[test]
    fn strict_isolation_keeps_reads_off_the_cache_and_deferred_results_are_bounded() {
        let mut tx: Transaction<u8> = Transaction::default();
        tx.begin(Begin::At(Isolation::Snapshot));
        tx.complete(TxStatus::InTransaction, Bumps::default(), None);
        assert_eq!(tx.reads_may_use_cache(), Err(BypassReason::IsolationLevel));
        tx.begin(Begin::AtDefault);
        tx.default_isolation = Isolation::Snapshot;
        assert_eq!(tx.reads_may_use_cache(), Err(BypassReason::IsolationLevel));
        tx.begin(Begin::At(Isolation::PerStatement));
        assert_eq!(tx.reads_may_use_cache(), Ok(()), "READ COMMITTED named");
        tx.begin(Begin::AtDefault);
        tx.default_isolation = Isolation::PerStatement;
        tx.complete(
            TxStatus::InTransaction,
            Bumps::default(),
            Some((1, MAX_DEFERRED_BYTES)),
        );
        tx.complete(TxStatus::InTransaction, Bumps::default(), Some((2, 1)));
        tx.command_complete(b"COMMIT\0");
        let end = tx.complete(TxStatus::Idle, Bumps::default(), None);
        assert_eq!(end.store.as_slice(), [1], "past the byte bound, not held");
    }
}
