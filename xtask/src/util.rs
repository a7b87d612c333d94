use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The workspace root, so tasks behave the same from any subdirectory.
pub fn repo_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Shell-like rendering of a command, including env overrides and directory,
/// so a failing step can be rerun by hand.
pub fn describe(cmd: &Command) -> String {
    // `env -u` options must precede the assignments to be a valid shell line.
    let mut unset = Vec::new();
    let mut set = Vec::new();
    for (key, value) in cmd.get_envs() {
        let key = key.to_string_lossy();
        match value {
            Some(value) => set.push(format!("{key}={}", value.to_string_lossy())),
            None => unset.push(format!("-u {key}")),
        }
    }
    let mut parts = Vec::new();
    if !unset.is_empty() {
        parts.push("env".to_string());
        parts.extend(unset);
    }
    parts.extend(set);
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    let line = parts.join(" ");
    // Only mention the directory when it is not where the user already is.
    let here = std::env::current_dir().ok();
    match cmd.get_current_dir() {
        Some(dir) if here.as_deref() != Some(dir) => format!("(cd {} && {line})", dir.display()),
        _ => line,
    }
}

/// Print the command, run it with inherited stdio, and fail if it does not succeed.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = describe(cmd);
    println!("$ {shown}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Run a probe quietly and report whether it succeeded; used for "is it already there?" checks.
pub fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Run a probe quietly and return its stdout if it succeeded.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A `cargo` command run in the workspace root; goes through the rustup proxy
/// so rust-toolchain.toml and `+toolchain` work.
pub fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(repo_root());
    cmd
}
