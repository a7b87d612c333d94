use anyhow::{Context, Result};

use crate::util::{cargo, repo_root, run as run_cmd};

/// fmt, clippy, the Helm chart, the images, tests: cheapest first,
/// stopping at the first failure.
pub fn run(extra: &[String]) -> Result<()> {
    run_cmd(cargo().args(["fmt", "--all", "--check"])).context("step `fmt` failed")?;

    run_cmd(cargo().args([
        "clippy",
        "--workspace",
        "--exclude",
        "lb-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))
    .context("step `clippy` failed")?;
    clippy_ebpf()?;

    // The real-node tests import the images into their nodes' containerd.
    crate::chart::run().context("step `chart-check` failed")?;
    crate::image::run().context("step `image` failed")?;

    let mut test = cargo();
    // lb-ebpf builds only for the BPF target; lb-agent's build.rs builds it.
    test.args(["test", "--workspace", "--exclude", "lb-ebpf"])
        .args(extra);
    // The tests set up namespaces and BPF state and manage their own concurrency.
    test.env_remove("RUST_TEST_THREADS");
    run_cmd(&mut test).context("step `test` failed")?;

    println!("all checks passed");
    Ok(())
}

/// The generated-input tests, long, in release mode: the agent's
/// (`generated_*`, `cases` inputs each) and the XDP program's (50 frames a
/// case: 5 million by default).
pub fn fuzz(cases: u32) -> Result<()> {
    let mut agent = cargo();
    agent
        .args(["test", "--release", "-p", "lb-agent", "--lib", "generated_"])
        .env("PROPTEST_CASES", cases.to_string());
    run_cmd(&mut agent).context("the agent's generated-input tests failed")?;
    let mut xdp = cargo();
    xdp.args([
        "test",
        "--release",
        "-p",
        "xlb-tests",
        "--test",
        "xdp_generated_needs_root",
        "--",
        "--nocapture",
    ])
    .env("XLB_XDP_FRAMES", (u64::from(cases) * 50).to_string());
    run_cmd(&mut xdp).context("the XDP program's generated frames broke an invariant")
}

/// The eBPF crate only builds for bpfel with nightly, so the workspace clippy skips it.
pub fn clippy_ebpf() -> Result<()> {
    let mut cmd = cargo();
    cmd.current_dir(repo_root().join("lb-ebpf")).args([
        "+nightly",
        "clippy",
        "-p",
        "lb-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ]);
    run_cmd(&mut cmd).context("step `clippy-ebpf` failed")
}
