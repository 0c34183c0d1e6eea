//! Server processes of the tests' own: binaries, the OS user they run as,
//! scratch directories, and clean-up when the test process exits.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub fn pg_bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").exists() {
            return dir;
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries not found: run .ci/run or install postgresql")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .expect("no initdb under /usr/lib/postgresql/*/bin")
}

/// PostgreSQL refuses to run as root: run it as the `postgres` user then.
pub fn server_user() -> Option<(u32, u32)> {
    if current_uid() != 0 {
        return None;
    }
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a postgres OS user")
    };
    Some((id("-u"), id("-g")))
}

pub fn current_uid() -> u32 {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A command that runs as the server user.
pub fn server_cmd(program: PathBuf) -> Command {
    let mut cmd = Command::new(program);
    if let Some((uid, gid)) = server_user() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

pub fn scratch_dir(prefix: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).unwrap();
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .unwrap()
        .keep();
    if let Some((uid, gid)) = server_user() {
        Command::new("chown")
            .arg(format!("{uid}:{gid}"))
            .arg(&dir)
            .status()
            .unwrap();
        // The parents must be traversable by the server user.
        Command::new("chmod").arg("o+x").arg(base).status().unwrap();
    }
    dir
}

/// Runs `script` (sh) once this test process has exited.
// The watchdog must outlive this process, so it is deliberately never waited on.
#[allow(clippy::zombie_processes)]
pub fn on_process_exit(script: &str) {
    let me = std::process::id();
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; {script}"
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn cleanup watchdog");
}

/// A process stopped with SIGSTOP, continued (SIGCONT) when dropped, so a
/// failing test never leaves a stopped server process behind.
pub struct Stopped(i32);

impl Stopped {
    pub fn new(pid: i32) -> Self {
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(sig: &str, pid: i32) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}
