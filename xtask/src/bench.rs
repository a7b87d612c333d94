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
/// `rollout [ARGS]`, `podnet [ARGS]` and `chaos [ARGS]` run only that
/// benchmark (the chaos run only so: it takes about 10 minutes).
pub fn run(args: &[String]) -> Result<()> {
    let only = [
        ("load-aware", "xlb-load-aware-bench"),
        ("l2", "xlb-l2-bench"),
        ("rollout", "xlb-rollout-bench"),
        ("podnet", "xlb-podnet-bench"),
        ("chaos", "xlb-chaos-bench"),
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

/// `cargo run --release -p xlb-bench --bin BIN -- ARGS`.
fn run_bench(bin: &str, args: &[&String]) -> Result<()> {
    run_cmd(
        cargo()
            .args(["run", "--release", "-p", "xlb-bench", "--bin", bin, "--"])
            .args(args),
    )
}
