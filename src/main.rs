use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use pgcache::config::{Config, Overrides};

/// Read-through query-result caching proxy for PostgreSQL.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// TOML configuration file (every key is documented in config/pgcache.toml).
    #[arg(long, env = "PGCACHE_CONFIG")]
    config: Option<PathBuf>,
    /// Address clients connect to [default: 127.0.0.1:6432].
    #[arg(long, env = "PGCACHE_LISTEN")]
    listen: Option<SocketAddr>,
    /// PostgreSQL server, as a libpq URL or key=value string [default: postgres://127.0.0.1:5432].
    #[arg(long, env = "PGCACHE_UPSTREAM")]
    upstream: Option<String>,
    /// Redis URL for the shared tier (optional).
    #[arg(long, env = "PGCACHE_REDIS")]
    redis: Option<String>,
    /// Address of the Prometheus endpoint [default: 127.0.0.1:9187].
    #[arg(long, env = "PGCACHE_METRICS")]
    metrics: Option<SocketAddr>,
    /// Pure pass-through: cache nothing.
    #[arg(long, env = "PGCACHE_NO_CACHE")]
    no_cache: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Remove what pgcache leaves in every database of the server in
    /// `--upstream` (its publication, the `pgcache` schema and function,
    /// the event triggers), then exit. Running it again changes nothing.
    Uninstall {
        /// Remove them even from databases a pgcache still streams from
        /// (a running pgcache puts them back when its stream restarts).
        #[arg(long)]
        force: bool,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    let overrides = Overrides {
        listen: cli.listen,
        upstream: cli.upstream,
        redis: cli.redis,
        metrics: cli.metrics,
        no_cache: cli.no_cache,
    };
    let config = Config::load(cli.config.as_deref(), &overrides)?;
    if let Some(Command::Uninstall { force }) = cli.command {
        return uninstall(&config, force);
    }
    let source = (cli.config.clone(), overrides);
    // One worker is a current-thread runtime: no work stealing and no
    // waking of a parked sibling. On two cores shared with PostgreSQL and
    // its clients that is a fifth less CPU per pooled transaction, with
    // the same hit throughput (README, Benchmarks), hence half the CPUs by
    // default.
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
        n => n,
    };
    let mut builder = match workers {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(n);
            builder
        }
    };
    let runtime = builder.enable_all().build()?;
    // The accept loop is a task: with several workers it runs on one of
    // them, not on this thread, where each connection it accepted would go
    // to the workers through the runtime's shared queue, waking a worker
    // and parking this thread again each time (pgbench -C: four futex
    // calls and eight context switches a connection, a fifth of pgcache's
    // CPU).
    let serving = runtime.spawn(async move {
        let listener = tokio::net::TcpListener::bind(config.server.listen)
            .await
            .with_context(|| {
                format!("cannot listen on {} (server.listen)", config.server.listen)
            })?;
        let app = pgcache::App::start(config).await?;
        app.set_config_source(source.0, source.1);
        tokio::spawn(reload_on_sighup(std::sync::Arc::clone(&app)));
        pgcache::serve(app, listener, shutdown_signal()).await;
        anyhow::Ok(())
    });
    runtime.block_on(serving)?
}

/// `pgcache uninstall`: one line per database; exits non-zero if any was
/// refused or failed.
fn uninstall(config: &Config, force: bool) -> anyhow::Result<()> {
    let upstream =
        pgcache::upstream::Upstream::new(&config.upstream.url, config.connect_timeout())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let outcomes = runtime
        .block_on(pgcache::uninstall::uninstall(
            &upstream,
            &config.replication.publication,
            force,
        ))
        .with_context(|| format!("cannot list the databases of {}", upstream.describe()))?;
    let mut incomplete = 0;
    let mut out = std::io::stdout().lock();
    for (db, outcome) in &outcomes {
        writeln!(out, "{db}: {outcome}")?;
        if *outcome != pgcache::uninstall::Outcome::Removed {
            incomplete += 1;
        }
    }
    anyhow::ensure!(incomplete == 0, "{incomplete} database(s) not cleaned");
    Ok(())
}

/// SIGHUP re-reads the configuration, as the admin console's RELOAD does.
async fn reload_on_sighup(app: std::sync::Arc<pgcache::App>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        match app.reload() {
            Ok(restart) if !restart.is_empty() => {
                tracing::warn!(?restart, "SIGHUP: reloaded; these changes need a restart")
            }
            Ok(_) => {}
            Err(e) => tracing::error!("SIGHUP: configuration not reloaded, nothing changed: {e}"),
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
