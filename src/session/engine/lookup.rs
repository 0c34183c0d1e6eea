//! Asking the cache for a read, and what its answer means for the client:
//! a hit staged for it (with a refresh or a sampler's check of it, run off
//! its path), or the request forwarded, with a capture if its result is to
//! be stored.

use crate::session::pipeline::Inflight;

use super::{Action, Ctx, Engine, Need};
use crate::cache::key::RequestKey;
use crate::cache::sampler::Check;
use crate::cache::{Lookup, Reads, Request};
use crate::classify::BypassReason;
use crate::config::CacheMode;
use crate::protocol::{TxStatus, messages};
use crate::session::capture::Capture;
use crate::session::explain::Explain;
use crate::session::offload;
use crate::session::plan::Plan;
use crate::session::row_limit::cut_stored;

/// What became of a read the cache was asked for.
pub(super) enum Answer {
    /// Answered from the cache; the backend sees only a refresh, if any.
    Served { refreshed: bool },
    /// To forward, with a capture if its result is to be stored, and what
    /// to tell the client of it (`/*+ explain */`).
    Forward(Option<Capture>, Option<Box<Explain>>),
}

impl Engine {
    /// Asks the cache for a read (`key`, or why it may not be served); a
    /// bypass is counted here.
    /// `by_row`: what a keyed read reads for this run's rows, in place of
    /// its tables' versions.
    pub(super) fn look_up(
        &mut self,
        ctx: &Ctx,
        key: Result<RequestKey, BypassReason>,
        plan: &Plan,
        by_row: Option<&Reads>,
    ) -> Result<Result<Lookup, BypassReason>, Need> {
        // A key is only made for a cacheable read, which has its reads.
        let (key, tables) = match (key, plan.read.as_ref().map_err(|r| *r)) {
            (Ok(key), Ok(tables)) => (key, tables),
            (Err(reason), _) | (_, Err(reason)) => {
                ctx.instance.cache().bypassed(&self.db, reason);
                plan.stats.bypassed(reason);
                return Ok(Err(reason));
            }
        };
        let admission = self.known.policy.admission;
        if admission
            && !ctx
                .instance
                .cache()
                .admission
                .admits(&plan.stats.admission, ctx.now)
        {
            let reason = BypassReason::NotAdmitted;
            ctx.instance.cache().bypassed(&self.db, reason);
            plan.stats.bypassed(reason);
            return Ok(Err(reason));
        }
        let reads = by_row.unwrap_or(tables);
        let shared = ctx.instance.cache().shared().is_some();
        let shared_reads = match &plan.keyed {
            Some(keyed) if by_row.is_some() && !keyed.ready(shared) => tables,
            _ => reads,
        };
        let req = Request {
            db: &self.db,
            key,
            reads,
            shared_reads,
            tier: plan.tier,
            lifetime: plan.lifetime,
            stats: &plan.stats,
            admission,
            in_transaction: self.tx.status != TxStatus::Idle,
            coalesce_wait: self.known.policy.coalesce_wait,
            first_read_wait: self.known.policy.first_read_wait,
            started: ctx.now,
            shadow: self.known.policy.mode == CacheMode::Shadow,
        };
        match ctx.instance.cache().lookup(&req, &mut self.found.lookup) {
            Ok(lookup) => Ok(Ok(lookup)),
            Err(wait) => Err(Need::Cache(wait)),
        }
    }

    /// What the cache's answer means for the client: a hit is staged for
    /// it, with a refresh or a sampler's check sent as `request` (the
    /// frames that ask for it again) when one is due.
    pub(super) fn answer(
        &mut self,
        ctx: &Ctx,
        looked: Result<Lookup, BypassReason>,
        by_row: Option<&Reads>,
        plan: &Plan,
        request: &[u8],
        row_limit: u32,
    ) -> Answer {
        if let Err(BypassReason::ReplicationDown)
        | Ok(Lookup::Bypass(BypassReason::ReplicationDown)) = &looked
        {
            // pgcache may have let go of the database: take hold again
            // (also for a table not yet published: the stream adds it).
            self.actions.push(Action::Watch);
        }
        let explain = plan.explain.then(|| Explain::new(&looked, ctx.now));
        let (bytes, refresh) = match looked {
            Err(_) => return Answer::Forward(None, explain),
            Ok(Lookup::Hit { bytes, refresh, .. }) => (bytes, refresh),
            Ok(Lookup::Miss(fill)) => return Answer::Forward(Some(Capture::new(fill)), explain),
            Ok(Lookup::Bypass(reason)) => {
                plan.stats.bypassed(reason);
                return Answer::Forward(None, explain);
            }
            // Checked against PostgreSQL's frames as they arrive, before
            // any row-limit cut for the client.
            Ok(Lookup::WouldHit(stored)) => {
                return Answer::Forward(Some(Capture::compare(stored)), explain);
            }
        };
        // The session saw the rows it read (or the tables) as of now.
        if ctx.instance.replicas().enabled()
            && let Some(reads) = by_row.or(plan.read.as_ref().ok())
        {
            self.observed_hit(reads, ctx.now);
        }
        let cut = (row_limit > 0).then(|| cut_stored(&bytes, row_limit));
        self.out
            .extend_from_slice(cut.flatten().as_deref().unwrap_or(&bytes));
        if let Some(explain) = explain {
            explain.notice(ctx.now, &mut self.out);
        }
        self.out
            .extend_from_slice(&messages::ready_for_query(self.tx.status));
        // A refresh, or a check of the correctness sampler: the request
        // again, as pgcache's own.
        let hidden = match refresh {
            Some(fill) => Some(Capture::new(fill)),
            None if self.sampled(ctx) => {
                let reads = plan.read.as_ref().expect("a hit has its reads");
                let check = Check::new(&self.db, &plan.stats, bytes, reads, plan.unwatched);
                Some(Capture::verify(check))
            }
            None => None,
        };
        let Some(capture) = hidden else {
            return Answer::Served { refreshed: false };
        };
        // Off the client's path where pgcache can; else on its connection,
        // answered to nobody.
        match offload::errand(&self.link, &self.known, &self.db, request) {
            Some(errand) => {
                self.actions
                    .push(Action::Offload(Box::new(errand), capture));
                Answer::Served { refreshed: false }
            }
            None => {
                self.forward(request);
                self.pipeline.push_hidden(Inflight::hidden(Some(capture)));
                Answer::Served { refreshed: true }
            }
        }
    }

    /// The correctness sampler checks this hit: a draw of the session's
    /// policy, outside a transaction block.
    fn sampled(&self, ctx: &Ctx) -> bool {
        let policy = &self.known.policy;
        let (rate, max) = (policy.verify_rate, policy.verify_max_per_sec);
        // No draw at all with the sampler off.
        self.tx.status == TxStatus::Idle
            && rate > 0.0
            && ctx.instance.cache().sampler.draw(
                (roll(ctx.draw), ctx.now),
                rate,
                max,
                &ctx.instance.metrics().verify,
            )
    }
}

/// A draw uniform in [0, 1), from `draw` ([`Ctx::draw`]).
fn roll(draw: fn() -> u64) -> f64 {
    (draw() >> 11) as f64 / (1u64 << 53) as f64
}
