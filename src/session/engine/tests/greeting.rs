//! Transaction mode's greeting: what pgcache tells a client it logs in
//! for, and when it needs a connection first.

use super::*;
use crate::session::link::{ClientState, Link};

#[test]
fn transaction_mode_the_greeting_tells_the_client_its_own_values_and_pgcaches_key() {
    use crate::pool::Statuses;
    let mut rig = Rig::new();
    rig.engine.startup.params.extend([
        ("client_encoding".into(), "utf8".into()),
        ("application_name".into(), "shop-web".into()),
        ("search_path".into(), "not reported".into()),
    ]);
    let pool = rig.app.pool.pooled.pool("shop", "alice");
    let state = ClientState::from_startup(&rig.engine.startup).expect("startup");
    rig.engine.link = Link::pooled(std::sync::Arc::clone(&pool), state);
    // The pool's latest login, as PostgreSQL reported it.
    let mut latest = Statuses::default();
    latest.set("server_version", "16.4");
    latest.set("client_encoding", "SQL_ASCII");
    latest.set("application_name", "");
    assert!(!rig.engine.logged_in());

    let ctx = ctx(&rig.app, &rig.entry);
    let out = rig
        .engine
        .greeting(&ctx, latest, &pool.reported, (77, &[1, 2, 3, 4]));

    let mut expected = Statuses::default();
    expected.set("server_version", "16.4");
    // The client's own values, as the server reports them.
    expected.set("client_encoding", "UTF8");
    expected.set("application_name", "shop-web");
    assert_eq!(
        out,
        expected.login_frames(&[&77u32.to_be_bytes(), &[1, 2, 3, 4]])
    );
    assert!(rig.engine.logged_in(), "logged in");
}

#[test]
fn transaction_mode_the_greeting_waits_for_a_connection_only_while_no_login_is_known() {
    use crate::session::engine::Greeting;
    let mut rig = Rig::new();
    let pool = rig.app.pool.pooled.pool("shop", "alice");
    let state = ClientState::from_startup(&rig.engine.startup).expect("startup");
    rig.engine.link = Link::pooled(pool, state);
    let ctx = ctx(&rig.app, &rig.entry);
    assert_eq!(rig.engine.greet(&ctx, false), Greeting::Connection);
    assert!(
        rig.engine.cancel.is_none(),
        "no key before the login is known"
    );

    // A connection held, whose login the pool did not keep: greeted with
    // what is known, and pgcache's key.
    assert_eq!(rig.engine.greet(&ctx, true), Greeting::Greeted);
    let (pid, secret) = rig.engine.cancel.as_ref().expect("a key").key();
    let mut key = pid.to_be_bytes().to_vec();
    key.extend_from_slice(secret);
    let sent = rig.sent_to_client();
    assert!(sent.ends_with(&rfq(TxStatus::Idle)));
    assert!(
        sent.windows(key.len()).any(|w| w == key),
        "BackendKeyData carries the registered key"
    );
    assert!(rig.engine.logged_in());
}
