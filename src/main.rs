use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use pgcache::config::{Config, LogFormat, Overrides};

/// Read-through query-result caching proxy for PostgreSQL.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// TOML configuration file (every key is documented in config/pgcache.toml).
    #[arg(long, env = "PGCACHE_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Address clients connect to [default: 127.0.0.1:6432].
    #[arg(long, env = "PGCACHE_LISTEN", global = true)]
    listen: Option<SocketAddr>,
    /// PostgreSQL server, as a libpq URL or key=value string [default: postgres://127.0.0.1:5432].
    #[arg(long, env = "PGCACHE_UPSTREAM", global = true)]
    upstream: Option<String>,
    /// Redis URL for the shared tier (optional).
    #[arg(long, env = "PGCACHE_REDIS", global = true)]
    redis: Option<String>,
    /// Directory of a disk tier between memory and Redis, which survives restarts (optional).
    #[arg(long, env = "PGCACHE_DISK", global = true)]
    disk: Option<PathBuf>,
    /// Address of the Prometheus endpoint [default: 127.0.0.1:9187].
    #[arg(long, env = "PGCACHE_METRICS", global = true)]
    metrics: Option<SocketAddr>,
    /// Pure pass-through: cache nothing.
    #[arg(long, env = "PGCACHE_NO_CACHE", global = true)]
    no_cache: bool,
    /// Threads that serve sessions; 0 = one per CPU [default: 0].
    #[arg(long, env = "PGCACHE_WORKERS", global = true)]
    workers: Option<usize>,
    /// Log lines as text (coloured only on a terminal) or JSON [default: text].
    #[arg(long, env = "PGCACHE_LOG_FORMAT", global = true, value_enum)]
    log_format: Option<LogFormat>,
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

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The message alone: a start-up error is the operator's to
            // read, not a crash (anyhow would add a backtrace whenever
            // RUST_BACKTRACE happens to be set).
            let _ = writeln!(std::io::stderr(), "pgcache: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let overrides = Overrides {
        listen: cli.listen,
        upstream: cli.upstream,
        redis: cli.redis,
        disk: cli.disk,
        metrics: cli.metrics,
        no_cache: cli.no_cache,
        workers: cli.workers,
        log_format: cli.log_format,
    };
    let config = Config::load(cli.config.as_deref(), &overrides)?;
    init_logging(config.log.format);
    if let Some(Command::Uninstall { force }) = cli.command {
        return uninstall(&config, force);
    }
    let source = (cli.config.clone(), overrides);
    // One worker is a current-thread runtime: no work stealing and no
    // waking of a parked sibling, the least CPU per transaction where
    // pgcache shares its cores. The default is where a proxy usually
    // runs: a host or container of its own, every core serving hits.
    let workers = match config.server.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
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
    // and parking this thread again each time.
    let serving = runtime.spawn(async move {
        let addr = config.server.listen;
        let (listener, _taken_over) = pgcache::handover::listen(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (server.listen)"))?;
        let app = pgcache::App::start(config).await?;
        if addr.port() != 0 {
            pgcache::handover::offer(
                &listener,
                pgcache::handover::path(addr),
                app.handed_over.clone(),
                app.drain.clone(),
            );
        }
        app.set_config_source(source.0, source.1);
        tokio::spawn(reload_on_sighup(std::sync::Arc::clone(&app)));
        pgcache::serve(app, listener, shutdown_signal()).await;
        anyhow::Ok(())
    });
    runtime.block_on(serving)?
}

/// Logs go to standard output: text coloured only on a terminal and never
/// with `NO_COLOR` set, or JSON lines. Levels follow `RUST_LOG`; by default
/// `info`, with the NOTICEs PostgreSQL sends pgcache's own connections
/// (which tokio-postgres logs at info) shown only when asked for.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,tokio_postgres=warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => {
            let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
            builder
                .with_ansi(std::io::stdout().is_terminal() && !no_color)
                .init();
        }
        LogFormat::Json => builder.json().init(),
    }
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
        if !matches!(
            outcome,
            pgcache::uninstall::Outcome::Removed | pgcache::uninstall::Outcome::Absent
        ) {
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
