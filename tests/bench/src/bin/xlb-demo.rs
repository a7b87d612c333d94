//! `cargo xtask demo`: xlb at work in network namespaces on this machine.
//!
//! Builds a client, the load balancer and three nginx backends (see
//! `xlb_tests::topology`), starts lb-agent with a weighted service, sends
//! 600 HTTP/1.0 requests from the client (each on a new connection, so each
//! is a new flow that Maglev places), counts which backend answered, shows
//! `lbctl stats` and `lbctl maglev`, and removes everything again, also on
//! Ctrl-C.

use std::{
    collections::BTreeMap,
    fs,
    net::SocketAddr,
    process::ExitCode,
    time::{Duration, Instant},
};

use clap::Parser;
use xlb_bench::support::{
    check_interrupt, http_get, in_ns, install_sigint_flag, interrupted, xdp_attached, Agent, Bins,
    Res,
};
use xlb_tests::topology::{backend_ip, Topology, BACKEND_PORT, CLIENT_IP, VIP};

const PREFIX: &str = "xdemo";
const REQUESTS: usize = 600;
const WEIGHTS: [u32; 3] = [1, 1, 2];
const METRICS: &str = "127.0.0.1:9469";

/// xlb at work in network namespaces on this machine: a client, the load
/// balancer and three nginx backends, traffic, lbctl, and teardown.
#[derive(Parser, Debug)]
#[command(name = "xlb-demo")]
struct Cli {}

fn main() -> ExitCode {
    Cli::parse();
    install_sigint_flag();
    let result = run();
    if interrupted() {
        println!("\ninterrupted: the namespaces, the agent and its XDP program are gone");
        return ExitCode::from(130);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\ndemo failed: {e}");
            eprintln!("(everything it set up has been removed)");
            ExitCode::FAILURE
        }
    }
}

fn step(n: usize, what: &str) {
    println!("\n[{n}/5] {what}");
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    {l}\n"))
        .collect::<String>()
}

fn config() -> String {
    let backends: String = WEIGHTS
        .iter()
        .enumerate()
        .map(|(i, w)| {
            format!(
                "      - {{ ip: {}, port: {BACKEND_PORT}, weight: {w} }}\n",
                backend_ip(i + 1)
            )
        })
        .collect();
    format!(
        "interfaces: [lbc, lbb1, lbb2, lbb3]\n\
         metrics_addr: {METRICS}\n\
         services:\n\
         \x20 - name: web\n\
         \x20   vip: {VIP}\n\
         \x20   port: 80\n\
         \x20   protocol: tcp\n\
         \x20   mode: nat\n\
         \x20   backends:\n\
         {backends}\
         \x20   health_check: {{ type: tcp, interval: 1s, timeout: 500ms, rise: 2, fall: 2 }}\n"
    )
}

fn run() -> Res<()> {
    let bins = Bins::locate()?;
    println!("xlb demo: a client, a load balancer running lb-agent (XDP) and 3 nginx backends,");
    println!("each in its own network namespace on this machine.");

    step(1, "topology");
    let started = Instant::now();
    let topo = Topology::new(PREFIX, WEIGHTS.len());
    println!(
        "    {c} (client {CLIENT_IP}) -> {lb} (lb-agent) -> {b} (nginx on 10.2.N.2:{BACKEND_PORT}, answers \"bN\")",
        c = topo.client.name,
        lb = topo.lb.name,
        b = topo
            .backends
            .iter()
            .map(|b| b.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    );
    println!("    ready in {:.1} s", started.elapsed().as_secs_f64());
    check_interrupt()?;

    step(2, "lb-agent");
    let cfg_path = topo.dir.join("xlb.yaml");
    fs::write(&cfg_path, config()).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    println!("    {}:", cfg_path.display());
    print!("{}", indent(&config()));
    let metrics: SocketAddr = METRICS.parse().unwrap();
    let log = topo.dir.join("lb-agent.log");
    let mut agent = Agent::spawn(&bins, &topo.lb, &cfg_path, &topo.pin_dir, metrics, &log)?;
    let took = agent.wait_ready(Duration::from_secs(30))?;
    let attached: Vec<String> = topo
        .lb_interfaces()
        .into_iter()
        .filter(|i| xdp_attached(&topo.lb, i))
        .collect();
    println!(
        "    ready after {:.1} s (/readyz on {METRICS} in {}); XDP attached to {}; log: {}",
        took.as_secs_f64(),
        topo.lb.name,
        attached.join(", "),
        log.display()
    );
    check_interrupt()?;

    step(
        3,
        &format!(
            "traffic: {REQUESTS} HTTP/1.0 requests from the client to http://{VIP}/, one connection each"
        ),
    );
    let started = Instant::now();
    let vip = SocketAddr::new(VIP.into(), 80);
    // One client thread per CPU, each pinned: on veth a packet is processed
    // (XDP included) on the CPU that sent it, so this spreads the work the
    // way a NIC's receive queues would.
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(REQUESTS);
    let threads: Vec<_> = (0..cpus)
        .map(|cpu| {
            let n = REQUESTS / cpus + usize::from(cpu < REQUESTS % cpus);
            in_ns(&topo.client.name, move || {
                pin_to_cpu(cpu);
                let mut answers: BTreeMap<String, usize> = BTreeMap::new();
                let mut failures: Vec<String> = Vec::new();
                let mut times: Vec<Duration> = Vec::with_capacity(n);
                for _ in 0..n {
                    if interrupted() {
                        break;
                    }
                    let t0 = Instant::now();
                    let r = http_get(vip, "/", Duration::from_secs(5));
                    times.push(t0.elapsed());
                    match r {
                        Ok((200, body)) => {
                            *answers.entry(body.trim().to_string()).or_default() += 1
                        }
                        Ok((status, _)) => failures.push(format!("HTTP {status}")),
                        Err(e) => failures.push(e),
                    }
                }
                (answers, failures, times)
            })
        })
        .collect();
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    let mut times: Vec<Duration> = Vec::new();
    for t in threads {
        let (a, f, d) = t.join().map_err(|_| "a client thread panicked")?;
        for (k, v) in a {
            *answers.entry(k).or_default() += v;
        }
        failures.extend(f);
        times.extend(d);
    }
    times.sort();
    check_interrupt()?;
    let elapsed = started.elapsed().as_secs_f64();
    let served: usize = answers.values().sum();
    let total_weight: u32 = WEIGHTS.iter().sum();
    println!();
    println!("    backend           weight  requests   share  expected");
    for (i, w) in WEIGHTS.iter().enumerate() {
        let name = format!("b{}", i + 1);
        let n = answers.get(&name).copied().unwrap_or(0);
        println!(
            "    {name} {:<14} {w:>4} {n:>9} {:>6.1}% {:>8.1}%",
            format!("{}:{BACKEND_PORT}", backend_ip(i + 1)),
            n as f64 * 100.0 / served.max(1) as f64,
            *w as f64 * 100.0 / total_weight as f64
        );
    }
    for (other, n) in answers
        .iter()
        .filter(|(k, _)| !(1..=WEIGHTS.len()).any(|i| **k == format!("b{i}")))
    {
        println!("    unexpected answer {other:?}: {n}");
    }
    println!(
        "    total                    {served:>9}  in {elapsed:.2} s ({:.0} connections/s)",
        served as f64 / elapsed
    );
    if let (Some(p50), Some(max)) = (times.get(times.len() / 2), times.last()) {
        println!(
            "    time per request: median {:.2} ms, slowest {:.2} ms",
            p50.as_secs_f64() * 1000.0,
            max.as_secs_f64() * 1000.0
        );
    }
    let slow = times
        .iter()
        .filter(|d| **d > Duration::from_millis(100))
        .count();
    if slow > 0 {
        println!(
            "    {slow} requests took over 100 ms: packets were lost and retransmitted \
             (lbctl stats below counts what the data plane passed to the kernel)"
        );
    }
    if !failures.is_empty() {
        println!(
            "    {} requests failed, e.g. {}",
            failures.len(),
            failures[0]
        );
    }
    println!("    (Maglev gives each backend a share of its lookup table by weight; every new");
    println!("    connection hashes to one entry, so the shares above vary by a few percent.)");

    step(
        4,
        &format!("lbctl --pin-dir {} stats", topo.pin_dir.display()),
    );
    print!("{}", indent(&bins.lbctl(&topo.pin_dir, &["stats"])?));
    check_interrupt()?;

    step(
        5,
        &format!(
            "lbctl --pin-dir {} maglev {VIP}:80/tcp",
            topo.pin_dir.display()
        ),
    );
    print!(
        "{}",
        indent(&bins.lbctl(&topo.pin_dir, &["maglev", &format!("{VIP}:80/tcp")])?)
    );

    println!("\nteardown");
    agent.stop()?;
    println!(
        "    lb-agent stopped; `lb-agent --cleanup --pin-dir {}` detached XDP and removed the pins",
        topo.pin_dir.display()
    );
    drop(topo);
    println!("    namespaces {PREFIX}-* deleted");
    // A show, not a test: a few lost requests are reported above; the demo
    // fails when the service did not work (a backend never answered, or
    // most requests failed).
    let silent: Vec<String> = (1..=WEIGHTS.len())
        .map(|i| format!("b{i}"))
        .filter(|b| !answers.contains_key(b))
        .collect();
    if served * 10 < REQUESTS * 9 || !silent.is_empty() {
        return Err(format!(
            "only {served} of {REQUESTS} requests were answered{}",
            if silent.is_empty() {
                String::new()
            } else {
                format!("; never answered: {}", silent.join(", "))
            }
        ));
    }
    Ok(())
}

/// Pins the calling thread to `cpu` (best effort).
fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) affects this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    #[test]
    fn takes_no_arguments() {
        Cli::command().debug_assert();
        Cli::try_parse_from(["xlb-demo"]).unwrap();
        Cli::try_parse_from(["xlb-demo", "--requests", "10"]).unwrap_err();
    }
}
