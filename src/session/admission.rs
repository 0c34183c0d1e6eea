//! What a StartupMessage becomes, decided without I/O: turned away (TLS
//! required, no place under `server.max_client_connections`, a startup
//! transaction mode cannot carry), the admin console, or a session, in
//! session or transaction mode, and where its server connections come
//! from; what its login needs, and what becomes of its connection at its
//! end. The driver ([`super::admit`]) takes the place, authenticates the
//! client, connects and builds the session.

use std::sync::Arc;

use bytes::BytesMut;

use super::SessionError;
use super::link::{ClientState, Link, SessionLink};
use crate::App;
use crate::config::{PoolMode, SslMode};
use crate::pool::PoolKey;
use crate::pool::transaction::Pool;
use crate::protocol::sqlstate;
use crate::protocol::startup::Startup;
use crate::protocol::stream::FramedStream;
use crate::scram::ClientSecret;
use crate::tls::ClientStream;

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
    /// The session's link to its server connections, and what becomes of
    /// its connection at its end (`checked_by_pgcache`: pgcache
    /// authenticated the client itself).
    pub fn into_parts(self, checked_by_pgcache: bool) -> (Link, End) {
        match self {
            Mode::Session { key, checks } => {
                let link = Link::Session(SessionLink {
                    checks,
                    ..SessionLink::default()
                });
                let end = End::Session {
                    key,
                    checked_by_pgcache,
                };
                (link, end)
            }
            Mode::Pooled { pool, state } => (Link::pooled(pool, state), End::Pooled),
        }
    }
}

/// A client turned away, with why.
pub(super) type Refused = (FramedStream<ClientStream>, SessionError);

/// What becomes of a session's connection at its end.
pub(super) enum End {
    /// Session mode: parked for the next client under `key`, if the
    /// session handed it back and may (`checked_by_pgcache`: pgcache
    /// authenticated the client itself).
    Session {
        key: Option<PoolKey>,
        checked_by_pgcache: bool,
    },
    /// Transaction mode: an idle pooled connection goes back to its pool.
    Pooled,
}

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
}
