//! Running the XDP program through BPF_PROG_TEST_RUN in the fixture namespace.

use std::time::Duration;

use aya::programs::{TestRun, TestRunOptions, Xdp};
use lb_agent::{dataplane::Dataplane, netif::ifindex};

use crate::netns::{fixture_namespace_named, Netns};

/// The fixture namespace, entered by the calling thread, with the program
/// loaded and allowed to redirect to both of the namespace's interfaces.
pub struct FixtureBed {
    pub dp: Dataplane,
    /// Client-side and backend-side interface indexes.
    pub cl0: u32,
    pub be0: u32,
    // Last: the namespace goes after the program.
    pub ns: Netns,
}

impl FixtureBed {
    pub fn new(name: &str) -> Self {
        Self::with_pins(name, None)
    }

    /// As [`FixtureBed::new`], with the maps pinned under `pin_dir` (so that
    /// lbctl can read them).
    pub fn with_pins(name: &str, pin_dir: Option<&std::path::Path>) -> Self {
        let ns = fixture_namespace_named(name);
        ns.enter();
        let cl0 = ifindex("cl0").expect("cl0");
        let be0 = ifindex("be0").expect("be0");
        let mut dp = Dataplane::open(pin_dir).expect("load the XDP program (root needed)");
        dp.allow_redirect(cl0).unwrap();
        dp.allow_redirect(be0).unwrap();
        Self { dp, cl0, be0, ns }
    }
}

/// Runs `prog` once on `input` arriving on `ingress`: the verdict, the
/// output frame and the kernel's duration of the run.
pub fn test_run(prog: &Xdp, ingress: u32, input: &[u8]) -> (u32, Vec<u8>, Duration) {
    let mut ctx = [0u32; 6];
    ctx[1] = input.len() as u32; // data_end
    ctx[3] = ingress; // ingress_ifindex
    let ctx_bytes: Vec<u8> = ctx.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let mut out = vec![0u8; input.len() + 256];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx_bytes),
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    out.truncate(r.data_size_out as usize);
    (r.return_value, out, r.duration)
}
