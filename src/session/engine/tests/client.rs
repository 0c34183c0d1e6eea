//! The client's side: what is served, what is forwarded, and what the
//! engine waits for.

use super::*;
use crate::pool::marks::Pin;
use crate::session::engine::life::Ending;
use crate::session::link::Link;

const READ: &str = "SELECT v FROM items WHERE k = 1";

/// The backend's answer to [`READ`], and the ReadyForQuery after it.
pub(super) fn answer() -> Vec<u8> {
    [description(), row("a"), complete("SELECT 1")].concat()
}

/// Runs [`READ`] once through the backend, so that it is stored.
fn fill(rig: &mut Rig) {
    assert_eq!(rig.client(&query(READ)), Flow::Continue);
    assert_eq!(rig.sent_to_backend(), query(READ), "a miss is forwarded");
    rig.backend(&[answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 1, "the answer is stored");
}

#[test]
fn a_repeated_read_is_answered_from_the_local_tier_and_the_backend_never_sees_it() {
    let mut rig = Rig::caching();
    fill(&mut rig);
    assert_eq!(rig.client(&query(READ)), Flow::Continue);
    assert!(rig.sent_to_backend().is_empty());
    assert_eq!(
        rig.sent_to_client(),
        [answer(), rfq(TxStatus::Idle)].concat()
    );
    assert!(rig.engine.pipeline.is_quiet());
    assert_eq!(rig.settings_reads, 1, "the settings are read once");
}

#[test]
fn a_read_whose_settings_cannot_be_read_is_forwarded_and_not_stored() {
    let mut rig = Rig::caching();
    rig.settings = None;
    rig.client(&query(READ));
    assert_eq!(rig.sent_to_backend(), query(READ));
    rig.backend(&[answer(), rfq(TxStatus::Idle)]);
    assert_eq!(rig.store(), 0);
}

#[test]
fn a_setting_changed_by_the_session_makes_it_read_its_settings_again() {
    let mut rig = Rig::caching();
    fill(&mut rig);
    rig.client(&query("SET TimeZone = 'UTC'"));
    rig.sent_to_backend();
    rig.backend(&[complete("SET"), rfq(TxStatus::Idle)]);
    rig.client(&query(READ));
    assert_eq!(rig.settings_reads, 2);
    // The same settings as before: the same key, served.
    assert!(rig.sent_to_backend().is_empty());
    assert!(rig.sent_to_client().ends_with(&rfq(TxStatus::Idle)));
}

#[test]
fn a_write_in_a_transaction_stops_hits_until_the_transaction_ends() {
    let mut rig = Rig::caching();
    rig.knows_table("other");
    fill(&mut rig);
    rig.client(&query("BEGIN"));
    assert_eq!(rig.sent_to_backend(), query("BEGIN"));
    rig.backend(&[complete("BEGIN"), rfq(TxStatus::InTransaction)]);
    rig.client(&query(READ));
    assert!(
        rig.sent_to_client().starts_with(&answer()),
        "served before a write"
    );
    // A write to another table leaves the entry's key as it was; a
    // trigger could still have written to `items`.
    rig.client(&query("UPDATE other SET v = 'b' WHERE k = 1"));
    rig.backend(&[complete("UPDATE 1"), rfq(TxStatus::InTransaction)]);
    rig.sent_to_backend();
    rig.client(&query(READ));
    assert_eq!(
        rig.sent_to_backend(),
        query(READ),
        "after a write: forwarded"
    );
    assert!(rig.sent_to_client().is_empty());
    rig.backend(&[answer(), rfq(TxStatus::InTransaction)]);
    rig.client(&query("COMMIT"));
    rig.backend(&[complete("COMMIT"), rfq(TxStatus::Idle)]);
    rig.sent_to_backend();
    rig.store();
    // Served again once the transaction is over.
    rig.client(&query(READ));
    assert!(rig.sent_to_backend().is_empty());
}

#[test]
fn nothing_is_served_while_a_request_is_in_flight() {
    let mut rig = Rig::caching();
    fill(&mut rig);
    rig.client(&query("SELECT pg_sleep(1)"));
    rig.client(&query(READ));
    assert_eq!(
        rig.sent_to_backend(),
        [query("SELECT pg_sleep(1)"), query(READ)].concat(),
        "pipelined behind a request: forwarded in order"
    );
    assert!(rig.sent_to_client().is_empty());
}

#[test]
fn copy_in_is_forwarded_frame_by_frame_and_ends_with_its_ready_for_query() {
    let mut rig = Rig::caching();
    rig.client(&query("COPY items FROM STDIN"));
    rig.backend(&[frame(be::COPY_IN_RESPONSE, &[0, 0, 0])]);
    let data = frame(fe::COPY_DATA, b"1\ta\n");
    rig.client(&data);
    rig.client(&frame(fe::COPY_DONE, &[]));
    // A Sync during COPY is the client's to send; it ends nothing.
    assert_eq!(
        rig.sent_to_backend(),
        [
            query("COPY items FROM STDIN"),
            data,
            frame(fe::COPY_DONE, &[])
        ]
        .concat()
    );
    rig.backend(&[complete("COPY 1"), rfq(TxStatus::Idle)]);
    assert!(rig.engine.pipeline.is_quiet());
}

#[test]
fn a_malformed_hint_is_warned_of_once_per_text() {
    let mut rig = Rig::caching();
    let sql = "/*+ ttl=banana */ SELECT v FROM items WHERE k = 1";
    rig.client(&query(sql));
    let warned = rig.sent_to_client();
    assert!(String::from_utf8_lossy(&warned).contains("hint ignored"));
    rig.backend(&[answer(), rfq(TxStatus::Idle)]);
    rig.client(&query(sql));
    assert!(!String::from_utf8_lossy(&rig.sent_to_client()).contains("hint ignored"));
}

#[test]
fn terminate_ends_the_session() {
    let mut rig = Rig::caching();
    assert_eq!(rig.client(&frame(fe::TERMINATE, &[])), Flow::Close);
    assert!(rig.engine.ending == Some(Ending::ClientEnded));
    assert_eq!(rig.sent_to_backend(), frame(fe::TERMINATE, &[]));
}

#[test]
fn transaction_mode_a_feature_that_lives_in_one_backend_pins_the_session() {
    for (sql, pinned) in [
        ("SELECT 1", None),
        ("LISTEN jobs", Some(Pin::Listen)),
        ("PREPARE p AS SELECT 1", Some(Pin::SqlPrepare)),
        ("SELECT pg_advisory_lock(7)", Some(Pin::AdvisoryLock)),
    ] {
        let mut rig = Rig::pooled();
        rig.client(&query(sql));
        let Link::Pooled(link) = &rig.engine.link else {
            panic!("transaction mode");
        };
        assert_eq!(link.pinned, pinned, "{sql}");
        assert_eq!(rig.sent_to_backend(), query(sql), "{sql}: forwarded");
    }
    // Session mode has nothing to pin: the session stays in its mode.
    let mut rig = Rig::caching();
    rig.client(&query("LISTEN jobs"));
    assert!(matches!(rig.engine.link, Link::Session(_)));
    assert_eq!(rig.sent_to_backend(), query("LISTEN jobs"));
}

#[test]
fn with_caching_off_requests_go_out_as_they_are_and_still_pin_the_session_and_end_it() {
    let mut rig = Rig::pooled();
    rig.engine.caching = false;
    let batch = [
        parse("", "SELECT v FROM items WHERE k = $1"),
        bind("", &["1"]),
        execute(0),
        sync(),
    ];
    rig.frames(&batch);
    assert_eq!(rig.sent_to_backend(), batch.concat(), "nothing held");
    assert_eq!(rig.engine.pipeline.len(), 1, "PostgreSQL answers the Sync");
    assert_eq!(rig.client(&query("LISTEN jobs")), Flow::Continue);
    assert_eq!(rig.sent_to_backend(), query("LISTEN jobs"));
    let Link::Pooled(link) = &rig.engine.link else {
        panic!("transaction mode");
    };
    assert_eq!(link.pinned, Some(Pin::Listen));
    // The pool's connection outlives the client: its Terminate stays here.
    assert_eq!(rig.client(&frame(fe::TERMINATE, &[])), Flow::Close);
    assert!(rig.sent_to_backend().is_empty());
    assert!(rig.engine.ending == Some(Ending::ClientEnded));
    // Session mode: PostgreSQL hears the Terminate, unless the connection
    // is handed back to be parked.
    let terminate = frame(fe::TERMINATE, &[]);
    for parks in [false, true] {
        let mut rig = Rig::logged_in();
        rig.engine.caching = false;
        rig.engine.server = crate::session::reuse::ServerBook::new(parks);
        assert_eq!(rig.client(&terminate), Flow::Close);
        assert_eq!(rig.sent_to_backend().is_empty(), parks);
        assert!(rig.engine.close_expected());
    }
}

#[test]
fn transaction_mode_a_clients_statement_goes_out_under_a_name_of_pgcaches() {
    let mut rig = Rig::pooled();
    rig.frames(&[
        parse("s1", "SELECT v FROM items WHERE k = $1"),
        bind("s1", &["1"]),
        execute(0),
        sync(),
    ]);
    let (staged, answers) = rig.engine.staged(&*rig.app);
    assert!(answers.is_empty(), "the connection lacks the statement");
    let sent = std::mem::take(staged);
    let frames: Vec<&[u8]> = crate::protocol::codec::frames(&sent).collect();
    assert_eq!(frames.len(), 4);
    let parse = crate::protocol::extended::parse(&frames[0][5..]).expect("a Parse");
    assert_ne!(parse.name, b"s1", "the server knows it by pgcache's name");
    assert!(!parse.name.is_empty());
    let (_, statement) = crate::protocol::extended::bind_names(&frames[1][5..]).expect("a Bind");
    assert_eq!(statement, parse.name, "the Bind names it the same way");
    assert!(rig.engine.pipeline.to_backend.is_empty());
}

/// What the engine does with `frame` now, needs and all.
fn decide(rig: &mut Rig, frame: &[u8]) -> Result<Flow, Need> {
    let ctx = ctx(&rig.app, &rig.entry);
    let frame = Bytes::copy_from_slice(frame);
    rig.engine.on_client_frame(&ctx, &frame)
}

#[test]
fn a_first_statement_waits_for_its_facts_only_where_a_shared_tier_could_answer() {
    let read = query("SELECT v FROM fresh WHERE k = 1");
    // No shared tier: forwarded at once (the facts are fetched meanwhile).
    let mut rig = Rig::logged_in();
    assert!(matches!(decide(&mut rig, &read), Ok(Flow::Continue)));
    assert_eq!(rig.sent_to_backend(), read);

    let mut rig = Rig::logged_in();
    let config = crate::Config::from_toml("[redis]\nurl = \"redis://127.0.0.1:1\"\n", "t".as_ref())
        .expect("config");
    let nodes = config.redis.nodes().expect("a Redis");
    let metrics = rig.app.metrics.shared.clone();
    let tier = crate::cache::shared::SharedTier::new(&config, nodes, "t", metrics);
    rig.app.cache.set_shared(std::sync::Arc::new(tier));
    match decide(&mut rig, &read) {
        Err(Need::Fetched { rels, .. }) => assert_eq!(rels, ["fresh"]),
        _ => panic!("a shared tier could answer: wait for the facts"),
    }
    assert!(rig.sent_to_backend().is_empty());
    // Waited once: decided.
    rig.engine.found.facts = true;
    assert!(matches!(decide(&mut rig, &read), Ok(Flow::Continue)));
    rig.engine.found.clear();

    // A name DDL made since start: no tier can hold an answer about it.
    rig.engine
        .db
        .catalog
        .forget(&crate::cache::Ddl::objects(["made"]));
    let read = query("SELECT v FROM made WHERE k = 1");
    assert!(matches!(decide(&mut rig, &read), Ok(Flow::Continue)));
}

#[test]
fn transaction_mode_the_engine_says_when_a_connection_is_taken_and_given_back() {
    use crate::session::engine::LinkStep::{CheckOut, GiveBack, ReadBack};
    let mut rig = Rig::pooled();
    rig.knows_table("items");
    let step = |rig: &Rig, attached: bool, unread: bool| rig.engine.link_step(attached, unread);
    // Nothing staged and nothing held: nothing to do.
    assert_eq!(step(&rig, false, false), None);
    let write = query("UPDATE items SET v = 1");
    rig.client(&write);
    assert_eq!(step(&rig, false, false), Some(CheckOut), "a request waits");
    assert_eq!(rig.sent_to_backend(), write);
    // Taken, and the request sent: kept until it is answered.
    assert_eq!(step(&rig, true, false), None);
    rig.backend(&[complete("UPDATE 1"), rfq(TxStatus::Idle)]);
    assert_eq!(step(&rig, true, false), Some(GiveBack));
    assert_eq!(step(&rig, true, true), None, "bytes not read yet");
    // Inside a transaction block: kept until it ends.
    rig.client(&query("BEGIN"));
    rig.sent_to_backend();
    rig.backend(&[complete("BEGIN"), rfq(TxStatus::InTransaction)]);
    assert_eq!(step(&rig, true, false), None);
    rig.client(&query("COMMIT"));
    rig.sent_to_backend();
    rig.backend(&[complete("COMMIT"), rfq(TxStatus::Idle)]);
    assert_eq!(step(&rig, true, false), Some(GiveBack));
    // A SET: the client's settings are read back before it goes back.
    rig.client(&query("SET search_path = a"));
    rig.sent_to_backend();
    rig.backend(&[complete("SET"), rfq(TxStatus::Idle)]);
    assert_eq!(step(&rig, true, false), Some(ReadBack));
    let Link::Pooled(link) = &mut rig.engine.link else {
        panic!("transaction mode");
    };
    link.settled(link.state.clone());
    assert_eq!(step(&rig, true, false), Some(GiveBack));
    // A feature that lives in one backend: the connection is the
    // session's for good.
    rig.client(&query("LISTEN jobs"));
    rig.sent_to_backend();
    rig.backend(&[complete("LISTEN"), rfq(TxStatus::Idle)]);
    assert_eq!(step(&rig, true, false), None);
    // Session mode takes nothing and gives nothing back.
    let mut rig = Rig::caching();
    rig.client(&write);
    assert_eq!(rig.engine.link_step(true, false), None);
    assert_eq!(rig.engine.link_step(false, false), None);
}

#[test]
fn transaction_mode_a_failed_checkout_fails_each_request_and_the_session_goes_on() {
    use crate::pool::PoolError;
    use crate::session::SessionError;
    let mut rig = Rig::pooled();
    rig.knows_table("items");
    rig.client(&query("UPDATE items SET v = 1"));
    rig.frames(&[parse("s1", "SELECT 1"), sync()]);
    assert!(rig.engine.known.statements.contains_key(&b"s1"[..]));
    let now = ctx(&rig.app, &rig.entry);
    rig.engine
        .checkout_failed(&now, SessionError::Pool(PoolError::WaitTimeout(5)))
        .expect("the session goes on");
    let answers = rig.sent_to_client();
    let e = PoolError::WaitTimeout(5);
    let mut expected = BytesMut::new();
    for _ in 0..2 {
        messages::error_response(&mut expected, "ERROR", e.sqlstate(), &e.to_string());
        expected.extend_from_slice(&rfq(TxStatus::Idle));
    }
    assert_eq!(answers, expected, "one error and ReadyForQuery a request");
    assert!(!rig.engine.pipeline.awaits_backend());
    assert!(
        !rig.engine.known.statements.contains_key(&b"s1"[..]),
        "a statement whose Parse never ran is forgotten"
    );
    assert_eq!(
        rig.engine.link_step(false, false),
        None,
        "nothing left to send"
    );

    // Half a batch (a Close goes out at once, its Sync still to come),
    // or another error: the session ends with it.
    rig.frames(&[frame(fe::CLOSE, b"Ss9\0")]);
    assert!(rig.engine.pipeline.unsynced);
    let now = ctx(&rig.app, &rig.entry);
    let e = rig
        .engine
        .checkout_failed(&now, SessionError::Pool(PoolError::Full))
        .expect_err("unsynced");
    assert_eq!(e.sqlstate(), PoolError::Full.sqlstate());
    let io = std::io::Error::other("reset");
    assert!(
        rig.engine
            .checkout_failed(&now, SessionError::ClientIo(io))
            .is_err()
    );
}

#[test]
fn transaction_mode_the_engine_names_the_pool_and_a_failed_checkout_fails_what_waited() {
    use crate::pool::PoolError;
    let mut rig = Rig::caching();
    assert!(
        matches!(rig.engine.checkout(&*rig.app), Ok(None)),
        "session mode"
    );
    let mut rig = Rig::pooled();
    let (pool, wait) = rig.engine.checkout(&*rig.app).expect("ok").expect("pooled");
    assert_eq!((&*pool.id.database, &*pool.id.user), ("shop", "alice"));
    assert_eq!(wait, rig.app.config().pool.query_wait_timeout());
    let Link::Pooled(link) = &mut rig.engine.link else {
        panic!("transaction mode");
    };
    link.no_connection = Some(Box::new(PoolError::WaitTimeout(5)));
    let Err(e) = rig.engine.checkout(&*rig.app) else {
        panic!("what waited fails");
    };
    assert_eq!(e.sqlstate(), PoolError::WaitTimeout(5).sqlstate());
    assert!(rig.engine.checkout(&*rig.app).is_ok(), "once");
}

#[test]
fn the_sampler_checks_a_hit_as_the_seeded_draw_says_and_the_client_is_served_either_way() {
    for rate in [1.0, 0.0] {
        let mut rig = Rig::caching();
        let toml = format!("[cache]\nverify_sample_rate = {rate:?}\n");
        let config = crate::Config::from_toml(&toml, "t".as_ref()).expect("config");
        let generation = rig.engine.known.policy.generation;
        let policy = crate::policy::Policy::new(&config.cache, generation);
        rig.engine.known.policy = std::sync::Arc::new(policy);
        fill(&mut rig);
        rig.client(&query(READ));
        assert_eq!(
            rig.sent_to_client(),
            [answer(), rfq(TxStatus::Idle)].concat()
        );
        let checked = rig.app.cache.sampler.drawn();
        assert_eq!(checked, u64::from(rate > 0.0), "rate {rate}");
        let sent = String::from_utf8_lossy(&rig.sent_to_backend()).into_owned();
        assert_eq!(
            sent.contains("SELECT"),
            rate > 0.0,
            "the check is the read again: {sent}"
        );
    }
}
