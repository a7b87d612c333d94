use anyhow::Result;

use crate::util::{cargo, run as run_cmd};

/// Builds lb-agent and lbctl (the demo runs them as processes), then the demo
/// itself: namespaces, 3 nginx backends, lb-agent, traffic, lbctl, teardown.
pub fn run() -> Result<()> {
    build_agent()?;
    wait_through_ctrl_c();
    run_cmd(cargo().args(["run", "--release", "-p", "xlb-bench", "--bin", "xlb-demo"]))
}

/// Release builds of lb-agent and lbctl, which the demo and the end-to-end
/// benchmark find next to themselves in target/release/.
pub fn build_agent() -> Result<()> {
    run_cmd(cargo().args(["build", "--release", "-p", "lb-agent", "--bins"]))
}

extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
}

extern "C" fn on_sigint(_: i32) {}

/// Ctrl-C reaches the whole foreground process group. The child tears its
/// namespaces down on Ctrl-C; xtask must outlive it rather than return the
/// prompt in the middle of that. A handler (unlike SIG_IGN) is reset at
/// exec, so children still see the signal.
pub fn wait_through_ctrl_c() {
    const SIGINT: i32 = 2;
    let handler: extern "C" fn(i32) = on_sigint;
    // SAFETY: the handler does nothing, which is async-signal-safe.
    unsafe {
        signal(SIGINT, handler as usize);
    }
}
