//! Values read from Redis: anything stored there decodes to an entry or a
//! rejection, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let value = bytes::Bytes::copy_from_slice(data);
    let _ = pgcache::cache::shared::entry::decode(value, 7, &[1, 2]);
});
