//! `cargo xtask bench` (and `cargo xtask bench rollout`): established
//! connections lost when a node of the ECMP lab (`xlb_tests::ecmp`: a BIRD
//! router spreading the VIP over three nodes, three nginx backends) is
//! rolled, leaves, or joins. One fresh lab per speaker (GoBGP, BIRD) and
//! mode (nat, snat), with BGP graceful restart on the nodes' speakers
//! (`EcmpLab::start_graceful`).
//!
//! The client holds 30 keep-alive connections to the VIP, spread over the
//! nodes, and opens new ones one after another all along. Each round takes
//! every node in turn through four events:
//!
//! * restart: its agent restarts (SIGUSR2) and its speaker is killed, as a
//!   rollout of the chart's Pod does; both start again, and the event ends
//!   when the router's graceful restart with the node is over;
//! * crash: its agent and its speaker are killed (SIGKILL: an OOM kill, a
//!   node's container runtime restarting), and both start again; the
//!   program stays attached meanwhile and keeps forwarding. Ends as restart;
//! * leave: its agent is told to leave (SIGTERM: withdraw, drain 1 s, exit;
//!   with `--graceful-shutdown D`, announce GRACEFUL_SHUTDOWN and wait D
//!   first, RFC 8326, which the lab's router honours); ends when the
//!   router's FIB has the other two nodes only and the agent has exited;
//! * join: its agent starts again; ends when the FIB has all three.
//!
//! After each event every keep-alive connection makes one request; one that
//! fails is counted lost (and replaced). New connections that failed during
//! the event are counted too, and the TCP segments the client sent again
//! during it (its kernel's `RetransSegs`: packets of the keep-alive and new
//! connections that were lost or late). Prints a table per lab and the line
//! `rollout: LAB restart lost X/N, crash lost C/N, leave lost Y/N, join lost Z/N; new failed W/M`
//! per lab (N: connections checked, M: new connections made).

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use clap::{
    builder::{PossibleValuesParser, TypedValueParser},
    Parser,
};
use xlb_bench::support::{install_sigint_flag, interrupted};
use xlb_tests::{
    ecmp::{request_from, Driver, EcmpLab, NODES, VIP},
    topology::{in_netns, HttpConn},
};

const EVENTS: [&str; 4] = ["restart", "crash", "leave", "join"];

/// The labs, by name in `--labs`.
const LABS: [(&str, Driver, &str); 6] = [
    ("gobgp-nat", Driver::GoBgp, "nat"),
    ("gobgp-snat", Driver::GoBgp, "snat"),
    ("bird-nat", Driver::Bird, "nat"),
    ("bird-snat", Driver::Bird, "snat"),
    ("frr-nat", Driver::Frr, "nat"),
    ("frr-snat", Driver::Frr, "snat"),
];

/// Established connections lost when a node of the ECMP lab restarts,
/// crashes, leaves or joins, per speaker and mode.
#[derive(Parser, Debug)]
#[command(name = "xlb-rollout-bench", args_override_self = true)]
struct Opts {
    /// Labs, comma-separated [default: all]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = lab_parser(),
          default_values = LABS.map(|l| l.0), hide_default_value = true)]
    labs: Vec<(Driver, &'static str)>,
    /// Events, comma-separated [default: all]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = event_parser(),
          default_values = EVENTS, hide_default_value = true)]
    events: Vec<&'static str>,
    /// Rounds over the three nodes
    #[arg(long, value_name = "N", default_value_t = 2)]
    rounds: usize,
    /// Keep-alive connections
    #[arg(long, value_name = "N", default_value_t = 30)]
    conns: usize,
    /// `bgp.graceful_shutdown` in the agents' configs (e.g. 2s) [default: off]
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    graceful_shutdown: Option<Duration>,
}

/// `--labs`' parser: a lab by its name, as its speaker and mode.
fn lab_parser() -> impl TypedValueParser<Value = (Driver, &'static str)> {
    PossibleValuesParser::new(LABS.map(|l| l.0)).map(|name| {
        let (_, driver, mode) = LABS.into_iter().find(|l| l.0 == name).expect("a lab");
        (driver, mode)
    })
}

/// `--events`' parser: an entry of [`EVENTS`].
fn event_parser() -> impl TypedValueParser<Value = &'static str> {
    PossibleValuesParser::new(EVENTS)
        .map(|name| EVENTS.into_iter().find(|e| *e == name).expect("an event"))
}

/// Per event kind: (events, connections checked, lost, new made, new
/// failed, segments the client sent again).
type Tally = BTreeMap<&'static str, [u64; 6]>;

/// The TCP segments the client's kernel has sent again so far
/// (`RetransSegs` in its namespace's /proc/net/snmp).
fn client_retransmissions(lab: &EcmpLab) -> Result<u64, String> {
    // thread-self: /proc/self/net is the namespace of the process's
    // first thread, not of the one `in_netns` moved.
    let snmp = in_netns(&lab.client, || {
        std::fs::read_to_string("/proc/thread-self/net/snmp")
    })
    .join()
    .map_err(|_| "reading the client's /proc/net/snmp panicked".to_string())?
    .map_err(|e| format!("the client's /proc/net/snmp: {e}"))?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next(), tcp.next());
    let (Some(names), Some(values)) = (names, values) else {
        return Err(format!("no Tcp lines in /proc/net/snmp:\n{snmp}"));
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "RetransSegs")
        .and_then(|(_, v)| v.parse().ok())
        .ok_or(format!("no RetransSegs in /proc/net/snmp:\n{snmp}"))
}

/// The client's stream of new connections, counted.
struct NewConnections {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NewConnections {
    fn start(lab: &EcmpLab) -> Self {
        let (ok, failed, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (o, f, s) = (ok.clone(), failed.clone(), stop.clone());
        let thread = in_netns(&lab.client, move || {
            // Below the ephemeral range the keep-alive connections use.
            let mut port = 10000u16;
            while !s.load(Ordering::Relaxed) {
                let sent = std::time::Instant::now();
                match request_from(port) {
                    Ok(_) => o.fetch_add(1, Ordering::Relaxed),
                    // The port's previous connection still lingers in the
                    // client's kernel (its last ACK lost in an event, the
                    // FIN retransmitted): no packet was sent, so nothing of
                    // the balancer is measured. The next port is tried.
                    Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                        eprintln!("  port {port} still in use by an earlier connection: skipped");
                        0
                    }
                    Err(e) => {
                        // When and how: a reset at once, or a timeout that
                        // counts against a later event than its cause.
                        eprintln!(
                            "  new connection from port {port} failed after {:?}: {e}",
                            sent.elapsed()
                        );
                        f.fetch_add(1, Ordering::Relaxed)
                    }
                };
                port = if port == 30000 { 10000 } else { port + 1 };
            }
        });
        Self {
            ok,
            failed,
            stop,
            thread: Some(thread),
        }
    }

    fn counts(&self) -> (u64, u64) {
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

impl Drop for NewConnections {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Makes one request on every connection; replaces the ones that fail.
/// Returns how many failed.
fn check(lab: &EcmpLab, conns: &mut [HttpConn]) -> Result<u64, String> {
    let vip = SocketAddr::from((VIP, 80));
    let mut lost = 0;
    for c in conns.iter_mut() {
        if c.get().is_err() {
            lost += 1;
            *c = HttpConn::connect_in(&lab.client, vip).map_err(|e| format!("reconnect: {e}"))?;
            c.get().map_err(|e| format!("first request: {e}"))?;
        }
    }
    Ok(lost)
}

/// Runs one event on node `i`.
fn event(lab: &mut EcmpLab, kind: &str, i: usize, mode: &str) -> Result<(), String> {
    let all: Vec<usize> = (1..=NODES).collect();
    match kind {
        "restart" | "crash" => {
            if kind == "restart" {
                lab.node(i).signal_agent(libc::SIGUSR2);
                lab.node(i).wait_agent_exit(Duration::from_secs(5));
            } else {
                lab.node(i).kill_agent();
            }
            lab.node(i).kill_speaker();
            lab.node(i).start_speaker();
            let c = lab.agent_config_in(i, 1, mode);
            lab.node(i).start_agent(&c);
            lab.wait_graceful_restart_over(i, Duration::from_secs(30));
            lab.wait_next_hops(&all)
        }
        "leave" => {
            lab.node(i).sigterm_agent();
            let others: Vec<usize> = all.iter().copied().filter(|&n| n != i).collect();
            lab.wait_next_hops(&others)?;
            let st = lab.node(i).wait_agent_exit(Duration::from_secs(10));
            st.success()
                .then_some(())
                .ok_or(format!("node {i}'s agent exited with {st}"))
        }
        _ => {
            let c = lab.agent_config_in(i, 1, mode);
            lab.node(i).start_agent(&c);
            lab.wait_next_hops(&all)
        }
    }
}

fn run_lab(o: &Opts, driver: Driver, mode: &str) -> Result<Tally, String> {
    let mut lab = EcmpLab::start_graceful(driver, if mode == "nat" { 'n' } else { 's' });
    lab.graceful_shutdown = o.graceful_shutdown;
    for i in 1..=NODES {
        let c = lab.agent_config_in(i, 1, mode);
        lab.node(i).spawn_agent(&c);
    }
    for i in 1..=NODES {
        lab.node(i).wait_agent_ready();
    }
    lab.wait_next_hops(&[1, 2, 3])?;
    let vip = SocketAddr::from((VIP, 80));
    let mut conns = (0..o.conns)
        .map(|_| HttpConn::connect_in(&lab.client, vip))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("keep-alive connection: {e}"))?;
    check(&lab, &mut conns)?;
    let fresh = NewConnections::start(&lab);
    let mut tally = Tally::new();
    for round in 1..=o.rounds {
        for i in 1..=NODES {
            for &kind in &o.events {
                if interrupted() {
                    return Err("interrupted (Ctrl-C)".into());
                }
                let (ok0, failed0) = fresh.counts();
                let resent0 = client_retransmissions(&lab)?;
                event(&mut lab, kind, i, mode)?;
                let lost = check(&lab, &mut conns)?;
                let (ok1, failed1) = fresh.counts();
                let resent = client_retransmissions(&lab)? - resent0;
                let t = tally.entry(kind).or_default();
                t[0] += 1;
                t[1] += o.conns as u64;
                t[2] += lost;
                t[3] += (ok1 - ok0) + (failed1 - failed0);
                t[4] += failed1 - failed0;
                t[5] += resent;
                eprintln!(
                    "{} {mode} round {round}: node {i} {kind}: {lost} of {} connections lost, {} new failed, {resent} segments sent again",
                    driver.name(),
                    o.conns,
                    failed1 - failed0
                );
            }
        }
    }
    Ok(tally)
}

fn main() -> ExitCode {
    let o = Opts::parse();
    install_sigint_flag();
    let mut lines = Vec::new();
    let graceful = match o.graceful_shutdown {
        Some(d) => format!("graceful shutdown {}", humantime::format_duration(d)),
        None => "graceful shutdown off".into(),
    };
    println!(
        "Connections lost per event, ECMP lab, graceful restart on, {graceful}, {} keep-alive connections, {} rounds over {NODES} nodes",
        o.conns, o.rounds
    );
    for &(driver, mode) in &o.labs {
        let lab = format!("{}-{mode}", driver.name());
        let tally = match run_lab(&o, driver, mode) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("xlb-rollout-bench: {lab}: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!();
        println!("{lab}:");
        println!();
        println!("| event | events | connections checked | lost | new connections | new failed | segments sent again |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        let mut summary = Vec::new();
        for &kind in &o.events {
            let [n, checked, lost, made, failed, resent] =
                tally.get(kind).copied().unwrap_or_default();
            println!("| {kind} | {n} | {checked} | {lost} | {made} | {failed} | {resent} |");
            summary.push(format!("{kind} lost {lost}/{checked}"));
        }
        let made: u64 = tally.values().map(|t| t[3]).sum();
        let failed: u64 = tally.values().map(|t| t[4]).sum();
        lines.push(format!(
            "rollout: {lab} {}; new failed {failed}/{made}",
            summary.join(", ")
        ));
    }
    println!();
    for l in lines {
        println!("{l}");
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[&str]) -> Result<Opts, clap::Error> {
        Opts::try_parse_from(std::iter::once("xlb-rollout-bench").chain(args.iter().copied()))
    }

    #[test]
    fn documented_invocations_parse() {
        Opts::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert_eq!(
            o.labs,
            [
                (Driver::GoBgp, "nat"),
                (Driver::GoBgp, "snat"),
                (Driver::Bird, "nat"),
                (Driver::Bird, "snat"),
                (Driver::Frr, "nat"),
                (Driver::Frr, "snat"),
            ]
        );
        assert_eq!(o.events, EVENTS);
        assert_eq!((o.rounds, o.conns), (2, 30));
        // docs/benchmarks.md
        assert_eq!(parse(&["--rounds", "1"]).unwrap().rounds, 1);
        let o = parse(&[
            "--labs",
            "bird-snat,gobgp-nat",
            "--events",
            "crash,join",
            "--conns",
            "5",
        ])
        .unwrap();
        assert_eq!(o.labs, [(Driver::Bird, "snat"), (Driver::GoBgp, "nat")]);
        assert_eq!((o.events.as_slice(), o.conns), (&["crash", "join"][..], 5));
        assert_eq!(o.graceful_shutdown, None);
        let o = parse(&["--events", "leave,join", "--graceful-shutdown", "2s"]).unwrap();
        assert_eq!(o.graceful_shutdown, Some(Duration::from_secs(2)));
        parse(&["--labs", "exabgp-nat"]).unwrap_err();
        parse(&["--events", "reboot"]).unwrap_err();
    }
}
