//! A session's connection to a replica, for the reads its engine routes
//! there. In session mode, the session's own: opened as the client's user
//! with its pool's credentials when the first read is routed there, kept
//! until the session ends or the replica leaves the rotation. In transaction mode,
//! one of the replica's pool for the client's database and user, taken for
//! a read and given back once it is answered. Either is given the client's
//! settings (again whenever they change) before a read is written to it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::BackendStream;
use crate::cancel::CancelTarget;
use crate::pool::prepared::ServerStatements;
use crate::pool::transaction::{Lease, Pool};
use crate::pool::{PoolError, Pools};
use crate::protocol::answer::read_answer;
use crate::protocol::messages;
use crate::protocol::stream::FramedStream;
use crate::replica::{Connection, Replica};

/// A session's connection to a replica.
pub struct ReplicaConn {
    pub server: Arc<Replica>,
    pub stream: FramedStream<BackendStream>,
    /// Its cancel key: a CancelRequest goes there while a read is.
    pub key: Arc<CancelTarget>,
    /// When it logged in.
    pub opened: Instant,
    held: Held,
}

/// Whose the connection is.
enum Held {
    /// Session mode: the session's, listed in `SHOW SERVERS` while open;
    /// closed once its replica is out of rotation.
    Own {
        listed: Listed,
        rotation: tokio::sync::watch::Receiver<bool>,
    },
    /// Transaction mode: the replica's pool's, for one read.
    Leased(Lease),
}

impl ReplicaConn {
    /// Session mode: logs in to `server` as the pool's user, with its
    /// credentials, for client `client`; `id` names it in `SHOW SERVERS`.
    async fn open(
        pool: &Pool,
        server: &Arc<Replica>,
        id: u64,
        client: u64,
    ) -> Result<Self, String> {
        let (key, stream) = pool
            .log_in_at(&server.upstream)
            .await
            .map_err(|e| e.to_string())?;
        let shown = Arc::new(Connection::new(
            id,
            &pool.id.user,
            &pool.id.database,
            client,
            key.backend_pid,
        ));
        server.connections.opened(Arc::clone(&shown));
        Ok(Self {
            server: Arc::clone(server),
            stream,
            key: Arc::new(key),
            opened: Instant::now(),
            held: Held::Own {
                listed: Listed(Arc::clone(server), shown),
                rotation: server.watch_rotation(),
            },
        })
    }

    /// Transaction mode: a connection of `server`'s pool for the clients
    /// of `pool`, without waiting for one (a full pool leaves the read to
    /// the primary), with what it has: the client state applied there and
    /// its statements. `ids` numbers new connections, as the primary's.
    /// A connection for a client's read: leased from the replica's pool
    /// like `pool` (`pooled`), with the settings it was left in and its
    /// statements, else opened for the session alone.
    pub async fn connect(
        pool: &Pool,
        server: &Arc<Replica>,
        pooled: bool,
        ids: &Pools,
        client: u64,
    ) -> Result<(Self, u64, ServerStatements), String> {
        match pooled {
            true => Self::lease(pool, server, ids, client)
                .await
                .map_err(|e| e.to_string()),
            false => Self::open(pool, server, ids.server_id(), client)
                .await
                .map(|conn| (conn, 0, ServerStatements::default())),
        }
    }

    async fn lease(
        pool: &Pool,
        server: &Arc<Replica>,
        ids: &Pools,
        client: u64,
    ) -> Result<(Self, u64, ServerStatements), PoolError> {
        let replica_pool = server.pools.pool_like(pool);
        let (mut lease, stream) = replica_pool
            .checkout(&server.upstream, Some(Duration::ZERO), ids.ids(), client)
            .await?;
        let pooled = lease.server_mut();
        let applied = pooled.state;
        let prepared = std::mem::take(&mut pooled.prepared);
        let key = Arc::clone(&pooled.key);
        let opened = pooled.born;
        let conn = Self {
            server: Arc::clone(server),
            stream,
            key,
            opened,
            held: Held::Leased(lease),
        };
        Ok((conn, applied, prepared))
    }

    /// The connection is the session's own, kept between reads.
    pub fn is_own(&self) -> bool {
        matches!(self.held, Held::Own { .. })
    }

    /// Runs the SQL that gives the connection the client's settings.
    pub async fn apply(&mut self, sql: &str) -> Result<(), String> {
        let answered = read_answer(&mut self.stream, &messages::query(sql), drop).await;
        let answered = answered.map_err(|e| e.to_string())?;
        let answered = answered.ok_or("the replica closed the connection")?;
        match answered.result {
            Err(error) => {
                let error = error.unwrap_or_default();
                let (code, message) = messages::error_parts(&error, ("", "a row was unreadable"));
                Err(format!(
                    "the client's settings failed there: {code} {message}"
                ))
            }
            Ok(_) if answered.clean() => Ok(()),
            Ok(_) => Err("the settings left a transaction open".into()),
        }
    }

    /// A read was written to it (`true`), or its answer ended.
    pub fn set_active(&self, active: bool) {
        if let Held::Own { listed, .. } = &self.held {
            listed.1.set_active(active);
        }
    }

    /// Ready once its replica is out of rotation (at once if it is now); a
    /// leased connection is only held for a read, which ends anyway.
    pub async fn retired(&mut self) {
        let Held::Own { rotation, .. } = &mut self.held else {
            return std::future::pending().await;
        };
        loop {
            if !*rotation.borrow_and_update() {
                return;
            }
            if rotation.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Transaction mode: the read is answered, and the connection goes
    /// back to its pool with its books (the client state applied, its
    /// statements), unless it sent more than the answer or its replica
    /// left the rotation meanwhile (closed).
    pub fn give_back(self, applied: u64, prepared: ServerStatements, lifetime: Duration) {
        let ReplicaConn {
            server,
            stream,
            held,
            ..
        } = self;
        if let Held::Leased(mut lease) = held
            && stream.buffered().is_empty()
            && server.in_rotation()
        {
            let pooled = lease.server_mut();
            pooled.state = applied;
            pooled.prepared = prepared;
            lease.give_back(stream, lifetime);
        }
    }

    /// Ends the session on the replica, as a client would; a leased
    /// connection is closed by its pool.
    pub async fn close(mut self: Box<Self>) {
        if self.is_own() {
            let _ = self.stream.write_all(&messages::TERMINATE).await;
        }
    }
}

/// A session's own connection, listed with its replica while open.
struct Listed(Arc<Replica>, Arc<Connection>);

impl Drop for Listed {
    fn drop(&mut self) {
        self.0.connections.closed(self.1.id);
    }
}
