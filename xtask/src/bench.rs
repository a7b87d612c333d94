use anyhow::Result;

use crate::util::{cargo, run as run_cmd};

/// Release build, because debug numbers would say nothing about the load balancer.
pub fn run(args: &[String]) -> Result<()> {
    run_cmd(
        cargo()
            .args([
                "run",
                "--release",
                "-p",
                "xlb-tests",
                "--bin",
                "xlb-bench",
                "--",
            ])
            .args(args),
    )
}
