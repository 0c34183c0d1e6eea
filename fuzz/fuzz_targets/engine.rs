//! The session engine: any run of client and backend frames must be
//! decided without a panic (`pgcache::session::fuzz::feed`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    pgcache::session::fuzz::feed(data);
});
