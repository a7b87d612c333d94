//! `cargo xtask bench` (second part): xlb end to end, against what a
//! Kubernetes node would otherwise use, on the topology of the end-to-end
//! tests (client, load balancer and 3 nginx backends in network namespaces).
//!
//! * TCP: `wrk -t2 -c64 -d10s --latency http://VIP/` from the client through
//!   (a) xlb (lb-agent, nat mode), (b) iptables DNAT as kube-proxy's iptables
//!   mode writes it, (c) nftables DNAT as kube-proxy's nftables mode,
//!   (d) nginx as an L4 stream proxy, (e) HAProxy in TCP mode. The cases run
//!   interleaved in rounds (a..e, a..e, ...) so that machine noise hits all of
//!   them alike; the report gives the median per case. Before each run the
//!   mechanism must answer requests from every backend; after it, it is
//!   removed and must be gone (requests fail, no rules, no XDP, no process).
//! * UDP: datagrams per second forwarded through xlb and through nftables
//!   DNAT, with the same sender (8 sockets in the client blasting 64-byte
//!   datagrams at VIP:53) and a counting sink in each backend.
//! * The agent with 1000 services x 100 backends: resident memory, and how
//!   long a reload takes after one backend changed.
//!
//! Prints markdown tables and writes an SVG chart (docs/benchmarks-e2e.svg).

use std::{
    fmt::Write as _,
    fs,
    io::ErrorKind,
    net::UdpSocket,
    os::fd::AsRawFd,
    path::PathBuf,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use clap::Parser;
use xlb_bench::{
    args::{E2eArgs, Mech, E2E_SVG},
    support::{
        check_interrupt, cmd_line, in_ns, install_sigint_flag, interrupted, ipvs_not_measured,
        mechanisms::{check_serves, start, stop, write, Ctx, BACKENDS, UDP_BACKEND_PORT, UDP_PORT},
        median, metric, parse_wrk, run_in, sh_in, sleep_interruptible, strip_ansi, thousands,
        Agent, Bins, Res, Wrk,
    },
};
use xlb_tests::topology::{Topology, CLIENT_IP, VIP};

const PREFIX: &str = "xbench";
const MEM_METRICS: &str = "127.0.0.1:9470";

/// xlb end to end against iptables, nftables, nginx and HAProxy, UDP
/// forwarding, and the agent's memory with many services.
#[derive(Parser, Debug)]
#[command(name = "xlb-e2e-bench", args_override_self = true)]
struct Cli {
    #[command(flatten)]
    opts: E2eArgs,
}

fn run_wrk(t: &Topology, o: &E2eArgs) -> Res<Wrk> {
    let out = t.output_in(
        &t.client,
        "wrk",
        &[
            &format!("-t{}", o.threads),
            &format!("-c{}", o.connections),
            &format!("-d{}s", o.duration),
            "--latency",
            &format!("http://{VIP}/"),
        ],
    );
    check_interrupt()?;
    if !out.status.success() {
        return Err(format!(
            "wrk failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    parse_wrk(&String::from_utf8_lossy(&out.stdout))
}

/// One TCP run: set up, check, wrk, tear down (always, also after a failure).
fn tcp_run(ctx: &Ctx, o: &E2eArgs, mech: Mech) -> (Res<Wrk>, Res<()>) {
    let mut running = match start(ctx, mech) {
        Ok(r) => r,
        Err(e) => return (Err(e), Ok(())),
    };
    let result = (|| {
        let seen = check_serves(ctx.t, 30)?;
        if seen < BACKENDS {
            return Err(format!(
                "only {seen} of {BACKENDS} backends answered 30 requests"
            ));
        }
        check_interrupt()?;
        let before = tcp_retransmits(ctx.t)?;
        let mut w = run_wrk(ctx.t, o)?;
        w.retrans = tcp_retransmits(ctx.t)?.saturating_sub(before);
        Ok(w)
    })();
    let stopped = stop(ctx, mech, &mut running);
    (result, stopped)
}

/// `RetransSegs` of /proc/net/snmp in `ns` (procfs shows the reader's namespace).
fn retrans_segs(ns: &xlb_tests::netns::Netns) -> Res<u64> {
    let snmp = sh_in(ns, "cat /proc/net/snmp")?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        return Err("no Tcp lines in /proc/net/snmp".into());
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "RetransSegs")
        .and_then(|(_, v)| v.parse().ok())
        .ok_or_else(|| "no RetransSegs in /proc/net/snmp".into())
}

/// Retransmitted TCP segments of the client and all backends.
fn tcp_retransmits(t: &Topology) -> Res<u64> {
    let mut sum = retrans_segs(&t.client)?;
    for b in &t.backends {
        sum += retrans_segs(b)?;
    }
    Ok(sum)
}

struct Sinks {
    counts: Vec<Arc<AtomicU64>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Sinks {
    /// A UDP socket on :5353 in each backend, counting datagrams.
    fn start(t: &Topology) -> Res<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut counts = Vec::new();
        let mut threads = Vec::new();
        for b in &t.backends {
            let count = Arc::new(AtomicU64::new(0));
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let (c, s) = (count.clone(), stop.clone());
            threads.push(in_ns(&b.name, move || {
                let sock = match UdpSocket::bind(("0.0.0.0", UDP_BACKEND_PORT)) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                set_rcvbuf(&sock, 8 << 20);
                let _ = sock.set_read_timeout(Some(Duration::from_millis(100)));
                let _ = ready_tx.send(Ok(()));
                let mut buf = [0u8; 2048];
                while !s.load(Ordering::Relaxed) {
                    if sock.recv(&mut buf).is_ok() {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
            ready_rx
                .recv()
                .map_err(|_| "UDP sink thread died".to_string())?
                .map_err(|e| format!("UDP sink in {}: {e}", b.name))?;
            counts.push(count);
        }
        Ok(Self {
            counts,
            stop,
            threads,
        })
    }

    fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

impl Drop for Sinks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn set_rcvbuf(sock: &UdpSocket, bytes: libc::c_int) {
    // SO_RCVBUFFORCE (root) goes past net.core.rmem_max.
    // SAFETY: setsockopt with a valid fd and an int option.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &bytes as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Received packets of eth0 in each backend (what the LB delivered).
fn backend_rx(t: &Topology) -> Res<u64> {
    let mut sum = 0;
    for b in &t.backends {
        let out = netns_exec(b, "cat /sys/class/net/eth0/statistics/rx_packets")?;
        sum += out
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("rx_packets of {}: {e}", b.name))?;
    }
    Ok(sum)
}

/// A command in `ns` through `ip netns exec`, which (unlike nsenter) mounts
/// the namespace's own /sys, where its interfaces' counters are.
fn netns_exec(ns: &xlb_tests::netns::Netns, cmd: &str) -> Res<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "sh", "-c", cmd])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "`{cmd}` in {}: {}",
            ns.name,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Blast {
    sent: u64,
    blocked: u64,
    errors: u64,
    secs: f64,
}

/// Sends datagrams to VIP:53 from the client as fast as it can.
fn blast(t: &Topology, o: &E2eArgs, duration: Duration) -> Res<Blast> {
    let per_thread = o.udp_sockets / o.udp_senders;
    let payload = o.udp_payload;
    let handles: Vec<_> = (0..o.udp_senders)
        .map(|_| {
            in_ns(&t.client.name, move || -> Res<Blast> {
                let socks: Vec<UdpSocket> = (0..per_thread)
                    .map(|_| {
                        let s = UdpSocket::bind((CLIENT_IP, 0)).map_err(|e| e.to_string())?;
                        s.connect((VIP, UDP_PORT)).map_err(|e| e.to_string())?;
                        s.set_nonblocking(true).map_err(|e| e.to_string())?;
                        Ok(s)
                    })
                    .collect::<Res<_>>()?;
                let buf = vec![0x5au8; payload];
                let (mut sent, mut blocked, mut errors) = (0u64, 0u64, 0u64);
                let start = Instant::now();
                let end = start + duration;
                'outer: loop {
                    for _ in 0..64 {
                        for s in &socks {
                            match s.send(&buf) {
                                Ok(_) => sent += 1,
                                Err(e) if e.kind() == ErrorKind::WouldBlock => blocked += 1,
                                Err(_) => errors += 1,
                            }
                        }
                    }
                    if Instant::now() >= end || interrupted() {
                        break 'outer;
                    }
                }
                Ok(Blast {
                    sent,
                    blocked,
                    errors,
                    secs: start.elapsed().as_secs_f64(),
                })
            })
        })
        .collect();
    let mut total = Blast {
        sent: 0,
        blocked: 0,
        errors: 0,
        secs: 0.0,
    };
    for h in handles {
        let b = h.join().map_err(|_| "UDP sender panicked".to_string())??;
        total.sent += b.sent;
        total.blocked += b.blocked;
        total.errors += b.errors;
        total.secs = total.secs.max(b.secs);
    }
    Ok(total)
}

#[derive(Clone, Debug, Default)]
struct UdpResult {
    sent_pps: f64,
    nic_pps: f64,
    sink_pps: f64,
    /// Share of the sent datagrams that did not reach a backend.
    lost_pct: f64,
    /// Probe datagrams (of 30, sent one at a time) that arrived.
    probe: u64,
}

/// One UDP run; `start`/`stop` as for TCP.
fn udp_run(ctx: &Ctx, o: &E2eArgs, sinks: &Sinks, mech: Mech) -> (Res<UdpResult>, Res<()>) {
    let mut running = match start(ctx, mech) {
        Ok(r) => r,
        Err(e) => return (Err(e), Ok(())),
    };
    let result = (|| {
        // The path must work: 30 datagrams, all of them counted.
        let before = sinks.total();
        blast_few(ctx.t, 30)?;
        std::thread::sleep(Duration::from_millis(300));
        let probe = sinks.total() - before;
        if probe == 0 {
            return Err("none of 30 test datagrams reached the sinks".into());
        }
        let (sink0, rx0) = (sinks.total(), backend_rx(ctx.t)?);
        let b = blast(ctx.t, o, Duration::from_secs(o.udp_duration))?;
        check_interrupt()?;
        std::thread::sleep(Duration::from_millis(300));
        let (sink1, rx1) = (sinks.total(), backend_rx(ctx.t)?);
        if b.sent == 0 {
            return Err(format!(
                "the sender sent nothing ({} would block, {} errors)",
                b.blocked, b.errors
            ));
        }
        Ok(UdpResult {
            sent_pps: b.sent as f64 / b.secs,
            nic_pps: (rx1 - rx0) as f64 / b.secs,
            sink_pps: (sink1 - sink0) as f64 / b.secs,
            lost_pct: b.sent.saturating_sub(rx1 - rx0) as f64 * 100.0 / b.sent as f64,
            probe,
        })
    })();
    let mut stopped = stop(ctx, mech, &mut running);
    if stopped.is_ok() {
        // No UDP forwarding left either.
        let before = sinks.total();
        stopped = blast_few(ctx.t, 10).and_then(|_| {
            std::thread::sleep(Duration::from_millis(200));
            match sinks.total() - before {
                0 => Ok(()),
                n => Err(format!(
                    "{n} datagrams still forwarded after removing {}",
                    mech.id()
                )),
            }
        });
    }
    (result, stopped)
}

fn blast_few(t: &Topology, n: usize) -> Res<()> {
    run_in(&t.client, move || -> Res<()> {
        let s = UdpSocket::bind((CLIENT_IP, 0)).map_err(|e| e.to_string())?;
        for _ in 0..n {
            let _ = s.send_to(b"probe", (VIP, UDP_PORT));
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    })?
}

/// VIP of service `i` of the memory test: 192.0.2.0/24, then 198.18.0.0/15.
fn mem_vip(i: usize) -> std::net::Ipv4Addr {
    if i < 256 {
        std::net::Ipv4Addr::new(192, 0, 2, i as u8)
    } else {
        std::net::Ipv4Addr::from(
            u32::from(std::net::Ipv4Addr::new(198, 18, 0, 0)) + (i - 256) as u32,
        )
    }
}

fn mem_backend(i: usize, j: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(
        10,
        2 + (j / 250) as u8,
        (i % 256) as u8,
        (j % 250) as u8 + 1,
    )
}

fn mem_config(services: usize, per: usize, changed: bool) -> String {
    let mut s = format!(
        "interfaces: [lbc]\nmetrics_addr: {MEM_METRICS}\nmaglev_pool_entries: 32768000\nservices:\n"
    );
    for i in 0..services {
        let _ = writeln!(
            s,
            "  - name: svc-{i}\n    vip: {}\n    port: 80\n    table_size: 16381\n    backends:",
            mem_vip(i)
        );
        for j in 0..per {
            let ip = if changed && i == 0 && j == 0 {
                std::net::Ipv4Addr::new(10, 250, 0, 1)
            } else {
                mem_backend(i, j)
            };
            let _ = writeln!(s, "      - {{ ip: {ip}, port: 8080 }}");
        }
    }
    s
}

struct MemResult {
    services: usize,
    per: usize,
    outcome: Res<MemNumbers>,
}

struct MemNumbers {
    ready_s: f64,
    rss_kb: u64,
    anon_kb: u64,
    file_kb: u64,
    hwm_kb: u64,
    after_reload_rss_kb: u64,
    after_reload_anon_kb: u64,
    reload: Res<(f64, String)>,
}

fn status_kb(pid: u32, field: &str) -> u64 {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn memory_test(ctx: &Ctx, services: usize, per: usize) -> Res<MemNumbers> {
    let t = ctx.t;
    let cfg = t.dir.join("mem.yaml");
    write(&cfg, &mem_config(services, per, false))?;
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/xlb-{PREFIX}-mem"));
    let log = t.dir.join("lb-agent-mem.log");
    let mut agent = Agent::spawn(
        ctx.bins,
        &t.lb,
        &cfg,
        &pin_dir,
        MEM_METRICS.parse().unwrap(),
        &log,
    )?;
    let ready = agent.wait_ready(Duration::from_secs(300))?;
    let pid = agent.pid().ok_or("no agent pid")?;
    // Let the start settle (first scrape, allocator) before reading.
    sleep_interruptible(Duration::from_secs(1))?;
    let rss = status_kb(pid, "VmRSS:");
    let anon = status_kb(pid, "RssAnon:");
    let file = status_kb(pid, "RssFile:");
    let reload = (|| -> Res<(f64, String)> {
        // Write-and-rename so the agent never reads half a file.
        let tmp = t.dir.join("mem.yaml.new");
        write(&tmp, &mem_config(services, per, true))?;
        fs::rename(&tmp, &cfg).map_err(|e| e.to_string())?;
        let start = Instant::now();
        // Wait for the log line (scraping /metrics meanwhile would compete
        // with the reload for the data-plane lock).
        let line = loop {
            check_interrupt()?;
            let text = strip_ansi(&fs::read_to_string(&log).unwrap_or_default());
            if let Some(l) = text
                .lines()
                .find(|l| l.contains("config reloaded") || l.contains("config rejected"))
            {
                break l.to_string();
            }
            if start.elapsed() > Duration::from_secs(120) {
                return Err("no reload within 120 s of the file change".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if line.contains("config rejected") {
            return Err(format!("reload rejected: {line}"));
        }
        let took = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("took="))
            .unwrap_or("?")
            .to_string();
        let (_, text) = agent.get("/metrics", Duration::from_secs(30))?;
        let sum = metric(&text, "xlb_config_reload_duration_seconds_sum");
        let count = metric(&text, "xlb_config_reload_duration_seconds_count");
        match (sum, count) {
            (Some(s), Some(c)) if c >= 1.0 => Ok((s / c, took)),
            _ => Err(format!("no reload histogram in /metrics (log: {line})")),
        }
    })();
    let after = status_kb(pid, "VmRSS:");
    let after_anon = status_kb(pid, "RssAnon:");
    let hwm = status_kb(pid, "VmHWM:");
    agent.stop()?;
    Ok(MemNumbers {
        ready_s: ready.as_secs_f64(),
        rss_kb: rss,
        anon_kb: anon,
        file_kb: file,
        hwm_kb: hwm,
        after_reload_rss_kb: after,
        after_reload_anon_kb: after_anon,
        reload,
    })
}

fn mb(kb: u64) -> String {
    format!("{:.1} MB", kb as f64 / 1024.0)
}

fn fmt_ms(ms: f64) -> String {
    if ms.is_nan() {
        "-".into()
    } else if ms < 1.0 {
        format!("{:.0} µs", ms * 1000.0)
    } else {
        format!("{ms:.2} ms")
    }
}

fn short_err(e: &str) -> String {
    let first = e.lines().next().unwrap_or(e);
    let mut s: String = first.chars().take(160).collect();
    if s.len() < first.len() {
        s.push('…');
    }
    s.replace('|', "\\|")
}

struct TcpSummary {
    mech: Mech,
    runs: Vec<Wrk>,
    errors: Vec<String>,
    /// Requests/s of each round (None: the run failed).
    per_round: Vec<Option<f64>>,
}

/// The median over rounds of `a / b` (rounds where both ran): a ratio
/// within each round, so that a round the whole machine ran slow in
/// does not skew it.
fn ratio_per_round(a: &[Option<f64>], b: &[Option<f64>]) -> Option<f64> {
    let r: Vec<f64> = a
        .iter()
        .zip(b)
        .filter_map(|(x, y)| Some(x.as_ref()? / y.as_ref()?))
        .collect();
    (!r.is_empty()).then(|| median(&r))
}

impl TcpSummary {
    fn med(&self, f: impl Fn(&Wrk) -> f64) -> f64 {
        median(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

struct UdpSummary {
    mech: Mech,
    runs: Vec<UdpResult>,
    errors: Vec<String>,
    /// Datagrams/s received by the sinks, per round.
    per_round: Vec<Option<f64>>,
}

impl UdpSummary {
    fn med(&self, f: impl Fn(&UdpResult) -> f64) -> f64 {
        median(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
}

fn main() -> ExitCode {
    install_sigint_flag();
    let mut opts = Cli::parse().opts;
    opts.udp_sockets = opts.udp_sockets.max(opts.udp_senders);
    let r = run(&opts);
    if interrupted() {
        eprintln!("\ninterrupted: namespaces, agents, rules and proxies removed");
        return ExitCode::from(130);
    }
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nend-to-end benchmark failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(o: &E2eArgs) -> Res<()> {
    let bins = Bins::locate_with(o.lb_agent.as_deref())?;
    let started = Instant::now();
    let kernel = cmd_line("uname -r");
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "xlb end to end: client -> load balancer -> {BACKENDS} nginx backends in network namespaces \
         (Linux {kernel}, {cpus} CPUs)"
    );
    let t = Topology::new(PREFIX, BACKENDS);
    let _peer_xdp = o.peer_xdp.then(|| {
        println!("XDP_PASS on the client's and the backends' eth0 (--peer-xdp)");
        let eth0 = ["eth0".to_string()];
        let mut held = vec![xlb_tests::xdp::attach_pass(&t.client, &eth0)];
        for b in &t.backends {
            held.push(xlb_tests::xdp::attach_pass(b, &eth0));
        }
        held
    });
    let ctx = Ctx {
        t: &t,
        bins: &bins,
        xdp_mode: o.xdp_mode.clone(),
    };
    let mut md = String::new();
    let mut tcp: Vec<TcpSummary> = o
        .cases
        .iter()
        .map(|&mech| TcpSummary {
            mech,
            runs: vec![],
            errors: vec![],
            per_round: vec![],
        })
        .collect();
    if !o.no_tcp {
        tcp_rounds(&ctx, o, &mut tcp)?;
        tcp_table(o, &tcp, &mut md);
        tcp_goals(&tcp, &mut md);
    }
    let mut udp: Vec<UdpSummary> = [Mech::Xlb, Mech::Nftables]
        .into_iter()
        .map(|mech| UdpSummary {
            mech,
            runs: vec![],
            errors: vec![],
            per_round: vec![],
        })
        .collect();
    if !o.no_udp {
        udp_rounds(&ctx, o, &mut udp)?;
        udp_table(o, &udp, &mut md);
    }
    if !o.no_memory {
        let mem = memory_runs(&ctx, o)?;
        memory_table(&mem, &mut md);
    }

    println!("\n---- results (markdown) ----\n");
    print!("{md}");
    if let Some(path) = o.svg.path(E2E_SVG) {
        let svg = svg(&tcp, &udp, o, &format!("Linux {kernel}, {cpus} CPUs"));
        match fs::write(&path, svg) {
            Ok(()) => println!("chart: {}", path.display()),
            Err(e) => println!("chart: writing {}: {e}", path.display()),
        }
    }
    println!("total time {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The TCP part: every case once per round, interleaved.
fn tcp_rounds(ctx: &Ctx, o: &E2eArgs, tcp: &mut [TcpSummary]) -> Res<()> {
    println!(
        "\nTCP: wrk -t{} -c{} -d{}s --latency http://{VIP}/ from the client, {} rounds of {}",
        o.threads,
        o.connections,
        o.duration,
        o.rounds,
        o.cases
            .iter()
            .map(|m| m.id())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for round in 1..=o.rounds {
        println!("round {round}/{}", o.rounds);
        for s in tcp.iter_mut() {
            check_interrupt()?;
            let (r, stopped) = tcp_run(ctx, o, s.mech);
            check_interrupt()?;
            match r {
                Ok(w) => {
                    println!(
                        "  {:<38} {:>9.0} req/s  p50 {:>9}  p90 {:>9}  p99 {:>9}  errors {}  retransmits {}",
                        s.mech.label(&o.xdp_mode),
                        w.rps,
                        fmt_ms(w.p50_ms),
                        fmt_ms(w.p90_ms),
                        fmt_ms(w.p99_ms),
                        w.errors,
                        w.retrans
                    );
                    s.per_round.push(Some(w.rps));
                    s.runs.push(w);
                }
                Err(e) => {
                    println!("  {:<38} FAILED: {e}", s.mech.label(&o.xdp_mode));
                    s.per_round.push(None);
                    s.errors.push(e);
                }
            }
            // A mechanism that cannot be removed would falsify every later case.
            stopped.map_err(|e| format!("removing {}: {e}", s.mech.id()))?;
        }
    }
    Ok(())
}

/// The TCP results as a markdown table.
fn tcp_table(o: &E2eArgs, tcp: &[TcpSummary], md: &mut String) {
    let _ = writeln!(
        md,
        "TCP, `wrk -t{} -c{} -d{}s --latency http://{VIP}/`, {} interleaved rounds; each column is \
         the median of the rounds, \"vs xlb\" the median of the per-round ratios:\n",
        o.threads, o.connections, o.duration, o.rounds
    );
    md.push_str("| case | requests/s | min - max | p50 | p90 | p99 | TCP retransmits | vs xlb |\n");
    md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    let xlb_rounds = tcp
        .iter()
        .find(|s| s.mech == Mech::Xlb)
        .map(|s| s.per_round.clone());
    for s in tcp {
        if s.runs.is_empty() {
            let _ = writeln!(
                md,
                "| {} | failed: {} | | | | | | |",
                s.mech.label(&o.xdp_mode),
                short_err(s.errors.first().map_or("no run", |e| e.as_str()))
            );
            continue;
        }
        let rps = s.med(|w| w.rps);
        let min = s.runs.iter().map(|w| w.rps).fold(f64::INFINITY, f64::min);
        let max = s.runs.iter().map(|w| w.rps).fold(0.0, f64::max);
        let errors: u64 = s.runs.iter().map(|w| w.errors).sum();
        let vs = xlb_rounds
            .as_ref()
            .and_then(|x| ratio_per_round(&s.per_round, x))
            .map_or("-".into(), |r| format!("{r:.2}x"));
        let _ = writeln!(
            md,
            "| {}{} | {} | {} - {} | {} | {} | {} | {} | {vs} |",
            s.mech.label(&o.xdp_mode),
            if errors > 0 {
                format!(" ({errors} socket errors)")
            } else {
                String::new()
            },
            thousands(rps as u64),
            thousands(min as u64),
            thousands(max as u64),
            fmt_ms(s.med(|w| w.p50_ms)),
            fmt_ms(s.med(|w| w.p90_ms)),
            fmt_ms(s.med(|w| w.p99_ms)),
            thousands(s.med(|w| w.retrans as f64) as u64),
        );
        if !s.errors.is_empty() {
            let _ = writeln!(
                md,
                "| ↳ {} failed run(s): {} | | | | | | | |",
                s.errors.len(),
                short_err(&s.errors[0])
            );
        }
    }
    md.push('\n');
}

/// Issue 33's goal for requests/s, against each kernel baseline measured:
/// ahead by more than the noise, i.e. faster in every round, and the
/// median per-round ratio above 1 by more than xlb's own spread over the
/// rounds ((max - min) / median).
fn tcp_goals(tcp: &[TcpSummary], md: &mut String) {
    let Some(x) = tcp.iter().find(|s| s.mech == Mech::Xlb) else {
        return;
    };
    let own: Vec<f64> = x.per_round.iter().flatten().copied().collect();
    if own.is_empty() {
        return;
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        (lo, hi)
    };
    let (lo, hi) = spread(&own);
    let noise = (hi - lo) / median(&own);
    for s in tcp
        .iter()
        .filter(|s| matches!(s.mech, Mech::Iptables | Mech::Nftables))
    {
        let ratios: Vec<f64> = x
            .per_round
            .iter()
            .zip(&s.per_round)
            .filter_map(|(a, b)| Some(a.as_ref()? / b.as_ref()?))
            .collect();
        if ratios.is_empty() {
            continue;
        }
        let (rlo, rhi) = spread(&ratios);
        let med = median(&ratios);
        let met = rlo > 1.0 && med - 1.0 > noise;
        let _ = writeln!(
            md,
            "Goal, ahead of {} by more than the noise in requests/s: xlb/{} {med:.2}x (rounds \
             {rlo:.2}-{rhi:.2}x), xlb's own spread {:.1} %: {}",
            s.mech.id(),
            s.mech.id(),
            noise * 100.0,
            if met { "met" } else { "not met" }
        );
    }
    let _ = writeln!(md, "IPVS: not measured ({}).\n", ipvs_not_measured());
}

/// The UDP part: xlb and nftables once per round, interleaved.
fn udp_rounds(ctx: &Ctx, o: &E2eArgs, udp: &mut [UdpSummary]) -> Res<()> {
    println!(
        "\nUDP: {} sender thread(s), {} sockets, {}-byte datagrams to {VIP}:{UDP_PORT} for {} s; \
         sinks on :{UDP_BACKEND_PORT} in the backends; {} rounds",
        o.udp_senders, o.udp_sockets, o.udp_payload, o.udp_duration, o.rounds
    );
    let sinks = Sinks::start(ctx.t)?;
    for round in 1..=o.rounds {
        println!("round {round}/{}", o.rounds);
        for s in udp.iter_mut() {
            check_interrupt()?;
            let (r, stopped) = udp_run(ctx, o, &sinks, s.mech);
            check_interrupt()?;
            match r {
                Ok(u) => {
                    println!(
                        "  {:<38} sent {:>8.0}/s  forwarded (backend NICs) {:>8.0}/s  received by sinks {:>8.0}/s  lost {:.1}%  probe {}/30",
                        s.mech.label(&o.xdp_mode),
                        u.sent_pps,
                        u.nic_pps,
                        u.sink_pps,
                        u.lost_pct,
                        u.probe
                    );
                    s.per_round.push(Some(u.sink_pps));
                    s.runs.push(u);
                }
                Err(e) => {
                    println!("  {:<38} FAILED: {e}", s.mech.label(&o.xdp_mode));
                    s.per_round.push(None);
                    s.errors.push(e);
                }
            }
            stopped.map_err(|e| format!("removing {}: {e}", s.mech.id()))?;
        }
    }
    drop(sinks);
    Ok(())
}

/// The UDP results as a markdown table.
fn udp_table(o: &E2eArgs, udp: &[UdpSummary], md: &mut String) {
    let _ = writeln!(
        md,
        "UDP, {} sender thread(s) on {} sockets, {}-byte datagrams for {} s, {} interleaved rounds; \
         medians, and the median of the per-round ratios:\n",
        o.udp_senders, o.udp_sockets, o.udp_payload, o.udp_duration, o.rounds
    );
    md.push_str(
        "| case | sent/s | forwarded/s (backend NICs) | received by sinks/s | lost | probes arrived | sinks vs nftables |\n",
    );
    md.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
    let nft_rounds = udp
        .iter()
        .find(|s| s.mech == Mech::Nftables)
        .map(|s| s.per_round.clone());
    for s in udp {
        if s.runs.is_empty() {
            let _ = writeln!(
                md,
                "| {} | failed: {} | | | | | |",
                s.mech.label(&o.xdp_mode),
                short_err(s.errors.first().map_or("no run", |e| e.as_str()))
            );
            continue;
        }
        let sink = s.med(|u| u.sink_pps);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.1}% | {}/30 | {} |",
            s.mech.label(&o.xdp_mode),
            thousands(s.med(|u| u.sent_pps) as u64),
            thousands(s.med(|u| u.nic_pps) as u64),
            thousands(sink as u64),
            s.med(|u| u.lost_pct),
            s.med(|u| u.probe as f64),
            nft_rounds
                .as_ref()
                .and_then(|n| ratio_per_round(&s.per_round, n))
                .map_or("-".into(), |r| format!("{r:.2}x"))
        );
    }
    md.push('\n');
}

/// The memory part: the configured size, and the largest that fits when
/// the data plane's backend table is too small for it.
fn memory_runs(ctx: &Ctx, o: &E2eArgs) -> Res<Vec<MemResult>> {
    let mut mem: Vec<MemResult> = Vec::new();
    let (n, per) = (o.services, o.backends_per_service);
    println!("\nagent memory and reload: {n} services x {per} backends (table_size 16381 each)");
    let r = memory_test(ctx, n, per);
    check_interrupt()?;
    let full = matches!(&r, Err(e) if e.contains("is full"));
    report_mem(n, per, &r);
    mem.push(MemResult {
        services: n,
        per,
        outcome: r,
    });
    let max_backends = lb_common::MAX_BACKENDS as usize;
    if full && n * per > max_backends {
        // The data plane's backend table holds fewer: measure the largest
        // configuration that fits, with the same backends per service.
        let fit = max_backends / per;
        println!(
            "  retrying with {fit} services x {per} backends ({} backends, the data plane holds {max_backends})",
            fit * per
        );
        let r = memory_test(ctx, fit, per);
        check_interrupt()?;
        report_mem(fit, per, &r);
        mem.push(MemResult {
            services: fit,
            per,
            outcome: r,
        });
    }
    Ok(mem)
}

/// The memory results as a markdown table.
fn memory_table(mem: &[MemResult], md: &mut String) {
    md.push_str(
        "Agent with many services (no health checks, `maglev_pool_entries: 32768000`):\n\n",
    );
    md.push_str("| services x backends | start to ready | VmRSS | RssFile (mapped MAGLEV pool) | RssAnon (heap) | after the reload: VmRSS / RssAnon | VmHWM | reload (1 backend changed) |\n");
    md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for m in mem {
        match &m.outcome {
            Ok(x) => {
                let reload = match &x.reload {
                    Ok((secs, took)) => format!("{:.0} ms (log: took={took})", secs * 1000.0),
                    Err(e) => format!("failed: {}", short_err(e)),
                };
                let _ = writeln!(
                    md,
                    "| {} x {} | {:.1} s | {} | {} | {} | {} / {} | {} | {reload} |",
                    m.services,
                    m.per,
                    x.ready_s,
                    mb(x.rss_kb),
                    mb(x.file_kb),
                    mb(x.anon_kb),
                    mb(x.after_reload_rss_kb),
                    mb(x.after_reload_anon_kb),
                    mb(x.hwm_kb),
                );
            }
            Err(e) => {
                let _ = writeln!(
                    md,
                    "| {} x {} | failed: {} | | | | | | |",
                    m.services,
                    m.per,
                    short_err(&summarize_agent_error(e))
                );
            }
        }
    }
    md.push('\n');
}

/// The most telling line of an agent failure (its error, not the log's
/// tail), with a long list of per-service errors cut to its first two.
fn summarize_agent_error(e: &str) -> String {
    let line = e
        .lines()
        .rev()
        .find(|l| l.starts_with("lb-agent:"))
        .or_else(|| e.lines().rev().find(|l| l.contains("ERROR")))
        .unwrap_or_else(|| e.lines().next().unwrap_or(e));
    let line = line
        .split_once("ERROR")
        .map_or(line, |x| x.1)
        .trim_start_matches("lb-agent:")
        .trim();
    let parts: Vec<&str> = line.split("; ").collect();
    if parts.len() > 2 {
        format!(
            "{}; {}; ... ({} services refused)",
            parts[0],
            parts[1],
            parts.len()
        )
    } else {
        line.to_string()
    }
}

fn report_mem(n: usize, per: usize, r: &Res<MemNumbers>) {
    match r {
        Ok(x) => {
            println!(
                "  {n} x {per}: ready after {:.1} s; VmRSS {} (RssAnon {}, RssFile {}); after the reload VmRSS {} (RssAnon {}); VmHWM {}",
                x.ready_s,
                mb(x.rss_kb),
                mb(x.anon_kb),
                mb(x.file_kb),
                mb(x.after_reload_rss_kb),
                mb(x.after_reload_anon_kb),
                mb(x.hwm_kb),
            );
            match &x.reload {
                Ok((s, took)) => println!(
                    "  reload after one backend changed: {:.0} ms (histogram), log took={took}",
                    s * 1000.0
                ),
                Err(e) => println!("  reload FAILED: {e}"),
            }
        }
        Err(e) => println!("  {n} x {per}: FAILED: {}", summarize_agent_error(e)),
    }
}

/// Two bar charts side by side: TCP requests/s (p99 under each bar) and UDP
/// datagrams/s received by the sinks.
fn svg(tcp: &[TcpSummary], udp: &[UdpSummary], o: &E2eArgs, machine: &str) -> String {
    const H: f64 = 380.0;
    const TOP: f64 = 60.0;
    const BASE: f64 = 290.0;
    let mut s = String::new();
    let tcp_w = 110.0 * tcp.len().max(1) as f64 + 60.0;
    let udp_w = 130.0 * udp.len().max(1) as f64 + 60.0;
    let width = tcp_w + udp_w + 40.0;
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{H}\" viewBox=\"0 0 {width} {H}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>"
    );
    let color = |m: Mech| match m {
        Mech::Xlb => "#d9480f",
        Mech::Iptables => "#5c7cfa",
        Mech::Nftables => "#4c6ef5",
        Mech::Nginx => "#2b8a3e",
        Mech::Haproxy => "#5f3dc4",
    };
    let _ = writeln!(
        s,
        "<text x=\"20\" y=\"{}\" fill=\"#555\" font-size=\"11\">cargo xtask bench: client, load balancer and 3 nginx backends in network namespaces (veth); {machine}. Higher is better.</text>",
        H - 12.0
    );
    let mut panel =
        |x0: f64, title: &str, bars: Vec<(Mech, f64, String)>, bar_w: f64, step: f64| {
            let _ = writeln!(
                s,
                "<text x=\"{}\" y=\"24\" font-size=\"14\" font-weight=\"bold\">{title}</text>",
                x0
            );
            let max = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1.0);
            let _ = writeln!(
                s,
                "<line x1=\"{x0}\" y1=\"{BASE}\" x2=\"{}\" y2=\"{BASE}\" stroke=\"#333\"/>",
                x0 + step * bars.len() as f64
            );
            for (i, (m, v, under)) in bars.iter().enumerate() {
                let x = x0 + 10.0 + step * i as f64;
                let h = if v.is_nan() {
                    0.0
                } else {
                    (BASE - TOP) * v / max
                };
                let _ = writeln!(
                    s,
                    "<rect x=\"{x}\" y=\"{:.1}\" width=\"{bar_w}\" height=\"{h:.1}\" fill=\"{}\"/>",
                    BASE - h,
                    color(*m)
                );
                let label = if v.is_nan() || *v == 0.0 {
                    "failed".to_string()
                } else {
                    thousands(*v as u64)
                };
                let cx = x + bar_w / 2.0;
                let _ = writeln!(
                    s,
                    "<text x=\"{cx}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
                    BASE - h - 6.0
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{cx}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                    BASE + 16.0,
                    m.short()
                );
                let _ = writeln!(
                    s,
                    "<text x=\"{cx}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">{under}</text>",
                    BASE + 32.0
                );
            }
        };
    let nft_rounds: Vec<Option<f64>> = udp
        .iter()
        .find(|u| u.mech == Mech::Nftables)
        .map_or(vec![], |u| u.per_round.clone());
    panel(
        20.0,
        &format!(
            "TCP requests/s (wrk -c{} -d{}s, median of {}), p99 below",
            o.connections, o.duration, o.rounds
        ),
        tcp.iter()
            .map(|t| {
                let rps = if t.runs.is_empty() {
                    f64::NAN
                } else {
                    t.med(|w| w.rps)
                };
                let p99 = if t.runs.is_empty() {
                    String::new()
                } else {
                    format!("p99 {}", fmt_ms(t.med(|w| w.p99_ms)))
                };
                (t.mech, rps, p99)
            })
            .collect(),
        80.0,
        110.0,
    );
    panel(
        tcp_w + 40.0,
        &format!("UDP datagrams/s received ({}-byte)", o.udp_payload),
        udp.iter()
            .map(|u| {
                let pps = if u.runs.is_empty() {
                    f64::NAN
                } else {
                    u.med(|r| r.sink_pps)
                };
                let under = match ratio_per_round(&u.per_round, &nft_rounds) {
                    Some(r) if u.mech != Mech::Nftables => format!("{r:.2}x nftables"),
                    _ => String::new(),
                };
                (u.mech, pps, under)
            })
            .collect(),
        90.0,
        130.0,
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use xlb_bench::support::mechanisms::xlb_config;

    use super::*;

    #[test]
    fn ratios_are_taken_within_rounds() {
        let a = [Some(200.0), Some(50.0), None, Some(30.0)];
        let b = [Some(100.0), Some(100.0), Some(1.0), Some(10.0)];
        assert_eq!(ratio_per_round(&a, &b), Some(2.0));
        assert_eq!(ratio_per_round(&[None], &b), None);
    }

    #[test]
    fn memory_config_addresses_are_distinct() {
        let vips: std::collections::BTreeSet<_> = (0..1000).map(mem_vip).collect();
        assert_eq!(vips.len(), 1000);
        assert_eq!(mem_vip(256), std::net::Ipv4Addr::new(198, 18, 0, 0));
        assert_eq!(mem_vip(999), std::net::Ipv4Addr::new(198, 18, 2, 231));
        let backends: std::collections::BTreeSet<_> = (0..100).map(|j| mem_backend(7, j)).collect();
        assert_eq!(backends.len(), 100);
    }

    fn parse(args: &[&str]) -> Result<E2eArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("xlb-e2e-bench").chain(args.iter().copied()))
            .map(|c| c.opts)
    }

    #[test]
    fn documented_invocations_parse() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert_eq!(
            (o.rounds, o.duration, o.threads, o.connections),
            (3, 10, 2, 64)
        );
        assert_eq!(o.cases, Mech::ALL);
        assert!(!o.no_tcp && !o.no_udp && !o.no_memory && !o.peer_xdp);
        assert!(o.svg.path(E2E_SVG).unwrap().ends_with(E2E_SVG));
        assert_eq!(o.xdp_mode, "native");
        // docs/benchmarks.md, README.md
        let o = parse(&["--no-memory", "--no-svg", "--no-udp"]).unwrap();
        assert!(o.no_memory && o.no_udp && !o.no_tcp && o.svg.path(E2E_SVG).is_none());
        let o = parse(&["--no-memory", "--no-svg", "--peer-xdp"]).unwrap();
        assert!(o.no_memory && o.peer_xdp);
        let o = parse(&["--no-tcp", "--no-udp", "--no-svg"]).unwrap();
        assert!(o.no_tcp && o.no_udp && !o.no_memory);
        // xtask's own test of `cargo xtask bench --duration 5`
        assert_eq!(parse(&["--duration", "5"]).unwrap().duration, 5);
        let o = parse(&[
            "--cases",
            "xlb,nftables",
            "--xdp-mode",
            "generic",
            "--lb-agent",
            "/a",
        ])
        .unwrap();
        assert_eq!(o.cases, [Mech::Xlb, Mech::Nftables]);
        assert_eq!(o.xdp_mode, "generic");
        assert_eq!(o.lb_agent.unwrap(), std::path::Path::new("/a"));
        // The later of --svg and --no-svg wins, as does the later of a repeated option.
        let o = parse(&[
            "--svg", "x.svg", "--no-svg", "--rounds", "2", "--rounds", "5",
        ])
        .unwrap();
        assert_eq!((o.svg.path(E2E_SVG), o.rounds), (None, 5));
        let o = parse(&["--no-svg", "--svg", "x.svg"]).unwrap();
        assert_eq!(o.svg.path(E2E_SVG).unwrap(), std::path::Path::new("x.svg"));
        parse(&["--rounds", "0"]).unwrap_err();
        parse(&["--cases", "ipvs"]).unwrap_err();
        parse(&["--xdp-mode", "offload"]).unwrap_err();
        parse(&["--no-such-flag"]).unwrap_err();
    }

    #[test]
    fn configs_parse() {
        lb_agent::config::AgentConfig::parse(&xlb_config("native")).unwrap();
        lb_agent::config::AgentConfig::parse(&xlb_config("generic")).unwrap();
        lb_agent::config::AgentConfig::parse(&mem_config(3, 100, true)).unwrap();
    }
}
