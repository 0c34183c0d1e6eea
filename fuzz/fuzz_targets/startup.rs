//! The startup-packet parser: lengths, SSL/GSS/cancel requests, parameters.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgcache::protocol::startup;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(len)) = startup::packet_len(data) {
        assert!(len <= data.len());
        let _ = startup::parse(&data[..len]);
    }
    let _ = startup::parse(data);
});
