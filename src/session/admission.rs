//! What a StartupMessage becomes, decided without I/O: turned away (TLS
//! required, no place under `server.max_client_connections`, a wrong
//! password in terminate mode, a startup transaction mode cannot carry),
//! the admin console, or a session, in session or transaction mode, with
//! its first server connection. [`Admission`] takes the client there one
//! [`Step`] at a time; the driver ([`super::relay`]) does what each step
//! asks and hands back what came of it.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use tracing::{info, warn};

use super::SessionError;
use super::engine::Engine;
use super::known::Known;
use super::link::{ClientState, Link, SessionLink};
use super::reuse::ServerBook;
use crate::App;
use crate::auth::{ExchangeError, LookupError, SaslServer, Turn};
use crate::backend::{BackendError, BackendStream};
use crate::config::{AuthMode, PoolMode, SslMode};
use crate::pool::clients::Arrival;
use crate::pool::transaction::Pool;
use crate::pool::{PoolKey, Server};
use crate::protocol::codec::MAX_BACKEND_FRAME;
use crate::protocol::sqlstate;
use crate::protocol::startup::Startup;
use crate::protocol::stream::{FramedStream, READ_CHUNK};
use crate::scram::{ClientSecret, Credentials};
use crate::tls::ClientStream;
use crate::upstream::UpstreamAddr;

/// A StartupMessage, as received and as parsed.
pub struct Negotiated {
    pub raw: BytesMut,
    pub startup: Startup,
}

/// Where a StartupMessage goes, before authentication.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Door {
    /// The admin console (`admin.database`, when it has a password).
    Admin,
    /// A session, once the client is authenticated.
    Session,
}

/// The first checks of a StartupMessage: TLS where it is required
/// (`on_tls`: the client's connection is), a place under the connection
/// limit (`placed`: one was free), then the admin console.
pub(super) fn door(
    app: &App,
    on_tls: bool,
    placed: bool,
    startup: &Startup,
) -> Result<Door, SessionError> {
    if app.tls.mode == SslMode::Require && !on_tls {
        return Err(SessionError::refused(
            sqlstate::INVALID_AUTHORIZATION,
            "pgcache requires TLS: connect with sslmode=require (or stronger)",
        ));
    }
    if !placed {
        return Err(SessionError::refused(
            sqlstate::TOO_MANY_CONNECTIONS,
            "sorry, too many clients already",
        ));
    }
    let admin = &app.config().admin;
    match !admin.password.is_empty() && startup.database() == admin.database {
        true => Ok(Door::Admin),
        false => Ok(Door::Session),
    }
}

/// Where an authenticated client's session gets its server connections.
pub(super) enum Mode {
    /// Session mode: a connection of its own, a parked one under `key`
    /// first if there is one it may have, and the pool pgcache's own
    /// requests for its hits run on (`checks`, with caching on).
    Session {
        key: Option<PoolKey>,
        checks: Option<Arc<Pool>>,
    },
    /// Transaction mode: the pool of its database and user, and the
    /// client's state there.
    Pooled { pool: Arc<Pool>, state: ClientState },
}

/// The session's mode: transaction mode for a client whose startup a
/// pool can take, else session mode. The client's secret (`secret`, when
/// pgcache checked its password) is taught to the pool that logs in with
/// it.
pub(super) fn mode(
    app: &App,
    startup: &Startup,
    secret: Option<&ClientSecret>,
) -> Result<Mode, SessionError> {
    let config = app.config();
    let poolable = PoolKey::of(startup);
    let learn = |pool: &Arc<Pool>| {
        if let Some(secret) = secret {
            pool.learn_secret(secret.clone());
        }
    };
    if config.pool.mode == PoolMode::Transaction && poolable.is_some() {
        let state = ClientState::from_startup(startup)
            .map_err(|message| SessionError::refused(sqlstate::FEATURE_NOT_SUPPORTED, message))?;
        let pool = app.pool.pooled.pool(startup.database(), startup.user());
        learn(&pool);
        return Ok(Mode::Pooled { pool, state });
    }
    let checks = config.cache.enabled && poolable.is_some();
    let key = poolable.filter(|_| config.pool.max_idle_servers > 0);
    let checks = checks.then(|| app.pool.pooled.pool(startup.database(), startup.user()));
    if let Some(pool) = &checks {
        learn(pool);
    }
    Ok(Mode::Session { key, checks })
}

impl Mode {
    /// The session's link to its server connections
    /// (`checked_by_pgcache`: pgcache authenticated the client itself).
    pub fn into_link(self, checked_by_pgcache: bool) -> Link {
        match self {
            Mode::Session { key, checks } => Link::Session(SessionLink {
                checks,
                parks_under: key,
                checked_by_pgcache,
                ..SessionLink::default()
            }),
            Mode::Pooled { pool, state } => Link::pooled(pool, state),
        }
    }
}

/// A client on its way from its StartupMessage to a session.
pub(super) struct Admission {
    negotiated: Negotiated,
    on_tls: bool,
    /// Terminate mode: the exchange with the client, and what is known
    /// of its user.
    exchange: Option<(Box<SaslServer>, Option<Credentials>)>,
    /// Terminate mode: what logs in to PostgreSQL on the client's behalf.
    secret: Option<Box<ClientSecret>>,
    mode: Option<Mode>,
    first: Option<First>,
}

/// What the driver is to do next for a client being admitted, and which
/// of [`Admission`]'s methods it hands the outcome to.
pub(super) enum Step {
    /// Turned away: the client is told.
    Refuse(SessionError),
    /// The admin console takes the connection.
    Admin,
    /// Terminate mode: the user's credentials are looked up
    /// ([`Admission::found`]).
    Lookup,
    /// Terminate mode: `out` goes to the client, then (`read`) its next
    /// message is read ([`Admission::answered`]).
    Send { out: BytesMut, read: bool },
    /// The client is listed in `SHOW CLIENTS` ([`Admission::registered`]).
    Register,
    /// Transaction mode: the pool's lesson in how to log in is held while
    /// this client's login teaches it; then [`Step::Connect`].
    Learn(Arc<Pool>),
    /// Session mode: a connection parked under the key, if there is one
    /// (`trusted_only`: one PostgreSQL let log in with a password)
    /// ([`Admission::parked`]).
    TakeParked { key: PoolKey, trusted_only: bool },
    /// A new connection to the primary ([`Admission::connected`]).
    Connect,
    /// Admitted: [`Admission::into_admitted`].
    Ready,
}

/// A session's first server connection: none in transaction mode for a
/// client the pool logs in for, else a new or parked one, where it is, and
/// what the session keeps of it.
pub(super) struct First {
    pub stream: Option<FramedStream<BackendStream>>,
    pub addr: UpstreamAddr,
    pub book: ServerBook,
}

/// An admitted client: what its login needs, and what its session is
/// built from.
pub(super) struct Admitted {
    pub login: Box<Login>,
    pub parts: Parts,
}

/// What a session is built from.
pub(super) struct Parts {
    pub startup: Startup,
    pub link: Link,
    pub first: First,
}

impl Parts {
    /// The session's engine, and its first server connection.
    pub fn into_engine(self, app: &App) -> (Engine, Option<FramedStream<BackendStream>>) {
        let (known, caching) = (Known::new(app.policy()), app.config().cache.enabled);
        let Parts {
            startup,
            link,
            first,
        } = self;
        let engine = Engine::new(caching, startup, known, (link, first.book), first.addr);
        (engine, first.stream)
    }
}

impl Admission {
    pub fn new(negotiated: Negotiated, on_tls: bool) -> Self {
        Self {
            negotiated,
            on_tls,
            exchange: None,
            secret: None,
            mode: None,
            first: None,
        }
    }

    pub fn startup(&self) -> &Startup {
        &self.negotiated.startup
    }

    /// The first step: the door (`placed`: a place under the connection
    /// limit was free), then authentication or the session's mode.
    pub fn begin(&mut self, app: &App, placed: bool) -> Step {
        match door(app, self.on_tls, placed, self.startup()) {
            Err(e) => Step::Refuse(e),
            Ok(Door::Admin) => Step::Admin,
            Ok(Door::Session) if app.config().auth.mode == AuthMode::Terminate => Step::Lookup,
            Ok(Door::Session) => self.decide_mode(app),
        }
    }

    /// Terminate mode: what was found of the user (`None`: the lookup
    /// outlasted the startup timeout). An unknown user's exchange runs
    /// against a stand-in no password matches.
    pub fn found(
        &mut self,
        app: &App,
        found: Option<Result<Option<Credentials>, LookupError>>,
    ) -> Step {
        let user = self.startup().user();
        let found = match found {
            None => return Self::timed_out(),
            Some(Ok(found)) => found,
            Some(Err(e)) => {
                warn!(user, error = %e, "cannot look up a user's password");
                let message = format!("pgcache cannot check the password of user \"{user}\" now");
                return self.refuse(app, sqlstate::INVALID_AUTHORIZATION, message);
            }
        };
        let verifier = match &found {
            Some(c) => c.verifier.clone(),
            None => app.auth.stand_in(user),
        };
        let end_point = self.on_tls.then(|| app.tls.end_point()).flatten();
        let (exchange, out) = SaslServer::start(verifier, end_point);
        self.exchange = Some((Box::new(exchange), found));
        Step::Send { out, read: true }
    }

    /// Terminate mode: the client's message read after a [`Step::Send`]
    /// (none when nothing was to be read; `None`: the exchange outlasted
    /// the startup timeout).
    pub fn answered(
        &mut self,
        app: &App,
        read: Option<Result<Option<BytesMut>, ExchangeError>>,
    ) -> Step {
        let turn = match read {
            None => return Self::timed_out(),
            Some(Ok(None)) => return self.decide_mode(app),
            Some(Ok(Some(frame))) => match &mut self.exchange {
                Some((exchange, _)) => exchange.on_frame(&frame),
                None => Err(ExchangeError::Unexpected("no exchange")),
            },
            Some(Err(e)) => Err(e),
        };
        let user = self.startup().user();
        let failed = format!("password authentication failed for user \"{user}\"");
        match turn {
            Ok(Turn::Continue(out)) => Step::Send { out, read: true },
            Ok(Turn::Proven(out, client_key)) => {
                let Some((_, Some(found))) = self.exchange.take() else {
                    return self.refuse(app, sqlstate::INVALID_PASSWORD, failed);
                };
                let secret = match found.password {
                    Some(password) => ClientSecret::Password(password),
                    None => ClientSecret::Key {
                        client_key,
                        verifier: found.verifier,
                    },
                };
                self.secret = Some(Box::new(secret));
                Step::Send { out, read: false }
            }
            Ok(Turn::Refused) => self.refuse(app, sqlstate::INVALID_PASSWORD, failed),
            Err(e) => {
                let message = format!("authentication: {e}");
                self.refuse(app, sqlstate::PROTOCOL_VIOLATION, message)
            }
        }
    }

    /// Terminate mode: the client's authentication failed.
    fn refuse(&self, app: &App, code: &'static str, message: String) -> Step {
        app.metrics.auth_failures.client.inc();
        info!(user = self.startup().user(), reason = %message, "authentication failed");
        Step::Refuse(SessionError::refused(code, message))
    }

    fn decide_mode(&mut self, app: &App) -> Step {
        match mode(app, self.startup(), self.secret.as_deref()) {
            Ok(mode) => {
                self.mode = Some(mode);
                Step::Register
            }
            Err(e) => Step::Refuse(e),
        }
    }

    /// The client's line in `SHOW CLIENTS`.
    pub fn arrival(&self, addr: SocketAddr) -> Arrival<'_> {
        let startup = self.startup();
        Arrival {
            user: startup.user(),
            database: startup.database(),
            addr,
            tls: self.on_tls,
            application_name: startup.param("application_name").unwrap_or_default(),
        }
    }

    /// Listed: the first server connection, as the mode has it. In session
    /// mode, a parked one it may have (one PostgreSQL would have let it
    /// open without a password, unless pgcache checked it), else a new
    /// one; in transaction mode none for a client the pool can log in
    /// for, else a new one to log in on, relayed, holding the pool's
    /// lesson in how to log in.
    pub fn registered(&mut self, app: &App) -> Step {
        match &self.mode {
            Some(Mode::Pooled { pool, .. }) if pool.can_log_in() => Step::Ready,
            Some(Mode::Pooled { pool, .. }) => Step::Learn(Arc::clone(pool)),
            Some(Mode::Session { key: Some(key), .. }) => Step::TakeParked {
                key: key.clone(),
                trusted_only: self.secret.is_none(),
            },
            _ => self.fresh(app),
        }
    }

    /// Session mode: the parked connection taken, if there was one.
    pub fn parked(&mut self, app: &App, server: Option<Server>) -> Step {
        let Some(server) = server else {
            return self.fresh(app);
        };
        let book = ServerBook::reused(&server);
        let (stream, addr) = server.replay_login();
        self.first = Some(First {
            stream: Some(stream),
            addr,
            book,
        });
        Step::Ready
    }

    fn fresh(&mut self, app: &App) -> Step {
        if let Some(Mode::Session { .. }) = self.mode {
            app.metrics.pool.fresh.inc();
        }
        Step::Connect
    }

    /// The new connection, or why there is none. In session mode it is
    /// parked at the session's end, if the pool keeps idle connections.
    pub fn connected(
        &mut self,
        app: &App,
        connected: Result<(BackendStream, UpstreamAddr), BackendError>,
    ) -> Step {
        let (stream, addr) = match connected {
            Ok(connected) => connected,
            Err(e) => return Step::Refuse(SessionError::Connect(e)),
        };
        let parks = matches!(self.mode, Some(Mode::Session { .. }))
            && app.config().pool.max_idle_servers > 0;
        let buffer = BytesMut::with_capacity(READ_CHUNK);
        self.first = Some(First {
            stream: Some(FramedStream::new(stream, buffer, MAX_BACKEND_FRAME)),
            addr,
            book: ServerBook::new(parks),
        });
        Step::Ready
    }

    /// What the session is built from, once [`Step::Ready`]. The client's
    /// secret stays with its login in session mode; in transaction mode
    /// the pool was taught it.
    pub fn into_admitted(self, app: &App) -> Admitted {
        let checked_by_pgcache = self.secret.is_some();
        let mode = self.mode.unwrap_or(Mode::Session {
            key: None,
            checks: None,
        });
        let secret = self.secret.filter(|_| matches!(mode, Mode::Session { .. }));
        let link = mode.into_link(checked_by_pgcache);
        let Negotiated { raw, startup } = self.negotiated;
        // None: transaction mode, for a client the pool logs in for.
        let first = self.first.unwrap_or_else(|| First {
            stream: None,
            addr: app.upstream.addrs[0].clone(),
            book: ServerBook::new(false),
        });
        Admitted {
            login: Box::new(Login { raw, secret }),
            parts: Parts {
                startup,
                link,
                first,
            },
        }
    }

    /// Terminate mode: the client took longer than `startup_timeout` to
    /// authenticate.
    fn timed_out() -> Step {
        Step::Refuse(SessionError::refused(
            sqlstate::CONNECTION_EXCEPTION,
            "timeout expired during authentication",
        ))
    }
}

/// A client turned away, with why.
pub(super) type Refused = (FramedStream<ClientStream>, SessionError);

/// What a session's login to PostgreSQL needs: the StartupMessage as the
/// client sent it, and the client's secret when pgcache checked it
/// ([`super::engine::Engine::start`]).
pub(super) struct Login {
    pub raw: BytesMut,
    pub secret: Option<Box<ClientSecret>>,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::Config;

    fn app(toml: &str) -> App {
        App::new(Config::from_toml(toml, Path::new("t")).expect("config")).expect("app")
    }

    fn startup(database: &str, extra: &[(&str, &str)]) -> Startup {
        let mut params = vec![
            ("user".to_owned(), "alice".to_owned()),
            ("database".to_owned(), database.to_owned()),
        ];
        params.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        Startup {
            version: 196_608,
            params,
        }
    }

    #[test]
    fn the_door_refuses_plain_text_where_tls_is_required_then_a_client_over_the_limit() {
        let open = app("");
        assert_eq!(
            door(&open, false, true, &startup("shop", &[])).ok(),
            Some(Door::Session)
        );
        let full = door(&open, false, false, &startup("shop", &[]));
        assert_eq!(
            full.err().map(|e| e.sqlstate().to_owned()).as_deref(),
            Some(sqlstate::TOO_MANY_CONNECTIONS)
        );
        let admin = app("[admin]\npassword = \"pw\"\n");
        assert_eq!(
            door(&admin, false, true, &startup("pgcache", &[])).ok(),
            Some(Door::Admin)
        );
        assert_eq!(
            door(&admin, false, true, &startup("shop", &[])).ok(),
            Some(Door::Session)
        );
    }

    #[test]
    fn transaction_mode_takes_a_poolable_startup_and_refuses_one_it_cannot_carry() {
        let pooled = app("[pool]\nmode = \"transaction\"\n");
        let secret = ClientSecret::Password("pw".into());
        match mode(&pooled, &startup("shop", &[]), Some(&secret)) {
            Ok(Mode::Pooled { pool, .. }) => assert!(pool.can_log_in(), "the secret is taught"),
            _ => panic!("transaction mode"),
        }
        // A replication connection is never pooled: session mode.
        let replication = startup("shop", &[("replication", "database")]);
        assert!(matches!(
            mode(&pooled, &replication, None),
            Ok(Mode::Session {
                key: None,
                checks: None
            })
        ));
        let odd = startup("shop", &[("options", "-c")]);
        let refused = mode(&pooled, &odd, None)
            .err()
            .map(|e| e.sqlstate().to_owned());
        assert_eq!(refused.as_deref(), Some(sqlstate::FEATURE_NOT_SUPPORTED));
    }

    #[test]
    fn session_mode_parks_under_a_key_only_with_room_for_idle_servers() {
        let parks = app("");
        match mode(&parks, &startup("shop", &[]), None) {
            Ok(Mode::Session { key, checks }) => {
                assert_eq!(key.is_some(), parks.config().pool.max_idle_servers > 0);
                assert!(checks.is_some(), "caching on: the pool its checks run on");
            }
            _ => panic!("session mode"),
        }
        let none = app("[pool]\nmax_idle_servers = 0\n[cache]\nenabled = false\n");
        assert!(matches!(
            mode(&none, &startup("shop", &[]), None),
            Ok(Mode::Session {
                key: None,
                checks: None
            })
        ));
    }

    /// Terminate mode with `alice`'s password configured, and no pool
    /// that keeps idle connections (so a session connects anew).
    fn terminating() -> App {
        app(
            "[auth]\nmode = \"terminate\"\nusers = { alice = \"pencil\" }\n[pool]\nmax_idle_servers = 0\n",
        )
    }

    fn negotiated(database: &str) -> Negotiated {
        Negotiated {
            raw: BytesMut::new(),
            startup: startup(database, &[]),
        }
    }

    /// What `auth.users` says of alice.
    fn alice(app: &App) -> Result<Option<Credentials>, LookupError> {
        let runtime = tokio::runtime::Builder::new_current_thread().build();
        runtime
            .expect("runtime")
            .block_on(app.auth.lookup("", "alice"))
    }

    /// The client's SASL message carrying `text`, as a frame.
    fn sasl(initial: bool, text: String) -> BytesMut {
        use pgwire::messages::startup::{SASLInitialResponse, SASLResponse};
        let mut out = BytesMut::new();
        match initial {
            true => crate::protocol::messages::encode(
                &mut out,
                SASLInitialResponse::new(crate::scram::MECHANISM.to_owned(), Some(text.into())),
            ),
            false => crate::protocol::messages::encode(&mut out, SASLResponse::new(text.into())),
        }
        out
    }

    /// Runs terminate mode's exchange for `password` up to its verdict.
    fn exchange(app: &App, admission: &mut Admission, password: &str) -> Step {
        use crate::scram::ClientExchange;
        let Step::Send { read: true, .. } = admission.found(app, Some(alice(app))) else {
            panic!("AuthenticationSASL goes out");
        };
        let (mut client, first) = ClientExchange::start(ClientSecret::Password(password.into()));
        let Step::Send { out, read: true } =
            admission.answered(app, Some(Ok(Some(sasl(true, first)))))
        else {
            panic!("SASLContinue goes out");
        };
        let server_first = String::from_utf8_lossy(&out[9..]).into_owned();
        let last = client.respond(&server_first).expect("server-first");
        admission.answered(app, Some(Ok(Some(sasl(false, last)))))
    }

    #[test]
    fn terminate_mode_checks_the_password_before_it_connects() {
        let app = terminating();
        let mut admission = Admission::new(negotiated("shop"), false);
        assert!(matches!(admission.begin(&app, true), Step::Lookup));
        let Step::Send { read: false, .. } = exchange(&app, &mut admission, "pencil") else {
            panic!("SASLFinal goes out, and nothing more is read");
        };
        assert!(matches!(
            admission.answered(&app, Some(Ok(None))),
            Step::Register
        ));
        assert!(matches!(admission.registered(&app), Step::Connect));
        let admitted = admission.into_admitted(&app);
        assert!(
            matches!(admitted.login.secret.as_deref(), Some(ClientSecret::Password(p)) if p == "pencil"),
            "session mode logs in with the client's secret"
        );
    }

    #[test]
    fn a_wrong_password_or_a_broken_exchange_is_refused_and_counted() {
        let app = terminating();
        let mut admission = Admission::new(negotiated("shop"), false);
        admission.begin(&app, true);
        let refused = match exchange(&app, &mut admission, "crayon") {
            Step::Refuse(e) => e.sqlstate().to_owned(),
            _ => panic!("refused"),
        };
        assert_eq!(refused, sqlstate::INVALID_PASSWORD);
        assert_eq!(app.metrics.auth_failures.client.get(), 1);
        let mut admission = Admission::new(negotiated("shop"), false);
        admission.begin(&app, true);
        admission.found(&app, Some(alice(&app)));
        let query = BytesMut::from(&b"Q\0\0\0\x0bSELECT\0"[..]);
        let broken = match admission.answered(&app, Some(Ok(Some(query)))) {
            Step::Refuse(e) => e.sqlstate().to_owned(),
            _ => panic!("refused"),
        };
        assert_eq!(broken, sqlstate::PROTOCOL_VIOLATION);
        assert_eq!(app.metrics.auth_failures.client.get(), 2);
    }

    #[test]
    fn an_unknown_user_fails_the_exchange_and_a_slow_lookup_or_client_is_refused() {
        let app = terminating();
        let mut admission = Admission::new(negotiated("shop"), false);
        admission.begin(&app, true);
        let Step::Send { read: true, .. } = admission.found(&app, Some(Ok(None))) else {
            panic!("the exchange runs against a stand-in");
        };
        let lost = LookupError::Secret(crate::scram::ScramError::BindingType);
        let mut admission = Admission::new(negotiated("shop"), false);
        let refused = match admission.found(&app, Some(Err(lost))) {
            Step::Refuse(e) => e.sqlstate().to_owned(),
            _ => panic!("refused"),
        };
        assert_eq!(refused, sqlstate::INVALID_AUTHORIZATION);
        // Past the startup timeout, the lookup or the exchange.
        for late in [
            Admission::new(negotiated("shop"), false).found(&app, None),
            Admission::new(negotiated("shop"), false).answered(&app, None),
        ] {
            match late {
                Step::Refuse(e) => assert_eq!(e.sqlstate(), sqlstate::CONNECTION_EXCEPTION),
                _ => panic!("refused"),
            }
        }
    }

    #[test]
    fn a_session_takes_a_parked_connection_first_and_a_pooled_client_may_need_none() {
        let parks = app("[pool]\nmax_idle_servers = 4\n");
        let mut admission = Admission::new(negotiated("shop"), false);
        assert!(matches!(admission.begin(&parks, true), Step::Register));
        match admission.registered(&parks) {
            Step::TakeParked { trusted_only, .. } => {
                assert!(trusted_only, "pgcache did not check the password")
            }
            _ => panic!("a parked connection first"),
        }
        assert!(matches!(admission.parked(&parks, None), Step::Connect));
        assert_eq!(parks.metrics.pool.fresh.get(), 1);
        let pooled = app("[pool]\nmode = \"transaction\"\n");
        let mut admission = Admission::new(negotiated("shop"), false);
        admission.begin(&pooled, true);
        let Step::Learn(pool) = admission.registered(&pooled) else {
            panic!("the pool cannot log in yet: the client's login teaches it");
        };
        pool.learn_secret(ClientSecret::Password("pw".into()));
        let mut admission = Admission::new(negotiated("shop"), false);
        admission.begin(&pooled, true);
        assert!(matches!(admission.registered(&pooled), Step::Ready));
        assert!(
            admission
                .into_admitted(&pooled)
                .parts
                .first
                .stream
                .is_none()
        );
    }
}
