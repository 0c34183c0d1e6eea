//! Every command the README shows, run as written. Only the placeholders
//! the README names are replaced: `PASSWORD`, host and port (PostgreSQL's
//! are a throwaway server's; pgcache's own port 6432 is the free port the
//! test gave it through `PGCACHE_LISTEN`), `<user>` and `<database>`. A
//! command that cannot run here is in [`EXEMPT`] with the reason; a command
//! in neither place fails the test, so a command added to the README is
//! run or explained.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Commands not run here, and why.
const EXEMPT: &[(&str, &str)] = &[
    (
        "scripts/test.sh",
        "the suite this test belongs to (.ci/run runs it, checked below)",
    ),
    (
        "scripts/quickstart.sh",
        "stays up until Ctrl-C; scripts/test.sh runs it with --duration 10 after the tests",
    ),
    (
        "scripts/quickstart.sh --duration N",
        "scripts/test.sh runs exactly this, with N = 10, after the tests",
    ),
    (
        "docker compose up --build",
        "no Docker here, and its images come from the network",
    ),
    (
        "pgcache uninstall",
        "a reference to the full command above it, which is run",
    ),
];

/// What the README shows as commands: each line of its shell blocks, and
/// each inline code span that starts with a command.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let mut commands = Vec::new();
    let mut block: Option<bool> = None; // Some(shell?) inside a fence
    for line in readme.lines() {
        if let Some(info) = line.strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(matches!(info.trim(), "sh" | "bash" | "shell" | "console")),
            };
            continue;
        }
        match block {
            Some(true) => {
                let line = line.trim();
                if !line.is_empty() && !line.starts_with('#') {
                    commands.push(line.to_owned());
                }
            }
            Some(false) => {}
            None => {
                for (i, span) in line.split('`').enumerate() {
                    if i % 2 == 1 && is_command(span) {
                        commands.push(span.to_owned());
                    }
                }
            }
        }
    }
    commands
}

fn is_command(span: &str) -> bool {
    let first = span.split_whitespace().next().unwrap_or("");
    let program = matches!(first, "pgcache" | "psql" | "cargo" | "docker" | "curl");
    (program && span.contains(' ')) || first.starts_with("scripts/") || first == ".ci/run"
}

/// A command started in a process group of its own, stopped with it.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let _ = self.0.wait();
    }
}

fn shell(command: &str, envs: &[(&str, String)]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.args(["-c", command])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())));
    // As a user's shell has it: without what cargo sets for this test.
    // Build scripts (ring's) track CARGO_MANIFEST_DIR and CARGO_PKG_*, so
    // with them a `cargo run --release` here, and the next one outside,
    // would each build the release profile again.
    for (name, _) in std::env::vars_os() {
        if cargo_set(&name.to_string_lossy()) {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// What cargo sets in a test's environment (not a user's own
/// configuration, such as CARGO_HOME or CARGO_TARGET_DIR).
fn cargo_set(name: &str) -> bool {
    name == "CARGO"
        || [
            "CARGO_MANIFEST_",
            "CARGO_PKG_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_RUSTC_CURRENT_DIR",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
}

fn start(command: &str, envs: &[(&str, String)]) -> Running {
    use std::os::unix::process::CommandExt;
    let child = shell(command, envs)
        .process_group(0)
        .stdout(Stdio::null())
        .spawn()
        .expect("bash runs");
    Running(child)
}

/// Runs `command` with `input` on its standard input; its output, after
/// checking it succeeded.
fn run(command: &str, input: &str, envs: &[(&str, String)]) -> String {
    use std::io::Write;
    let mut child = shell(command, envs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("input written");
    let out = child.wait_with_output().expect("command ends");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "`{command}` failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Waits until pgcache answers a query on `dsn`.
async fn wait_serving(dsn: &str, what: &str) {
    // A first `cargo run --release` compiles pgcache.
    eventually(Duration::from_secs(900), what, || async {
        let client = connect_dsn(dsn).await.ok()?;
        client.simple_query("SELECT 1").await.ok().map(|_| ())
    })
    .await;
}

#[tokio::test]
async fn every_readme_command_runs_as_written_or_is_exempt_with_a_reason() {
    let commands = readme_commands();
    assert!(commands.len() >= 6, "commands found: {commands:?}");
    // The password is any: the throwaway server trusts local logins.
    let pg = Pg::dedicated();
    let password = "secret";
    let upstream_port = pg.port.to_string();
    let listen = free_port();
    let metrics = free_port();
    let path = format!(
        "{}:{}",
        pg_bindir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let envs = [
        ("PGCACHE_LISTEN", format!("127.0.0.1:{listen}")),
        ("PGCACHE_METRICS", format!("127.0.0.1:{metrics}")),
        ("PATH", path),
    ];
    let replace = |command: &str| {
        command
            .replace("PASSWORD", password)
            .replace("@host:5432", &format!("@127.0.0.1:{upstream_port}"))
            .replace("127.0.0.1:5432", &format!("127.0.0.1:{upstream_port}"))
            .replace("6432", &listen.to_string())
            .replace("<user>", "postgres")
            .replace("<database>", "postgres")
            .replacen(
                "pgcache uninstall",
                concat!(env!("CARGO_BIN_EXE_pgcache"), " uninstall"),
                1,
            )
    };
    let mut ran = Vec::new();
    let mut server: Option<Running> = None;
    // The order matters: pgcache runs before the commands that use it.
    let mut ordered = commands.clone();
    ordered.sort_by_key(|c| !c.starts_with("cargo run"));
    for command in &ordered {
        if let Some((_, why)) = EXEMPT.iter().find(|(c, _)| c == command) {
            assert!(!why.is_empty());
            continue;
        }
        if command == ".ci/run" {
            let ci = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/run"))
                .expect(".ci/run");
            let last = ci
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            assert_eq!(
                last.trim(),
                "exec scripts/test.sh",
                ".ci/run runs the README's test command"
            );
            ran.push(command.clone());
            continue;
        }
        let concrete = replace(command);
        if command.starts_with("cargo run") {
            server = Some(start(&concrete, &envs));
            let dsn = format!("postgres://postgres:{password}@127.0.0.1:{listen}/postgres");
            wait_serving(&dsn, &format!("`{command}` serves queries")).await;
        } else if command.starts_with("psql \"postgresql://pgcache:") {
            // The admin console, with `admin.password` set as the README says.
            drop(server.take());
            let config = scratch_dir("readme").join("pgcache.toml");
            std::fs::write(
                &config,
                format!(
                    "[server]\nlisten = \"127.0.0.1:{listen}\"\n[upstream]\nurl = \"postgres://postgres@127.0.0.1:{upstream_port}\"\n\
                     [metrics]\nlisten = \"127.0.0.1:{metrics}\"\n[admin]\npassword = \"{password}\"\n"
                ),
            )
            .expect("config written");
            let admin = format!(
                "{} --config {}",
                env!("CARGO_BIN_EXE_pgcache"),
                config.display()
            );
            server = Some(start(&admin, &envs[2..]));
            eventually(Duration::from_secs(60), "pgcache listens", || async {
                tokio::net::TcpStream::connect(("127.0.0.1", listen))
                    .await
                    .ok()
                    .map(|_| ())
            })
            .await;
            let out = run(&concrete, "SHOW STATS;\n", &envs);
            assert!(out.contains("row"), "SHOW STATS answered: {out}");
        } else if command.starts_with("psql ") {
            let out = run(&concrete, "SELECT 40 + 2 AS answer;\n", &envs);
            assert!(out.contains("42"), "`{concrete}` answered: {out}");
        } else if command.contains("uninstall") {
            // pgcache is stopped first, as the README says.
            drop(server.take());
            eventually(Duration::from_secs(60), "pgcache's stream ends", || async {
                let active =
                    pg.psql_admin("SELECT count(*) FROM pg_replication_slots WHERE active");
                (active.trim() == "0").then_some(())
            })
            .await;
            let out = run(&concrete, "", &envs);
            assert!(out.contains("postgres"), "one line per database: {out}");
        } else {
            panic!("`{command}` is in the README, but neither run here nor exempt with a reason");
        }
        ran.push(command.clone());
    }
    assert!(
        ran.iter().any(|c| c.starts_with("cargo run"))
            && ran.iter().any(|c| c.contains("uninstall")),
        "ran {ran:?}"
    );
    for (exempt, _) in EXEMPT {
        assert!(
            commands.iter().any(|c| c == exempt),
            "`{exempt}` is exempt but no longer in the README"
        );
    }
}
