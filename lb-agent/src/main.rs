//! lb-agent: owns the XDP program and its maps, keeps them equal to the
//! desired state (a config file in standalone mode), health-checks backends
//! and serves Prometheus metrics.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use lb_agent::{
    agent::{Agent, AgentOptions},
    config::AgentConfig,
    dataplane::Dataplane,
};
use tracing::{error, info};

#[derive(Parser, Debug)]
#[command(
    name = "lb-agent",
    version,
    about = "xlb's node agent: XDP load balancing from a config file"
)]
struct Cli {
    /// The configuration file (YAML, see docs/config.md).
    #[arg(long, short, required_unless_present_any = ["cleanup", "check", "print_crds"])]
    config: Option<PathBuf>,
    /// Where the program's maps and links are pinned.
    #[arg(long, default_value = "/sys/fs/bpf/xlb")]
    pin_dir: PathBuf,
    /// Detach the program from every interface, unpin everything, and exit.
    #[arg(long)]
    cleanup: bool,
    /// Serve /metrics, /healthz and /readyz here instead of the file's
    /// `metrics_addr` (the Helm chart passes the node's address).
    #[arg(long, value_name = "ADDR:PORT", value_parser = lb_agent::config::parse_listen_addr)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Only check the configuration file and exit (0 if valid).
    #[arg(long, value_name = "FILE")]
    check: Option<PathBuf>,
    /// Print the CustomResourceDefinitions xlb uses (YAML) and exit.
    #[arg(long)]
    print_crds: bool,
    /// Log filter (tracing's EnvFilter syntax), also from RUST_LOG.
    #[arg(long, default_value = "info")]
    log: String,
    /// Log lines as plain text (colours only on a terminal) or one JSON
    /// object per line, for log pipelines.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

/// kube-rs logs every failed request and watch itself (the HTTP stack at
/// ERROR, the watcher and stream at WARN): during an API server outage, or
/// the 403s of its permission cache loading after a restart, that is a line
/// per retry. The agent reports the outage itself (once when it starts,
/// once when it ends, a metric in between), so these are off unless the
/// filter names kube's crates.
const QUIET_KUBE: &[&str] = &[
    "kube_client::client::builder=off",
    "kube_client::client=error",
    "kube_runtime::watcher=error",
];

fn init_logging(filter: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let mut env_filter = tracing_subscriber::EnvFilter::new(filter);
    if !filter.contains("kube") {
        for directive in QUIET_KUBE {
            env_filter = env_filter.add_directive(directive.parse().expect("valid directive"));
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_target(false);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Text => {
            // Escape codes only where a person reads them: log collectors
            // store them verbatim.
            let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            builder.with_ansi(colour).init()
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| cli.log.clone());
    init_logging(&filter, cli.log_format);

    if cli.print_crds {
        print!("{}", lb_agent::k8s::crds_yaml());
        return ExitCode::SUCCESS;
    }
    if let Some(path) = &cli.check {
        return match AgentConfig::load(path) {
            Ok(_) => {
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    if cli.cleanup {
        if let Err(e) = lb_agent::notrack::remove() {
            error!(
                "removing the nf_tables table {}: {e}",
                lb_agent::notrack::TABLE
            );
        }
        return match Dataplane::cleanup(&cli.pin_dir) {
            Ok(removed) => {
                info!(dir = %cli.pin_dir.display(), ?removed, "detached and unpinned");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("cleanup failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let path = cli.config.expect("clap requires --config");
    // Invalid config at start: say why and exit before touching anything.
    let mut config = match AgentConfig::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lb-agent: {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    if let Some(addr) = cli.metrics_addr {
        config.metrics_addr = addr;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let opts = AgentOptions {
        config_path: path,
        pin_dir: cli.pin_dir,
    };
    match runtime.block_on(async move { Agent::start(opts, config).await?.run().await }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            eprintln!("lb-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
