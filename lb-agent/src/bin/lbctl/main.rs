//! lbctl: inspects the xlb data plane through the maps lb-agent pins under
//! /sys/fs/bpf/xlb. It only reads them, and works while the agent is down.

mod backends;
mod conntrack;
mod l2;
mod maglev;
mod services;
mod stats;
mod table;
mod trace;

use std::{io::Write, path::PathBuf, process::ExitCode};

use anyhow::Result;
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "lbctl",
    version,
    about = "Inspect the xlb XDP load balancer through its pinned BPF maps",
    long_about = "Inspect the xlb XDP load balancer through its pinned BPF maps. \
                  lbctl only reads the maps, and works while lb-agent is down. Needs root.\n\n\
                  Exit codes: 0 success, 1 error (no pinned maps, unknown service, ...), \
                  2 usage error, or `trace` found no service for the flow."
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Services: VIP, port, protocol, mode, table size, backends, traffic.
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

fn run(cli: &Cli) -> Result<ExitCode> {
    let maps = lb_agent::maps::PinnedMaps::open(&cli.pin_dir)?;
    let json = cli.json;
    match &cli.command {
        Command::Services => emit(services::run(&maps)?, json),
        Command::Backends(a) => emit(backends::run(&maps, a)?, json),
        Command::Conntrack(a) => emit(conntrack::run(&maps, a)?, json),
        Command::Stats => emit(stats::run(&maps)?, json),
        Command::Maglev(a) => emit(maglev::run(&maps, a)?, json),
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
