//! The frame decoder and the bounds-checked views of client messages, and
//! the pgoutput decoder: arbitrary bytes must never panic or read past the end.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgcache::protocol::{codec, extended};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some(len)) = codec::parse_frame(rest, 1 << 20) {
        assert!(len >= codec::HEADER_LEN && len <= rest.len());
        let body = &rest[codec::HEADER_LEN..len];
        let _ = extended::parse(body);
        let _ = extended::bind_names(body);
        if let Some(formats) = extended::walk_bind(body, |_, _| {}) {
            formats.for_each(drop);
        }
        let _ = extended::target(body);
        let _ = extended::execute(body);
        let _ = extended::data_row(body);
        rest = &rest[len..];
    }
    let _ = codec::missing_bytes(data);
    let _ = pgcache::invalidation::pgoutput::decode(data);
});
