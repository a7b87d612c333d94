//! Load-aware against static balancing, reproducing the load-aware ingress
//! paper's patterns (seeds/load-aware-ingress-controller.txt) at Layer 4.
//!
//! Three backends run `xlb-work-server` (a fixed pool of 4 workers and a
//! queue of 4: a request beyond that is answered 503), each limited by the
//! kernel's CPU controller to a share of a core. The client sends requests
//! at a fixed rate (open loop: a slow backend does not slow the sender) and
//! records every request's status and latency from its scheduled time. One
//! agent serves the same backends twice: VIP:80 `balance: static`, VIP:81
//! `balance: load-aware`, both with the same HTTP health check; each pattern
//! runs once on each, with the same request schedule, the agent restarted
//! before each run.
//!
//! Patterns:
//! - initialization: 3 equal backends, 90 % cheap requests and 10 % costing
//!   20 times as much, at 70 % of the total capacity;
//! - scaling: backends 1 and 2 share one CPU quota (the paper's two
//!   endpoints on one node) near saturation; then backend 3 (its own quota)
//!   joins and the rate rises to 80 % of the new total;
//! - load-30 and load-50: 3 equal backends at 30 % and 50 % of capacity
//!   (the CNI latency study measures below saturation too).
//!
//! `xlb-load-aware-bench [--seconds S] [--svg PATH]`

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use xlb_bench::args::Svg;
use xlb_tests::{
    cgroup::CpuLimit,
    topology::{backend_ip, in_netns, workspace_root, AgentHandle, Topology, LB_CLIENT_SIDE, VIP},
};

const WORK_PORT: u16 = 9090;
const WORKERS: &str = "4";
const QUEUE: &str = "4";
/// Each backend's CPU quota, in % of one core.
const QUOTA: f64 = 30.0;
const CHEAP_US: u64 = 2_000;
const EXPENSIVE_US: u64 = 40_000;
const EXPENSIVE_SHARE: f64 = 0.1;
const TIMEOUT: Duration = Duration::from_secs(5);

/// Requests per second one backend serves at its quota.
fn capacity() -> f64 {
    let mean_us = (1.0 - EXPENSIVE_SHARE) * CHEAP_US as f64 + EXPENSIVE_SHARE * EXPENSIVE_US as f64;
    QUOTA / 100.0 * 1e6 / mean_us
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Static,
    LoadAware,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Static => "static",
            Mode::LoadAware => "load-aware",
        }
    }
    fn port(self) -> u16 {
        match self {
            Mode::Static => 80,
            Mode::LoadAware => 81,
        }
    }
}

struct Pattern {
    name: &'static str,
    /// (from second, requests per second) phases.
    phases: Vec<(f64, f64)>,
    /// Backend 3 joins at this second (`None`: in from the start).
    joins: Option<f64>,
    /// Backends 1 and 2 share one CPU quota.
    shared_quota: bool,
    seconds: f64,
}

/// One request of the schedule: when, and what it costs.
#[derive(Clone, Copy)]
struct Planned {
    at: f64,
    cost_us: u64,
}

fn schedule(p: &Pattern, seed: u64) -> Vec<Planned> {
    let mut rng = seed;
    let mut next = move || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::new();
    let mut t = 0.0;
    while t < p.seconds {
        let rate = p
            .phases
            .iter()
            .rev()
            .find(|(from, _)| t >= *from)
            .map_or(1.0, |x| x.1);
        let cost_us = if next() < EXPENSIVE_SHARE {
            EXPENSIVE_US
        } else {
            CHEAP_US
        };
        out.push(Planned { at: t, cost_us });
        t += 1.0 / rate;
    }
    out
}

/// One request's outcome: status (0: error or timeout) and latency from
/// its scheduled time.
#[derive(Clone, Copy)]
struct Outcome {
    /// Its scheduled second.
    at: f64,
    status: u16,
    latency_ms: f64,
}

async fn request(vip: SocketAddr, cost_us: u64) -> u16 {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(vip).await.ok()?;
        let req =
            format!("GET /?cost_us={cost_us} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let head = String::from_utf8_lossy(&buf);
        head.get(9..12)?.parse().ok()
    };
    tokio::time::timeout(TIMEOUT, attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// Sends the schedule to `vip` from the client namespace, open loop.
fn send(t: &Topology, vip: SocketAddr, plan: Vec<Planned>) -> Vec<Outcome> {
    in_netns(&t.client, move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let start = tokio::time::Instant::now();
            let mut tasks = Vec::with_capacity(plan.len());
            for p in plan {
                let due = start + Duration::from_secs_f64(p.at);
                tokio::time::sleep_until(due).await;
                tasks.push(tokio::spawn(async move {
                    let status = request(vip, p.cost_us).await;
                    Outcome {
                        at: p.at,
                        status,
                        latency_ms: due.elapsed().as_secs_f64() * 1000.0,
                    }
                }));
            }
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.expect("request task"));
            }
            out
        })
    })
    .join()
    .expect("client thread")
}

/// The two services on backends 1..=`backends`; the load-aware one also
/// reads each backend's CPU from its cgroup (`groups[n - 1]`), as it would
/// a local Pod's.
fn config(backends: usize, groups: &[&str]) -> String {
    let mut s = format!(
        "interfaces: [lbc, lbb1, lbb2, lbb3]\nsnat_ipv4: {LB_CLIENT_SIDE}\n\
         services:\n"
    );
    for mode in [Mode::Static, Mode::LoadAware] {
        let _ = write!(
            s,
            "  - name: {}\n    vip: {VIP}\n    port: {}\n    balance: {}\n    \
             health_check: {{ type: http, path: /, interval: 500ms, timeout: 400ms, rise: 2, fall: 3 }}\n    \
             backends:\n",
            mode.name(),
            mode.port(),
            mode.name()
        );
        for n in 1..=backends {
            let cgroup = match mode {
                Mode::LoadAware => format!(", cgroup: {}", groups[n - 1]),
                Mode::Static => String::new(),
            };
            let _ = writeln!(
                s,
                "      - {{ ip: {}, port: {WORK_PORT}{cgroup} }}",
                backend_ip(n)
            );
        }
    }
    s
}

/// The load-aware service's weights now, per backend (0: not in the table).
fn weights(t: &Topology) -> [u64; 3] {
    let v = t.lbctl_json(&["backends", "192.0.2.10:81/tcp"]);
    let mut w = [0; 3];
    for b in v["services"][0]["backends"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let addr: SocketAddr = b["address"]
            .as_str()
            .unwrap_or("0.0.0.0:0")
            .parse()
            .unwrap();
        if let Some(n) = (1..=3).find(|&n| backend_ip(n) == addr.ip()) {
            w[n - 1] = b["load"]["weight"].as_u64().unwrap_or(0);
        }
    }
    w
}

struct Run {
    pattern: &'static str,
    mode: Mode,
    outcomes: Vec<Outcome>,
    /// (second, weights) of the load-aware service, sampled during the run.
    weights: Vec<(f64, [u64; 3])>,
}

impl Run {
    fn failed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.status != 200).count()
    }
    /// Latency percentile of the successful requests, in ms.
    fn pct(&self, q: f64) -> f64 {
        let mut v: Vec<f64> = self
            .outcomes
            .iter()
            .filter(|o| o.status == 200)
            .map(|o| o.latency_ms)
            .collect();
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
    }
}

struct Lab {
    t: Topology,
    agent: Option<AgentHandle>,
    servers: Vec<u32>,
    groups: Vec<CpuLimit>,
}

impl Lab {
    fn new() -> Lab {
        let mut t = Topology::new("lab-la", 3);
        let server = work_server();
        let mut servers = Vec::new();
        for n in 1..=3 {
            let listen = SocketAddr::from((backend_ip(n), WORK_PORT)).to_string();
            let child = t.spawn_in(
                &t.backends[n - 1],
                &server.to_string_lossy(),
                &[&listen, &format!("b{n}"), WORKERS, QUEUE],
            );
            servers.push(child.id());
            t.adopt_child(child);
            xlb_tests::topology::wait_for_port(
                &t.backends[n - 1],
                SocketAddr::from((backend_ip(n), WORK_PORT)),
            );
        }
        let groups = (1..=3)
            .map(|g| CpuLimit::new(&format!("xlb-lab-la-g{g}"), QUOTA))
            .collect();
        Lab {
            t,
            agent: None,
            servers,
            groups,
        }
    }

    fn run(&mut self, p: &Pattern, mode: Mode, seed: u64) -> Run {
        // Quotas: one group each, or backends 1 and 2 in one.
        let mut names = Vec::new();
        for (i, pid) in self.servers.iter().enumerate() {
            let g = if p.shared_quota && i == 1 { 0 } else { i };
            self.groups[g].add(*pid);
            names.push(self.groups[g].name());
        }
        if let Some(mut a) = self.agent.take() {
            a.sigterm_and_wait();
        }
        let first = if p.joins.is_some() { 2 } else { 3 };
        let agent = self.t.start_agent(&config(first, &names));
        // Let the health checks and the controller see the backends idle.
        std::thread::sleep(Duration::from_secs(2));
        let plan = schedule(p, seed);
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (stop_sampler, joins, names) = (stop.clone(), p.joins, &names);
            let t = &self.t;
            let agent = &agent;
            std::thread::scope(|scope| {
                let h = scope.spawn(move || {
                    let start = Instant::now();
                    let mut seen = Vec::new();
                    let mut joined = false;
                    while !stop_sampler.load(Ordering::Relaxed) {
                        let at = start.elapsed().as_secs_f64();
                        if joins.is_some_and(|j| !joined && at >= j) {
                            agent.write_config(&config(3, names));
                            joined = true;
                        }
                        seen.push((at, weights(t)));
                        std::thread::sleep(Duration::from_millis(250));
                    }
                    seen
                });
                let outcomes = send(t, SocketAddr::from((VIP, mode.port())), plan);
                stop.store(true, Ordering::Relaxed);
                (outcomes, h.join().expect("sampler"))
            })
        };
        self.agent = Some(agent);
        let (outcomes, weights) = sampler;
        Run {
            pattern: p.name,
            mode,
            outcomes,
            weights,
        }
    }
}

/// `xlb-work-server` next to this binary, built (release) if missing.
fn work_server() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let path = exe.with_file_name("xlb-work-server");
    if !path.exists() {
        let st = std::process::Command::new("cargo")
            .current_dir(workspace_root())
            .args([
                "build",
                "--release",
                "-p",
                "xlb-bench",
                "--bin",
                "xlb-work-server",
            ])
            .status()
            .expect("running cargo build");
        assert!(
            st.success() && path.exists(),
            "building xlb-work-server failed"
        );
    }
    path
}

fn patterns(seconds: f64) -> Vec<Pattern> {
    let cap = capacity();
    vec![
        Pattern {
            name: "initialization",
            phases: vec![(0.0, 0.7 * 3.0 * cap)],
            joins: None,
            shared_quota: false,
            seconds,
        },
        Pattern {
            name: "scaling",
            phases: vec![(0.0, 0.8 * cap), (seconds / 3.0, 0.8 * 2.0 * cap)],
            joins: Some(seconds / 3.0),
            shared_quota: true,
            seconds,
        },
        Pattern {
            name: "load-30",
            phases: vec![(0.0, 0.3 * 3.0 * cap)],
            joins: None,
            shared_quota: false,
            seconds: seconds / 2.0,
        },
        Pattern {
            name: "load-50",
            phases: vec![(0.0, 0.5 * 3.0 * cap)],
            joins: None,
            shared_quota: false,
            seconds: seconds / 2.0,
        },
    ]
}

/// The chart, relative to the workspace root.
const SVG: &str = "docs/benchmarks-load-aware.svg";

/// Load-aware against static balancing, the load-aware ingress paper's
/// patterns at Layer 4: three CPU-limited backends, an open-loop client.
#[derive(Parser, Debug)]
#[command(
    name = "xlb-load-aware-bench",
    args_override_self = true,
    mut_arg("svg", |a| a.help(format!("Where to write the weights chart [default: {SVG}]")))
)]
struct Cli {
    /// Seconds per pattern (half that for load-30 and load-50)
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    seconds: f64,
    #[command(flatten)]
    svg: Svg,
}

fn main() {
    let Cli {
        seconds,
        svg: svg_arg,
    } = Cli::parse();
    println!(
        "# load-aware vs static: 3 backends of {QUOTA}% of a core each ({:.1} req/s at the mix: \
         {}% of requests {} ms of CPU, the rest {} ms), 4 workers + 4 queued each, open-loop client, {seconds} s per pattern",
        capacity(),
        (EXPENSIVE_SHARE * 100.0) as u32,
        EXPENSIVE_US / 1000,
        CHEAP_US / 1000
    );
    let mut lab = Lab::new();
    let mut runs = Vec::new();
    for (i, p) in patterns(seconds).iter().enumerate() {
        // Alternate which mode goes first; the same schedule for both.
        let order = if i % 2 == 0 {
            [Mode::Static, Mode::LoadAware]
        } else {
            [Mode::LoadAware, Mode::Static]
        };
        for mode in order {
            let r = lab.run(p, mode, 0x5eed + i as u64);
            eprintln!(
                "{} {}: {} sent, {} failed",
                r.pattern,
                mode.name(),
                r.outcomes.len(),
                r.failed()
            );
            runs.push(r);
        }
    }
    print_table(&runs);
    if let Some(path) = svg_arg.path(SVG) {
        if let Err(e) = std::fs::write(&path, svg(&runs)) {
            eprintln!("writing {}: {e}", path.display());
        }
    }
    for name in ["initialization", "scaling", "load-30", "load-50"] {
        let get = |m: Mode| {
            runs.iter()
                .find(|r| r.pattern == name && r.mode == m)
                .unwrap()
        };
        let (s, l) = (get(Mode::Static), get(Mode::LoadAware));
        println!(
            "load-aware {name}: static failed {}/{} p99 {:.0} ms; load-aware failed {}/{} p99 {:.0} ms",
            s.failed(),
            s.outcomes.len(),
            s.pct(0.99),
            l.failed(),
            l.outcomes.len(),
            l.pct(0.99)
        );
    }
}

fn print_table(runs: &[Run]) {
    println!(
        "\n| pattern | mode | sent | succeeded | failed | p50 ms | p99 ms | p99.9 ms |\n|---|---|---:|---:|---:|---:|---:|---:|"
    );
    for r in runs {
        let n = r.outcomes.len();
        println!(
            "| {} | {} | {n} | {} | {} ({:.1} %) | {:.1} | {:.1} | {:.1} |",
            r.pattern,
            r.mode.name(),
            n - r.failed(),
            r.failed(),
            100.0 * r.failed() as f64 / n.max(1) as f64,
            r.pct(0.5),
            r.pct(0.99),
            r.pct(0.999)
        );
    }
    println!("\nfailed requests by when they were sent (5 s windows):");
    for r in runs {
        let mut windows = vec![
            0;
            r.outcomes
                .iter()
                .map(|o| o.at as usize / 5 + 1)
                .max()
                .unwrap_or(0)
        ];
        for o in r.outcomes.iter().filter(|o| o.status != 200) {
            windows[o.at as usize / 5] += 1;
        }
        let cells: Vec<String> = windows.iter().map(|n| n.to_string()).collect();
        println!(
            "  {:<15} {:<10} {}",
            r.pattern,
            r.mode.name(),
            cells.join(" ")
        );
    }
    println!("\nload-aware weights over time (backend 1/2/3, every ~2 s):");
    for r in runs.iter().filter(|r| r.mode == Mode::LoadAware) {
        let mut line = format!("  {:<15}", r.pattern);
        let mut next = 0.0;
        for (at, w) in &r.weights {
            if *at >= next {
                let _ = write!(line, " {:.0}s:{}/{}/{}", at, w[0], w[1], w[2]);
                next += 2.0;
            }
        }
        println!("{line}");
    }
    println!();
}

/// The load-aware runs' weights over time, one panel per pattern.
fn svg(runs: &[Run]) -> String {
    let panels: Vec<&Run> = runs.iter().filter(|r| r.mode == Mode::LoadAware).collect();
    let (pw, ph, pad) = (420.0, 160.0, 40.0);
    let w = pw * 2.0 + pad * 3.0;
    let h = (ph + pad * 1.5) * panels.len().div_ceil(2) as f64 + pad;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let colors = ["#d62728", "#1f77b4", "#2ca02c"];
    for (i, r) in panels.iter().enumerate() {
        let x0 = pad + (i % 2) as f64 * (pw + pad);
        let y0 = pad + (i / 2) as f64 * (ph + pad * 1.5);
        let tmax = r.weights.last().map_or(1.0, |x| x.0).max(1.0);
        let _ = writeln!(
            s,
            "<text x=\"{x0}\" y=\"{}\">{}: load-aware weight per backend (0-100) over {tmax:.0} s</text>\n\
             <rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>",
            y0 - 6.0,
            r.pattern
        );
        for (b, color) in colors.iter().enumerate() {
            let pts: Vec<String> = r
                .weights
                .iter()
                .map(|(at, wt)| {
                    let x = x0 + at / tmax * pw;
                    let y = y0 + ph - (wt[b].min(100) as f64 / 100.0) * ph;
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            let _ = writeln!(
                s,
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
                 <text x=\"{}\" y=\"{}\" fill=\"{color}\">backend {}</text>",
                pts.join(" "),
                x0 + pw - 60.0,
                y0 + 14.0 + 12.0 * b as f64,
                b + 1
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, SVG};

    #[test]
    fn documented_invocations_parse() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from(["xlb-load-aware-bench"]).unwrap();
        assert_eq!(c.seconds, 30.0);
        assert!(c.svg.path(SVG).unwrap().ends_with(SVG));
        let c = Cli::try_parse_from(["xlb-load-aware-bench", "--seconds", "10", "--svg", "w.svg"])
            .unwrap();
        assert_eq!(c.seconds, 10.0);
        assert_eq!(c.svg.path(SVG).unwrap(), std::path::Path::new("w.svg"));
        Cli::try_parse_from(["xlb-load-aware-bench", "--pattern", "scaling"]).unwrap_err();
    }
}
