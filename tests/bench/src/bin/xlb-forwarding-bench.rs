//! Forwarding rate: how many packets per second reach the backends when
//! the sender costs nothing.
//!
//! The end-to-end UDP benchmark sends from sockets, and on veth the
//! sender's skb path costs more than any load balancer, so it cannot show
//! what XDP saves. Here the kernel makes the frames itself: BPF_PROG_RUN
//! with live frames runs `xlb_trafficgen` (lb-ebpf/src/bench.rs) in the
//! client namespace, and every frame it returns XDP_TX for leaves the
//! client's eth0 with no skb, each with the next source port (a new flow
//! until the ports wrap). The backends' eth0 run `xlb_sink`, which drops
//! what arrives after the interface counted it, so no receiver shares the
//! CPU with what is measured.
//!
//! Cases, interleaved in every round, for UDP and for TCP SYNs to a VIP:
//! * the limit: `xlb_redirect_only` on the LB's client-side veth redirects
//!   every frame, untouched, to a backend's veth;
//! * xlb, native XDP, nat mode, three backends;
//! * nftables DNAT as kube-proxy's nftables mode writes it, three backends.
//!
//! For each: frames generated per second and frames that reached the
//! backends' interfaces per second (their rx_packets), the ratio to
//! nftables and the fraction of the limit, medians over the rounds.
//!
//! `xlb-forwarding-bench [--rounds N] [--seconds S]` (defaults 3 and 3).

use std::{fmt::Write as _, fs, path::Path, process::ExitCode, time::Duration};

use aya::maps::Array;
use clap::Parser;
use lb_agent::netif::ifindex;
use xlb_bench::{
    args::positive,
    support::{
        attach_pinned, check_interrupt, detach_xdp, install_sigint_flag, median,
        pin_bench_programs, sh_in, thousands, Agent, Bins, PinnedPrograms, Res,
    },
};
use xlb_tests::{
    netns::Netns,
    packet::{Ipv4, PacketBuilder, Tcp, Udp},
    topology::{backend_ip, Topology, BACKEND_PORT, CLIENT_IP, VIP},
    xdp::{generate_live, LIVE_BATCH},
};

const BACKENDS: usize = 3;
const UDP_PORT: u16 = 53;
const METRICS: &str = "127.0.0.1:9479";
/// Where the benchmark pins its three programs, for `ip link set … xdp pinned`.
const PROG_DIR: &str = "/sys/fs/bpf/xlb-fwbench-progs";
/// Frames of the run that sizes the measured one.
const SIZING_FRAMES: u32 = 200_000;
const TCP_SYN: u8 = 0x02;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Case {
    Limit,
    /// Flood mode off: every new flow is written to the flow table.
    Xlb,
    /// The default `flood_threshold`: above it a CPU's new flows go
    /// untracked, as a user's xlb does under a flood.
    XlbDefault,
    Nftables,
}

impl Case {
    const ALL: [Case; 4] = [Case::Limit, Case::Xlb, Case::XlbDefault, Case::Nftables];

    fn label(self) -> &'static str {
        match self {
            Case::Limit => "limit: XDP redirect only",
            Case::Xlb => "xlb (XDP native, nat)",
            Case::XlbDefault => "xlb, default flood mode",
            Case::Nftables => "nftables DNAT (kube-proxy nftables)",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Traffic {
    Udp,
    TcpSyn,
}

impl Traffic {
    const ALL: [Traffic; 2] = [Traffic::Udp, Traffic::TcpSyn];

    fn label(self) -> &'static str {
        match self {
            Traffic::Udp => "UDP",
            Traffic::TcpSyn => "TCP SYN",
        }
    }
}

/// Forwarding rate with a sender that costs nothing (XDP live frames): the
/// bare redirect, xlb and nftables DNAT, for UDP and TCP SYNs.
#[derive(Parser, Debug)]
#[command(name = "xlb-forwarding-bench", args_override_self = true)]
struct Opts {
    /// Rounds, each running every case
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive::<usize>)]
    rounds: usize,
    /// Seconds of traffic per case and round
    #[arg(long, value_name = "S", default_value_t = 3.0, value_parser = positive::<f64>)]
    seconds: f64,
}

/// The benchmark programs, loaded from the agent's object and pinned under
/// [`PROG_DIR`] (removed on drop).
struct Programs {
    pinned: PinnedPrograms,
}

impl Programs {
    fn load() -> Res<Self> {
        let pinned = pin_bench_programs(Path::new(PROG_DIR))?;
        Ok(Self { pinned })
    }

    /// Points `xlb_redirect_only` at interface `ifindex`.
    fn redirect_to(&mut self, ifindex: u32) -> Res<()> {
        let mut to: Array<_, u32> = Array::try_from(
            self.pinned
                .ebpf
                .map_mut("REDIRECT_TO")
                .ok_or("REDIRECT_TO is not in the object")?,
        )
        .map_err(|e| e.to_string())?;
        to.set(0, ifindex, 0)
            .map_err(|e| format!("REDIRECT_TO: {e}"))
    }
}

fn attach(ns: &Netns, iface: &str, prog: &str) -> Res<()> {
    attach_pinned(ns, iface, Path::new(PROG_DIR), prog)
}

/// The MAC address of `iface` in `ns`.
fn mac_of(ns: &Netns, iface: &str) -> Res<[u8; 6]> {
    let out = sh_in(ns, &format!("ip -j link show dev {iface}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| format!("ip -j link show {iface}: {e}"))?;
    let text = v[0]["address"]
        .as_str()
        .ok_or(format!("no MAC for {iface} in {}: {out}", ns.name))?;
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for b in mac.iter_mut() {
        let h = parts.next().ok_or(format!("MAC {text}"))?;
        *b = u8::from_str_radix(h, 16).map_err(|e| format!("MAC {text}: {e}"))?;
    }
    Ok(mac)
}

fn ifindex_in(ns: &Netns, iface: &str) -> Res<u32> {
    let name = iface.to_string();
    xlb_bench::support::run_in(ns, move || ifindex(&name))?
        .ok_or(format!("no interface {iface} in {}", ns.name))
}

/// The bench's setup on top of the end-to-end topology: the backends' MACs
/// known to the LB (their sinks drop ARP), a sink on every backend, GRO on
/// the LB's client side (a veth takes XDP frames only with NAPI on).
fn prepare(t: &Topology) -> Res<()> {
    for (n, b) in t.backends.iter().enumerate() {
        let mac = mac_of(b, "eth0")?;
        let mac = mac.map(|x| format!("{x:02x}")).join(":");
        sh_in(
            &t.lb,
            &format!(
                "ip neigh replace {} lladdr {mac} dev lbb{} nud permanent",
                backend_ip(n + 1),
                n + 1
            ),
        )?;
        attach(b, "eth0", "xlb_sink")?;
    }
    sh_in(&t.lb, "ethtool -K lbc gro on >/dev/null").map(drop)
}

fn frame(t: &Topology, traffic: Traffic) -> Res<Vec<u8>> {
    let ip = Ipv4::new(CLIENT_IP, VIP);
    let b = PacketBuilder::new()
        .eth(mac_of(&t.client, "eth0")?, mac_of(&t.lb, "lbc")?)
        .ipv4(ip);
    Ok(match traffic {
        Traffic::Udp => b.udp(Udp::new(1024, UDP_PORT).payload(&[0x5a; 18])).build(),
        Traffic::TcpSyn => b
            .tcp(Tcp::new(1024, 80).seq(1).flags(TCP_SYN).window(64240))
            .build(),
    })
}

/// Sends `frames` generated frames out of the client's eth0; how long it took.
fn generate(p: &mut Programs, t: &Topology, frame: &[u8], frames: u32) -> Res<Duration> {
    let eth0 = ifindex_in(&t.client, "eth0")?;
    let ebpf = &mut p.pinned.ebpf;
    std::thread::scope(|s| {
        s.spawn(|| {
            Netns::enter_by_name(&t.client.name);
            generate_live(ebpf, eth0, frame, frames)
        })
        .join()
        .map_err(|_| "the generator thread panicked".to_string())?
    })
}

/// Packets the backends' interfaces received, all together.
fn backend_rx(t: &Topology) -> Res<u64> {
    let mut sum = 0;
    for b in &t.backends {
        let out = sh_in(b, "ip -s -j link show dev eth0")?;
        let v: serde_json::Value =
            serde_json::from_str(&out).map_err(|e| format!("ip -s -j link: {e}"))?;
        sum += v[0]["stats64"]["rx"]["packets"]
            .as_u64()
            .ok_or(format!("no rx packets in {out}"))?;
    }
    Ok(sum)
}

/// With `flood_mode` false, flood mode is off: every SYN is written to the
/// flow table, the worst case and the figure earlier runs measured. With
/// it, the default threshold (no `flood_threshold` key).
fn xlb_config(flood_mode: bool) -> String {
    let mut s = format!(
        "interfaces: [lbc, lbb1, lbb2, lbb3]\nxdp_mode: native\nmetrics_addr: {METRICS}\n{}services:\n",
        if flood_mode { "" } else { "flood_threshold: 0\n" }
    );
    for (name, port, proto) in [("web", 80, "tcp"), ("dns", UDP_PORT, "udp")] {
        let _ = writeln!(
            s,
            "  - name: {name}\n    vip: {VIP}\n    port: {port}\n    protocol: {proto}\n    mode: nat\n    backends:"
        );
        for n in 1..=BACKENDS {
            let _ = writeln!(
                s,
                "      - {{ ip: {}, port: {BACKEND_PORT} }}",
                backend_ip(n)
            );
        }
    }
    s
}

/// kube-proxy's nftables mode in one rule per service: `numgen random`
/// into a map of endpoints.
fn nft_rules() -> String {
    let map = (1..=BACKENDS)
        .map(|n| format!("{} : {} . {BACKEND_PORT}", n - 1, backend_ip(n)))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "table ip xlb_fwbench {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n\
         \x20   ip daddr {VIP} tcp dport 80 dnat to numgen random mod {BACKENDS} map {{ {map} }}\n\
         \x20   ip daddr {VIP} udp dport {UDP_PORT} dnat to numgen random mod {BACKENDS} map {{ {map} }}\n  }}\n}}\n"
    )
}

/// What runs for a case until it is torn down.
enum Running {
    Limit,
    Xlb(Agent),
    Nftables,
}

fn start(p: &mut Programs, t: &Topology, bins: &Bins, case: Case) -> Res<Running> {
    Ok(match case {
        Case::Limit => {
            p.redirect_to(ifindex_in(&t.lb, "lbb1")?)?;
            attach(&t.lb, "lbc", "xlb_redirect_only")?;
            Running::Limit
        }
        Case::Xlb | Case::XlbDefault => {
            let cfg = t.dir.join("xlb.yaml");
            fs::write(&cfg, xlb_config(case == Case::XlbDefault))
                .map_err(|e| format!("{}: {e}", cfg.display()))?;
            let mut agent = Agent::spawn(
                bins,
                &t.lb,
                &cfg,
                &t.pin_dir,
                METRICS.parse().unwrap(),
                &t.dir.join("lb-agent.log"),
            )?;
            agent.wait_ready(Duration::from_secs(30))?;
            Running::Xlb(agent)
        }
        Case::Nftables => {
            let f = t.dir.join("xlb_fwbench.nft");
            fs::write(&f, nft_rules()).map_err(|e| format!("{}: {e}", f.display()))?;
            sh_in(&t.lb, &format!("nft -f {}", f.display()))?;
            Running::Nftables
        }
    })
}

fn stop(t: &Topology, running: Running) -> Res<()> {
    match running {
        Running::Limit => detach_xdp(&t.lb, "lbc"),
        Running::Xlb(mut agent) => agent.stop(),
        Running::Nftables => {
            sh_in(&t.lb, "nft delete table ip xlb_fwbench")?;
            // New flows must not find the old entries' translations.
            sh_in(&t.lb, "conntrack -F 2>/dev/null || true").map(drop)
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Rate {
    generated_pps: f64,
    forwarded_pps: f64,
}

/// One case, one traffic kind: a short run that proves the path and sizes
/// the measured run, then the measured run of about `seconds`.
fn measure(p: &mut Programs, t: &Topology, traffic: Traffic, seconds: f64) -> Res<Rate> {
    let frame = frame(t, traffic)?;
    let rx0 = backend_rx(t)?;
    let took = generate(p, t, &frame, SIZING_FRAMES)?;
    let arrived = backend_rx(t)? - rx0;
    if arrived == 0 {
        return Err(format!(
            "none of {SIZING_FRAMES} generated frames reached a backend"
        ));
    }
    let frames = (SIZING_FRAMES as f64 * seconds / took.as_secs_f64()).clamp(1e5, 4e9) as u32;
    check_interrupt()?;
    let rx0 = backend_rx(t)?;
    let took = generate(p, t, &frame, frames)?;
    let arrived = backend_rx(t)? - rx0;
    Ok(Rate {
        generated_pps: frames as f64 / took.as_secs_f64(),
        forwarded_pps: arrived as f64 / took.as_secs_f64(),
    })
}

fn run_case(
    p: &mut Programs,
    t: &Topology,
    bins: &Bins,
    case: Case,
    traffic: Traffic,
    seconds: f64,
) -> Res<Rate> {
    let running = start(p, t, bins, case)?;
    let rate = measure(p, t, traffic, seconds);
    let stopped = stop(t, running);
    let rate = rate?;
    stopped?;
    Ok(rate)
}

/// Results per traffic kind and case, one entry per round.
type Results = Vec<(Traffic, Case, Vec<Rate>)>;

fn rounds(o: &Opts, t: &Topology, bins: &Bins, p: &mut Programs) -> Res<Results> {
    let mut results: Results = Traffic::ALL
        .iter()
        .flat_map(|&tr| Case::ALL.iter().map(move |&c| (tr, c, Vec::new())))
        .collect();
    for round in 1..=o.rounds {
        for (traffic, case, rates) in results.iter_mut() {
            check_interrupt()?;
            let r = run_case(p, t, bins, *case, *traffic, o.seconds)
                .map_err(|e| format!("{} {}: {e}", traffic.label(), case.label()))?;
            eprintln!(
                "round {round}: {:<8} {:<38} generated {:>6.2} Mpps, forwarded {:>6.2} Mpps",
                traffic.label(),
                case.label(),
                r.generated_pps / 1e6,
                r.forwarded_pps / 1e6
            );
            rates.push(r);
        }
    }
    Ok(results)
}

fn median_of(rates: &[Rate], f: impl Fn(&Rate) -> f64) -> f64 {
    median(&rates.iter().map(f).collect::<Vec<_>>())
}

/// One traffic kind's rounds of one case.
fn rates_of(results: &Results, traffic: Traffic, case: Case) -> &[Rate] {
    results
        .iter()
        .find(|(tr, c, _)| *tr == traffic && *c == case)
        .map(|(_, _, r)| r.as_slice())
        .unwrap_or(&[])
}

/// The median over rounds of `a`'s forwarded rate over `b`'s, each ratio
/// taken within one round (the machine's speed drifts between rounds).
fn ratio(a: &[Rate], b: &[Rate]) -> f64 {
    let per_round: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.forwarded_pps / y.forwarded_pps)
        .collect();
    median(&per_round)
}

/// The table: medians over rounds.
fn table(results: &Results, o: &Opts) -> String {
    let mut md = format!(
        "Forwarding rate, {} rounds of ~{} s per case, interleaved; one generator \
         thread (BPF_PROG_RUN, live frames, batches of {LIVE_BATCH}); medians.\n\n\
         | traffic | case | generated | forwarded to backends | vs nftables | of the limit |\n\
         |---|---|---:|---:|---:|---:|\n",
        o.rounds, o.seconds
    );
    for traffic in Traffic::ALL {
        let nft = rates_of(results, traffic, Case::Nftables);
        let limit = rates_of(results, traffic, Case::Limit);
        for case in Case::ALL {
            let r = rates_of(results, traffic, case);
            let _ = writeln!(
                md,
                "| {} | {} | {} pps | {} pps | {:.2}x | {:.0}% |",
                traffic.label(),
                case.label(),
                thousands(median_of(r, |x| x.generated_pps) as u64),
                thousands(median_of(r, |x| x.forwarded_pps) as u64),
                ratio(r, nft),
                ratio(r, limit) * 100.0
            );
        }
    }
    md
}

fn run(o: &Opts) -> Res<()> {
    let bins = Bins::locate()?;
    let mut programs = Programs::load()?;
    let t = Topology::new("fw", BACKENDS);
    prepare(&t)?;
    let results = rounds(o, &t, &bins, &mut programs)?;
    println!("\n{}", table(&results, o));
    let summary: Vec<String> = Traffic::ALL
        .iter()
        .map(|&traffic| {
            let xlb = rates_of(&results, traffic, Case::Xlb);
            format!(
                "{} {:.2}x nftables, {:.0}% of the limit",
                traffic.label(),
                ratio(xlb, rates_of(&results, traffic, Case::Nftables)),
                ratio(xlb, rates_of(&results, traffic, Case::Limit)) * 100.0
            )
        })
        .collect();
    println!("{}", where_the_time_goes(&results));
    println!("forwarding: xlb {}", summary.join("; "));
    Ok(())
}

/// The goals (3x nftables; 70 % of the limit for UDP, 50 % for SYNs, which
/// each make a flow) against the figures, and
/// what one frame's whole path costs on the generator's core in each case:
/// what xlb adds to the limit is its program, which `xlb-bench` breaks down.
fn where_the_time_goes(results: &Results) -> String {
    let mut out = String::from(
        "\nGoals and where the time goes (one frame's whole path on one core, medians):\n",
    );
    for traffic in Traffic::ALL {
        let ns = |case| 1e9 / median_of(rates_of(results, traffic, case), |x| x.forwarded_pps);
        let xlb = rates_of(results, traffic, Case::Xlb);
        let vs_nft = ratio(xlb, rates_of(results, traffic, Case::Nftables));
        let of_limit = ratio(xlb, rates_of(results, traffic, Case::Limit));
        let verdict = |met: bool| if met { "met" } else { "not met" };
        let goal = match traffic {
            Traffic::Udp => 0.7,
            Traffic::TcpSyn => 0.5,
        };
        let (limit, with_xlb) = (ns(Case::Limit), ns(Case::Xlb));
        let _ = writeln!(
            out,
            "- {}: {vs_nft:.2}x nftables (goal 3x: {}), {:.0}% of the limit (goal {:.0}%: {}). \
             A frame takes {limit:.0} ns at the limit, {with_xlb:.0} ns through xlb, {:.0} ns \
             through nftables: xlb adds {:.0} ns; {:.0}% of the limit allows {:.0}.",
            traffic.label(),
            verdict(vs_nft >= 3.0),
            of_limit * 100.0,
            goal * 100.0,
            verdict(of_limit >= goal),
            ns(Case::Nftables),
            with_xlb - limit,
            goal * 100.0,
            limit / goal - limit,
        );
        let default = ratio(
            rates_of(results, traffic, Case::XlbDefault),
            rates_of(results, traffic, Case::Limit),
        );
        let _ = writeln!(
            out,
            "  With the default flood_threshold (a CPU's new flows above 125,000 a second go \
             untracked): {:.0}% of the limit (goal {:.0}%: {}); xlb adds {:.0} ns.",
            default * 100.0,
            goal * 100.0,
            verdict(default >= goal),
            ns(Case::XlbDefault) - limit,
        );
    }
    let _ = writeln!(
        out,
        "- IPVS beside nftables: not measured ({}).",
        xlb_bench::support::ipvs_not_measured()
    );
    out
}

fn main() -> ExitCode {
    install_sigint_flag();
    let o = Opts::parse();
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xlb-forwarding-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Opts;

    #[test]
    fn documented_invocations_parse() {
        Opts::command().debug_assert();
        let o = Opts::try_parse_from(["xlb-forwarding-bench"]).unwrap();
        assert_eq!((o.rounds, o.seconds), (3, 3.0));
        let o = Opts::try_parse_from(["xlb-forwarding-bench", "--rounds", "5", "--seconds", "1.5"])
            .unwrap();
        assert_eq!((o.rounds, o.seconds), (5, 1.5));
        Opts::try_parse_from(["xlb-forwarding-bench", "--seconds", "0"]).unwrap_err();
        Opts::try_parse_from(["xlb-forwarding-bench", "--rounds", "0"]).unwrap_err();
    }
}
