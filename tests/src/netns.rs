//! Network namespaces for tests: created on demand, removed on drop (also
//! when a test panics), and entered per thread with setns(2).

use std::{fs::File, os::fd::AsRawFd, process::Command};

/// Runs a command and panics with its output if it fails.
pub fn sh(cmd: &str) {
    let out = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .expect("spawn sh");
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A named network namespace, deleted when dropped.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Creates `name`, replacing a leftover of an earlier, killed run.
    pub fn new(name: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        sh(&format!("ip netns add {name}"));
        let ns = Self {
            name: name.to_string(),
        };
        ns.run("ip link set lo up");
        ns
    }

    /// Runs a shell command inside the namespace.
    pub fn run(&self, cmd: &str) {
        sh(&format!(
            "ip netns exec {} sh -c '{}'",
            self.name,
            cmd.replace('\'', "'\\''")
        ));
    }

    /// Moves the calling thread into the namespace (for BPF_PROG_TEST_RUN,
    /// which resolves interfaces and routes in the caller's namespace).
    pub fn enter(&self) {
        let f = File::open(format!("/var/run/netns/{}", self.name)).expect("open netns");
        // SAFETY: setns on a valid namespace fd affects only this thread.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
