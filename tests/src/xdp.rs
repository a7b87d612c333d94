//! Running the XDP program through BPF_PROG_TEST_RUN in the fixture
//! namespace, and the forwarding benchmark's traffic generator.

use std::time::Duration;

use aya::{
    maps::Array,
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
    Ebpf, EbpfLoader,
};
use lb_agent::{
    dataplane::{Dataplane, MapSizes, OBJECT},
    netif::ifindex,
};
use lb_common::map_names;

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
        Self::with(name, pin_dir, MapSizes::default())
    }

    /// As [`FixtureBed::with_pins`], with maps of the given sizes.
    pub fn with(name: &str, pin_dir: Option<&std::path::Path>, sizes: MapSizes) -> Self {
        let ns = fixture_namespace_named(name);
        ns.enter();
        let cl0 = ifindex("cl0").expect("cl0");
        let be0 = ifindex("be0").expect("be0");
        let mut dp =
            Dataplane::open_with(pin_dir, sizes).expect("load the XDP program (root needed)");
        dp.allow_redirect(cl0).unwrap();
        dp.allow_redirect(be0).unwrap();
        // As attaching does: frames to other MACs are passed untouched.
        dp.learn_interface("cl0").unwrap();
        dp.learn_interface("be0").unwrap();
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

/// Frames per BPF_PROG_RUN batch when generating live frames (the kernel
/// allows up to 256).
pub const LIVE_BATCH: u32 = 64;

/// The benchmarks' programs (`xlb_trafficgen`, `xlb_redirect_only`,
/// `xlb_sink`, `xlb_route_only`, lb-ebpf/src/bench.rs), loaded from the
/// agent's object. The object's other maps are made as small as the kernel
/// allows: these programs use none of them.
pub fn load_bench_programs() -> Result<Ebpf, String> {
    let mut loader = EbpfLoader::new();
    for name in map_names::ALL {
        loader.map_max_entries(name, 1);
    }
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|e| format!("loading the eBPF object: {e}"))?;
    for name in BENCH_PROGRAMS {
        let prog: &mut Xdp = ebpf
            .program_mut(name)
            .ok_or(format!("{name} is not in the object"))?
            .try_into()
            .map_err(|e| format!("{name}: {e}"))?;
        prog.load().map_err(|e| format!("loading {name}: {e}"))?;
    }
    Ok(ebpf)
}

pub const BENCH_PROGRAMS: [&str; 4] = [
    "xlb_trafficgen",
    "xlb_redirect_only",
    "xlb_sink",
    "xlb_route_only",
];

/// Attaches `xlb_floor` (XDP_PASS only) to `ifaces` of `ns`, natively. A
/// veth hands the frames its peer sends with XDP_TX or a redirect to its
/// own XDP poll at once only when it runs a program; with GRO alone they
/// wait for its next poll (up to tens of milliseconds). The program stays
/// attached while the returned object lives.
pub fn attach_pass(ns: &Netns, ifaces: &[String]) -> Ebpf {
    let ifaces = ifaces.to_vec();
    crate::topology::in_netns(ns, move || {
        let mut loader = EbpfLoader::new();
        for name in map_names::ALL {
            loader.map_max_entries(name, 1);
        }
        let mut ebpf = loader.load(OBJECT).expect("loading the eBPF object");
        let prog: &mut Xdp = ebpf
            .program_mut("xlb_floor")
            .expect("xlb_floor")
            .try_into()
            .expect("an XDP program");
        prog.load().expect("loading xlb_floor");
        for iface in &ifaces {
            prog.attach(iface, aya::programs::XdpMode::Driver)
                .unwrap_or_else(|e| panic!("attaching xlb_floor to {iface}: {e}"));
        }
        ebpf
    })
    .join()
    .expect("attach thread")
}

/// Bytes of a frame the generator rewrites on every run.
pub const TEMPLATE_LEN: usize = 54;

/// Runs `xlb_trafficgen` (from [`load_bench_programs`]) with live frames:
/// `frames` copies of `frame` (at least [`TEMPLATE_LEN`] bytes: Ethernet,
/// IPv4, TCP or UDP), each with the next source port, sent out of interface
/// `ingress` of the calling thread's namespace. Returns how long the
/// kernel took.
pub fn generate_live(
    ebpf: &mut Ebpf,
    ingress: u32,
    frame: &[u8],
    frames: u32,
) -> Result<Duration, String> {
    if frame.len() < TEMPLATE_LEN {
        return Err(format!(
            "a generated frame needs at least {TEMPLATE_LEN} bytes, not {}",
            frame.len()
        ));
    }
    let mut template = [0u16; TEMPLATE_LEN / 2];
    for (w, pair) in template.iter_mut().zip(frame.chunks_exact(2)) {
        *w = u16::from_ne_bytes([pair[0], pair[1]]);
    }
    let mut map: Array<_, [u16; TEMPLATE_LEN / 2]> = Array::try_from(
        ebpf.map_mut("GEN_TEMPLATE")
            .ok_or("GEN_TEMPLATE is not in the object")?,
    )
    .map_err(|e| format!("GEN_TEMPLATE: {e}"))?;
    map.set(0, template, 0)
        .map_err(|e| format!("GEN_TEMPLATE: {e}"))?;
    let prog: &Xdp = ebpf
        .program("xlb_trafficgen")
        .ok_or("xlb_trafficgen is not in the object")?
        .try_into()
        .map_err(|e| format!("xlb_trafficgen: {e}"))?;
    let mut ctx = [0u32; 6];
    ctx[1] = frame.len() as u32; // data_end
    ctx[3] = ingress; // ingress_ifindex
    let ctx: Vec<u8> = ctx.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let start = std::time::Instant::now();
    prog.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(&ctx),
        repeat: frames,
        attrs: TestRunAttrs::new().xdp_live_frames(LIVE_BATCH),
        ..Default::default()
    })
    .map_err(|e| format!("BPF_PROG_RUN with live frames: {e}"))?;
    Ok(start.elapsed())
}
