//! pgcache's word to its client sessions that it is shutting down: first
//! drain (close when idle), then force (close now). Each session waits for
//! it in every turn of its relay loop, so waiting must cost next to
//! nothing: a load and a waker registration. A `CancellationToken`'s
//! future takes the token's lock, shared by every session, at each poll:
//! that was a tenth of the instructions of a relayed statement.

use std::future::poll_fn;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::Poll;

use futures_util::task::AtomicWaker;
use tokio_util::sync::CancellationToken;

/// How far shutting down has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Stage {
    Running = 0,
    /// Sessions close once idle.
    Drain = 1,
    /// Sessions close now.
    Force = 2,
}

/// One session's copy of the word.
#[derive(Default)]
pub struct Shutdown {
    stage: AtomicU8,
    waker: AtomicWaker,
}

impl Shutdown {
    /// Tells the session that shutting down reached `stage`.
    pub fn raise(&self, stage: Stage) {
        self.stage.fetch_max(stage as u8, Ordering::AcqRel);
        self.waker.wake();
    }

    /// A session that registered after shutting down began learns how
    /// far it is from the instance's tokens.
    pub fn catch_up(&self, force: &CancellationToken, drain: &CancellationToken) {
        if force.is_cancelled() {
            self.raise(Stage::Force);
        } else if drain.is_cancelled() {
            self.raise(Stage::Drain);
        }
    }

    pub fn reached(&self, stage: Stage) -> bool {
        self.stage.load(Ordering::Acquire) >= stage as u8
    }

    /// Ready once shutting down reached `stage`. One task waits at a time.
    pub async fn wait(&self, stage: Stage) {
        poll_fn(|cx| {
            if self.reached(stage) {
                return Poll::Ready(());
            }
            self.waker.register(cx.waker());
            // Raised between the check and the registration: not missed.
            if self.reached(stage) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiting_session_hears_each_stage() {
        let shutdown = std::sync::Arc::new(Shutdown::default());
        let waiting = {
            let shutdown = std::sync::Arc::clone(&shutdown);
            tokio::spawn(async move {
                shutdown.wait(Stage::Drain).await;
                let drained = !shutdown.reached(Stage::Force);
                shutdown.wait(Stage::Force).await;
                drained
            })
        };
        tokio::task::yield_now().await;
        assert!(!shutdown.reached(Stage::Drain));
        shutdown.raise(Stage::Drain);
        tokio::task::yield_now().await;
        shutdown.raise(Stage::Force);
        assert!(waiting.await.unwrap());
        // Never lowered.
        shutdown.raise(Stage::Drain);
        assert!(shutdown.reached(Stage::Force));
    }
}
