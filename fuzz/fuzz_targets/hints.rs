//! The hint lexer: any text must scan without panicking, and the normalised
//! text must stay within its bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let sql = String::from_utf8_lossy(data);
    let scan = pgcache::hints::scan(&sql);
    assert!(scan.normalized.len() <= 2048);
    if let Some(ttl) = scan.hints.ttl {
        assert!(!ttl.is_zero());
    }
});
