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

    /// GET `path` on pgcache's metrics port; returns (status, body).
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = *self.app.metrics_addr.get().expect("metrics endpoint bound");
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: pgcache\r\nConnection: close\r\n\r\n");
        s.write_all(request.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let status = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    /// The value of metric `name` for database `db` on `/metrics`.
    pub async fn database_metric(&self, name: &str, db: &str) -> f64 {
        let (_, metrics) = self.http_get("/metrics").await;
        let series = format!("{name}{{database=\"{db}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no series {series}"))
    }

    pub fn hits(&self) -> u64 {
        self.app.metrics.hits.get()
    }

    /// The statistics of the statement whose normalised text contains
    /// `needle`.
    pub fn statement(&self, needle: &str) -> pgcache::cache::stats::QueryRow {
        self.app
            .cache
            .stats
            .top(100)
            .into_iter()
            .find(|q| q.text.contains(needle))
            .unwrap_or_else(|| panic!("statistics for {needle}"))
    }

    pub fn stores(&self) -> u64 {
        self.app.metrics.stores.get()
    }

    /// Connects as `postgres`, waits until the database's replication
    /// stream is up (until then pgcache serves nothing from its cache) and
    /// until pgcache knows every relation and function the database has now
    /// (see [`Proxy::learn`]).
    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        let client = connect_dsn(&self.dsn("postgres", db))
            .await
            .expect("connect through pgcache");
        self.wait_streaming(db).await;
        client
    }

    /// A connection of pgcache's own kind (its upstream credentials) to `db`.
    async fn control(&self, db: &str) -> tokio_postgres::Client {
        self.app
            .upstream
            .control(db)
            .await
            .expect("control connection")
    }

    /// [`Proxy::learn`] for every relation outside the system schemas and
    /// every function `db` has now.
    pub async fn learn_all(&self, db: &str) {
        let direct = self.control(db).await;
        let names = |sql: &'static str| {
            let direct = &direct;
            async move {
                direct
                    .query(sql, &[])
                    .await
                    .expect("catalog names")
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect::<Vec<_>>()
            }
        };
        let rels = names(
            "SELECT DISTINCT relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp)'
               AND c.relkind IN ('r', 'p', 'v', 'm', 'f')",
        )
        .await;
        let funcs = names("SELECT DISTINCT proname::text FROM pg_proc").await;
        let rels: Vec<&str> = rels.iter().map(String::as_str).collect();
        let funcs: Vec<&str> = funcs.iter().map(String::as_str).collect();
        self.learn(db, &rels, &funcs).await;
    }

    /// Waits until the shared tier (Redis) may be used for `db`: in sync
    /// with this instance.
    pub async fn shared_ready(&self, db: &str) {
        let tier = self.app.cache.shared().cloned().expect("a shared tier");
        let state = self.app.cache.db(db);
        eventually(Duration::from_secs(20), "the shared tier", || {
            let ready = tier.usable(&state);
            async move { ready.then_some(()) }
        })
        .await;
    }

    /// Waits until the database's replication stream is up, then until
    /// pgcache knows the database's relations and functions again (a stream
    /// that starts forgets them: DDL may have been missed).
    pub async fn wait_streaming(&self, db: &str) {
        self.wait_stream(db).await;
        self.learn_all(db).await;
        self.wait_published(db).await;
    }

    /// Tables made since the stream started join the publication when a
    /// statement first names them ([`Proxy::learn_all`] names them all):
    /// waits until those that can have joined, then until the stream has
    /// handled pgcache's ALTER PUBLICATION (DDL too, which forgets those
    /// tables' facts), and looks everything up again.
    async fn wait_published(&self, db: &str) {
        let config = self.app.config();
        if !self.app.cache.replication_on() || !config.replication.manage_publication {
            return;
        }
        let direct = self.control(db).await;
        let publication = &config.replication.publication;
        eventually(Duration::from_secs(20), "new tables in the publication", || {
            let direct = &direct;
            async move {
                let missing: i64 = direct
                    .query_one(
                        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                         WHERE c.relkind IN ('r', 'p') AND c.relpersistence = 'p' AND NOT c.relispartition
                           AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname !~ '^pg_(toast|temp)'
                           AND (c.relreplident = 'f' OR EXISTS (SELECT FROM pg_index i WHERE i.indrelid = c.oid
                             AND CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END))
                           AND NOT EXISTS (SELECT FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                             WHERE p.pubname = $1 AND pr.prrelid = c.oid)",
                        &[publication],
                    )
                    .await
                    .expect("tables missing from the publication")
                    .get(0);
                (missing == 0).then_some(())
            }
        })
        .await;
        self.wait_stream(db).await;
        self.learn_all(db).await;
    }

    /// Waits until the database's replication stream is up and has applied
    /// every change committed before this call: the cache is served only
    /// then, and an invalidation still in flight would otherwise evict a
    /// result the test stores next.
    pub async fn wait_stream(&self, db: &str) {
        if self.app.cache.replication_on() {
            let state = self.app.cache.db(db);
            let now = std::time::Instant::now();
            eventually(
                Duration::from_secs(20),
                "a current replication stream",
                || {
                    // Waiting for the stream is using the database: with a
                    // short idle_release_secs, pgcache could otherwise let
                    // go of it while the helpers run.
                    self.app.streams.ensure(&state);
                    let up = state.stream.is_current() && state.stream.covers(now);
                    async move { up.then_some(()) }
                },
            )
            .await;
        }
    }

    /// Makes pgcache learn the catalog facts of relations `rels` and
    /// functions `funcs` in `db`, and waits until it knows them. A client's
    /// first statement naming them does the same, but is forwarded uncached
    /// while they are fetched: a test that counts hits and stores from its
    /// first read learns the names first.
    pub async fn learn(&self, db: &str, rels: &[&str], funcs: &[&str]) {
        let state = self.app.cache.db(db);
        eventually(Duration::from_secs(20), "catalog facts", || {
            let (_, queued) = state
                .catalog
                .facts(rels.iter().copied(), funcs.iter().copied());
            if queued {
                self.app.fetch_catalog(&state);
            }
            let known = state.catalog.knows(rels, funcs);
            async move { known.then_some(()) }
        })
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
