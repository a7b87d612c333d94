//! Generated frames through the real XDP program (BPF_PROG_TEST_RUN):
//! mutations of the frames it meets (clients' TCP and UDP to nat and snat
//! services, IPv4 and IPv6, backends' replies, ICMP, ARP, VLAN, traffic for
//! others) and random bytes. On every frame:
//! - a frame addressed to another MAC, or not for a VIP, from no backend
//!   and not ICMP, leaves unchanged (passed as it came);
//! - a translated frame whose input had valid checksums has valid checksums;
//! - a translated frame, addressed to the node again, is not translated a
//!   second time;
//!
//! and over the run, the reason counters add up to the frames sent.
//! `XLB_XDP_FRAMES` sets how many (20,000 here; `cargo xtask fuzz` runs
//! millions), `XLB_XDP_SEED` the seed (printed, to replay a failure).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use lb_agent::dataplane::{BackendSpec, Dataplane, Protocol, ServiceSpec};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use xlb_tests::{
    packet::{
        tcp_flags, verify_checksums, Icmpv4, Icmpv6, Ipv4, Ipv6, Mac, PacketBuilder, Quote, Tcp,
        Udp,
    },
    xdp::{test_run, FixtureBed},
};

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

const CL0_MAC: Mac = [2, 0, 0, 0, 1, 0];
const BE0_MAC: Mac = [2, 0, 0, 0, 2, 0];
const CLIENT_MAC: Mac = [2, 0, 0, 0, 1, 2];
const B2_MAC: Mac = [2, 0, 0, 0, 2, 2];
const B3_MAC: Mac = [2, 0, 0, 0, 2, 3];

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const OTHER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 77);
const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const B2: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 2);
const B3: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 3);
const SNAT4: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 1);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x10);
const B6: Ipv6Addr = Ipv6Addr::new(0xfd02, 0, 0, 0, 0, 0, 0, 2);
const SNAT6: Ipv6Addr = Ipv6Addr::new(0xfd02, 0, 0, 0, 0, 0, 0, 1);

fn service(
    vip: IpAddr,
    port: u16,
    p: Protocol,
    snat: Option<IpAddr>,
    b: (IpAddr, u16),
) -> ServiceSpec {
    ServiceSpec {
        snat,
        backends: vec![BackendSpec {
            addr: SocketAddr::new(b.0, b.1),
            weight: 1,
        }],
        ..ServiceSpec::new(vip, port, p, [])
    }
}

fn services() -> Vec<ServiceSpec> {
    use Protocol::*;
    vec![
        service(VIP.into(), 80, Tcp, None, (B2.into(), 8080)),
        service(VIP.into(), 53, Udp, None, (B2.into(), 5353)),
        service(VIP.into(), 443, Tcp, Some(SNAT4.into()), (B3.into(), 8443)),
        service(VIP6.into(), 80, Tcp, None, (B6.into(), 8080)),
        service(VIP6.into(), 443, Tcp, Some(SNAT6.into()), (B6.into(), 8443)),
    ]
}

/// Where a frame enters.
#[derive(Clone, Copy)]
enum Side {
    Clients,
    Backends,
}

fn seeds() -> Vec<(Side, Vec<u8>)> {
    let c = || PacketBuilder::new().eth(CLIENT_MAC, CL0_MAC);
    let b = |mac| PacketBuilder::new().eth(mac, BE0_MAC);
    let tcp = |s, d, f| {
        Tcp::new(s, d)
            .seq(1000)
            .ack(5001)
            .flags(f)
            .payload(b"GET /")
    };
    let v4 = |s, d| Ipv4::new(s, d).ttl(64);
    let v6 = |s, d| Ipv6::new(s, d).hop_limit(64);
    let syn = tcp_flags::SYN;
    let ack = tcp_flags::ACK;
    let inner = c()
        .ipv4(v4(CLIENT, VIP))
        .tcp(tcp(40000, 80, ack))
        .build_ip();
    vec![
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP)).tcp(tcp(40000, 80, syn)).build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP)).tcp(tcp(40000, 80, ack)).build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP)).tcp(tcp(40001, 443, syn)).build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP))
                .tcp(tcp(40001, 443, tcp_flags::FIN | ack))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP))
                .tcp(tcp(40002, 80, tcp_flags::RST))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP))
                .udp(Udp::new(5000, 53).payload(b"q"))
                .build(),
        ),
        (
            Side::Clients,
            c().vlan(7)
                .ipv4(v4(CLIENT, VIP))
                .tcp(tcp(40003, 80, syn))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP).options(&[1, 1, 1, 0]))
                .tcp(tcp(40004, 80, syn))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP).mf(true))
                .tcp(tcp(40005, 80, syn))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv6(v6(CLIENT6, VIP6)).tcp(tcp(40000, 80, syn)).build(),
        ),
        (
            Side::Clients,
            c().ipv6(v6(CLIENT6, VIP6))
                .tcp(tcp(40001, 443, ack))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, VIP))
                .icmpv4(Icmpv4::echo_request(1, 1))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv6(v6(CLIENT6, VIP6))
                .icmpv6(Icmpv6::echo_request(1, 1))
                .build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(CLIENT, OTHER)).tcp(tcp(40000, 80, syn)).build(),
        ),
        (
            Side::Clients,
            c().ipv4(v4(OTHER, VIP))
                .icmpv4(Icmpv4::frag_needed(1400, &inner, Quote::All))
                .build(),
        ),
        (
            Side::Backends,
            b(B2_MAC)
                .ipv4(v4(B2, CLIENT))
                .tcp(tcp(8080, 40000, syn | ack))
                .build(),
        ),
        (
            Side::Backends,
            b(B3_MAC)
                .ipv4(v4(B3, SNAT4))
                .tcp(tcp(8443, 20000, ack))
                .build(),
        ),
        (
            Side::Backends,
            b(B2_MAC)
                .ipv4(v4(B2, CLIENT))
                .udp(Udp::new(5353, 5000).payload(b"a"))
                .build(),
        ),
        (
            Side::Backends,
            b(B2_MAC)
                .ipv6(v6(B6, CLIENT6))
                .tcp(tcp(8080, 40000, ack))
                .build(),
        ),
        (
            Side::Backends,
            b(B2_MAC)
                .ipv4(v4(B2, OTHER))
                .tcp(tcp(22, 40000, ack))
                .build(),
        ),
        (Side::Clients, {
            // An ARP request for the VIP (no L2 mode here: passed).
            let mut f = vec![0xff; 6];
            f.extend_from_slice(&CLIENT_MAC);
            f.extend_from_slice(&[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
            f.extend_from_slice(&CLIENT_MAC);
            f.extend_from_slice(&CLIENT.octets());
            f.extend_from_slice(&[0; 6]);
            f.extend_from_slice(&VIP.octets());
            f
        }),
    ]
}

/// A number below `n` (at least 1).
fn below(rng: &mut SmallRng, n: usize) -> usize {
    rng.random_range(0..n.max(1))
}

/// The shortest frame a NIC hands XDP (and BPF_PROG_TEST_RUN takes): an
/// Ethernet header.
const MIN_FRAME: usize = 14;

/// One to four mutations of `seed`, or random bytes one time in sixteen;
/// never shorter than [`MIN_FRAME`].
fn mutate(rng: &mut SmallRng, seed: &[u8]) -> Vec<u8> {
    if below(rng, 16) == 0 {
        let len = MIN_FRAME + below(rng, 200);
        return (0..len).map(|_| rng.random::<u8>()).collect();
    }
    let mut f = seed.to_vec();
    for _ in 0..1 + below(rng, 4) {
        match below(rng, 5) {
            0 if !f.is_empty() => {
                let i = below(rng, f.len());
                f[i] ^= 1 << below(rng, 8);
            }
            1 if !f.is_empty() => {
                let i = below(rng, f.len());
                f[i] = rng.random::<u8>();
            }
            2 => f.truncate(MIN_FRAME + below(rng, f.len().saturating_sub(MIN_FRAME) + 1)),
            3 => f.extend((0..below(rng, 40)).map(|_| rng.random::<u8>())),
            _ => {}
        }
    }
    f
}

/// The IP source, destination and protocol (IPv4) or next header (IPv6)
/// of `f`, read from the IP header alone (after at most one VLAN tag).
fn ip_header(f: &[u8]) -> Option<(IpAddr, IpAddr, u8)> {
    let mut at = 12;
    let mut ethertype = u16::from_be_bytes(f.get(at..at + 2)?.try_into().ok()?);
    if ethertype == 0x8100 {
        at += 4;
        ethertype = u16::from_be_bytes(f.get(at..at + 2)?.try_into().ok()?);
    }
    let ip = f.get(at + 2..)?;
    match ethertype {
        0x0800 if ip.len() >= 20 => {
            let addr = |o: usize| IpAddr::from(<[u8; 4]>::try_from(&ip[o..o + 4]).unwrap());
            Some((addr(12), addr(16), ip[9]))
        }
        0x86dd if ip.len() >= 40 => {
            let addr = |o: usize| IpAddr::from(<[u8; 16]>::try_from(&ip[o..o + 16]).unwrap());
            Some((addr(8), addr(24), ip[6]))
        }
        _ => None,
    }
}

/// Whether the program may change `f`: addressed to one of the node's
/// interfaces (or a group address), and for a VIP, from a backend, or ICMP
/// (errors quoting a flow are translated).
fn may_change(f: &[u8]) -> bool {
    let to_us = f[..6] == CL0_MAC || f[..6] == BE0_MAC || f[0] & 1 == 1;
    let Some((src, dst, proto)) = ip_header(f).filter(|_| to_us) else {
        return false;
    };
    let vips: [IpAddr; 2] = [VIP.into(), VIP6.into()];
    let backends: [IpAddr; 3] = [B2.into(), B3.into(), B6.into()];
    vips.contains(&dst) || backends.contains(&src) || proto == 1 || proto == 58
}

fn total(dp: &Dataplane) -> u64 {
    dp.reason_counts().unwrap().iter().sum()
}

#[test]
fn generated_frames_keep_the_invariants_needs_root() {
    let frames: usize = std::env::var("XLB_XDP_FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("XLB_XDP_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("XLB_XDP_SEED={seed} XLB_XDP_FRAMES={frames}");
    let FixtureBed {
        mut dp,
        cl0,
        be0,
        ns: _ns,
    } = FixtureBed::new("xlb-xdp-generated");
    for s in services() {
        dp.set_service(&s).unwrap();
    }
    let seeds = seeds();
    let mut rng = SmallRng::seed_from_u64(seed);
    let before = total(&dp);
    let mut runs = 0u64;
    let (mut translated, mut unchanged) = (0u64, 0u64);
    for n in 0..frames {
        let (side, base) = &seeds[below(&mut rng, seeds.len())];
        let f = if below(&mut rng, 8) == 0 {
            base.clone()
        } else {
            mutate(&mut rng, base)
        };
        let ingress = match side {
            Side::Clients => cl0,
            Side::Backends => be0,
        };
        let (verdict, out, _) = test_run(dp.program(), ingress, &f);
        runs += 1;
        let what = || {
            format!("frame {n} (seed {seed}): verdict {verdict}\nin:  {f:02x?}\nout: {out:02x?}")
        };
        if !may_change(&f) {
            assert!(
                verdict == XDP_PASS && out == f,
                "a frame for no VIP and from no backend was changed: {}",
                what()
            );
        }
        if out == f {
            unchanged += 1;
            continue;
        }
        assert!(
            [XDP_PASS, XDP_TX, XDP_REDIRECT].contains(&verdict),
            "changed and dropped? {}",
            what()
        );
        translated += 1;
        if verify_checksums(&f).is_ok() {
            if let Err(e) = verify_checksums(&out) {
                panic!("translated with a bad checksum ({e}): {}", what());
            }
        }
        // Addressed to the node again, on the side it went to: not for a
        // VIP any more, so not translated again.
        let to_backend = out.len() >= 6 && [B2_MAC, B3_MAC].iter().any(|m| out[..6] == *m);
        let back_in = match verdict {
            XDP_REDIRECT if to_backend => be0,
            XDP_REDIRECT => cl0,
            _ => ingress,
        };
        let mut again = out.clone();
        if again.len() >= 12 {
            again[..6].copy_from_slice(if back_in == be0 { &BE0_MAC } else { &CL0_MAC });
        }
        if !may_change(&again) {
            let (v2, out2, _) = test_run(dp.program(), back_in, &again);
            runs += 1;
            assert!(
                v2 == XDP_PASS && out2 == again,
                "translated twice: verdict {v2}\nsecond: {out2:02x?}\n{}",
                what()
            );
        }
    }
    println!("{frames} frames: {translated} translated, {unchanged} unchanged");
    assert!(
        translated > frames as u64 / 100,
        "too few translated to mean much"
    );
    assert_eq!(
        total(&dp) - before,
        runs,
        "the reason counters do not add up to the frames run (seed {seed})"
    );
}
