//! lbctl: inspects the xlb data plane through the maps lb-agent pins under
//! /sys/fs/bpf/xlb. It only reads them, and works while the agent is down.
//! What only the agent knows (`status`, service names) it reads from the
//! agent's metrics endpoint.

mod agent;
mod backends;
mod conntrack;
mod l2;
mod maglev;
mod services;
mod stats;
mod status;
mod table;
mod trace;
mod watch;

use std::{
    collections::BTreeMap, io::Write, net::SocketAddr, path::PathBuf, process::ExitCode,
    time::Duration,
};

use anyhow::Result;
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "lbctl",
    version,
    about = "Inspect the xlb XDP load balancer through its pinned BPF maps",
    long_about = "Inspect the xlb XDP load balancer through its pinned BPF maps. \
                  lbctl only reads the maps, and works while lb-agent is down. Needs root. \
                  `status` and the service names come from the agent's metrics endpoint \
                  (--agent).\n\n\
                  Exit codes: 0 success, 1 error (no pinned maps, unknown service, agent \
                  unreachable for `status`, ...), 2 usage error, 3 `trace` found no service \
                  for the flow, 4 `status`: the agent is not ready."
)]
struct Cli {
    /// Directory where lb-agent pins the XDP program's maps.
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        default_value = "/sys/fs/bpf/xlb"
    )]
    pin_dir: PathBuf,
    /// Machine-readable output: one JSON document on stdout.
    #[arg(long, global = true)]
    json: bool,
    /// The agent's metrics address (its `metrics_addr` or `--metrics-addr`),
    /// ADDR:PORT with or without http://. The chart sets XLB_AGENT in the
    /// agent's container.
    #[arg(
        long,
        global = true,
        value_name = "ADDR:PORT",
        env = "XLB_AGENT",
        default_value = "127.0.0.1:9469",
        value_parser = agent::parse_agent
    )]
    agent: SocketAddr,
    /// `services`, `backends` and `stats`: again every SECONDS, with rates
    /// per second (text redraws a terminal; --json: one document a line).
    #[arg(long, global = true, value_name = "SECONDS", value_parser = watch_interval)]
    watch: Option<Duration>,
    /// With --watch: stop after this many reports.
    #[arg(long, global = true, value_name = "N", requires = "watch")]
    count: Option<u64>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The agent: ready, Kubernetes API, allocator Lease, BGP sessions, L2 VIPs, flow-sync peers.
    Status,
    /// Services: name, VIP, port, protocol, mode, table size, backends, traffic.
    Services,
    /// Backends of each service's live Maglev table, with share and traffic.
    Backends(backends::Args),
    /// Connection-table entries (client -> VIP flows and their backends).
    Conntrack(conntrack::Args),
    /// Packets per verdict reason and CPU; warns when one CPU does most of the work.
    Stats,
    /// A service's live Maglev table: entries and share per backend.
    Maglev(maglev::Args),
    /// Which backend a flow goes to now, computed as the data plane does.
    Trace(trace::Args),
    /// L2 mode: the VIPs this node answers ARP/NDP for, and its interfaces.
    L2,
}

/// A command's result: JSON through serde, or text for people.
trait Render: Serialize {
    fn human(&self) -> String;
    fn exit_code(&self) -> u8 {
        0
    }
}

fn emit<R: Render>(report: R, json: bool) -> Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        write!(out, "{}", report.human())?;
    }
    Ok(ExitCode::from(report.exit_code()))
}

/// The agent's series; none (said on stderr) when it does not answer:
/// the maps are read anyway.
fn from_agent(agent: SocketAddr) -> Vec<agent::Sample> {
    agent::scrape(agent).unwrap_or_else(|e| {
        eprintln!("lbctl: service names and backend states unknown: {e:#}");
        Vec::new()
    })
}

/// Service names by `(VIP, port, protocol)` from the agent.
fn service_names(agent: SocketAddr) -> BTreeMap<(std::net::IpAddr, u16, String), String> {
    agent::service_names(&from_agent(agent))
}

/// The agent's names when `service` is given by name; none to ask for
/// otherwise.
fn names_for(service: Option<&services::ServiceRef>, agent: SocketAddr) -> services::Names {
    match service {
        Some(s) if s.is_name() => service_names(agent),
        _ => services::Names::new(),
    }
}

/// `lbctl backends`, with names and states from the agent read afresh.
fn backends(
    maps: &lb_agent::maps::PinnedMaps,
    args: &backends::Args,
    agent: SocketAddr,
) -> Result<backends::BackendsReport> {
    let all = from_agent(agent);
    let names = agent::service_names(&all);
    backends::run(maps, args, &names, &agent::backends(&all))
}

fn watch_interval(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(secs) if (0.1..=3600.0).contains(&secs) => Ok(Duration::from_secs_f64(secs)),
        _ => Err(format!("{s:?}: seconds from 0.1 to 3600")),
    }
}

fn run(cli: &Cli) -> Result<ExitCode> {
    let json = cli.json;
    if let Some(every) = cli.watch {
        let maps = lb_agent::maps::PinnedMaps::open(&cli.pin_dir)?;
        let n = cli.count;
        return match &cli.command {
            Command::Services => {
                let names = service_names(cli.agent);
                watch::run(json, every, n, || services::run(&maps, &names))
            }
            Command::Backends(a) => watch::run(json, every, n, || backends(&maps, a, cli.agent)),
            Command::Stats => watch::run(json, every, n, || stats::run(&maps)),
            _ => anyhow::bail!("--watch works with services, backends and stats"),
        };
    }
    if let Command::Status = cli.command {
        return emit(status::run(cli.agent)?, json);
    }
    let maps = lb_agent::maps::PinnedMaps::open(&cli.pin_dir)?;
    match &cli.command {
        Command::Status => unreachable!("answered above"),
        Command::Services => emit(services::run(&maps, &service_names(cli.agent))?, json),
        Command::Backends(a) => emit(backends(&maps, a, cli.agent)?, json),
        Command::Conntrack(a) => {
            let names = names_for(a.service.as_ref(), cli.agent);
            emit(conntrack::run(&maps, a, &names)?, json)
        }
        Command::Stats => emit(stats::run(&maps)?, json),
        Command::Maglev(a) => {
            let names = names_for(Some(&a.service), cli.agent);
            emit(maglev::run(&maps, a, &names)?, json)
        }
        Command::Trace(a) => emit(trace::run(&maps, a)?, json),
        Command::L2 => emit(l2::run(&maps)?, json),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(code) => code,
        Err(e) => {
            if cli.json {
                println!("{}", serde_json::json!({ "error": format!("{e:#}") }));
            }
            eprintln!("lbctl: {e:#}");
            ExitCode::from(1)
        }
    }
}
