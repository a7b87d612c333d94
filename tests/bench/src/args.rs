//! Command-line pieces the benchmark binaries share (clap): numbers that
//! must be positive, `--svg PATH` / `--no-svg`, and the end-to-end
//! benchmark's options, which `xlb-bench` accepts too because
//! `cargo xtask bench ARGS` passes ARGS to both.

use std::{fmt::Display, path::PathBuf, str::FromStr};

use clap::{builder::PossibleValuesParser, Args, ValueEnum};

use crate::support::workspace_root;

/// A value parser for a number above zero (a count, a duration).
pub fn positive<T>(s: &str) -> Result<T, String>
where
    T: FromStr + PartialOrd + Default,
    T::Err: Display,
{
    let v: T = s.parse().map_err(|e| format!("{e}"))?;
    if v > T::default() {
        Ok(v)
    } else {
        Err("not a positive number".into())
    }
}

/// Where a benchmark writes its chart: `--svg PATH`, or none with
/// `--no-svg`; the later of the two wins. A binary names its own default
/// file in the help with `#[command(mut_arg("svg", ...))]` and passes it
/// to [`Svg::path`].
#[derive(Args, Debug, Clone)]
pub struct Svg {
    /// Where to write the chart (default: its file under docs/)
    #[arg(long, value_name = "PATH", overrides_with = "no_svg")]
    svg: Option<PathBuf>,
    /// Write no chart
    #[arg(long, overrides_with = "svg")]
    no_svg: bool,
}

impl Svg {
    /// `--svg`'s path, else `default` (relative to the workspace root);
    /// `None` with `--no-svg`.
    pub fn path(&self, default: &str) -> Option<PathBuf> {
        if self.no_svg {
            return None;
        }
        Some(
            self.svg
                .clone()
                .unwrap_or_else(|| workspace_root().join(default)),
        )
    }
}

/// A TCP case of the end-to-end benchmark: the mechanism between the
/// client and the backends.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Mech {
    Xlb,
    Iptables,
    Nftables,
    Nginx,
    Haproxy,
}

impl Mech {
    pub const ALL: [Mech; 5] = [
        Mech::Xlb,
        Mech::Iptables,
        Mech::Nftables,
        Mech::Nginx,
        Mech::Haproxy,
    ];

    /// Its name in `--cases`.
    pub fn id(self) -> &'static str {
        match self {
            Mech::Xlb => "xlb",
            Mech::Iptables => "iptables",
            Mech::Nftables => "nftables",
            Mech::Nginx => "nginx",
            Mech::Haproxy => "haproxy",
        }
    }

    pub fn label(self, xdp_mode: &str) -> String {
        match self {
            Mech::Xlb => return format!("xlb (XDP {xdp_mode}, nat)"),
            Mech::Iptables => "iptables DNAT (kube-proxy iptables)",
            Mech::Nftables => "nftables DNAT (kube-proxy nftables)",
            Mech::Nginx => "nginx stream proxy",
            Mech::Haproxy => "HAProxy, mode tcp",
        }
        .into()
    }

    pub fn short(self) -> &'static str {
        match self {
            Mech::Xlb => "xlb",
            Mech::Iptables => "iptables",
            Mech::Nftables => "nftables",
            Mech::Nginx => "nginx stream",
            Mech::Haproxy => "HAProxy",
        }
    }
}

/// The end-to-end benchmark's chart, relative to the workspace root.
pub const E2E_SVG: &str = "docs/benchmarks-e2e.svg";

/// The end-to-end benchmark's options (`xlb-e2e-bench`), here because
/// `xlb-bench` takes them too: `cargo xtask bench ARGS` passes ARGS to both.
#[derive(Args, Debug, Clone)]
#[command(mut_arg("svg", |a| a.help(format!("Where to write the chart [default: {E2E_SVG}]"))))]
pub struct E2eArgs {
    /// Interleaved rounds of every case
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive::<usize>)]
    pub rounds: usize,
    /// wrk duration per run, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = positive::<u64>)]
    pub duration: u64,
    /// wrk threads
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive::<usize>)]
    pub threads: usize,
    /// wrk connections
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = positive::<usize>)]
    pub connections: usize,
    /// TCP cases, comma-separated [default: all]
    #[arg(long, value_name = "LIST", value_enum, value_delimiter = ',',
          default_values_t = Mech::ALL, hide_default_value = true)]
    pub cases: Vec<Mech>,
    /// UDP send time per run, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = positive::<u64>)]
    pub udp_duration: u64,
    /// UDP sender threads, sharing --udp-sockets sockets
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = positive::<usize>)]
    pub udp_senders: usize,
    /// UDP sockets (at least one per sender)
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = positive::<usize>)]
    pub udp_sockets: usize,
    /// UDP datagram payload, in bytes
    #[arg(long, value_name = "BYTES", default_value_t = 64, value_parser = positive::<usize>)]
    pub udp_payload: usize,
    /// Services for the memory test
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = positive::<usize>)]
    pub services: usize,
    /// Backends per service for the memory test
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = positive::<usize>)]
    pub backends_per_service: usize,
    /// Skip the TCP part
    #[arg(long)]
    pub no_tcp: bool,
    /// Skip the UDP part
    #[arg(long)]
    pub no_udp: bool,
    /// Skip the memory part
    #[arg(long)]
    pub no_memory: bool,
    // What a veth needs to take redirected frames at once.
    /// XDP_PASS on the client's and the backends' veth ends
    #[arg(long)]
    pub peer_xdp: bool,
    #[command(flatten)]
    pub svg: Svg,
    // E.g. a build with a change.
    /// The lb-agent binary to measure (default: the one next to this binary)
    #[arg(long, value_name = "PATH")]
    pub lb_agent: Option<PathBuf>,
    /// xdp_mode of the xlb case
    #[arg(long, value_name = "MODE", default_value = "native",
          value_parser = PossibleValuesParser::new(["native", "generic"]))]
    pub xdp_mode: String,
}
