//! `cargo xtask bench` (locality): what keeping traffic on the node buys
//! (`trafficDistribution: PreferSameNode`). The end-to-end topology with two
//! "nodes": the LB node (this agent, XDP) with a Pod attached to it, and a
//! second node, a router namespace, with a Pod behind it. One VIP goes to
//! the local Pod, another to the remote one; `wrk` runs against each in
//! interleaved rounds, so that machine noise hits both alike.
//!
//! Usage: xlb-locality-bench [--rounds N] [--duration SECS] [--connections N]

use std::{net::SocketAddr, process::ExitCode};

use clap::Parser;
use xlb_bench::{
    args::positive,
    support::{self, median, parse_wrk, Wrk, REMOTE_POD},
};
use xlb_tests::{
    netns::Netns,
    topology::{nginx_config, wait_for_port, Topology, BACKEND_PORT},
};

const LOCAL_VIP: &str = "192.0.2.10";
const REMOTE_VIP: &str = "192.0.2.11";
const LOCAL_POD: &str = "10.2.1.2";

/// What keeping traffic on the node buys: wrk against a VIP whose Pod is
/// local and one whose Pod is behind a second node, in interleaved rounds.
#[derive(Parser, Debug)]
#[command(name = "xlb-locality-bench", args_override_self = true)]
struct Opts {
    /// Interleaved rounds (one wrk run per VIP each)
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = positive::<usize>)]
    rounds: usize,
    /// wrk duration per run, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 5, value_parser = positive::<u32>)]
    duration: u32,
    /// wrk connections
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive::<u32>)]
    connections: u32,
}

/// The second node (`n2`, a router) and its Pod (`p2`, nginx), reached
/// from the LB node over `lbn2`.
fn add_remote_node(t: &mut Topology) -> (Netns, Netns) {
    let (n2, pod) = support::add_remote_node(t, "loc");
    let dir = t.dir.join("nginx-remote");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("nginx.conf"), nginx_config(&dir, 9)).unwrap();
    let nginx = t.spawn_in(
        &pod,
        "nginx",
        &["-c", &dir.join("nginx.conf").to_string_lossy()],
    );
    t.adopt_child(nginx);
    wait_for_port(&pod, SocketAddr::new(REMOTE_POD.into(), BACKEND_PORT));
    (n2, pod)
}

fn wrk(t: &Topology, vip: &str, o: &Opts) -> Result<Wrk, String> {
    let out = t.output_in(
        &t.client,
        "wrk",
        &[
            "-t2",
            &format!("-c{}", o.connections),
            &format!("-d{}s", o.duration),
            "--latency",
            &format!("http://{vip}/"),
        ],
    );
    if !out.status.success() {
        return Err(format!(
            "wrk failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let w = parse_wrk(&String::from_utf8_lossy(&out.stdout))?;
    if w.errors > 0 || w.requests == 0 {
        return Err(format!(
            "wrk to {vip}: {} errors, {} requests",
            w.errors, w.requests
        ));
    }
    Ok(w)
}

fn run(o: &Opts) -> Result<(), String> {
    let mut t = Topology::new("loc", 1);
    // Kept to the end: dropping them deletes the second node.
    let _remote = add_remote_node(&mut t);
    let service = |name: &str, vip: &str, pod: &str| {
        format!(
            "  - name: {name}\n    vip: {vip}\n    port: 80\n    backends:\n      - {{ ip: {pod}, port: {BACKEND_PORT} }}\n"
        )
    };
    let config = format!(
        "interfaces: [lbc, lbb1, lbn2]\nservices:\n{}{}",
        service("local", LOCAL_VIP, LOCAL_POD),
        service("remote", REMOTE_VIP, &REMOTE_POD.to_string())
    );
    let _agent = t.start_agent(&config);
    for vip in [LOCAL_VIP, REMOTE_VIP] {
        let probe = Opts {
            rounds: 1,
            duration: 1,
            connections: 2,
        };
        wrk(&t, vip, &probe).map_err(|e| format!("{vip} does not answer: {e}"))?;
    }
    let mut local = Vec::new();
    let mut remote = Vec::new();
    for round in 0..o.rounds {
        // Alternate which goes first: neither always gets the warmer machine.
        let order = if round % 2 == 0 {
            [(LOCAL_VIP, true), (REMOTE_VIP, false)]
        } else {
            [(REMOTE_VIP, false), (LOCAL_VIP, true)]
        };
        for (vip, is_local) in order {
            let w = wrk(&t, vip, o)?;
            eprintln!(
                "round {}: {} {:.0} requests/s, p99 {:.2} ms",
                round + 1,
                if is_local { "local " } else { "remote" },
                w.rps,
                w.p99_ms
            );
            if is_local { &mut local } else { &mut remote }.push(w);
        }
    }
    let med = |v: &[Wrk], f: fn(&Wrk) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    let (l_rps, r_rps) = (med(&local, |w| w.rps), med(&remote, |w| w.rps));
    println!(
        "Locality: `wrk -t2 -c{} -d{}s --latency`, {} interleaved rounds, medians\n",
        o.connections, o.duration, o.rounds
    );
    println!("| endpoint | requests/s | p50 ms | p99 ms | requests/s vs local |");
    println!("|---|---:|---:|---:|---:|");
    for (name, runs, rps) in [
        ("local (this node)", &local, l_rps),
        ("remote (one more node)", &remote, r_rps),
    ] {
        println!(
            "| {name} | {rps:.0} | {:.2} | {:.2} | {:.2}x |",
            med(runs, |w| w.p50_ms),
            med(runs, |w| w.p99_ms),
            rps / l_rps
        );
    }
    println!(
        "\nlocality: remote endpoints served {:.0}% of the local requests/s",
        100.0 * r_rps / l_rps
    );
    Ok(())
}

fn main() -> ExitCode {
    let o = Opts::parse();
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xlb-locality-bench: {e}");
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
        let o = Opts::try_parse_from(["xlb-locality-bench"]).unwrap();
        assert_eq!((o.rounds, o.duration, o.connections), (5, 5, 32));
        // docs/benchmarks.md
        let o = Opts::try_parse_from(["xlb-locality-bench", "--rounds", "5", "--duration", "5"])
            .unwrap();
        assert_eq!((o.rounds, o.duration), (5, 5));
        let o = Opts::try_parse_from(["xlb-locality-bench", "--connections", "8"]).unwrap();
        assert_eq!(o.connections, 8);
        Opts::try_parse_from(["xlb-locality-bench", "--rounds", "0"]).unwrap_err();
    }
}
