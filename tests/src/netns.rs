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
        Self::enter_by_name(&self.name);
    }

    /// Moves the calling thread into the namespace called `name`.
    pub fn enter_by_name(name: &str) {
        Self::enter_path(&format!("/var/run/netns/{name}"));
    }

    /// Moves the calling thread into the network namespace at `path`
    /// (`/proc/PID/ns/net` too).
    pub fn enter_path(path: &str) {
        let f = File::open(path).unwrap_or_else(|e| panic!("open {path}: {e}"));
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

/// The namespace of the packet fixtures and the per-packet benchmark:
/// `cl0` faces clients (10.0.0.0/24, fd00::/64, a router 10.0.0.254 for
/// 198.51.100.0/24), `be0` faces backends (10.2.0.0/24, fd02::/64). Static
/// neighbours make `bpf_fib_lookup` answer without any traffic.
pub fn fixture_namespace() -> Netns {
    fixture_namespace_named("xlb-fixtures")
}

/// [`fixture_namespace`] under another name (tests that run in parallel).
pub fn fixture_namespace_named(name: &str) -> Netns {
    let ns = Netns::new(name);
    for cmd in [
        "ip link add cl0 type veth peer name cl1",
        "ip link add be0 type veth peer name be1",
        "ip link set cl0 address 02:00:00:00:01:00",
        "ip link set be0 address 02:00:00:00:02:00",
        "ip link set cl0 up && ip link set cl1 up && ip link set be0 up && ip link set be1 up",
        "ip addr add 10.0.0.1/24 dev cl0 && ip addr add fd00::1/64 dev cl0 nodad",
        "ip addr add 10.2.0.1/24 dev be0 && ip addr add fd02::1/64 dev be0 nodad",
        "ip neigh add 10.0.0.2 lladdr 02:00:00:00:01:02 dev cl0 nud permanent",
        "ip neigh add 10.0.0.254 lladdr 02:00:00:00:01:fe dev cl0 nud permanent",
        "ip neigh add fd00::2 lladdr 02:00:00:00:01:02 dev cl0 nud permanent",
        "ip neigh add 10.2.0.2 lladdr 02:00:00:00:02:02 dev be0 nud permanent",
        "ip neigh add 10.2.0.3 lladdr 02:00:00:00:02:03 dev be0 nud permanent",
        "ip neigh add 10.2.0.4 lladdr 02:00:00:00:02:04 dev be0 nud permanent",
        "ip neigh add fd02::2 lladdr 02:00:00:00:02:02 dev be0 nud permanent",
        "ip neigh add fd02::3 lladdr 02:00:00:00:02:03 dev be0 nud permanent",
        "ip route add 198.51.100.0/24 via 10.0.0.254",
        "sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
    ] {
        ns.run(cmd);
    }
    ns
}

/// The pids of the processes in the named namespace (`ip netns pids`).
pub fn pids(ns: &str) -> Vec<i32> {
    std::process::Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}
