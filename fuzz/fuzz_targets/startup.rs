//! The startup-packet parser: lengths, SSL/GSS/cancel requests, parameters.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pgcache::protocol::startup;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(len)) = startup::packet_len(data) {
        assert!(len <= data.len());
        let _ = startup::parse(&data[..len]);
    }
    if let Ok(startup::StartupPacket::Startup(before)) = startup::parse(data)
        && let Some(added) = startup::with_setting(data, "a.b", "1")
    {
        // The same packet but for its options, which end with the setting.
        let Ok(startup::StartupPacket::Startup(after)) = startup::parse(&added) else {
            panic!("a packet with a setting added does not parse");
        };
        let others = |s: &startup::Startup| {
            s.params
                .iter()
                .filter(|(k, _)| k != "options")
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(others(&before), others(&after));
        assert!(after.param("options").unwrap().ends_with("-c a.b=1"));
    }
});
