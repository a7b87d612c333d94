//! The forwarding benchmark's traffic source (`xlb_trafficgen`, run with
//! BPF_PROG_RUN live frames) holds to what the benchmark reports: every
//! frame it is asked for leaves the interface, each with the next source
//! port, and with checksums the receiving kernel accepts (it drops a UDP
//! datagram or TCP segment whose checksum is wrong and counts it). Needs root.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, UdpSocket},
    time::Duration,
};

use lb_agent::netif::ifindex;
use xlb_tests::{
    netns::Netns,
    packet::{Ipv4, PacketBuilder, Tcp, Udp},
    topology::{set_affinity, set_rcvbuf},
    traffic::wait_until,
    xdp::{generate_live, load_bench_programs},
};

const TX_MAC: [u8; 6] = [2, 0, 0, 0, 9, 1];
const RX_MAC: [u8; 6] = [2, 0, 0, 0, 9, 2];
const TX_IP: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
const RX_IP: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
const FIRST_PORT: u16 = 1024;

/// `tx` holds g0 (10.9.0.1), `rx` holds g1 (10.9.0.2, GRO on: a veth takes
/// XDP frames only with NAPI on).
fn pair(prefix: &str) -> (Netns, Netns) {
    let tx = Netns::new(&format!("{prefix}-tx"));
    let rx = Netns::new(&format!("{prefix}-rx"));
    xlb_tests::netns::sh(&format!(
        "ip link add g0 netns {} type veth peer name g1 netns {}",
        tx.name, rx.name
    ));
    let mac = |m: [u8; 6]| m.map(|b| format!("{b:02x}")).join(":");
    tx.run(&format!(
        "ip link set g0 address {} && ip addr add {TX_IP}/24 dev g0 && ip link set g0 up",
        mac(TX_MAC)
    ));
    rx.run(&format!(
        "ip link set g1 address {} && ip addr add {RX_IP}/24 dev g1 && ip link set g1 up \
         && ethtool -K g1 gro on >/dev/null && ip neigh add {TX_IP} lladdr {} dev g1 nud permanent",
        mac(RX_MAC),
        mac(TX_MAC)
    ));
    (tx, rx)
}

/// Runs the generator for `frames` copies of `frame` out of g0, on one CPU
/// (the source port counter is per CPU).
fn generate(tx: &Netns, frame: Vec<u8>, frames: u32) {
    let name = tx.name.clone();
    std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        set_affinity(0, &[xlb_tests::topology::allowed_cpus()[0]]);
        let mut ebpf = load_bench_programs().expect("load the bench programs (root needed)");
        let g0 = ifindex("g0").expect("g0");
        generate_live(&mut ebpf, g0, &frame, frames).expect("generate");
    })
    .join()
    .expect("generator thread");
}

/// `field` of protocol `proto` in the namespace's /proc/net/snmp.
fn snmp(ns: &Netns, proto: &str, field: &str) -> u64 {
    let (name, proto, field) = (ns.name.clone(), proto.to_string(), field.to_string());
    std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        let text = std::fs::read_to_string("/proc/thread-self/net/snmp").unwrap();
        let mut lines = text.lines().filter(|l| l.starts_with(&format!("{proto}:")));
        let (head, values) = (lines.next().unwrap(), lines.next().unwrap());
        let i = head
            .split_whitespace()
            .position(|h| h == field)
            .unwrap_or_else(|| panic!("no {proto} {field} in /proc/net/snmp"));
        values.split_whitespace().nth(i).unwrap().parse().unwrap()
    })
    .join()
    .unwrap()
}

#[test]
fn every_udp_frame_arrives_once_with_its_own_source_port_and_a_good_checksum() {
    let (tx, rx) = pair("xlb-gen-udp");
    const FRAMES: u32 = 1000;
    let name = rx.name.clone();
    let receiver = std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        let sock = UdpSocket::bind((RX_IP, 5353)).unwrap();
        set_rcvbuf(&sock, 8 << 20);
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        sock
    })
    .join()
    .unwrap();
    let frame = PacketBuilder::new()
        .eth(TX_MAC, RX_MAC)
        .ipv4(Ipv4::new(TX_IP, RX_IP))
        .udp(Udp::new(FIRST_PORT, 5353).payload(b"xlb-trafficgen-test"))
        .build();
    generate(&tx, frame, FRAMES);

    let mut ports = Vec::new();
    let mut buf = [0u8; 64];
    while let Ok((n, from)) = sock_recv(&receiver, &mut buf) {
        assert_eq!(&buf[..n], b"xlb-trafficgen-test");
        assert_eq!(from.0, TX_IP);
        ports.push(from.1);
    }
    assert_eq!(snmp(&rx, "Udp", "InCsumErrors"), 0, "bad UDP checksums");
    assert_eq!(ports.len(), FRAMES as usize, "datagrams received");
    let distinct: BTreeSet<u16> = ports.iter().copied().collect();
    let expected: BTreeSet<u16> = (FIRST_PORT..FIRST_PORT + FRAMES as u16).collect();
    assert_eq!(distinct, expected, "one datagram from each port 1024..2023");
}

fn sock_recv(sock: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, (Ipv4Addr, u16))> {
    let (n, from) = sock.recv_from(buf)?;
    match from {
        std::net::SocketAddr::V4(a) => Ok((n, (*a.ip(), a.port()))),
        other => panic!("datagram from {other}"),
    }
}

#[test]
fn every_tcp_syn_reaches_the_receiving_stack_with_a_good_checksum() {
    let (tx, rx) = pair("xlb-gen-tcp");
    const FRAMES: u32 = 200;
    let frame = PacketBuilder::new()
        .eth(TX_MAC, RX_MAC)
        .ipv4(Ipv4::new(TX_IP, RX_IP))
        .tcp(Tcp::new(FIRST_PORT, 9).seq(7).flags(0x02).window(64240))
        .build();
    let (segs0, rsts0) = (snmp(&rx, "Tcp", "InSegs"), snmp(&rx, "Tcp", "OutRsts"));
    generate(&tx, frame, FRAMES);
    // Port 9 is closed: each valid SYN is refused with a reset of its own.
    let rsts = wait_until("a reset for every SYN", Duration::from_secs(5), || {
        let n = snmp(&rx, "Tcp", "OutRsts") - rsts0;
        (n >= FRAMES as u64).then_some(n)
    });
    assert_eq!(snmp(&rx, "Tcp", "InCsumErrors"), 0, "bad TCP checksums");
    assert_eq!(
        snmp(&rx, "Tcp", "InSegs") - segs0,
        FRAMES as u64,
        "SYNs received"
    );
    assert_eq!(rsts, FRAMES as u64, "SYNs answered");
}
