//! pgcache's own requests for a served hit (a refresh-ahead, a check of
//! the correctness sampler) run off the client's path, on a connection of
//! the pool of the client's database and user put in the client's
//! settings, so that the client's next statement neither waits for them
//! nor bypasses the cache because of them. The request is the client's own
//! frames, translated with its statements: in transaction mode a copy of
//! its translator's, in session mode those it prepared on its own
//! connection.

use std::sync::Arc;
use std::time::Instant;

use tracing::debug;

use super::capture::{Capture, Captured};
use super::known::Known;
use super::link::{Link, SessionLink};
use crate::App;
use crate::cache::DbState;
use crate::pool::errand::Errand;
use crate::pool::prepared::Translator;
use crate::protocol::codec::{HEADER_LEN, frames};
use crate::protocol::{extended, frontend as fe};

/// pgcache's own request for a served hit: `request` (frames ending in
/// Sync, or a Query) as an errand on a connection of the session's pool;
/// `None` when that cannot be done: pgcache does not know the client's
/// settings or a statement the request names, or cannot log in for the
/// client (passthrough authentication with a password).
pub(super) fn errand(link: &Link, known: &Known, db: &DbState, request: &[u8]) -> Option<Errand> {
    let (pool, translator) = match link {
        Link::Pooled(link) if !link.state_dirty => {
            (Arc::clone(&link.pool), link.translator.for_request())
        }
        // Session mode: the settings were read with the hit's key.
        Link::Session(SessionLink {
            checks: Some(pool), ..
        }) if known.prefix.is_some() && pool.can_log_in() => {
            (Arc::clone(pool), statements_for(known, db, request)?)
        }
        _ => return None,
    };
    let state = link.state();
    Some(Errand {
        pool,
        translator,
        settings: (state.id, state.apply_sql()),
        request: request.to_vec(),
    })
}

/// An errand for `capture` ran, to `result` (when its answer was
/// complete): what it captured is stored or judged.
pub(super) fn finish(app: &App, capture: Capture, result: Result<Instant, &'static str>) {
    let is_check = capture.is_check();
    let answered = match result {
        Ok(done) => capture.finish().map(|captured| (captured, done)),
        Err(why) => {
            debug!(why, "request for a served hit dropped");
            None
        }
    };
    match answered {
        Some((Captured::Store(fill, bytes), _)) => app.cache.store(*fill, &bytes),
        Some((Captured::Verified(check, answer), done)) => check.judge(&app.cache, &answer, done),
        Some((Captured::Compared { .. }, _)) => {}
        // Every drawn check gets a verdict.
        None if is_check => app.metrics.verify.skipped.inc(),
        None => {}
    }
}

/// Session mode: a translator that knows the statements `request`
/// names but does not prepare, as the client prepared them on its own
/// connection; `None` if one is unknown to pgcache.
fn statements_for(known: &Known, db: &DbState, request: &[u8]) -> Option<Translator> {
    let mut translator = Translator::following(Arc::clone(&db.versions.schema));
    let mut seen: Vec<&[u8]> = Vec::new();
    for frame in frames(request) {
        let body = &frame[HEADER_LEN..];
        let name = match frame[0] {
            fe::PARSE => {
                seen.push(extended::parse(body)?.name);
                continue;
            }
            fe::BIND => extended::bind_names(body)?.1,
            fe::DESCRIBE => match extended::target(body)? {
                (fe::TARGET_STATEMENT, name) => name,
                _ => continue,
            },
            _ => continue,
        };
        if seen.contains(&name) {
            continue;
        }
        let statement = known.statements.get(name)?;
        translator.define(name, &statement.sql, &statement.param_types);
        seen.push(name);
    }
    Some(translator)
}
