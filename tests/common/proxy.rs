//! pgcache itself, started in-process on port 0.

use std::net::SocketAddr;
use std::time::Duration;

use pgcache::Config;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{connect_dsn, eventually};

/// pgcache running in this test's runtime.
pub struct Proxy {
    pub addr: SocketAddr,
    pub app: std::sync::Arc<pgcache::App>,
    shutdown: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<()>>,
}

impl Proxy {
    pub async fn start(config: Config) -> Proxy {
        // RUST_LOG=pgcache=debug shows pgcache's log in a failing test's output.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let listener = TcpListener::bind(config.server.listen).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let app = pgcache::App::start(config).await.expect("pgcache starts");
        let join = tokio::spawn(pgcache::serve(
            std::sync::Arc::clone(&app),
            listener,
            async {
                let _ = rx.await;
            },
        ));
        Proxy {
            addr,
            app,
            shutdown: Some(tx),
            join: Some(join),
        }
    }

    pub fn dsn(&self, user: &str, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} dbname={db}",
            self.addr.port()
        )
    }

    pub fn hits(&self) -> u64 {
        self.app.metrics.hits.get()
    }

    pub fn stores(&self) -> u64 {
        self.app.metrics.stores.get()
    }

    /// Connects as `postgres`, and waits until the database's replication
    /// stream is up (until then pgcache serves nothing from its cache).
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        let client = connect_dsn(&self.dsn("postgres", db))
            .await
            .expect("connect through pgcache");
        self.wait_streaming(db).await;
        client
    }

    pub async fn wait_streaming(&self, db: &str) {
        if self.app.cache.replication_on() {
            let state = self.app.cache.db(db);
            eventually(Duration::from_secs(20), "the replication stream", || {
                let up = state.stream.is_streaming();
                async move { up.then_some(()) }
            })
            .await;
        }
    }

    /// Waits until the database's stream is current (up, and its last
    /// commit arrived within `replication.max_lag_ms`): a test that counts
    /// hits must not lose one to a commit the loaded machine delivered
    /// late. Each wait commits a logical message directly, so a fresh
    /// commit comes through.
    pub async fn wait_current(&self, db: &str) {
        if !self.app.cache.replication_on() {
            return;
        }
        let state = self.app.cache.db(db);
        let direct = super::pg().direct(db).await;
        eventually(
            Duration::from_secs(20),
            "a current replication stream",
            || {
                let (state, direct) = (&state, &direct);
                async move {
                    if state.stream.is_current() {
                        return Some(());
                    }
                    direct
                        .batch_execute(
                            "SELECT pg_catalog.pg_logical_emit_message(true, 'pgcache_test', '')",
                        )
                        .await
                        .ok()?;
                    None
                }
            },
        )
        .await;
    }

    /// Starts shutdown; returns the task that finishes when pgcache stops.
    pub fn begin_shutdown(&mut self) -> JoinHandle<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.join.take().expect("already shut down")
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
