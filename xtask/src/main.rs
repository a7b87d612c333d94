//! Developer tasks for xlb: `cargo xtask <command>` (alias in .cargo/config.toml).

mod bench;
mod chart;
mod demo;
mod image;
mod kube;
mod setup;
mod test;
mod util;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Developer tasks for xlb")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install whatever this machine lacks (toolchain parts, bpf-linker, Debian packages, bpffs,
    /// the Kubernetes control plane the tests run against).
    Setup,
    /// Run fmt, clippy and the workspace tests; arguments after `--` go to `cargo test`.
    Test {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Show the load balancer at work.
    Demo,
    /// Run the benchmark binary; arguments are passed to it.
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Lint the eBPF crate for its real target (needs nightly).
    ClippyEbpf,
    /// Lint, render and schema-check the Helm chart (charts/xlb) over its CI values files.
    ChartCheck,
    /// Build the container images (agent, gobgpd, and the real-node tests' pause and backend) with buildah, run their binaries, save them as OCI archives.
    Image,
    /// Run the generated-input tests (the flow and membership decoders, the config file,
    /// the Kubernetes annotations) long: CASES inputs each (`cargo xtask test` runs 256).
    Fuzz {
        #[arg(long, default_value_t = 100_000)]
        cases: u32,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Print the error chain ourselves: anyhow's Debug output adds a backtrace
    // whenever RUST_BACKTRACE is set, burying which step failed.
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    // Every task needs the machine set up, so do it first rather than fail halfway.
    setup::run()?;
    // The demo needs no Kubernetes; everything else may run the control plane.
    if !matches!(
        command,
        Command::Demo | Command::ClippyEbpf | Command::Image | Command::Fuzz { .. }
    ) {
        kube::setup()?;
    }
    match command {
        Command::Setup => Ok(()),
        Command::Test { args } => test::run(&args),
        Command::Demo => demo::run(),
        Command::Bench { args } => bench::run(&args),
        Command::ClippyEbpf => test::clippy_ebpf(),
        Command::ChartCheck => chart::run(),
        Command::Image => image::run(),
        Command::Fuzz { cases } => test::fuzz(cases),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Command {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()))
            .unwrap()
            .command
    }

    #[test]
    fn test_args_after_double_dash_reach_cargo_test_verbatim() {
        let Command::Test { args } = parse(&["test", "--", "fixtures", "--", "--nocapture"]) else {
            panic!("not the test command");
        };
        assert_eq!(args, ["fixtures", "--", "--nocapture"]);
    }

    #[test]
    fn bench_args_pass_through_with_or_without_double_dash() {
        for argv in [
            &["bench", "--duration", "5"][..],
            &["bench", "--", "--duration", "5"][..],
        ] {
            let Command::Bench { args } = parse(argv) else {
                panic!("not the bench command");
            };
            assert_eq!(args, ["--duration", "5"]);
        }
    }
}
