//! kbench: per-packet cost of Katran's XDP balancer and of xlb's XDP program,
//! measured side by side in one process with BPF_PROG_TEST_RUN, with the same
//! packets, the same syscall wrapper and the same methods, interleaved in
//! rounds. Built by build.sh against xlb's own crates (its fixture namespace,
//! its agent-side loader `Dataplane`), and kb_loader.c for Katran (libbpf).
//!
//! Method A: repeat = 1 per syscall, CALLS calls per (program, case) per
//!   round, ROUNDS rounds; median, p90 and mean of the kernel's duration.
//! Method C: one syscall with repeat = REPEAT per (program, case) per round,
//!   through kb_wrap (kb_wrap.bpf.c), which restores the original packet
//!   before every iteration and tail-calls the program; the wrapper's own
//!   cost is measured as kb_wrap -> kb_pass and subtracted.
//!
//! Every call's verdict is checked (method A); in method C the last verdict
//! is checked and each program's own counters must have moved by exactly
//! REPEAT (Katran: XDP_TX / XDP_PASS counters, LRU misses; xlb: reason
//! counters), so every iteration took the expected path.
//!
//! Usage: kbench --katran OBJ --katran-nolimit OBJ --wrap OBJ
//!   [--rounds-a 80] [--calls 2500] [--rounds-c 20] [--repeat 1000000]
//!   [--cpu N] [--nreals 100] [--katran-lru N] [--skip-a] [--skip-c]
//!
//! --katran-lru N: Katran as deployed, one LRU of N flows per CPU (KatranLb
//!   with forwarding cores) instead of its 1,000-entry fallback_cache, which
//!   stays in cache and so makes a new flow's insert cheaper than in any
//!   deployment. N = 131072 on two CPUs is xlb's table (262,144 flows,
//!   one LRU list per CPU).

use std::{
    ffi::{c_char, c_int, c_long, c_void, CString},
    io,
    net::{Ipv4Addr, SocketAddr},
    os::fd::{AsFd, AsRawFd},
    time::Instant,
};

use lb_agent::dataplane::{BackendSpec, Protocol, ServiceSpec, FLOOR_PROGRAM};
use lb_common::Reason;
use xlb_tests::{
    packet::{tcp_flags, Ipv4, PacketBuilder, Tcp, Udp},
    xdp::FixtureBed,
};

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

// Katran's stats indexes (balancer_consts.h, MAX_VIPS = 512).
const K_LRU_CNTRS: u32 = 512; // v1 packets to VIPs, v2 LRU misses
const K_LRU_MISS_CNTR: u32 = 513; // v1 TCP SYN misses, v2 non-SYN misses
const K_NEW_CONN_RATE_CNTR: u32 = 514; // v1 new connections this second (per CPU)
const K_XDP_TX_CNTR: u32 = 529;
const K_XDP_PASS_CNTR: u32 = 531;
const K_MAX_CONN_RATE: u64 = 125_000;

const CL0_MAC: [u8; 6] = [2, 0, 0, 0, 1, 0];
const BE0_MAC: [u8; 6] = [2, 0, 0, 0, 2, 0];
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 1, 2];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const BACKEND_BASE: u32 = 0x0a02_0002; // 10.2.0.2, .3, ...
const KATRAN_DEFAULT_MAC: [u8; 6] = [0x00, 0x00, 0xDE, 0xAD, 0xBE, 0xAF];
const SYN_BASE_A: u32 = 0x0a03_0000; // method A new flows: 10.3.x.x
const SYN_BASE_C: u32 = 0x0a01_0000; // method C new flows: 10.1.x.x

#[repr(C)]
struct KbKatran {
    prog_fd: c_int,
    stats_fd: c_int,
    ncpus: c_int,
    pad: c_int,
    obj: *mut c_void,
}

#[repr(C)]
struct KbWrap {
    wrap_fd: c_int,
    pass_fd: c_int,
    jmp_fd: c_int,
    orig_fd: c_int,
    obj: *mut c_void,
}

// From libc (no `libc` crate: kbench names only xlb's own crates).
extern "C" {
    fn syscall(num: c_long, ...) -> c_long;
    fn sched_setaffinity(pid: c_int, size: usize, mask: *const u64) -> c_int;
}
#[cfg(target_arch = "x86_64")]
const SYS_BPF: c_long = 321;
#[cfg(target_arch = "aarch64")]
const SYS_BPF: c_long = 280;

extern "C" {
    fn kb_katran_load(
        path: *const c_char,
        vip: u32,
        tcp_port: u16,
        udp_port: u16,
        real_base: u32,
        nreals: u32,
        mac: *const u8,
        out: *mut KbKatran,
    ) -> c_int;
    fn kb_katran_attach_lrus(k: *const KbKatran, entries: u32) -> c_int;
    fn kb_katran_stat(k: *const KbKatran, idx: u32, v1: *mut u64, v2: *mut u64) -> c_int;
    fn kb_katran_stat_cpu(
        k: *const KbKatran,
        idx: u32,
        cpu: c_int,
        v1: *mut u64,
        v2: *mut u64,
    ) -> c_int;
    fn kb_wrap_load(path: *const c_char, out: *mut KbWrap) -> c_int;
    fn kb_wrap_set(
        w: *const KbWrap,
        target_fd: c_int,
        pkt: *const u8,
        len: u32,
        vary: u32,
        vary_base: u32,
    ) -> c_int;
    fn kb_wrap_counter(w: *const KbWrap) -> u64;
    fn kb_prog_sizes(fd: c_int, xlated: *mut u32, jited: *mut u32) -> c_int;
}

/// "N BPF insns, M bytes JITed" for a loaded program.
fn prog_size(fd: i32) -> String {
    let (mut x, mut j) = (0u32, 0u32);
    // SAFETY: out pointers valid.
    if unsafe { kb_prog_sizes(fd, &mut x, &mut j) } != 0 {
        return "size unknown".into();
    }
    format!("{} BPF insns, {} bytes JITed", x / 8, j)
}

/// `union bpf_attr` for BPF_PROG_TEST_RUN.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// One BPF_PROG_TEST_RUN: (verdict, kernel duration per repetition in ns,
/// output length). The same call for every program.
fn test_run(fd: i32, pkt: &[u8], ingress: u32, repeat: u32, out: &mut [u8]) -> (u32, u32, usize) {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex
    let ctx: [u32; 6] = [0, pkt.len() as u32, 0, ingress, 0, 0];
    let mut a = TestRunAttr {
        prog_fd: fd as u32,
        data_size_in: pkt.len() as u32,
        data_size_out: out.len() as u32,
        data_in: pkt.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat,
        ctx_size_in: std::mem::size_of_val(&ctx) as u32,
        ctx_in: ctx.as_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: the attr points at live buffers of the sizes given.
    let rc = unsafe {
        syscall(
            SYS_BPF,
            10 as c_int, /* BPF_PROG_TEST_RUN */
            &mut a as *mut TestRunAttr,
            std::mem::size_of::<TestRunAttr>() as u32,
        )
    };
    if rc < 0 {
        panic!("BPF_PROG_TEST_RUN on fd {fd}: {}", io::Error::last_os_error());
    }
    (a.retval, a.duration, a.data_size_out as usize)
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Lb {
    Katran,
    KatranNoLimit,
    /// xlb with flood mode off (threshold 0): every new flow written.
    Xlb,
    /// The same program with flood mode at Katran's threshold.
    XlbFlood,
    FloorC,
    FloorXlb,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Case {
    Floor,
    TcpEst,
    UdpEst,
    Syn,
    NonVip,
    Reply,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Floor => "floor (XDP_PASS only)",
            Case::TcpEst => "TCP established",
            Case::UdpEst => "UDP established",
            Case::Syn => "TCP SYN, new flow",
            Case::NonVip => "non-VIP pass",
            Case::Reply => "reply translation",
        }
    }
}

struct Pair {
    lb: Lb,
    case: Case,
    fd: i32,
    /// The packet (for new flows: the template kb_wrap rewrites in method C).
    pkt: Vec<u8>,
    ingress: u32,
    verdict: u32,
    a: Vec<u32>,
    c: Vec<u32>,
}

impl Pair {
    fn label(&self) -> String {
        let lb = match self.lb {
            Lb::Katran => "Katran",
            Lb::KatranNoLimit => "Katran, new-conn limit lifted",
            Lb::Xlb => "xlb",
            Lb::XlbFlood => "xlb, flood mode on",
            Lb::FloorC => "kb_pass (C)",
            Lb::FloorXlb => "xlb_floor (Rust)",
        };
        format!("{lb}: {}", self.case.name())
    }
}

struct Args {
    katran: String,
    katran_nolimit: String,
    wrap: String,
    rounds_a: usize,
    calls: usize,
    rounds_c: usize,
    repeat: u32,
    cpu: usize,
    nreals: u32,
    katran_lru: u32,
    skip_a: bool,
    skip_c: bool,
}

fn parse_args() -> Args {
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut a = Args {
        katran: String::new(),
        katran_nolimit: String::new(),
        wrap: String::new(),
        rounds_a: 80,
        calls: 2500,
        rounds_c: 20,
        repeat: 1_000_000,
        cpu: ncpu - 1,
        nreals: 100,
        katran_lru: 0,
        skip_a: false,
        skip_c: false,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = |i: usize| v.get(i + 1).cloned().unwrap_or_else(|| panic!("{} needs a value", v[i]));
        match v[i].as_str() {
            "--katran" => a.katran = val(i),
            "--katran-nolimit" => a.katran_nolimit = val(i),
            "--wrap" => a.wrap = val(i),
            "--rounds-a" => a.rounds_a = val(i).parse().expect("--rounds-a"),
            "--calls" => a.calls = val(i).parse().expect("--calls"),
            "--rounds-c" => a.rounds_c = val(i).parse().expect("--rounds-c"),
            "--repeat" => a.repeat = val(i).parse().expect("--repeat"),
            "--cpu" => a.cpu = val(i).parse().expect("--cpu"),
            "--nreals" => a.nreals = val(i).parse().expect("--nreals"),
            "--katran-lru" => a.katran_lru = val(i).parse().expect("--katran-lru"),
            "--skip-a" => {
                a.skip_a = true;
                i += 1;
                continue;
            }
            "--skip-c" => {
                a.skip_c = true;
                i += 1;
                continue;
            }
            "-h" | "--help" => {
                println!("{}", include_str!("kbench.rs").lines().take_while(|l| l.starts_with("//!")).map(|l| l.trim_start_matches("//!").trim_start()).collect::<Vec<_>>().join("\n"));
                std::process::exit(0);
            }
            o => panic!("unknown argument {o} (see --help)"),
        }
        i += 2;
    }
    assert!(!a.katran.is_empty() && !a.katran_nolimit.is_empty() && !a.wrap.is_empty(), "--katran, --katran-nolimit and --wrap are required");
    a
}

fn pin_to(cpu: usize) {
    // A cpu_set_t (1024 bits) with one bit set, for the calling thread.
    let mut set = [0u64; 16];
    set[cpu / 64] |= 1 << (cpu % 64);
    // SAFETY: the mask is as large as the size given.
    let rc = unsafe { sched_setaffinity(0, std::mem::size_of_val(&set), set.as_ptr()) };
    assert_eq!(rc, 0, "sched_setaffinity({cpu}): {}", io::Error::last_os_error());
}

fn tcp(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, flags: u8, macs: ([u8; 6], [u8; 6])) -> Vec<u8> {
    PacketBuilder::new()
        .eth(macs.0, macs.1)
        .ipv4(Ipv4::new(src, dst))
        .tcp(Tcp::new(sport, dport).seq(1).ack(1).flags(flags).payload(&[0u8; 20]))
        .build()
}

fn syn(n: u64, base: u32) -> Vec<u8> {
    let src = Ipv4Addr::from(base + (n / 50_000) as u32);
    tcp(src, VIP, 1024 + (n % 50_000) as u16, 80, tcp_flags::SYN, (CLIENT_MAC, CL0_MAC))
}

fn katran_stat(k: &KbKatran, idx: u32) -> (u64, u64) {
    let (mut v1, mut v2) = (0u64, 0u64);
    // SAFETY: k was filled by kb_katran_load.
    let rc = unsafe { kb_katran_stat(k, idx, &mut v1, &mut v2) };
    assert_eq!(rc, 0, "reading Katran stats[{idx}]");
    (v1, v2)
}

/// The counters a pair's packets must move, read before and after a run.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
struct Counters {
    tx: u64,
    pass: u64,
    lru_miss_total: u64,
    syn_miss: u64,
    xlb_redirect: u64,
    xlb_no_service: u64,
    xlb_untracked: u64,
}

struct Bench {
    dp: lb_agent::dataplane::Dataplane,
    katran: KbKatran,
    katran_nl: KbKatran,
}

impl Bench {
    fn counters(&self, lb: Lb) -> Counters {
        match lb {
            Lb::Katran | Lb::KatranNoLimit => {
                let k = if lb == Lb::Katran { &self.katran } else { &self.katran_nl };
                Counters {
                    tx: katran_stat(k, K_XDP_TX_CNTR).0,
                    pass: katran_stat(k, K_XDP_PASS_CNTR).0,
                    lru_miss_total: katran_stat(k, K_LRU_CNTRS).1,
                    syn_miss: katran_stat(k, K_LRU_MISS_CNTR).0,
                    ..Default::default()
                }
            }
            Lb::Xlb | Lb::XlbFlood => {
                let r = self.dp.reason_counts().expect("xlb reason counters");
                Counters {
                    xlb_redirect: r[Reason::Redirect as usize],
                    xlb_no_service: r[Reason::PassNoService as usize],
                    xlb_untracked: self.dp.flows_untracked().expect("xlb flow events"),
                    ..Default::default()
                }
            }
            Lb::FloorC | Lb::FloorXlb => Counters::default(),
        }
    }

    /// Sets xlb's flood threshold for `lb`'s runs (the program is one; its
    /// per-CPU window carries on, as Katran's does).
    fn select(&mut self, lb: Lb) {
        let threshold = match lb {
            Lb::Xlb => 0,
            Lb::XlbFlood => K_MAX_CONN_RATE as u32,
            _ => return,
        };
        self.dp.set_flood_threshold(threshold).expect("xlb flood threshold");
    }

    /// Checks that `n` packets of `case` moved `lb`'s counters as expected.
    fn check(&self, lb: Lb, case: Case, before: Counters, after: Counters, n: u64, what: &str) {
        let d = |f: fn(&Counters) -> u64| f(&after) - f(&before);
        let ok = match lb {
            Lb::Katran | Lb::KatranNoLimit => match case {
                // Every packet forwarded; at most the first missed the LRU
                // (the SYN runs evict it: fallback_cache has 1000 entries).
                Case::TcpEst | Case::UdpEst => d(|c| c.tx) == n && d(|c| c.lru_miss_total) <= 1,
                // Every packet forwarded, each one a new TCP session.
                Case::Syn => d(|c| c.tx) == n && d(|c| c.syn_miss) == n && d(|c| c.lru_miss_total) == n,
                Case::NonVip => d(|c| c.pass) == n && d(|c| c.tx) == 0,
                _ => true,
            },
            // Flood mode off: every new flow written.
            Lb::Xlb => match case {
                Case::TcpEst | Case::UdpEst | Case::Syn | Case::Reply => {
                    d(|c| c.xlb_redirect) == n && d(|c| c.xlb_untracked) == 0
                }
                Case::NonVip => d(|c| c.xlb_no_service) == n && d(|c| c.xlb_redirect) == 0,
                _ => true,
            },
            // A run longer than the threshold: some flows untracked.
            Lb::XlbFlood => d(|c| c.xlb_redirect) == n && (n <= K_MAX_CONN_RATE || d(|c| c.xlb_untracked) > 0),
            _ => true,
        };
        assert!(ok, "{what}: {lb:?} {case:?}: counters moved unexpectedly for {n} packets: before {before:?} after {after:?}");
    }
}

fn stats(v: &mut [u32]) -> (u32, u32, f64) {
    v.sort_unstable();
    let med = v[v.len() / 2];
    let p90 = v[v.len() * 9 / 10];
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    (med, p90, mean)
}

fn main() {
    let args = parse_args();
    pin_to(args.cpu);
    let t0 = Instant::now();

    // xlb, through its own test fixture and loader (as xlb-bench does).
    let FixtureBed { mut dp, cl0, be0, ns } = FixtureBed::new("kbench");
    let backend = |i: u32| Ipv4Addr::from(BACKEND_BASE + i);
    ns.run(&format!(
        "for i in $(seq 2 {}); do ip neigh replace 10.2.0.$i lladdr 02:00:00:00:02:$(printf %02x $i) dev be0 nud permanent; done",
        args.nreals + 1
    ));
    for (port, protocol, bport) in [(80, Protocol::Tcp, 8080), (53, Protocol::Udp, 5353)] {
        dp.set_service(&ServiceSpec {
            vip: VIP.into(),
            port,
            protocol,
            snat: None,
            table_size: None,
            // As xlb-bench's NAT services: no source ranges, no affinity,
            // plain Maglev, no held flows, no new-flow limit.
            source_ranges: None,
            client_affinity: false,
            least_loaded: false,
            hold_unknown_flows: false,
            new_flow_limit: None,
            backends: (0..args.nreals)
                .map(|i| BackendSpec { addr: SocketAddr::new(backend(i).into(), bport), weight: 1 })
                .collect(),
        })
        .expect("xlb service");
    }
    let xlb_fd = dp.program().fd().expect("xlb fd").as_fd().as_raw_fd();
    // The floor (XDP_PASS only), loaded on demand as xlb-bench does.
    let xlb_floor_fd = dp.bench_program(FLOOR_PROGRAM).expect("xlb_floor").fd().expect("xlb_floor fd").as_fd().as_raw_fd();

    // Katran (default build, and the same build with MAX_CONN_RATE lifted).
    let load_katran = |path: &str| {
        let mut k = KbKatran { prog_fd: -1, stats_fd: -1, ncpus: 0, pad: 0, obj: std::ptr::null_mut() };
        let p = CString::new(path).unwrap();
        // SAFETY: valid C string and out pointer.
        let rc = unsafe {
            kb_katran_load(
                p.as_ptr(),
                u32::from(VIP).to_be(),
                80u16.to_be(),
                53u16.to_be(),
                BACKEND_BASE,
                args.nreals,
                KATRAN_DEFAULT_MAC.as_ptr(),
                &mut k,
            )
        };
        assert_eq!(rc, 0, "loading Katran from {path}");
        if args.katran_lru > 0 {
            // SAFETY: k was filled by kb_katran_load.
            let rc = unsafe { kb_katran_attach_lrus(&k, args.katran_lru) };
            assert_eq!(rc, 0, "per-CPU LRUs of {} for Katran", args.katran_lru);
        }
        k
    };
    let katran = load_katran(&args.katran);
    let katran_nl = load_katran(&args.katran_nolimit);
    let mut wrap = KbWrap { wrap_fd: -1, pass_fd: -1, jmp_fd: -1, orig_fd: -1, obj: std::ptr::null_mut() };
    let wp = CString::new(args.wrap.as_str()).unwrap();
    // SAFETY: valid C string and out pointer.
    assert_eq!(unsafe { kb_wrap_load(wp.as_ptr(), &mut wrap) }, 0, "loading {}", args.wrap);
    let mut bench = Bench { dp, katran, katran_nl };
    eprintln!("setup done in {:.1}s", t0.elapsed().as_secs_f64());

    // The same packets for both load balancers (Katran is given xlb's VIP).
    let client = (CLIENT_MAC, CL0_MAC);
    let tcp_syn0 = tcp(CLIENT, VIP, 40000, 80, tcp_flags::SYN, client);
    let tcp_est = tcp(CLIENT, VIP, 40000, 80, tcp_flags::ACK, client);
    let udp = PacketBuilder::new()
        .eth(CLIENT_MAC, CL0_MAC)
        .ipv4(Ipv4::new(CLIENT, VIP))
        .udp(Udp::new(40001, 53).payload(&[0u8; 32]))
        .build();
    let nonvip = tcp(CLIENT, Ipv4Addr::new(10, 0, 0, 1), 40000, 22, tcp_flags::ACK, client);

    // Establish the flows: a SYN then the ACK (Katran: the first packet of a
    // flow puts it in the LRU; xlb: in CONNTRACK and SHARED_FLOWS).
    let mut out = vec![0u8; 512];
    let mut reference: std::collections::HashMap<(i32, &'static str), Vec<u8>> = Default::default();
    for (fd, name, tx) in [
        (bench.katran.prog_fd, "katran", XDP_TX),
        (bench.katran_nl.prog_fd, "katran-nolimit", XDP_TX),
        (xlb_fd, "xlb", XDP_REDIRECT),
    ] {
        for (pkt, label) in [(&tcp_syn0, "syn0"), (&tcp_est, "tcp"), (&tcp_est, "tcp"), (&udp, "udp"), (&udp, "udp")] {
            let (v, _, len) = test_run(fd, pkt, cl0, 1, &mut out);
            assert_eq!(v, tx, "{name}: warm-up {label}: verdict");
            reference.insert((fd, label), out[..len].to_vec());
        }
        let (v, _, len) = test_run(fd, &nonvip, cl0, 1, &mut out);
        assert_eq!(v, XDP_PASS, "{name}: non-VIP verdict");
        reference.insert((fd, "nonvip"), out[..len].to_vec());
    }
    // Katran's output: IPIP encapsulation to a real, to the default MAC.
    for k in [&bench.katran, &bench.katran_nl] {
        let o = &reference[&(k.prog_fd, "tcp")];
        assert_eq!(o.len(), tcp_est.len() + 20, "Katran output is the packet plus an outer IPv4 header");
        assert_eq!(&o[0..6], &KATRAN_DEFAULT_MAC, "Katran output goes to the default MAC");
        assert_eq!(o[23], 4, "Katran's outer header is IPIP");
        assert_eq!(&o[34..], &tcp_est[14..], "Katran's inner packet is the original");
    }
    // xlb's output: DNAT to the backend its Maglev table picked; the reply
    // case comes back from that backend.
    let x = &reference[&(xlb_fd, "tcp")];
    let be_ip = Ipv4Addr::new(x[30], x[31], x[32], x[33]);
    let be_port = u16::from_be_bytes([x[36], x[37]]);
    assert_eq!(be_port, 8080, "xlb rewrote the port to the backend's");
    let be_mac = [2, 0, 0, 0, 2, (u32::from(be_ip) & 0xff) as u8];
    let reply = tcp(be_ip, CLIENT, 8080, 40000, tcp_flags::ACK, (be_mac, BE0_MAC));
    let (v, _, len) = test_run(xlb_fd, &reply, be0, 1, &mut out);
    assert_eq!(v, XDP_REDIRECT, "xlb reply verdict");
    reference.insert((xlb_fd, "reply"), out[..len].to_vec());
    eprintln!(
        "flows established; Katran TCP flow -> real {}.{}.{}.{}, xlb TCP flow -> {be_ip}:{be_port}",
        reference[&(bench.katran.prog_fd, "tcp")][30],
        reference[&(bench.katran.prog_fd, "tcp")][31],
        reference[&(bench.katran.prog_fd, "tcp")][32],
        reference[&(bench.katran.prog_fd, "tcp")][33]
    );

    let pkt_of = |case: Case| -> Vec<u8> {
        match case {
            Case::TcpEst | Case::Floor => tcp_est.clone(),
            Case::UdpEst => udp.clone(),
            Case::NonVip => nonvip.clone(),
            Case::Reply => reply.clone(),
            Case::Syn => syn(0, SYN_BASE_C),
        }
    };
    let mk = |lb: Lb, case: Case, fd: i32, ingress: u32, verdict: u32| Pair { lb, case, fd, pkt: pkt_of(case), ingress, verdict, a: vec![], c: vec![] };
    let mut pairs = vec![
        mk(Lb::Katran, Case::TcpEst, bench.katran.prog_fd, cl0, XDP_TX),
        mk(Lb::Xlb, Case::TcpEst, xlb_fd, cl0, XDP_REDIRECT),
        mk(Lb::Katran, Case::UdpEst, bench.katran.prog_fd, cl0, XDP_TX),
        mk(Lb::Xlb, Case::UdpEst, xlb_fd, cl0, XDP_REDIRECT),
        mk(Lb::Katran, Case::Syn, bench.katran.prog_fd, cl0, XDP_TX),
        mk(Lb::Xlb, Case::Syn, xlb_fd, cl0, XDP_REDIRECT),
        mk(Lb::XlbFlood, Case::Syn, xlb_fd, cl0, XDP_REDIRECT),
        mk(Lb::Katran, Case::NonVip, bench.katran.prog_fd, cl0, XDP_PASS),
        mk(Lb::Xlb, Case::NonVip, xlb_fd, cl0, XDP_PASS),
        mk(Lb::FloorC, Case::Floor, wrap.pass_fd, cl0, XDP_PASS),
        mk(Lb::FloorXlb, Case::Floor, xlb_floor_fd, cl0, XDP_PASS),
        mk(Lb::KatranNoLimit, Case::Syn, bench.katran_nl.prog_fd, cl0, XDP_TX),
        mk(Lb::Xlb, Case::Reply, xlb_fd, be0, XDP_REDIRECT),
    ];
    let ref_label = |case: Case| match case {
        Case::TcpEst => "tcp",
        Case::UdpEst => "udp",
        Case::NonVip => "nonvip",
        Case::Reply => "reply",
        _ => "",
    };

    // ---- Method A: repeat = 1 per syscall, interleaved rounds.
    let mut katran_conn_rate_max = 0u64;
    // Katran established-flow packets that missed the LRU (the SYN runs evict
    // the flow from the 1000-entry fallback_cache), of all such packets.
    let mut katran_est_misses = (0u64, 0u64);
    if !args.skip_a {
        let t = Instant::now();
        let mut flow = 0u64;
        let np = pairs.len();
        for r in 0..args.rounds_a {
            for j in 0..np {
                let p = &mut pairs[(r + j) % np];
                bench.select(p.lb);
                let before = bench.counters(p.lb);
                for _ in 0..args.calls {
                    let (v, d) = if p.case == Case::Syn {
                        let pkt = syn(flow, SYN_BASE_A);
                        flow += 1;
                        let (v, d, _) = test_run(p.fd, &pkt, p.ingress, 1, &mut out);
                        (v, d)
                    } else {
                        let (v, d, _) = test_run(p.fd, &p.pkt, p.ingress, 1, &mut out);
                        (v, d)
                    };
                    assert_eq!(v, p.verdict, "method A: {}: verdict", p.label());
                    p.a.push(d);
                }
                let after = bench.counters(p.lb);
                bench.check(p.lb, p.case, before, after, args.calls as u64, "method A");
                if p.lb == Lb::Katran && matches!(p.case, Case::TcpEst | Case::UdpEst) {
                    katran_est_misses.0 += after.lru_miss_total - before.lru_miss_total;
                    katran_est_misses.1 += args.calls as u64;
                }
                if p.lb == Lb::Katran && p.case == Case::Syn {
                    let (mut v1, mut v2) = (0, 0);
                    // SAFETY: filled by kb_katran_load.
                    unsafe { kb_katran_stat_cpu(&bench.katran, K_NEW_CONN_RATE_CNTR, args.cpu as c_int, &mut v1, &mut v2) };
                    katran_conn_rate_max = katran_conn_rate_max.max(v1);
                }
            }
        }
        eprintln!("method A done in {:.1}s", t.elapsed().as_secs_f64());
    }

    // ---- Method C: repeat = REPEAT through kb_wrap, interleaved rounds.
    // Extra pairs measured only here: the wrapper floors and bare kb_pass.
    let mut wrap_floor: Vec<u32> = vec![];
    let mut wrap_floor_vary: Vec<u32> = vec![];
    let mut bare_pass: Vec<u32> = vec![];
    let mut xlb_tailcall_ok = true;
    let mut katran_c_conn_rate_max = 0u64;
    if !args.skip_c {
        let t = Instant::now();
        // Is xlb tail-callable from kb_wrap? (prog array compatibility)
        // SAFETY: wrap loaded; packet buffer valid.
        if unsafe { kb_wrap_set(&wrap, xlb_fd, tcp_est.as_ptr(), tcp_est.len() as u32, 0, 0) } != 0 {
            xlb_tailcall_ok = false;
            eprintln!("xlb cannot be tail-called from kb_wrap: method C skips xlb");
        }
        let np = pairs.len();
        for r in 0..args.rounds_c {
            // The wrapper floors, first in every round.
            for (vary, dst) in [(0u32, &mut wrap_floor), (1u32, &mut wrap_floor_vary)] {
                let pkt = if vary == 1 { syn(0, SYN_BASE_C) } else { tcp_est.clone() };
                // SAFETY: as above.
                assert_eq!(unsafe { kb_wrap_set(&wrap, wrap.pass_fd, pkt.as_ptr(), pkt.len() as u32, vary, SYN_BASE_C) }, 0);
                let (v, d, _) = test_run(wrap.wrap_fd, &pkt, cl0, args.repeat, &mut out);
                assert_eq!(v, XDP_PASS, "method C: kb_wrap -> kb_pass verdict");
                dst.push(d);
            }
            let (v, d, _) = test_run(wrap.pass_fd, &tcp_est, cl0, args.repeat, &mut out);
            assert_eq!(v, XDP_PASS);
            bare_pass.push(d);
            for j in 0..np {
                let p = &mut pairs[(r + j) % np];
                if matches!(p.lb, Lb::Xlb | Lb::XlbFlood) && !xlb_tailcall_ok || p.case == Case::Floor {
                    continue;
                }
                let vary = (p.case == Case::Syn) as u32;
                let pkt = p.pkt.clone();
                // SAFETY: as above.
                assert_eq!(unsafe { kb_wrap_set(&wrap, p.fd, pkt.as_ptr(), pkt.len() as u32, vary, SYN_BASE_C) }, 0, "kb_wrap_set for {}", p.label());
                bench.select(p.lb);
                let before = bench.counters(p.lb);
                let (v, d, len) = test_run(wrap.wrap_fd, &pkt, p.ingress, args.repeat, &mut out);
                let after = bench.counters(p.lb);
                assert_eq!(v, p.verdict, "method C: {}: last verdict", p.label());
                bench.check(p.lb, p.case, before, after, args.repeat as u64, "method C");
                if p.lb == Lb::Katran && matches!(p.case, Case::TcpEst | Case::UdpEst) {
                    katran_est_misses.0 += after.lru_miss_total - before.lru_miss_total;
                    katran_est_misses.1 += args.repeat as u64;
                }
                if vary == 0 {
                    // The last iteration saw the original packet: its output is
                    // what a single run gives.
                    let want = &reference[&(p.fd, ref_label(p.case))];
                    assert_eq!(&out[..len], &want[..], "method C: {}: output differs from a single run's", p.label());
                }
                if p.lb == Lb::Katran && p.case == Case::Syn {
                    let (mut v1, mut v2) = (0, 0);
                    // SAFETY: filled by kb_katran_load.
                    unsafe { kb_katran_stat_cpu(&bench.katran, K_NEW_CONN_RATE_CNTR, args.cpu as c_int, &mut v1, &mut v2) };
                    katran_c_conn_rate_max = katran_c_conn_rate_max.max(v1);
                }
                p.c.push(d);
            }
        }
        // SAFETY: wrap loaded.
        let flows = unsafe { kb_wrap_counter(&wrap) };
        eprintln!("method C done in {:.1}s ({flows} new flows made by kb_wrap)", t.elapsed().as_secs_f64());
    }

    // ---- Report.
    println!("kbench: Katran vs xlb, BPF_PROG_TEST_RUN, CPU {} pinned, {} reals/backends", args.cpu, args.nreals);
    println!("Katran: {} (and {} for \"new-conn limit lifted\"): {}", args.katran, args.katran_nolimit, prog_size(bench.katran.prog_fd));
    println!("xlb: the object built into lb-agent, loaded by lb_agent::dataplane::Dataplane: {}", prog_size(xlb_fd));
    println!();
    let mut a_res: std::collections::HashMap<(Lb, Case), (u32, u32, f64)> = Default::default();
    if !args.skip_a {
        println!("## Method A: repeat=1 per syscall, {} rounds x {} calls = {} calls per row; kernel-reported ns per call", args.rounds_a, args.calls, args.rounds_a * args.calls);
        println!();
        println!("| program: case | median | p90 | mean |");
        println!("|---|---:|---:|---:|");
        for p in pairs.iter_mut() {
            let s = stats(&mut p.a);
            a_res.insert((p.lb, p.case), s);
            println!("| {} | {} | {} | {:.1} |", p.label(), s.0, s.1, s.2);
        }
        println!();
        println!("Katran default build: highest new-connection count within one second on CPU {} after a SYN segment: {} (flood protection engages above {K_MAX_CONN_RATE})", args.cpu, katran_conn_rate_max);
        println!();
    }
    let mut c_res: std::collections::HashMap<(Lb, Case), f64> = Default::default();
    let mean = |v: &[u32]| v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64;
    if !args.skip_c {
        println!("## Method C: kb_wrap restores the packet, then tail-calls; repeat={} per syscall, {} rounds; kernel-reported ns per iteration (integer, truncated)", args.repeat, args.rounds_c);
        println!();
        println!("| program: case | mean | min | max |");
        println!("|---|---:|---:|---:|");
        let row = |label: &str, v: &[u32]| {
            if !v.is_empty() {
                println!("| {label} | {:.1} | {} | {} |", mean(v), v.iter().min().unwrap(), v.iter().max().unwrap());
            }
        };
        row("bare kb_pass, no wrapper", &bare_pass);
        row("kb_wrap -> kb_pass (wrapper floor)", &wrap_floor);
        row("kb_wrap(vary) -> kb_pass (wrapper floor, new flows)", &wrap_floor_vary);
        for p in pairs.iter() {
            if !p.c.is_empty() {
                c_res.insert((p.lb, p.case), mean(&p.c));
                row(&format!("kb_wrap -> {}", p.label()), &p.c);
            }
        }
        println!();
        println!("Katran default build, method C: highest new-connection count within one second on CPU {} after a SYN run: {} (flood protection engages above {K_MAX_CONN_RATE}: the rest of that second's SYNs skip the LRU update)", args.cpu, katran_c_conn_rate_max);
        println!();
    }

    println!("Katran established TCP/UDP packets that missed the LRU (first packet after a SYN run evicted the flow): {} of {}", katran_est_misses.0, katran_est_misses.1);
    println!();
    println!("## Summary: ns per packet, above the floor of the same method");
    println!();
    println!("| case | method | Katran | xlb | floor | Katran above floor | xlb above floor | xlb/Katran above floor |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    // (case, Katran build, xlb setting): new flows compared with both
    // flood limits on, and with both lifted.
    let cases = [
        (Case::TcpEst, Lb::Katran, Lb::Xlb),
        (Case::UdpEst, Lb::Katran, Lb::Xlb),
        (Case::Syn, Lb::Katran, Lb::XlbFlood),
        (Case::Syn, Lb::KatranNoLimit, Lb::Xlb),
        (Case::NonVip, Lb::Katran, Lb::Xlb),
    ];
    let case_name = |case: Case, klb: Lb| match (case, klb) {
        (Case::Syn, Lb::KatranNoLimit) => format!("{} (both flood limits lifted)", case.name()),
        (Case::Syn, _) => format!("{} (both in flood mode above {K_MAX_CONN_RATE}/s)", case.name()),
        _ => case.name().to_string(),
    };
    if !args.skip_a {
        let floor = a_res[&(Lb::FloorC, Case::Floor)];
        for (case, klb, xlb) in cases {
            let k = a_res[&(klb, case)];
            let x = a_res[&(xlb, case)];
            let (ka, xa) = (k.0 as f64 - floor.0 as f64, x.0 as f64 - floor.0 as f64);
            let name = case_name(case, klb);
            println!(
                "| {name} | A: median (p90) | {} ({}) | {} ({}) | {} ({}) | {ka:.0} | {xa:.0} | {} |",
                k.0, k.1, x.0, x.1, floor.0, floor.1,
                if ka > 0.0 { format!("{:.1}x", xa / ka) } else { "-".into() }
            );
            println!(
                "| {name} | A: mean | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                k.2, x.2, floor.2, k.2 - floor.2, x.2 - floor.2,
                if k.2 - floor.2 > 0.0 { format!("{:.1}x", (x.2 - floor.2) / (k.2 - floor.2)) } else { "-".into() }
            );
        }
        let x = a_res[&(Lb::Xlb, Case::Reply)];
        println!("| reply translation (xlb only) | A: median (p90) | - | {} ({}) | {} | - | {} | - |", x.0, x.1, floor.0, x.0 as f64 - floor.0 as f64);
    }
    if !args.skip_c && xlb_tailcall_ok {
        let wf = mean(&wrap_floor);
        let wfv = mean(&wrap_floor_vary);
        for (case, klb, xlb) in cases {
            let f = if case == Case::Syn { wfv } else { wf };
            let k = c_res[&(klb, case)];
            let x = c_res[&(xlb, case)];
            let name = case_name(case, klb);
            println!(
                "| {name} | C: mean, wrapped | {k:.1} | {x:.1} | {f:.1} (wrapper) | {:.1} | {:.1} | {} |",
                k - f, x - f,
                if k - f > 0.0 { format!("{:.1}x", (x - f) / (k - f)) } else { "-".into() }
            );
        }
        let x = c_res[&(Lb::Xlb, Case::Reply)];
        println!("| reply translation (xlb only) | C: mean, wrapped | - | {x:.1} | {wf:.1} (wrapper) | - | {:.1} | - |", x - wf);
        println!();
        println!("Method C floors: bare XDP_PASS {:.1} ns; wrapper -> XDP_PASS {wf:.1} ns (+{:.1} for the wrapper and tail call); with a new flow per iteration {wfv:.1} ns", mean(&bare_pass), wf - mean(&bare_pass));
    }
    if !args.skip_c && xlb_tailcall_ok {
        // Issue 33's goals, in method C (xlb/Katran above the floor).
        let ratio = |case: Case, klb: Lb, xlb: Lb| {
            let f = if case == Case::Syn { mean(&wrap_floor_vary) } else { mean(&wrap_floor) };
            (c_res[&(xlb, case)] - f) / (c_res[&(klb, case)] - f)
        };
        let katran = if args.katran_lru > 0 {
            format!("Katran with per-CPU LRUs of {} flows", args.katran_lru)
        } else {
            "Katran with its 1,000-entry fallback_cache".to_string()
        };
        println!();
        println!("## Goals (method C, xlb/Katran above the floor; {katran})");
        println!();
        for (what, case, klb, xlb, goal) in [
            ("TCP established", Case::TcpEst, Lb::Katran, Lb::Xlb, 1.0),
            ("UDP established", Case::UdpEst, Lb::Katran, Lb::Xlb, 1.0),
            ("TCP SYN, new flow (both flood limits lifted)", Case::Syn, Lb::KatranNoLimit, Lb::Xlb, 1.5),
            ("TCP SYN, new flow (both in flood mode)", Case::Syn, Lb::Katran, Lb::XlbFlood, 1.0),
        ] {
            let r = ratio(case, klb, xlb);
            let verdict = if r <= goal { "met" } else { "not met" };
            println!("{what}: {r:.2}x, goal <= {goal:.1}x: {verdict}");
        }
    }
    drop(bench);
    drop(ns);
    eprintln!("total {:.1}s", t0.elapsed().as_secs_f64());
}
