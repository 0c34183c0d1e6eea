//! The running pgcache as its sessions' engines see it: [`App`] behind
//! the narrow [`Instance`], and the [`Ctx`] of an event.

use std::sync::Arc;

use super::engine::{Ctx, Instance, Lesson};
use super::link::Knobs;
use super::{SharedLogins, SharedPlans};
use crate::App;
use crate::cache::Cache;
use crate::cancel::{CancelGuard, CancelTarget, ClientPid};
use crate::metrics::Metrics;
use crate::policy::Policy;
use crate::pool::clients::ClientEntry;
use crate::pool::transaction::Pool;
use crate::replica::Replicas;
use crate::upstream::Upstream;

impl Instance for App {
    fn cache(&self) -> &Cache {
        &self.cache
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn replicas(&self) -> &Replicas {
        &self.replicas
    }

    fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    fn plans(&self) -> &SharedPlans {
        &self.plans
    }

    fn logins(&self) -> &SharedLogins {
        &self.logins
    }

    fn policy(&self) -> Arc<Policy> {
        App::policy(self)
    }

    fn policy_generation(&self) -> u64 {
        App::policy_generation(self)
    }

    fn publication(&self) -> Option<String> {
        App::publication(self)
    }

    fn pool_knobs(&self, memo: &mut Knobs) -> Knobs {
        let generation = App::policy_generation(self);
        if memo.generation != generation {
            let config = self.config();
            *memo = Knobs {
                generation,
                wait: config.pool.query_wait_timeout(),
                lifetime: config.pool.server_lifetime(),
                max_prepared: config.pool.max_prepared_statements,
            };
        }
        *memo
    }

    fn register_cancel(&self) -> (u32, Vec<u8>, CancelGuard) {
        self.cancel.register_pooled()
    }

    fn register_cancel_for(&self, backend: &CancelTarget) -> (u32, Vec<u8>, CancelGuard) {
        self.cancel.register(backend.clone(), ClientPid::Backend)
    }

    fn evict_parked(&self) {
        self.pool.evict_all();
    }

    fn draining(&self) -> bool {
        self.drain.is_cancelled()
    }

    fn teach_pool(&self, pool: &Pool, lesson: Lesson<'_>) {
        match lesson {
            Lesson::Trusted => pool.learn_trusted(),
            Lesson::Reported {
                name,
                value,
                reported,
            } => pool.reported.learn(name, value, reported),
            Lesson::Settings {
                state,
                policy,
                generation,
                row,
            } => pool.remember_settings(state, policy, generation, row),
        }
    }
}

/// What the engine reads with an event of the client's (`entry`): the
/// instance, the time now and the process's randomness.
pub(super) fn ctx<'a>(app: &'a App, entry: &'a ClientEntry) -> Ctx<'a> {
    Ctx {
        instance: app,
        client: &entry.client,
        now: std::time::Instant::now(),
        draw: rand::random,
    }
}
