//! `cargo xtask bench podnet` (also part of `cargo xtask bench`): what the
//! program on a pod-side interface (generic XDP on the bridge `cni0`)
//! costs a Pod's own egress, traffic it does not translate. In the lab of
//! `xlb_tests::podnet_lab` (Pods behind `cni0` on node 1, a router, a
//! client), iperf3 runs from Pod 1 to the client, through the bridge,
//! node 1's stack, its uplink and the router: a TCP stream, and 64-byte
//! UDP datagrams as fast as one stream sends them. Each round measures
//! both cases with the program on `cni0` (the agent with `pod_interfaces:
//! auto`) and without (`pod_interfaces: none`, reloaded), which of the two
//! first alternating from round to round, so that machine noise hits both
//! alike. Pod 1's veth keeps its offloads (TSO, TX checksum), as a
//! container runtime leaves them.
//!
//! Prints a table (medians without and with, their ratio, every run) and
//! the line `podnet: Pod egress with the program on cni0: TCP X.XXx,
//! UDP 64 B Y.YYx of without`.

use std::{
    process::{Child, Command, ExitCode, Stdio},
    time::Duration,
};

use clap::Parser;
use xlb_bench::{
    args::positive,
    support::{install_sigint_flag, interrupted},
};
use xlb_tests::{
    podnet_lab::{config, PodLab, ATTACHED, CLIENT, DETACHED},
    topology::AgentHandle,
    traffic::poll_until,
};

/// What the program on a pod-side interface (generic XDP on cni0) costs a
/// Pod's own egress: iperf3 from a Pod with and without it.
#[derive(Parser, Debug)]
#[command(name = "xlb-podnet-bench", args_override_self = true)]
struct Opts {
    /// Rounds, each with and without the program
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = positive::<usize>)]
    rounds: usize,
    /// Seconds per iperf3 run
    #[arg(long, value_name = "SECS", default_value_t = 4, value_parser = positive::<u32>)]
    duration: u32,
}

/// One measured case: its row name, iperf3's extra arguments, and the
/// unit its figure is scaled to.
struct Case {
    name: &'static str,
    args: &'static [&'static str],
    udp: bool,
}

const CASES: [Case; 2] = [
    Case {
        name: "TCP stream (Gbit/s)",
        args: &[],
        udp: false,
    },
    Case {
        name: "UDP 64 B, 1 stream (kpps)",
        args: &["-u", "-b", "0", "-l", "64"],
        udp: true,
    },
];

/// The iperf3 server in the client namespace; killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One iperf3 run from namespace `pod` to the client: Gbit/s received
/// (TCP) or thousands of datagrams per second sent (UDP). Retried for up
/// to 30 s while the server is not up yet.
fn iperf(pod: &str, duration: u32, case: &Case) -> Result<f64, String> {
    let secs = duration.to_string();
    let client = CLIENT.to_string();
    poll_until(Duration::from_secs(30), Duration::from_millis(200), || {
        let out = Command::new("ip")
            .args(["netns", "exec", pod, "iperf3", "-c", &client, "-t", &secs])
            .arg("-J")
            .args(case.args)
            .output()
            .map_err(|e| format!("running iperf3: {e}"))?;
        let v = xlb_bench::support::iperf3_json(&out)?;
        let end = &v["end"];
        let figure = if case.udp {
            end["sum"]["packets"]
                .as_f64()
                .zip(end["sum"]["seconds"].as_f64())
                .map(|(p, s)| p / s / 1e3)
        } else {
            end["sum_received"]["bits_per_second"]
                .as_f64()
                .map(|b| b / 1e9)
        };
        figure.ok_or_else(|| format!("iperf3's output has no result: {}", end))
    })
}

/// The median of `v` (the mean of the middle two for even lengths).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Puts the program on cni0 (`with`) or takes it off, by rewriting the
/// agent's config, and waits for the agent to say it did.
fn switch(agent: &AgentHandle, with: bool, counts: &mut (usize, usize)) {
    let on = config(1);
    if with {
        agent.write_config(&on);
        counts.0 += 1;
        agent.wait_for_log(ATTACHED, counts.0, Duration::from_secs(5));
    } else {
        agent.write_config(&on.replace("pod_interfaces: auto", "pod_interfaces: none"));
        counts.1 += 1;
        agent.wait_for_log(DETACHED, counts.1, Duration::from_secs(5));
    }
}

/// Per case, the runs with the program and without.
type Runs = Vec<(Vec<f64>, Vec<f64>)>;

fn run(o: &Opts) -> Result<Runs, String> {
    let mut lab = PodLab::new("pnb");
    lab.bridge(1, "cni0", &[1, 2]);
    let agent = lab.start_agent(1, &config(1));
    // (attached, detached) so far, as the agent's log counts them.
    let mut counts = (1, 0);
    agent.wait_for_log(ATTACHED, counts.0, Duration::from_secs(5));
    let _server = Server(
        Command::new("ip")
            .args(["netns", "exec", &lab.client.name, "iperf3", "-s", "-B"])
            .arg(CLIENT.to_string())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting the iperf3 server: {e}"))?,
    );
    let pod = lab.pods[0].name.clone();
    let mut runs: Runs = CASES.iter().map(|_| (Vec::new(), Vec::new())).collect();
    let mut is_on = true;
    for round in 0..o.rounds {
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for with in order {
            if with != is_on {
                switch(&agent, with, &mut counts);
                is_on = with;
            }
            for (case, (w, wo)) in CASES.iter().zip(runs.iter_mut()) {
                if interrupted() {
                    return Err("interrupted (Ctrl-C)".into());
                }
                let v = iperf(&pod, o.duration, case)?;
                eprintln!(
                    "round {}, {}: {} {v:.2}",
                    round + 1,
                    if with { "with   " } else { "without" },
                    case.name
                );
                if with { w } else { wo }.push(v);
            }
        }
    }
    Ok(runs)
}

fn main() -> ExitCode {
    let o = Opts::parse();
    install_sigint_flag();
    let runs = match run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("xlb-podnet-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "Pod egress, Pod 1 to the client through cni0, node 1 and its uplink: \
         `iperf3 -c {CLIENT} -t {d}` (TCP) and `iperf3 -c {CLIENT} -t {d} -u -b 0 -l 64` (UDP), \
         {r} rounds alternating the program on cni0 (pod_interfaces: auto) and off (none), medians \
         (`xlb-podnet-bench --rounds {r} --duration {d}`)\n",
        d = o.duration,
        r = o.rounds
    );
    println!("| Pod egress | without the program on cni0 | with it (generic) | ratio | runs (with / without) |");
    println!("|---|---:|---:|---:|---|");
    let mut ratios = Vec::new();
    for (case, (with, without)) in CASES.iter().zip(&runs) {
        let list = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (w, wo) = (median(with), median(without));
        println!(
            "| {} | {wo:.2} | {w:.2} | {:.2} | {} / {} |",
            case.name,
            w / wo,
            list(with),
            list(without)
        );
        ratios.push(w / wo);
    }
    println!(
        "\npodnet: Pod egress with the program on cni0: TCP {:.2}x, UDP 64 B {:.2}x of without",
        ratios[0], ratios[1]
    );
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Opts;

    #[test]
    fn documented_invocations_parse() {
        Opts::command().debug_assert();
        let o = Opts::try_parse_from(["xlb-podnet-bench"]).unwrap();
        assert_eq!((o.rounds, o.duration), (4, 4));
        // docs/benchmarks.md
        let o =
            Opts::try_parse_from(["xlb-podnet-bench", "--rounds", "2", "--duration", "3"]).unwrap();
        assert_eq!((o.rounds, o.duration), (2, 3));
        Opts::try_parse_from(["xlb-podnet-bench", "--duration", "0"]).unwrap_err();
    }
}
