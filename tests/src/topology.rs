//! The end-to-end topology (agent tests, demo, benchmarks):
//!
//! ```text
//!   <p>-c (client)              <p>-lb (lb-agent, XDP on every interface)          <p>-bN (nginx "bN")
//!   eth0 10.0.0.2/24  <──veth──>  lbc 10.0.0.1/24
//!                                 lbb1 10.2.1.1/24  <──veth──>  eth0 10.2.1.2/24 (default via 10.2.1.1)
//!                                 lbb2 10.2.2.1/24  <──veth──>  eth0 10.2.2.2/24
//!                                 lbb3 10.2.3.1/24  <──veth──>  eth0 10.2.3.2/24
//! ```
//!
//! The client routes 192.0.2.0/24 (the VIPs) to the LB; backends route
//! everything back through the LB, so NAT mode works. The client and
//! backend ends of the veths have GRO on (XDP_REDIRECT into a veth needs it)
//! and TX checksum offload off: veth otherwise hands over packets with only
//! partial checksums, which XDP cannot complete (real NICs deliver full ones).
//!
//! Everything is removed on drop, also when a test panics. Processes are
//! started in a namespace with `nsenter --net` (not `ip netns exec`, which
//! remounts /sys and would hide the host's bpffs and the agent's pins).

use std::{
    fs,
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU16, Ordering},
        Arc, OnceLock,
    },
    thread::JoinHandle,
    time::{Duration, SystemTime},
};

use crate::{
    netns::{sh, Netns},
    traffic::poll_until,
};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
pub const LB_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
pub const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
pub const BACKEND_PORT: u16 = 8080;

/// Address of backend `n` (1-based).
pub fn backend_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 2, n as u8, 2)
}

pub struct Topology {
    pub prefix: String,
    pub client: Netns,
    pub lb: Netns,
    pub backends: Vec<Netns>,
    /// Working directory for configs and logs.
    pub dir: PathBuf,
    /// Pin directory of this topology's agent (under /sys/fs/bpf).
    pub pin_dir: PathBuf,
    children: Vec<Child>,
    nginx: Vec<Option<Child>>,
    /// Stop flags and threads of the UDP echo servers.
    echo: Vec<(Arc<AtomicBool>, JoinHandle<()>)>,
    /// Agents started so far (numbers their config and log files).
    agent_starts: usize,
}

impl Topology {
    /// Builds the namespaces and links and starts one nginx per backend,
    /// answering `GET /` with `b<N>` and keeping connections open for long.
    /// `prefix` must be short (interface names are limited to 15 bytes).
    pub fn new(prefix: &str, backends: usize) -> Self {
        let dir = std::env::temp_dir().join(format!("xlb-{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/xlb-{prefix}"));
        cleanup_pins(&pin_dir);
        let client = Netns::new(&format!("{prefix}-c"));
        let lb = Netns::new(&format!("{prefix}-lb"));
        sh(&format!(
            "ip link add lbc netns {lb} type veth peer name eth0 netns {c}",
            lb = lb.name,
            c = client.name
        ));
        lb.run("ip addr add 10.0.0.1/24 dev lbc && ip link set lbc up && sysctl -qw net.ipv4.ip_forward=1");
        client.run(
            "ip addr add 10.0.0.2/24 dev eth0 && ip link set eth0 up && ip route add 192.0.2.0/24 via 10.0.0.1 \
             && ethtool -K eth0 gro on tx off >/dev/null",
        );
        let mut ns_backends = Vec::new();
        for n in 1..=backends {
            let b = Netns::new(&format!("{prefix}-b{n}"));
            link_backend(&lb, &b, n);
            ns_backends.push(b);
        }
        let mut t = Topology {
            prefix: prefix.to_string(),
            client,
            lb,
            backends: ns_backends,
            dir,
            pin_dir,
            children: Vec::new(),
            nginx: Vec::new(),
            echo: Vec::new(),
            agent_starts: 0,
        };
        for n in 1..=backends {
            let child = t.start_nginx(n);
            t.nginx.push(Some(child));
        }
        for n in 1..=backends {
            wait_for_port(
                &t.backends[n - 1],
                SocketAddr::new(backend_ip(n).into(), BACKEND_PORT),
            );
        }
        t
    }

    /// Deletes backend `n`'s link (`lbb<n>` and its peer) and creates it
    /// again as it was: what a rebuilt bond, VLAN or reloaded driver does to
    /// the interfaces an agent is attached to.
    pub fn recreate_backend_link(&self, n: usize) {
        self.lb.run(&format!("ip link del lbb{n}"));
        link_backend(&self.lb, &self.backends[n - 1], n);
    }

    /// The interfaces the agent attaches to.
    pub fn lb_interfaces(&self) -> Vec<String> {
        let mut v = vec!["lbc".to_string()];
        v.extend((1..=self.backends.len()).map(|n| format!("lbb{n}")));
        v
    }

    /// One nginx process (`master_process off`: killing the child kills
    /// the server; a master's workers would outlive it).
    fn start_nginx(&self, n: usize) -> Child {
        let d = self.dir.join(format!("nginx-b{n}"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("nginx.conf"), nginx_config(&d, n)).unwrap();
        self.spawn_in(
            &self.backends[n - 1],
            "nginx",
            &["-c", &d.join("nginx.conf").to_string_lossy()],
        )
    }

    /// The process id of backend `n`'s nginx (1-based; one process).
    pub fn backend_pid(&self, n: usize) -> u32 {
        self.nginx[n - 1].as_ref().expect("nginx running").id()
    }

    /// Kills backend `n`'s nginx (1-based).
    pub fn kill_backend(&mut self, n: usize) {
        if let Some(mut c) = self.nginx[n - 1].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a process in `ns` (joining only its network namespace).
    pub fn spawn_in(&self, ns: &Netns, program: &str, args: &[&str]) -> Child {
        Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", ns.name))
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
    }

    /// Runs a process to completion in `ns` and returns its stdout.
    pub fn output_in(&self, ns: &Netns, program: &str, args: &[&str]) -> std::process::Output {
        Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", ns.name))
            .arg(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"))
    }

    /// Keeps a child to be killed when the topology goes.
    pub fn adopt_child(&mut self, c: Child) {
        self.children.push(c);
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in self
            .children
            .iter_mut()
            .chain(self.nginx.iter_mut().flatten())
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        for (stop, _) in &self.echo {
            stop.store(true, Ordering::Relaxed);
        }
        for (_, t) in self.echo.drain(..) {
            let _ = t.join();
        }
        cleanup_pins(&self.pin_dir);
        // A failed test keeps its logs; a passed one leaves nothing in /tmp.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        // Netns drops delete the namespaces (and with them the veths).
    }
}

/// The veth pair between the LB namespace (`lbb<n>`, 10.2.n.1) and backend
/// `n` (`eth0`, 10.2.n.2, its default route).
fn link_backend(lb: &Netns, b: &Netns, n: usize) {
    sh(&format!(
        "ip link add lbb{n} netns {lb} type veth peer name eth0 netns {b}",
        lb = lb.name,
        b = b.name
    ));
    lb.run(&format!(
        "ip addr add 10.2.{n}.1/24 dev lbb{n} && ip link set lbb{n} up"
    ));
    b.run(&format!(
        "ip addr add 10.2.{n}.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.2.{n}.1 \
         && ethtool -K eth0 gro on tx off >/dev/null"
    ));
}

/// Detaches and removes an agent's pins (what `lb-agent --cleanup` does).
pub fn cleanup_pins(dir: &std::path::Path) {
    if dir.exists() {
        let _ = lb_agent::dataplane::Dataplane::cleanup(dir);
    }
}

/// The config of backend `n`'s nginx, keeping its files in `dir`: one
/// process (`master_process off`: killing it kills the server), answering
/// `GET /` with `b<n>` and keeping connections open for long.
pub fn nginx_config(dir: &std::path::Path, n: usize) -> String {
    format!(
        "daemon off; master_process off; pid {d}/pid; error_log {d}/error.log;\n\
         events {{ worker_connections 4096; }}\n\
         http {{ access_log off; keepalive_timeout 600s; keepalive_requests 1000000;\n\
           client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
           server {{ listen {port} reuseport; location / {{ return 200 \"b{n}\\n\"; }} }} }}\n",
        d = dir.display(),
        port = BACKEND_PORT
    )
}

/// Waits until `addr` accepts TCP connections from inside `ns`.
pub fn wait_for_port(ns: &Netns, addr: SocketAddr) {
    let ns_name = ns.name.clone();
    let ok = std::thread::spawn(move || {
        Netns::enter_by_name(&ns_name);
        poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200))
        })
        .is_ok()
    })
    .join()
    .unwrap();
    assert!(ok, "{addr} did not start listening in {}", ns.name);
}

/// Runs `f` on a thread inside `ns` (sockets it opens live in that namespace).
pub fn in_netns<T: Send + 'static>(
    ns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let name = ns.name.clone();
    std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        f()
    })
}

// ---------------------------------------------------------------------------
// lb-agent and lbctl: the binaries, a running agent, lbctl --json.

/// The workspace root (the tests crate's parent directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// The directory of this build's binaries: `target/<profile>` (tests run
/// from `target/<profile>/deps`, binaries such as xlb-bench from the
/// directory itself).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe directory").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

fn mtime(p: &Path) -> Option<SystemTime> {
    fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The newest modification time of the files under `p` (a file or a directory).
fn newest_mtime(p: &Path) -> Option<SystemTime> {
    let meta = fs::metadata(p).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    fs::read_dir(p)
        .ok()?
        .flatten()
        .filter_map(|e| newest_mtime(&e.path()))
        .max()
}

/// Where `lb-agent` and `lbctl` are, built once per process (`cargo build
/// -p lb-agent --bins`, same profile as this executable) if either is
/// missing or older than the sources it is built from.
fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = profile_dir();
        let root = workspace_root();
        let newest_source = [
            "lb-agent/src",
            "lb-agent/build.rs",
            "lb-agent/Cargo.toml",
            "lb-common/src",
            "lb-common/Cargo.toml",
            "lb-ebpf/src",
            "lb-ebpf/Cargo.toml",
        ]
        .iter()
        .filter_map(|p| newest_mtime(&root.join(p)))
        .max();
        let stale =
            ["lb-agent", "lbctl"]
                .iter()
                .any(|b| match (mtime(&dir.join(b)), newest_source) {
                    (None, _) => true,
                    (Some(built), Some(src)) => built < src,
                    (Some(_), None) => false,
                });
        if stale {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.current_dir(&root)
                .args(["build", "-p", "lb-agent", "--bins"]);
            match dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") | None => {}
                Some("release") => {
                    cmd.arg("--release");
                }
                Some(profile) => {
                    cmd.args(["--profile", profile]);
                }
            }
            eprintln!("building lb-agent and lbctl: {cmd:?}");
            let out = cmd.output().expect("run cargo build");
            assert!(
                out.status.success(),
                "cargo build -p lb-agent --bins failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for b in ["lb-agent", "lbctl"] {
            assert!(dir.join(b).exists(), "{} missing", dir.join(b).display());
        }
        dir
    })
}

/// The `lb-agent` binary (built if needed).
pub fn agent_bin() -> PathBuf {
    bin_dir().join("lb-agent")
}

/// Runs `lbctl --pin-dir PIN_DIR --json ARGS` and parses its output
/// (panics with what it printed if that is not JSON): its exit code and
/// the value. In the network namespace `ns` if given, where an agent's
/// metrics address is (through nsenter, not `ip netns exec`, which mounts
/// a /sys without the pins' bpffs); else in the host namespaces (pins are
/// global).
pub fn lbctl_json_in(ns: Option<&str>, pin_dir: &Path, args: &[&str]) -> (i32, serde_json::Value) {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{ns}"))
                .arg("--")
                .arg(lbctl_bin());
            c
        }
        None => Command::new(lbctl_bin()),
    };
    let out = cmd
        .arg("--pin-dir")
        .arg(pin_dir)
        .arg("--json")
        .args(args)
        .output()
        .expect("run lbctl");
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "lbctl --pin-dir {} {args:?}{} ({}): not JSON ({e}): {}{}",
            pin_dir.display(),
            ns.map(|ns| format!(" in {ns}")).unwrap_or_default(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), json)
}

/// The `lbctl` binary (built if needed).
pub fn lbctl_bin() -> PathBuf {
    bin_dir().join("lbctl")
}

/// Removes ANSI escape sequences (colored log output).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Writes `contents` to `path` atomically (a reader sees the old or the new
/// file, never a partial one).
pub fn write_atomic(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, contents).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

/// `yaml` with a `metrics_addr` line appended unless it sets one (appended,
/// so that line numbers in error messages stay those of `yaml`).
fn with_metrics_addr(yaml: &str, addr: SocketAddr) -> String {
    if yaml.lines().any(|l| l.starts_with("metrics_addr:")) {
        yaml.to_string()
    } else {
        format!("{}\nmetrics_addr: {addr}\n", yaml.trim_end())
    }
}

/// A running `lb-agent` (in the topology's LB namespace). Killed on drop.
pub struct AgentHandle {
    pub child: Child,
    pub log_path: PathBuf,
    pub config_path: PathBuf,
    /// In the LB namespace.
    pub metrics_addr: SocketAddr,
    lb_ns: String,
}

impl AgentHandle {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill: {}", io::Error::last_os_error());
    }

    /// Asks the agent to reload its config file.
    pub fn sighup(&self) {
        self.signal(libc::SIGHUP);
    }

    /// Kills the agent with SIGKILL (the program stays attached, pinned).
    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and waits (at most 15 s) for the agent to exit.
    pub fn sigterm_and_wait(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        poll_until(Duration::from_secs(15), Duration::from_millis(20), || {
            self.child.try_wait().expect("wait lb-agent").ok_or(())
        })
        .unwrap_or_else(|()| {
            self.sigkill();
            panic!(
                "lb-agent did not exit within 15 s of SIGTERM; log:\n{}",
                self.log()
            )
        })
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The agent's output so far (stdout and stderr), without colors.
    pub fn log(&self) -> String {
        strip_ansi(&fs::read_to_string(&self.log_path).unwrap_or_default())
    }

    /// Waits until the log contains `needle` at least `count` times; returns the log.
    pub fn wait_for_log(&self, needle: &str, count: usize, timeout: Duration) -> String {
        poll_until(timeout, Duration::from_millis(25), || {
            let log = self.log();
            if log.matches(needle).count() >= count {
                Ok(log)
            } else {
                Err(log)
            }
        })
        .unwrap_or_else(|log| {
            panic!("no {count}x {needle:?} in the agent's log within {timeout:?}:\n{log}")
        })
    }

    /// Replaces the config file (atomically; the agent notices within 500 ms).
    pub fn write_config(&self, yaml: &str) {
        write_atomic(
            &self.config_path,
            &with_metrics_addr(yaml, self.metrics_addr),
        );
    }

    /// GET `path` from the agent's metrics endpoint (from inside the LB namespace).
    pub fn get(&self, path: &str) -> io::Result<(u16, String)> {
        let (addr, path, ns) = (self.metrics_addr, path.to_string(), self.lb_ns.clone());
        std::thread::spawn(move || {
            Netns::enter_by_name(&ns);
            http_get(addr, &path, Duration::from_secs(5))
        })
        .join()
        .expect("metrics thread")
    }

    /// The agent's /metrics text.
    pub fn metrics(&self) -> String {
        match self.get("/metrics") {
            Ok((200, body)) => body,
            other => panic!("GET /metrics: {other:?}"),
        }
    }
}

impl AgentHandle {
    /// Waits (at most 30 s) until `/readyz` answers 200.
    pub fn wait_ready(&mut self) {
        poll_until(Duration::from_secs(30), Duration::from_millis(50), || {
            if let Some(st) = self.child.try_wait().expect("wait lb-agent") {
                panic!("lb-agent exited ({st}) before ready; log:\n{}", self.log());
            }
            match self.get("/readyz") {
                Ok((200, _)) => Ok(()),
                _ => Err(()),
            }
        })
        .unwrap_or_else(|()| panic!("lb-agent not ready within 30 s; log:\n{}", self.log()));
    }
}

/// Starts `lb-agent` in the namespace `ns` with `config_yaml` (plus a
/// `metrics_addr` on 127.0.0.1 unless it has one) written to
/// `dir/agent.yaml`, pinning under `pin_dir`, logging to
/// `dir/agent-<start>.log`; does not wait for readiness.
pub fn spawn_agent_in(
    ns: &str,
    dir: &Path,
    pin_dir: &Path,
    start: usize,
    wrapper: &[&str],
    config_yaml: &str,
) -> AgentHandle {
    static NEXT_PORT: AtomicU16 = AtomicU16::new(19470);
    let port = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
    let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let config_path = dir.join("agent.yaml");
    let log_path = dir.join(format!("agent-{start}.log"));
    write_atomic(&config_path, &with_metrics_addr(config_yaml, metrics_addr));
    let log = fs::File::create(&log_path).expect("create agent log");
    let child = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{ns}"))
        .args(wrapper)
        .arg(agent_bin())
        .arg("--config")
        .arg(&config_path)
        .arg("--pin-dir")
        .arg(pin_dir)
        .arg("--log")
        .arg(std::env::var("XLB_AGENT_LOG").unwrap_or_else(|_| "info".into()))
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log)
        .spawn()
        .expect("spawn lb-agent");
    AgentHandle {
        child,
        log_path,
        config_path,
        metrics_addr,
        lb_ns: ns.to_string(),
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Topology {
    /// Writes `config_yaml` (plus a `metrics_addr` on 127.0.0.1 unless it
    /// has one) to `dir/agent.yaml`, starts `lb-agent` in the LB namespace
    /// with this topology's pin directory, and waits until `/readyz`
    /// answers 200. Starting again after the previous agent has exited
    /// reuses the pins (the agent adopts the running data plane).
    pub fn start_agent(&mut self, config_yaml: &str) -> AgentHandle {
        self.start_agent_wrapped(&[], config_yaml)
    }

    /// [`start_agent`](Self::start_agent), running the agent under
    /// `wrapper` (a command that execs its arguments, e.g. `setpriv ...`).
    pub fn start_agent_wrapped(&mut self, wrapper: &[&str], config_yaml: &str) -> AgentHandle {
        let mut agent = self.spawn_agent_wrapped(wrapper, config_yaml);
        agent.wait_ready();
        agent
    }

    /// [`start_agent`](Self::start_agent) without waiting for readiness.
    pub fn spawn_agent(&mut self, config_yaml: &str) -> AgentHandle {
        self.spawn_agent_wrapped(&[], config_yaml)
    }

    fn spawn_agent_wrapped(&mut self, wrapper: &[&str], config_yaml: &str) -> AgentHandle {
        self.agent_starts += 1;
        spawn_agent_in(
            &self.lb.name,
            &self.dir,
            &self.pin_dir,
            self.agent_starts,
            wrapper,
            config_yaml,
        )
    }

    /// Runs `lbctl --pin-dir <pin_dir> --json ARGS` and parses its output.
    pub fn lbctl_json(&self, args: &[&str]) -> serde_json::Value {
        lbctl_json_in(None, &self.pin_dir, args).1
    }

    /// `lbctl --json ARGS` asking `agent` too (service names, backend states).
    pub fn lbctl_json_with(&self, agent: &AgentHandle, args: &[&str]) -> serde_json::Value {
        let addr = agent.metrics_addr.to_string();
        let all: Vec<&str> = ["--agent", addr.as_str()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        lbctl_json_in(Some(&agent.lb_ns), &self.pin_dir, &all).1
    }

    /// Starts a UDP echo server on `port` of every backend (a thread in each
    /// backend namespace, stopped when the topology goes).
    pub fn start_udp_echo(&mut self, port: u16) {
        for n in 1..=self.backends.len() {
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, rx) = std::sync::mpsc::channel();
            let s = stop.clone();
            let t = in_netns(&self.backends[n - 1], move || {
                let sock = UdpSocket::bind((backend_ip(n), port)).expect("bind UDP echo");
                set_rcvbuf(&sock, 4 << 20);
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                tx.send(()).unwrap();
                let mut buf = [0u8; 2048];
                while !s.load(Ordering::Relaxed) {
                    if let Ok((len, from)) = sock.recv_from(&mut buf) {
                        let _ = sock.send_to(&buf[..len], from);
                    }
                }
            });
            rx.recv_timeout(Duration::from_secs(10))
                .expect("UDP echo server did not start");
            self.echo.push((stop, t));
        }
    }
}

/// Sets a socket's receive buffer to `bytes` (SO_RCVBUFFORCE: root may
/// exceed net.core.rmem_max), so that a briefly descheduled reader does not
/// lose datagrams.
pub fn set_rcvbuf(sock: &impl std::os::fd::AsRawFd, bytes: i32) {
    // SAFETY: setsockopt with a valid fd and an int option value.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&bytes as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", io::Error::last_os_error());
}

/// One `GET path` on a new connection (`Connection: close`); returns the
/// status and the body. Call it from a thread in the right namespace.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    parse_response(&buf)
        .map(|(status, body, _)| (status, body))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad HTTP response: {:?}", String::from_utf8_lossy(&buf)),
            )
        })
}

/// Status, body and total length of the first complete response in `buf`
/// (the body is `Content-Length` bytes, or everything when there is none).
fn parse_response(buf: &[u8]) -> Option<(u16, String, usize)> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(buf.len() - head_end);
    let body = buf.get(head_end..head_end + len)?;
    Some((
        status,
        String::from_utf8_lossy(body).into_owned(),
        head_end + len,
    ))
}

/// A keep-alive HTTP/1.1 connection: repeated `GET /` on one TCP connection.
pub struct HttpConn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl HttpConn {
    /// Connects from a thread in `ns` (the socket stays in that namespace
    /// and can then be used from any thread).
    pub fn connect_in(ns: &Netns, addr: SocketAddr) -> io::Result<HttpConn> {
        in_netns(ns, move || HttpConn::connect(addr, Duration::from_secs(5)))
            .join()
            .expect("connect thread")
    }

    /// Connects from the calling thread's namespace, giving up on the
    /// connection, and later on each request and answer, after `timeout`.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<HttpConn> {
        let s = TcpStream::connect_timeout(&addr, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        Ok(HttpConn {
            stream: s,
            buf: Vec::new(),
        })
    }

    /// One `GET /`; returns the body, trimmed (`b1`, ...).
    pub fn get(&mut self) -> io::Result<String> {
        self.stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut chunk = [0u8; 4096];
        loop {
            if let Some((status, body, used)) = parse_response(&self.buf) {
                self.buf.drain(..used);
                if status != 200 {
                    return Err(io::Error::other(format!("HTTP status {status}")));
                }
                return Ok(body.trim().to_string());
            }
            let n = match self.stream.read(&mut chunk) {
                // A signal to the process (a child's exit): not an answer.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => r?,
            };
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

// ---------------------------------------------------------------------------
// CPU affinity: which CPU handles a packet on a veth follows the CPU that
// sent it, which is how tests move a flow between CPUs.

/// The CPUs the calling thread may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        assert_eq!(rc, 0, "sched_getaffinity: {}", io::Error::last_os_error());
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Restricts `pid` (0: the calling thread) to `cpus`.
pub fn set_affinity(pid: i32, cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        let rc = libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set);
        assert_eq!(
            rc,
            0,
            "sched_setaffinity({pid}, {cpus:?}): {}",
            io::Error::last_os_error()
        );
    }
}

impl Topology {
    /// Restricts every running nginx to `cpus`.
    pub fn pin_backends(&self, cpus: &[usize]) {
        for c in self.nginx.iter().flatten() {
            set_affinity(c.id() as i32, cpus);
        }
    }
}
