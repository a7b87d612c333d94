//! What the demo (`xlb-demo`) and the end-to-end benchmark (`xlb-e2e-bench`)
//! add to [`crate::topology`]: finding the agent's binaries, running
//! lb-agent in a namespace with its log in a file, waiting for `/readyz`,
//! stopping it and removing its pins, plain HTTP/1.0 requests, commands in a
//! namespace that return errors instead of panicking, and a Ctrl-C flag.
//!
//! Errors are strings: these binaries report a failed step and go on (or
//! stop cleanly), they do not need to match on error kinds.

use std::{
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use xlb_tests::netns::Netns;

pub type Res<T> = Result<T, String>;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Makes Ctrl-C set a flag instead of killing the process, so that the
/// caller can stop between steps and let its guards tear everything down.
/// (Children started afterwards get the default action back at exec.)
pub fn install_sigint_flag() {
    let handler: extern "C" fn(libc::c_int) = on_sigint;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// `Err("interrupted")` once Ctrl-C was pressed.
pub fn check_interrupt() -> Res<()> {
    if interrupted() {
        Err("interrupted (Ctrl-C)".into())
    } else {
        Ok(())
    }
}

/// Sleeps up to `d`, returning early (with an error) on Ctrl-C.
pub fn sleep_interruptible(d: Duration) -> Res<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        check_interrupt()?;
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(50)));
    }
    check_interrupt()
}

pub use xlb_tests::topology::workspace_root;

/// lb-agent and lbctl, from the target directory this binary runs from.
pub struct Bins {
    pub lb_agent: PathBuf,
    pub lbctl: PathBuf,
}

impl Bins {
    /// [`Bins::locate`], with `--lb-agent PATH` in place of the lb-agent
    /// found there when it is given.
    pub fn locate_with(lb_agent: Option<&Path>) -> Res<Self> {
        let mut bins = Self::locate()?;
        if let Some(p) = lb_agent {
            if !p.exists() {
                return Err(format!("--lb-agent {}: no such file", p.display()));
            }
            println!("lb-agent: {}", p.display());
            bins.lb_agent = p.to_path_buf();
        }
        Ok(bins)
    }

    /// Looks next to the running executable (`target/<profile>/`) and builds
    /// the two binaries with that profile if either is missing.
    pub fn locate() -> Res<Self> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let dir = exe
            .parent()
            .ok_or("the executable has no directory")?
            .to_path_buf();
        let bins = Self {
            lb_agent: dir.join("lb-agent"),
            lbctl: dir.join("lbctl"),
        };
        if !bins.lb_agent.exists() || !bins.lbctl.exists() {
            let release = dir.file_name().is_some_and(|n| n == "release");
            let mut cmd = Command::new("cargo");
            cmd.current_dir(workspace_root())
                .args(["build", "-p", "lb-agent", "--bins"]);
            if release {
                cmd.arg("--release");
            }
            eprintln!("lb-agent/lbctl missing in {}: building them", dir.display());
            let st = cmd
                .status()
                .map_err(|e| format!("running cargo build: {e}"))?;
            if !st.success() || !bins.lb_agent.exists() {
                return Err(format!(
                    "cargo build -p lb-agent --bins failed ({st}); build them first"
                ));
            }
        }
        Ok(bins)
    }

    /// Runs `lbctl --pin-dir DIR ARGS...` and returns its stdout.
    pub fn lbctl(&self, pin_dir: &Path, args: &[&str]) -> Res<String> {
        let out = Command::new(&self.lbctl)
            .arg("--pin-dir")
            .arg(pin_dir)
            .args(args)
            .output()
            .map_err(|e| format!("running lbctl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "lbctl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// `nsenter --net=/var/run/netns/NAME` (keeps the host's /sys and bpffs).
pub fn nsenter(ns: &str) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/var/run/netns/{ns}"));
    c
}

/// Starts `program` in `ns` with stdout and stderr appended to `log`.
pub fn spawn_logged(ns: &Netns, program: &str, args: &[&str], log: &Path) -> Res<Child> {
    let f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let f2 = f.try_clone().map_err(|e| e.to_string())?;
    nsenter(&ns.name)
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .spawn()
        .map_err(|e| format!("starting {program}: {e}"))
}

/// Runs a shell command in `ns`; its stdout, or an error with its stderr.
pub fn sh_in(ns: &Netns, cmd: &str) -> Res<String> {
    let out = nsenter(&ns.name)
        .args(["sh", "-c", cmd])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("`{cmd}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{cmd}` in {} failed ({}): {}{}",
            ns.name,
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `f` on a thread inside the namespace called `ns`.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
    let name = ns.to_string();
    std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        f()
    })
}

/// Runs `f` inside `ns` and waits for it.
pub fn run_in<T: Send + 'static>(ns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> Res<T> {
    in_ns(&ns.name, f)
        .join()
        .map_err(|_| format!("a thread in {} panicked", ns.name))
}

/// One HTTP/1.0 request (a new connection each time); status and body.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> Res<(u16, String)> {
    let mut s =
        TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("{addr}: not an HTTP response: {text:.60}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Whether `addr` accepts a TCP connection from inside `ns` within `timeout`.
pub fn wait_tcp(ns: &Netns, addr: SocketAddr, timeout: Duration) -> bool {
    run_in(ns, move || {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    })
    .unwrap_or(false)
}

/// Removes terminal colour sequences (`ESC [ ... m`), which the agent's
/// log has even when written to a file.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The last `n` lines of a file, without colours (for error messages).
pub fn tail(path: &Path, n: usize) -> String {
    let text = strip_ansi(&fs::read_to_string(path).unwrap_or_default());
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Sends `sig` to `pid`.
pub fn kill(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// SIGTERM, then SIGKILL after `grace`; reaps the child.
pub fn terminate(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    kill(child.id(), libc::SIGTERM);
    let end = Instant::now() + grace;
    while Instant::now() < end {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A running lb-agent in a namespace. Dropping it stops it and runs
/// `lb-agent --cleanup` on its pin directory (detaching the program).
pub struct Agent {
    child: Option<Child>,
    lb_agent: PathBuf,
    ns: String,
    pub pin_dir: PathBuf,
    pub log: PathBuf,
    pub metrics: SocketAddr,
}

impl Agent {
    /// `lb-agent --config CONFIG --pin-dir PIN_DIR` in `ns`; `metrics` must
    /// be the config's `metrics_addr`. Removes stale pins first.
    pub fn spawn(
        bins: &Bins,
        ns: &Netns,
        config: &Path,
        pin_dir: &Path,
        metrics: SocketAddr,
        log: &Path,
    ) -> Res<Self> {
        cleanup(&bins.lb_agent, pin_dir)?;
        let _ = fs::remove_file(log);
        let child = spawn_logged(
            ns,
            &bins.lb_agent.to_string_lossy(),
            &[
                "--config",
                &config.to_string_lossy(),
                "--pin-dir",
                &pin_dir.to_string_lossy(),
            ],
            log,
        )?;
        Ok(Self {
            child: Some(child),
            lb_agent: bins.lb_agent.clone(),
            ns: ns.name.clone(),
            pin_dir: pin_dir.to_path_buf(),
            log: log.to_path_buf(),
            metrics,
        })
    }

    /// The agent's pid (nsenter execs it, so the child is the agent).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn exited(&mut self) -> Option<String> {
        let c = self.child.as_mut()?;
        match c.try_wait() {
            Ok(Some(st)) => Some(format!(
                "lb-agent exited ({st}); its log ends with:\n{}",
                tail(&self.log, 15)
            )),
            _ => None,
        }
    }

    /// GET `path` from the agent's metrics endpoint, from inside its namespace.
    pub fn get(&self, path: &str, timeout: Duration) -> Res<(u16, String)> {
        let (addr, path) = (self.metrics, path.to_string());
        in_ns(&self.ns, move || http_get(addr, &path, timeout))
            .join()
            .map_err(|_| "metrics request thread panicked".to_string())?
    }

    /// Polls `/readyz` until it answers 200; returns how long that took.
    pub fn wait_ready(&mut self, timeout: Duration) -> Res<Duration> {
        let start = Instant::now();
        loop {
            check_interrupt()?;
            if let Some(e) = self.exited() {
                return Err(e);
            }
            if let Ok((200, _)) = self.get("/readyz", Duration::from_millis(500)) {
                return Ok(start.elapsed());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "lb-agent not ready after {timeout:?}; its log ends with:\n{}",
                    tail(&self.log, 15)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the agent (SIGTERM), detaches the program and removes the pins
    /// and, in the agent's namespace, its nf_tables table `xlb` (notrack
    /// rules a stopped agent keeps, as it keeps its pins).
    pub fn stop(&mut self) -> Res<()> {
        if let Some(mut c) = self.child.take() {
            terminate(&mut c, Duration::from_secs(5));
        }
        cleanup_in(Some(&self.ns), &self.lb_agent, &self.pin_dir)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// `lb-agent --cleanup --pin-dir DIR` (nothing to do if DIR does not exist).
pub fn cleanup(lb_agent: &Path, pin_dir: &Path) -> Res<()> {
    cleanup_in(None, lb_agent, pin_dir)
}

/// The same, run in network namespace `ns` (`None`: this one), where it
/// also removes the agent's nf_tables table.
fn cleanup_in(ns: Option<&str>, lb_agent: &Path, pin_dir: &Path) -> Res<()> {
    if !pin_dir.exists() {
        return Ok(());
    }
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = nsenter(ns);
            c.arg(lb_agent);
            c
        }
        None => Command::new(lb_agent),
    };
    let out = cmd
        .arg("--cleanup")
        .arg("--pin-dir")
        .arg(pin_dir)
        .output()
        .map_err(|e| format!("lb-agent --cleanup: {e}"))?;
    if !out.status.success() || pin_dir.exists() {
        return Err(format!(
            "lb-agent --cleanup --pin-dir {} failed ({}): {}",
            pin_dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The benchmark programs, pinned under `dir` (removed on drop).
pub struct PinnedPrograms {
    pub ebpf: aya::Ebpf,
    dir: PathBuf,
}

impl Drop for PinnedPrograms {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Loads the benchmark programs (lb-ebpf/src/bench.rs) from the agent's
/// object and pins each under `dir` (made afresh), so that `ip link set …
/// xdpdrv pinned` attaches them in any namespace.
pub fn pin_bench_programs(dir: &Path) -> Res<PinnedPrograms> {
    use aya::programs::Xdp;
    let mut ebpf = xlb_tests::xdp::load_bench_programs()?;
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for name in xlb_tests::xdp::BENCH_PROGRAMS {
        let prog: &mut Xdp = ebpf
            .program_mut(name)
            .and_then(|p| p.try_into().ok())
            .ok_or(format!("{name} is not an XDP program in the object"))?;
        prog.pin(dir.join(name))
            .map_err(|e| format!("pinning {name}: {e}"))?;
    }
    Ok(PinnedPrograms {
        ebpf,
        dir: dir.to_path_buf(),
    })
}

/// Attaches benchmark program `prog`, pinned under `dir`, to `iface` in
/// `ns` (native mode).
pub fn attach_pinned(ns: &Netns, iface: &str, dir: &Path, prog: &str) -> Res<()> {
    sh_in(
        ns,
        &format!(
            "ip link set dev {iface} xdpdrv pinned {}",
            dir.join(prog).display()
        ),
    )
    .map(drop)
}

/// Detaches the native XDP program of `iface` in `ns`.
pub fn detach_xdp(ns: &Netns, iface: &str) -> Res<()> {
    sh_in(ns, &format!("ip link set dev {iface} xdpdrv off")).map(drop)
}

/// Whether an XDP program is attached to `iface` in `ns`.
pub fn xdp_attached(ns: &Netns, iface: &str) -> bool {
    sh_in(ns, &format!("ip -d link show dev {iface}")).is_ok_and(|s| s.contains("prog/xdp"))
}

/// A metric's value from Prometheus text (`name` includes any labels).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The median of `v` (upper median for even lengths); NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

/// Splits a number into thousands: 1234567 -> "1 234 567".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// What `wrk --latency` reports (and, from the e2e bench, retransmits).
#[derive(Clone, Debug, Default)]
pub struct Wrk {
    pub rps: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub requests: u64,
    pub errors: u64,
    /// TCP segments retransmitted by the client and the backends during the run.
    pub retrans: u64,
}

fn parse_latency_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, mult) = if let Some(v) = s.strip_suffix("us") {
        (v, 0.001)
    } else if let Some(v) = s.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1000.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60_000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|v| v * mult)
}

pub fn parse_wrk(out: &str) -> Res<Wrk> {
    let mut w = Wrk::default();
    let mut got_rps = false;
    for line in out.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        match first {
            "50%" => w.p50_ms = words.next().and_then(parse_latency_ms).unwrap_or(f64::NAN),
            "90%" => w.p90_ms = words.next().and_then(parse_latency_ms).unwrap_or(f64::NAN),
            "99%" => w.p99_ms = words.next().and_then(parse_latency_ms).unwrap_or(f64::NAN),
            "Requests/sec:" => {
                w.rps = words.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
                got_rps = true;
            }
            "Socket" | "Non-2xx" => {
                // The counts follow the colon ("Non-2xx" has digits of its own).
                w.errors += line
                    .split_once(':')
                    .map_or("", |x| x.1)
                    .split(|c: char| !c.is_ascii_digit())
                    .filter_map(|n| n.parse::<u64>().ok())
                    .sum::<u64>();
            }
            _ if line.contains(" requests in ") => {
                w.requests = first.parse().unwrap_or(0);
            }
            _ => {}
        }
    }
    if !got_rps {
        return Err(format!("no Requests/sec in wrk's output:\n{out}"));
    }
    Ok(w)
}

/// The balancers the end-to-end benchmark (`xlb-e2e-bench`) compares and
/// the latency benchmark (`xlb-latency-bench`) reuses, set up in the LB
/// namespace of the end-to-end topology (3 nginx backends) and removed
/// again: xlb (lb-agent from a config file), iptables and nftables DNAT as
/// kube-proxy writes them, nginx's stream proxy and HAProxy.
pub mod mechanisms {
    use std::{fmt::Write as _, fs, net::SocketAddr, process::Child, time::Duration};

    use xlb_tests::topology::{backend_ip, Topology, BACKEND_PORT, VIP};

    use super::{
        http_get, run_in, sh_in, spawn_logged, tail, terminate, wait_tcp, xdp_attached, Agent,
        Bins, Res,
    };
    use crate::args::Mech;

    pub const BACKENDS: usize = 3;
    pub const UDP_PORT: u16 = 53;
    pub const UDP_BACKEND_PORT: u16 = 5353;
    pub const METRICS: &str = "127.0.0.1:9469";

    /// What is running for a case, until it is torn down.
    pub enum Running {
        Xlb(Agent),
        Rules,
        Proxy(Child),
    }

    pub struct Ctx<'a> {
        pub t: &'a Topology,
        pub bins: &'a Bins,
        pub xdp_mode: String,
    }

    pub fn vip80() -> SocketAddr {
        SocketAddr::new(VIP.into(), 80)
    }

    pub fn xlb_config(xdp_mode: &str) -> String {
        let mut s = format!(
            "interfaces: [lbc, lbb1, lbb2, lbb3]\nxdp_mode: {xdp_mode}\nmetrics_addr: {METRICS}\nservices:\n"
        );
        for (name, port, proto, bport) in [
            ("web", 80, "tcp", BACKEND_PORT),
            ("dns", UDP_PORT, "udp", UDP_BACKEND_PORT),
        ] {
            let _ = writeln!(
                s,
                "  - name: {name}\n    vip: {VIP}\n    port: {port}\n    protocol: {proto}\n    mode: nat\n    backends:"
            );
            for n in 1..=BACKENDS {
                let _ = writeln!(s, "      - {{ ip: {}, port: {bport} }}", backend_ip(n));
            }
        }
        s
    }

    /// kube-proxy's iptables mode: a services chain, a chain per service that
    /// picks an endpoint with `statistic --mode random`, a DNAT chain per endpoint.
    pub fn iptables_rules() -> String {
        let mut s = String::from(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:XLB-SERVICES - [0:0]\n:XLB-SVC-WEB - [0:0]\n",
        );
        for n in 1..=BACKENDS {
            let _ = writeln!(s, ":XLB-SEP-WEB{n} - [0:0]");
        }
        s.push_str("-A PREROUTING -j XLB-SERVICES\n");
        let _ = writeln!(
            s,
            "-A XLB-SERVICES -d {VIP}/32 -p tcp -m tcp --dport 80 -j XLB-SVC-WEB"
        );
        for n in 1..=BACKENDS {
            let left = BACKENDS - n + 1;
            if left > 1 {
                let _ = writeln!(
                    s,
                    "-A XLB-SVC-WEB -m statistic --mode random --probability {:.11} -j XLB-SEP-WEB{n}",
                    1.0 / left as f64
                );
            } else {
                let _ = writeln!(s, "-A XLB-SVC-WEB -j XLB-SEP-WEB{n}");
            }
        }
        for n in 1..=BACKENDS {
            let _ = writeln!(
                s,
                "-A XLB-SEP-WEB{n} -p tcp -m tcp -j DNAT --to-destination {}:{BACKEND_PORT}",
                backend_ip(n)
            );
        }
        s.push_str("COMMIT\n");
        s
    }

    /// kube-proxy's nftables mode in one rule per service: `numgen random` into
    /// a map of endpoints.
    pub fn nft_rules() -> String {
        let map = |port: u16| {
            (1..=BACKENDS)
                .map(|n| format!("{} : {} . {port}", n - 1, backend_ip(n)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "table ip xlb_bench {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n\
             \x20   ip daddr {VIP} tcp dport 80 dnat to numgen random mod {BACKENDS} map {{ {} }}\n\
             \x20   ip daddr {VIP} udp dport {UDP_PORT} dnat to numgen random mod {BACKENDS} map {{ {} }}\n  }}\n}}\n",
            map(BACKEND_PORT),
            map(UDP_BACKEND_PORT)
        )
    }

    pub fn nginx_stream_conf(dir: &std::path::Path) -> String {
        let servers: String = (1..=BACKENDS)
            .map(|n| format!("server {}:{BACKEND_PORT}; ", backend_ip(n)))
            .collect();
        format!(
            "load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n\
             daemon off; pid {d}/nginx.pid; error_log {d}/nginx-error.log; worker_processes auto;\n\
             events {{ worker_connections 8192; }}\n\
             stream {{ upstream b {{ {servers}}} server {{ listen {VIP}:80; proxy_pass b; }} }}\n",
            d = dir.display()
        )
    }

    pub fn haproxy_conf() -> String {
        let mut s = format!(
            "global\n    maxconn 8000\n\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 1m\n    timeout server 1m\n\n\
             frontend vip\n    bind {VIP}:80\n    default_backend nginx\n\nbackend nginx\n    balance roundrobin\n"
        );
        for n in 1..=BACKENDS {
            let _ = writeln!(s, "    server b{n} {}:{BACKEND_PORT}", backend_ip(n));
        }
        s
    }

    pub fn write(path: &std::path::Path, text: &str) -> Res<()> {
        fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Sets `mech` up in the LB namespace and waits until it serves.
    pub fn start(ctx: &Ctx, mech: Mech) -> Res<Running> {
        let t = ctx.t;
        let dir = &t.dir;
        Ok(match mech {
            Mech::Xlb => {
                let cfg = dir.join("xlb.yaml");
                write(&cfg, &xlb_config(&ctx.xdp_mode))?;
                let mut agent = Agent::spawn(
                    ctx.bins,
                    &t.lb,
                    &cfg,
                    &t.pin_dir,
                    METRICS.parse().unwrap(),
                    &dir.join("lb-agent.log"),
                )?;
                agent.wait_ready(Duration::from_secs(30))?;
                Running::Xlb(agent)
            }
            Mech::Iptables => {
                let f = dir.join("iptables.rules");
                write(&f, &iptables_rules())?;
                sh_in(
                    &t.lb,
                    &format!("iptables-restore --noflush < {}", f.display()),
                )?;
                Running::Rules
            }
            Mech::Nftables => {
                let f = dir.join("xlb_bench.nft");
                write(&f, &nft_rules())?;
                sh_in(&t.lb, &format!("nft -f {}", f.display()))?;
                Running::Rules
            }
            Mech::Nginx | Mech::Haproxy => {
                sh_in(&t.lb, &format!("ip addr add {VIP}/32 dev lo"))?;
                let log = dir.join(format!("{}.log", mech.id()));
                let child = if mech == Mech::Nginx {
                    let conf = dir.join("nginx-stream.conf");
                    write(&conf, &nginx_stream_conf(dir))?;
                    let err = dir.join("nginx-error.log");
                    spawn_logged(
                        &t.lb,
                        "nginx",
                        &["-c", &conf.to_string_lossy(), "-e", &err.to_string_lossy()],
                        &log,
                    )?
                } else {
                    let conf = dir.join("haproxy.cfg");
                    write(&conf, &haproxy_conf())?;
                    spawn_logged(
                        &t.lb,
                        "haproxy",
                        &["-db", "-f", &conf.to_string_lossy()],
                        &log,
                    )?
                };
                let mut running = Running::Proxy(child);
                if !wait_tcp(&t.lb, vip80(), Duration::from_secs(10)) {
                    let _ = stop(ctx, mech, &mut running);
                    return Err(format!(
                        "{} did not listen on {VIP}:80; {}:\n{}",
                        mech.short(),
                        log.display(),
                        tail(&log, 10)
                    ));
                }
                running
            }
        })
    }

    /// Removes `mech` completely and checks that it is gone.
    pub fn stop(ctx: &Ctx, mech: Mech, running: &mut Running) -> Res<()> {
        let t = ctx.t;
        match running {
            Running::Xlb(agent) => {
                agent.stop()?;
                if let Some(i) = t.lb_interfaces().iter().find(|i| xdp_attached(&t.lb, i)) {
                    return Err(format!("XDP still attached to {i} after cleanup"));
                }
            }
            Running::Rules => {
                if mech == Mech::Iptables {
                    sh_in(&t.lb, "iptables -t nat -F && iptables -t nat -X")?;
                    // iptables-nft leaves its (empty) table behind.
                    let _ = sh_in(&t.lb, "nft delete table ip nat");
                } else {
                    sh_in(&t.lb, "nft delete table ip xlb_bench")?;
                }
                let rules = sh_in(&t.lb, "nft list ruleset")?;
                if !rules.trim().is_empty() {
                    return Err(format!("rules left after removing {}:\n{rules}", mech.id()));
                }
            }
            Running::Proxy(child) => {
                terminate(child, Duration::from_secs(5));
                // The address was added by start(); after a failed start it may be missing.
                let _ = sh_in(&t.lb, &format!("ip addr del {VIP}/32 dev lo"));
                if sh_in(&t.lb, "ip -4 addr show dev lo")?.contains(&VIP.to_string()) {
                    return Err(format!("{VIP} still on lo"));
                }
            }
        }
        // Whatever it was, the VIP must not answer any more.
        let vip = vip80();
        let answer = run_in(&t.client, move || {
            http_get(vip, "/", Duration::from_millis(700))
        })?;
        if let Ok((status, body)) = answer {
            return Err(format!(
                "{VIP}:80 still answers after removing {} (HTTP {status} {})",
                mech.id(),
                body.trim()
            ));
        }
        Ok(())
    }

    /// `n` requests from the client, each on a new connection: all must answer
    /// 200; returns how many distinct backends answered.
    pub fn check_serves(t: &Topology, n: usize) -> Res<usize> {
        let vip = vip80();
        let r = run_in(&t.client, move || {
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..n {
                match http_get(vip, "/", Duration::from_secs(2)) {
                    Ok((200, body)) => {
                        seen.insert(body.trim().to_string());
                    }
                    Ok((s, _)) => return Err(format!("HTTP {s}")),
                    Err(e) => return Err(e),
                }
            }
            Ok(seen.len())
        })??;
        Ok(r)
    }
}

/// The remote Pod's address (`add_remote_node`).
pub const REMOTE_POD: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 4, 0, 2);

/// A second node (`<prefix>-n2`, a router) and its Pod (`<prefix>-p2`, at
/// [`REMOTE_POD`]), reached from the LB node over `lbn2` (10.3.0.0/24).
pub fn add_remote_node(t: &xlb_tests::topology::Topology, prefix: &str) -> (Netns, Netns) {
    use xlb_tests::netns::sh;
    let n2 = Netns::new(&format!("{prefix}-n2"));
    let pod = Netns::new(&format!("{prefix}-p2"));
    sh(&format!(
        "ip link add lbn2 netns {} type veth peer name eth0 netns {}",
        t.lb.name, n2.name
    ));
    t.lb.run(
        "ip addr add 10.3.0.1/24 dev lbn2 && ip link set lbn2 up && ip route add 10.4.0.0/24 via 10.3.0.2",
    );
    n2.run(
        "ip addr add 10.3.0.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.3.0.1 \
         && sysctl -qw net.ipv4.ip_forward=1 && ethtool -K eth0 gro on tx off >/dev/null",
    );
    sh(&format!(
        "ip link add pod netns {} type veth peer name eth0 netns {}",
        n2.name, pod.name
    ));
    n2.run(
        "ip addr add 10.4.0.1/24 dev pod && ip link set pod up && ethtool -K pod tx off >/dev/null",
    );
    pod.run(&format!(
        "ip addr add {REMOTE_POD}/24 dev eth0 && ip link set eth0 up && ip route add default via 10.4.0.1 \
         && ethtool -K eth0 gro on tx off >/dev/null"
    ));
    (n2, pod)
}

/// `iperf3 -J`'s output as JSON, or the error it reports.
pub fn iperf3_json(out: &std::process::Output) -> Res<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "iperf3's output: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    match v["error"].as_str() {
        Some(e) => Err(format!("iperf3: {e}")),
        None => Ok(v),
    }
}

/// Why IPVS is not among a benchmark's cases on this machine.
pub fn ipvs_not_measured() -> &'static str {
    if Path::new("/proc/net/ip_vs").exists() {
        "this bench has no IPVS case yet"
    } else {
        "this kernel has no ip_vs: no /proc/net/ip_vs"
    }
}

/// A shell command's output, stdout then stderr, trimmed (for a report's
/// header: the kernel, the machine).
pub fn cmd_line(cmd: &str) -> String {
    Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).trim().to_string()
                + String::from_utf8_lossy(&o.stderr).trim()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_wrk_output() {
        let out = "Running 10s test @ http://192.0.2.10/
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.10ms    1.00ms  30.00ms   90.00%
    Req/Sec    15.00k     1.00k   17.00k    70.00%
  Latency Distribution
     50%  850.00us
     75%    2.00ms
     90%    3.10ms
     99%    1.20s
  300000 requests in 10.00s, 45.00MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 4
Requests/sec:  29999.50
Transfer/sec:      4.50MB
";
        let w = parse_wrk(out).unwrap();
        assert_eq!(w.rps, 29999.5);
        assert!((w.p50_ms - 0.85).abs() < 1e-9);
        assert_eq!(w.p90_ms, 3.1);
        assert_eq!(w.p99_ms, 1200.0);
        assert_eq!(w.requests, 300000);
        assert_eq!(w.errors, 9);
        assert!(parse_wrk("garbage").is_err());
    }

    use super::*;

    #[test]
    fn metric_finds_labelled_and_plain_values() {
        let text = "# HELP x y\nxlb_config_reloads_total{result=\"ok\"} 2\n\
                    xlb_config_reload_duration_seconds_sum 0.25\n\
                    xlb_config_reload_duration_seconds_count 2\n";
        assert_eq!(
            metric(text, "xlb_config_reloads_total{result=\"ok\"}"),
            Some(2.0)
        );
        assert_eq!(
            metric(text, "xlb_config_reload_duration_seconds_sum"),
            Some(0.25)
        );
        assert_eq!(metric(text, "xlb_config_reload_duration_seconds"), None);
    }

    #[test]
    fn strips_colours() {
        assert_eq!(
            strip_ansi("\x1b[2m12:00\x1b[0m \x1b[32m INFO\x1b[0m took\x1b[2m=\x1b[0m5ms"),
            "12:00  INFO took=5ms"
        );
    }

    #[test]
    fn median_and_thousands() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert!(median(&[]).is_nan());
        assert_eq!(thousands(1234567), "1 234 567");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1 000");
    }
}
