//! The classifier: any text, parsed by sqlparser and analysed, must yield an
//! answer (never a panic), and a statement that writes is never cacheable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgcache::classify::{Effect, analyze};

fuzz_target!(|data: &[u8]| {
    let Ok(sql) = std::str::from_utf8(data) else {
        return;
    };
    if sql.len() > 4096 {
        return;
    }
    let analysis = analyze(sql);
    if let Ok(st) = analysis.cacheable_select() {
        assert!(
            matches!(st.effect, Effect::None),
            "{sql:?} is cacheable but has effects"
        );
    }
});
