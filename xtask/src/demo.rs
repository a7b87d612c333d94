use anyhow::Result;

use crate::util::{cargo, run as run_cmd};

/// Placeholder until the agent exists: the packet fixtures are the closest thing to a demo.
pub fn run() -> Result<()> {
    println!("the demo arrives with the agent; running the packet tests");
    run_cmd(cargo().args([
        "test",
        "-p",
        "xlb-tests",
        "--test",
        "packet_fixtures",
        "--",
        "--nocapture",
    ]))
}
