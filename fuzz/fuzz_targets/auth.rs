//! Authentication input from clients (SCRAM messages, SASLInitialResponse),
//! from PostgreSQL (the SASL offer, SCRAM server messages) and connection
//! strings: any bytes must be refused or accepted without panicking.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use pgcache::scram::{self, ClientExchange, ClientSecret, ServerBinding, Verifier};

fn verifier() -> &'static Verifier {
    static V: OnceLock<Verifier> = OnceLock::new();
    V.get_or_init(|| Verifier::random("pencil"))
}

fuzz_target!(|data: &[u8]| {
    let _ = pgcache::auth::initial_response(data);
    let _ = pgcache::auth::without_plus(data);
    let text = String::from_utf8_lossy(data);
    let _ = Verifier::parse(&text);
    let _ = pgcache::upstream::UpstreamUrl::parse(&text);

    // The server side: client-first, then client-final, split at the first NUL.
    let (first, last) = match text.split_once('\0') {
        Some((a, b)) => (a, b),
        None => (&*text, ""),
    };
    for mechanism in [scram::MECHANISM, scram::MECHANISM_PLUS] {
        let binding = ServerBinding {
            offered: data.first().is_some_and(|b| b & 1 == 1),
            data: Some(b"end-point"),
        };
        if let Ok((exchange, _)) = scram::server_first(verifier().clone(), mechanism, first, binding)
        {
            let _ = exchange.finish(last);
        }
    }
    // The client side, with a key (no PBKDF2 at the server's iteration count).
    let (mut client, _) = ClientExchange::start(ClientSecret::Key {
        client_key: [7; 32],
        verifier: verifier().clone(),
    });
    let _ = client.respond(first);
    let _ = client.verify(last);
});
