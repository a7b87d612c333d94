use anyhow::Result;

use crate::{
    demo::{build_agent, wait_through_ctrl_c},
    util::{cargo, run as run_cmd},
};

/// Release builds, because debug numbers would say nothing about the load
/// balancer. First the per-packet benchmark (`xlb-bench`, BPF_PROG_TEST_RUN),
/// then the end-to-end one (`xlb-e2e-bench`: wrk and UDP through xlb,
/// iptables, nftables, nginx and HAProxy; the agent's memory and reload
/// time), the forwarding rate (`xlb-forwarding-bench`), the Kubernetes,
/// locality, pod-side interface and BGP convergence benchmarks. Arguments go to both (`xlb-bench` takes none and ignores them);
/// `--e2e-only` / `--per-packet-only` run just one of them;
/// `load-aware [ARGS]` (after `xlb-dispatch-model`), `l2 [ARGS]`,
/// `rollout [ARGS]`, `podnet [ARGS]`, `latency [ARGS]` and `chaos [ARGS]` run only that
/// benchmark (the chaos run only so: it takes about 10 minutes).
pub fn run(args: &[String]) -> Result<()> {
    let only = [
        ("load-aware", "xlb-load-aware-bench"),
        ("l2", "xlb-l2-bench"),
        ("rollout", "xlb-rollout-bench"),
        ("podnet", "xlb-podnet-bench"),
        ("chaos", "xlb-chaos-bench"),
        ("latency", "xlb-latency-bench"),
    ];
    if let Some((_, bin)) = only
        .iter()
        .find(|(name, _)| args.first() == Some(&name.to_string()))
    {
        wait_through_ctrl_c();
        build_agent()?;
        if *bin == "xlb-load-aware-bench" {
            run_bench("xlb-dispatch-model", &[])?;
        }
        let rest: Vec<&String> = args[1..].iter().collect();
        return run_bench(bin, &rest);
    }
    if args.first().map(String::as_str) == Some("katran") {
        return katran(&args[1..]);
    }
    let e2e_only = args.iter().any(|a| a == "--e2e-only");
    let per_packet_only = args.iter().any(|a| a == "--per-packet-only");
    let args: Vec<&String> = args
        .iter()
        .filter(|a| *a != "--e2e-only" && *a != "--per-packet-only")
        .collect();
    wait_through_ctrl_c();
    if !e2e_only {
        run_bench("xlb-bench", &args)?;
    }
    if per_packet_only {
        return Ok(());
    }
    build_agent()?;
    run_bench("xlb-e2e-bench", &args)?;
    // Packets per second with a sender that costs nothing (XDP live frames):
    // xlb, nftables DNAT and the bare redirect limit.
    run_bench("xlb-forwarding-bench", &[])?;
    // Pod readiness -> EndpointSlice -> data plane, and 1,000 Services'
    // memory, on the real control plane.
    run_bench("xlb-k8s-bench", &[])?;
    // What keeping traffic on the node buys (trafficDistribution).
    run_bench("xlb-locality-bench", &[])?;
    // What the program on a pod-side interface (generic XDP on cni0) costs
    // a Pod's own egress (16 iperf3 runs of 4 s).
    run_bench("xlb-podnet-bench", &[])?;
    // Latency at 30/50/70 % of the maximum request rate (open loop) through
    // xlb, nftables and no balancer; iperf3 throughput through xlb nat and
    // snat to a Pod on the balancer's node and on another.
    run_bench("xlb-latency-bench", &[])?;
    // Load-aware against static weights, the seed paper's patterns, after
    // the model of its dispatch policies.
    run_bench("xlb-dispatch-model", &[])?;
    run_bench("xlb-load-aware-bench", &[])?;
    // L2 mode: how long traffic stops when a VIP's owner goes away.
    run_bench("xlb-l2-bench", &[])?;
    // BGP convergence in the ECMP lab (defaults only).
    run_bench("xlb-convergence-bench", &[])?;
    // Connections lost when a node restarts, leaves or joins.
    run_bench("xlb-rollout-bench", &[])
}

/// Katran's XDP balancer and xlb's program side by side per packet
/// (tests/katran-bench): built from Katran's source (`KATRAN_SRC`, default
/// /tmp/katran, or unpacked from the git dir `KATRAN_GIT`), which no
/// package registry serves, so this is not part of the default run. Katran
/// gets per-CPU LRUs as deployed, each the size of one CPU's share of
/// xlb's flow table; `ARGS` go to kbench after that.
fn katran(args: &[String]) -> Result<()> {
    let source = std::env::var("KATRAN_SRC").unwrap_or_else(|_| "/tmp/katran".into());
    let source_there = std::path::Path::new(&source)
        .join("katran/lib/bpf/balancer.bpf.c")
        .exists();
    anyhow::ensure!(
        source_there || std::env::var_os("KATRAN_GIT").is_some(),
        "no Katran source in {source}: clone https://github.com/facebookincubator/katran \
         there (commit 19f08fec), or set KATRAN_GIT to a git dir holding it \
         (tests/katran-bench/README.md)"
    );
    let dir = crate::util::repo_root().join("tests/katran-bench");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let per_cpu = (lb_flows_entries()? / cpus).to_string();
    run_cmd(
        std::process::Command::new("bash")
            .arg(dir.join("build.sh"))
            .env("XLB", crate::util::repo_root()),
    )?;
    run_cmd(
        std::process::Command::new("bash")
            .arg(dir.join("run.sh"))
            .args(["--katran-lru", &per_cpu])
            .args(args)
            .env("XLB", crate::util::repo_root()),
    )
}

/// xlb's flow table size (lb-common's `FLOWS_ENTRIES`), read from its
/// source: xtask does not link the workspace's crates.
fn lb_flows_entries() -> Result<u32> {
    let path = crate::util::repo_root().join("lb-common/src/lib.rs");
    let src = std::fs::read_to_string(&path)?;
    src.lines()
        .find_map(|l| l.strip_prefix("pub const FLOWS_ENTRIES: u32 = 1 << "))
        .and_then(|rest| rest.trim_end_matches(';').parse::<u32>().ok())
        .map(|shift| 1 << shift)
        .ok_or_else(|| anyhow::anyhow!("no `FLOWS_ENTRIES: u32 = 1 << N` in {}", path.display()))
}

/// `cargo run --release -p xlb-bench --bin BIN -- ARGS`.
fn run_bench(bin: &str, args: &[&String]) -> Result<()> {
    run_cmd(
        cargo()
            .args(["run", "--release", "-p", "xlb-bench", "--bin", bin, "--"])
            .args(args),
    )
}
