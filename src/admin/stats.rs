//! `SHOW STATS`: totals and hit ratios, overall and per tier, the mean
//! times, and why statements did not use the cache.

use super::ratio;
use crate::App;

pub(super) fn stats(app: &App) -> Vec<Vec<String>> {
    let m = &app.metrics;
    let s = &m.shared;
    let hits = m.hits.get();
    let misses = m.misses.get();
    let shared_hits = s.hit.get();
    let local_hits = m.tiers.local.hits.get();
    let disk_hits = m.tiers.disk.hits.get();
    let shared_lookups = shared_hits + s.miss.get() + s.rejected.get() + s.error.get();
    let rows: Vec<(&str, String)> = vec![
        ("lookups_hit", hits.to_string()),
        ("lookups_miss", misses.to_string()),
        ("lookups_bypass", m.bypasses.get().to_string()),
        ("hit_ratio", ratio(hits, hits + misses)),
        ("local_hits", local_hits.to_string()),
        ("local_hit_ratio", ratio(local_hits, hits + misses)),
        ("disk_hits", disk_hits.to_string()),
        ("disk_hit_ratio", ratio(disk_hits, hits + misses)),
        (
            "disk_up",
            app.cache.disk().is_some_and(|t| t.is_up()).to_string(),
        ),
        ("disk_entries", m.disk.entries.get().to_string()),
        ("disk_bytes", m.disk.bytes.get().to_string()),
        ("shared_hits", shared_hits.to_string()),
        ("shared_lookups", shared_lookups.to_string()),
        ("shared_hit_ratio", ratio(shared_hits, shared_lookups)),
        (
            "shared_up",
            app.cache.shared().is_some_and(|t| t.is_up()).to_string(),
        ),
        ("stores", m.stores.get().to_string()),
        ("coalesced", m.coalesced.get().to_string()),
        ("refreshes", m.refreshes.get().to_string()),
        ("hint_problems", m.hint_problems.get().to_string()),
        ("local_entries", app.cache.local.entry_count().to_string()),
        ("local_bytes", app.cache.local.weighted_bytes().to_string()),
        ("client_connections", m.client_connections.get().to_string()),
    ];
    let (hit_ms, miss_ms) = m.mean_latency_ms();
    let ms = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.3}"));
    let latency = [("mean_hit_ms", ms(hit_ms)), ("mean_miss_ms", ms(miss_ms))];
    // Why statements did not use the cache, the most frequent first.
    let bypasses = m
        .bypass_breakdown()
        .into_iter()
        .map(|(reason, n)| vec![format!("bypass.{reason}"), n.to_string()]);
    rows.into_iter()
        .chain(latency)
        .map(|(k, v)| vec![k.to_owned(), v])
        .chain(bypasses)
        .collect()
}
