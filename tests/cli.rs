//! The `pgcache` binary as an operator meets it: start-up errors, log
//! lines for a terminal, a file or a log pipeline.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncBufReadExt, BufReader};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_pgcache")
}

/// Starts pgcache in front of the test server with `args` (through
/// `wrap`, a command line prefix such as `script`), reads its first log
/// line, and stops it.
async fn first_log_line(wrap: &[&str], args: &[&str], env: &[(&str, &str)]) -> String {
    let upstream = format!("postgres://postgres@127.0.0.1:{}", pg().port);
    let mut line: Vec<String> = [bin(), "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    line.extend(["--upstream".to_owned(), upstream]);
    line.extend(args.iter().map(|s| s.to_string()));
    let mut command = match wrap {
        [] => tokio::process::Command::new(&line[0]),
        [program, rest @ ..] => {
            let mut c = tokio::process::Command::new(program);
            c.args(rest);
            c
        }
    };
    if wrap.is_empty() {
        command.args(&line[1..]);
    } else {
        // script -c takes one command line; exec makes pgcache the child
        // of script, which it runs in a session of its own.
        command.arg(format!("exec {}", line.join(" ")));
        command.arg("/dev/null");
    }
    command
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("start pgcache");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("a log line within 30 s")
        .unwrap()
        .expect("a log line before pgcache exits");
    // pgcache under script is in a session of its own: killing script
    // leaves it running (it takes the hangup for a reload).
    if let (false, Some(pid)) = (wrap.is_empty(), child.id()) {
        let _ = tokio::process::Command::new("pkill")
            .args(["-KILL", "-P", &pid.to_string()])
            .status()
            .await;
    }
    let _ = child.kill().await;
    first
}

#[tokio::test]
async fn logs_to_a_pipe_have_no_colour() {
    let line = first_log_line(&[], &[], &[]).await;
    assert!(!line.contains('\x1b'), "{line:?}");
    assert!(line.contains("INFO"), "{line:?}");
}

#[tokio::test]
async fn logs_on_a_terminal_are_coloured_unless_no_color_is_set() {
    // `script` runs pgcache on a pseudo-terminal.
    let line = first_log_line(&["script", "-qfec"], &[], &[]).await;
    assert!(line.contains('\x1b'), "{line:?}");
    let line = first_log_line(&["script", "-qfec"], &[], &[("NO_COLOR", "1")]).await;
    assert!(!line.contains('\x1b'), "{line:?}");
}

#[tokio::test]
async fn json_logs_are_one_object_a_line() {
    for args in [&["--log-format", "json"][..], &[]] {
        let env: &[(&str, &str)] = if args.is_empty() {
            &[("PGCACHE_LOG_FORMAT", "json")]
        } else {
            &[]
        };
        let line = first_log_line(&[], args, env).await;
        let value: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert_eq!(value["level"], "INFO", "{line}");
        assert!(value["fields"]["message"].is_string(), "{line}");
    }
}

#[tokio::test]
async fn a_start_up_error_is_its_message_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[server]\nlisten_port = 1\n").unwrap();
    let out = tokio::process::Command::new(bin())
        .arg("--config")
        .arg(&path)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.starts_with("pgcache: "), "{err}");
    assert!(err.contains("listen_port"), "the key is named: {err}");
    assert!(!err.to_lowercase().contains("backtrace"), "{err}");
    assert!(!err.contains("src/main.rs"), "no stack frames: {err}");
}

/// What a new user gets wrong is named, and each cause said once.
#[tokio::test]
async fn mistaken_start_up_arguments_are_named_and_each_cause_said_once() {
    let (_held, port) = refused_port();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = listener.local_addr().unwrap().to_string();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--upstream", "postgress://u@127.0.0.1:5432/db"],
            "\"postgress://\" is not a PostgreSQL URL",
        ),
        (
            &["--upstream", "postgres://u@127.0.0.1:99999/db"],
            "port \"99999\": a port is a number from 1 to 65535",
        ),
        (
            &["--config", "/nonexistent/pgcache.toml"],
            "No such file or directory",
        ),
        (
            &["--metrics", &taken, "--listen", "127.0.0.1:0"],
            "Address already in use",
        ),
    ];
    for (args, said) in cases {
        let run = tokio::process::Command::new(bin())
            .args(args)
            .env(
                "PGCACHE_UPSTREAM",
                format!("postgres://postgres@127.0.0.1:{port}"),
            )
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(30), run)
            .await
            .unwrap_or_else(|_| panic!("{args:?}: pgcache started"))
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert_eq!(err.matches(said).count(), 1, "{args:?}: {err}");
    }
}

#[tokio::test]
async fn options_go_before_or_after_the_subcommand() {
    for args in [
        &["--workers", "1", "uninstall", "--help"][..],
        &["uninstall", "--workers", "1", "--no-cache", "--help"],
    ] {
        let out = run_tool(std::path::Path::new(bin()), args).await;
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
