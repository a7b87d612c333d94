//! `lbctl trace` re-implements the XDP program's choice of backend in Rust;
//! this test holds it to the program itself (needs root). Random flows of
//! both families, to NAT and SNAT services, are sent through the real
//! program with BPF_PROG_TEST_RUN; for each, `lbctl trace` on the pinned
//! maps must name the backend the program sent the packet to: for new
//! flows (the Maglev pick), after the backends changed (remembered flows
//! keep theirs, new ones are picked from the new table), from the per-CPU
//! table and from the shared one (a flow that arrives on another CPU), and
//! under session affinity.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    process::Command,
};

use lb_agent::dataplane::{BackendSpec, Dataplane, Protocol, ServiceSpec};
use xlb_tests::{
    packet::{parse, tcp_flags, Ipv4, Ipv6, PacketBuilder, Tcp},
    topology::lbctl_bin,
    xdp::{test_run, FixtureBed},
};

const XDP_DROP: u32 = 1;
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 1, 2];
const CL0_MAC: [u8; 6] = [2, 0, 0, 0, 1, 0];
const VIP4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);
const VIP6: &str = "2001:db8::20";

/// xorshift64*: reproducible flows without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn backends(list: &[&str]) -> Vec<BackendSpec> {
    list.iter()
        .map(|a| BackendSpec {
            addr: a.parse().unwrap(),
            weight: 1,
        })
        .collect()
}

fn service(vip: IpAddr, port: u16, snat: Option<&str>, list: &[&str]) -> ServiceSpec {
    ServiceSpec {
        snat: snat.map(|s| s.parse().unwrap()),
        backends: backends(list),
        ..ServiceSpec::new(vip, port, Protocol::Tcp, [])
    }
}

/// The four services: NAT and SNAT, IPv4 and IPv6, several backends each.
fn services() -> Vec<ServiceSpec> {
    let v4 = ["10.2.0.2:8080", "10.2.0.3:8080", "10.2.0.4:8080"];
    let v6 = ["[fd02::2]:8080", "[fd02::3]:8080"];
    vec![
        service(VIP4.into(), 80, None, &v4),
        service(VIP4.into(), 443, Some("10.2.0.1"), &v4),
        service(VIP6.parse().unwrap(), 80, None, &v6),
        service(VIP6.parse().unwrap(), 443, Some("fd02::1"), &v6),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Flow {
    client: IpAddr,
    sport: u16,
    vip: IpAddr,
    dport: u16,
}

fn random_flow(rng: &mut Rng) -> Flow {
    let r = rng.next();
    let v6 = r & 1 == 1;
    let dport = if r & 2 == 0 { 80 } else { 443 };
    let sport = 1024 + (rng.next() % 60000) as u16;
    let host = rng.next();
    let (client, vip) = if v6 {
        (
            IpAddr::V6(Ipv6Addr::new(
                0x2001,
                0xdb8,
                0xc1,
                0,
                0,
                0,
                (host >> 16) as u16,
                host as u16,
            )),
            VIP6.parse().unwrap(),
        )
    } else {
        (
            IpAddr::V4(Ipv4Addr::new(
                198,
                51,
                (host >> 8) as u8 % 100 + 100,
                host as u8,
            )),
            IpAddr::V4(VIP4),
        )
    };
    Flow {
        client,
        sport,
        vip,
        dport,
    }
}

/// A TCP segment of `flow` from the client side.
fn packet(flow: &Flow, flags: u8) -> Vec<u8> {
    let tcp = Tcp::new(flow.sport, flow.dport).seq(1).ack(1).flags(flags);
    let b = PacketBuilder::new().eth(CLIENT_MAC, CL0_MAC);
    match (flow.client, flow.vip) {
        (IpAddr::V4(c), IpAddr::V4(v)) => b.ipv4(Ipv4::new(c, v)).tcp(tcp).build(),
        (IpAddr::V6(c), IpAddr::V6(v)) => b.ipv6(Ipv6::new(c, v)).tcp(tcp).build(),
        _ => unreachable!(),
    }
}

/// Where the program sent the packet (its rewritten destination).
fn kernel_backend(bed: &FixtureBed, flow: &Flow, flags: u8) -> SocketAddr {
    let (verdict, out, _) = test_run(bed.dp.program(), bed.cl0, &packet(flow, flags));
    assert_ne!(verdict, XDP_DROP, "{flow:?} was dropped");
    let p = parse(&out).unwrap();
    SocketAddr::new(p.dst, p.dport.unwrap())
}

/// What `lbctl trace` says the flow's backend is, and what decided it.
fn traced(pin_dir: &PathBuf, flow: &Flow) -> (SocketAddr, String) {
    let out = Command::new(lbctl_bin())
        .arg("--pin-dir")
        .arg(pin_dir)
        .args([
            "--json",
            "trace",
            &flow.client.to_string(),
            &flow.vip.to_string(),
            &flow.sport.to_string(),
            &flow.dport.to_string(),
            "tcp",
        ])
        .output()
        .expect("run lbctl");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let backend = v["backend"]
        .as_str()
        .unwrap_or_else(|| panic!("no backend for {flow:?}: {v}"))
        .parse()
        .unwrap();
    (
        backend,
        v["decided_by"].as_str().unwrap_or_default().to_string(),
    )
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; one bit set, applied to this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// Checks every flow: the program's backend equals trace's, and trace was
/// decided by `want` (`None`: any).
fn check(bed: &FixtureBed, pins: &PathBuf, flows: &[Flow], flags: u8, want: Option<&str>) -> usize {
    let mut mismatches = Vec::new();
    for f in flows {
        // Trace first: it must predict what the packet will do.
        let (predicted, by) = traced(pins, f);
        let actual = kernel_backend(bed, f, flags);
        if predicted != actual || want.is_some_and(|w| w != by) {
            mismatches.push(format!(
                "{f:?}: trace says {predicted} ({by}), the program sent it to {actual}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    flows.len()
}

#[test]
fn trace_names_the_backend_the_program_picks_needs_root() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(cpus >= 2, "this test moves flows between two CPUs");
    let pins = PathBuf::from(format!("/sys/fs/bpf/xlb-test-trace-{}", std::process::id()));
    let _ = Dataplane::cleanup(&pins);
    let mut bed = FixtureBed::with_pins("xlb-trace", Some(&pins));
    for s in services() {
        bed.dp.set_service(&s).unwrap();
    }
    let mut rng = Rng(0x786c_6221_7472_6163);
    let first: Vec<Flow> = (0..60).map(|_| random_flow(&mut rng)).collect();

    // New flows on CPU 0: the Maglev pick (SNAT ports included).
    pin_to_cpu(0);
    let mut checked = check(&bed, &pins, &first, tcp_flags::SYN, Some("maglev"));

    // The backends change: remembered flows keep theirs (CPU 0's table),
    // new flows follow the new tables.
    let mut changed = services();
    changed[0].backends = backends(&["10.2.0.3:8080", "10.2.0.4:8080"]);
    changed[1].backends = backends(&["10.2.0.2:8080"]);
    changed[2].backends = backends(&["[fd02::3]:8080"]);
    for s in &changed {
        bed.dp.set_service(s).unwrap();
    }
    checked += check(&bed, &pins, &first, tcp_flags::ACK, Some("conntrack"));
    let second: Vec<Flow> = (0..40).map(|_| random_flow(&mut rng)).collect();
    checked += check(&bed, &pins, &second, tcp_flags::SYN, Some("maglev"));

    // The first flows arrive on CPU 1, which never saw them: the shared table.
    pin_to_cpu(1);
    let unseen: Vec<Flow> = first.iter().copied().filter(|f| f.dport == 80).collect();
    checked += check(&bed, &pins, &unseen, tcp_flags::ACK, None);

    // Session affinity: the client address alone decides.
    pin_to_cpu(0);
    for s in &mut changed {
        s.client_affinity = true;
        s.backends = services()
            .into_iter()
            .find(|o| o.key() == s.key())
            .unwrap()
            .backends;
        bed.dp.set_service(s).unwrap();
    }
    let third: Vec<Flow> = (0..40).map(|_| random_flow(&mut rng)).collect();
    checked += check(&bed, &pins, &third, tcp_flags::SYN, Some("maglev"));

    // Load-aware: the least loaded of three candidates, by the program's own
    // counts (a thousand apart, so the flows checked here do not tip them).
    for s in &mut changed {
        s.client_affinity = false;
        s.least_loaded = true;
        bed.dp.set_service(s).unwrap();
        for (i, b) in s.backends.iter().enumerate() {
            let id = bed.dp.backend_id(&s.key(), b.addr).unwrap();
            bed.dp
                .set_backend_active(id, (i as u64 * 7 % 3) * 1000)
                .unwrap();
        }
    }
    let fourth: Vec<Flow> = (0..40).map(|_| random_flow(&mut rng)).collect();
    checked += check(&bed, &pins, &fourth, tcp_flags::SYN, Some("maglev"));
    assert!(checked >= 240, "{checked} flows checked");
    drop(bed);
    let _ = Dataplane::cleanup(&pins);
}
