//! The data plane, packet by packet (needs root): every fixture runs the
//! real XDP program through BPF_PROG_TEST_RUN inside a network namespace
//! whose routes and neighbours make `bpf_fib_lookup` answer, and checks the
//! verdict, the whole output frame (checksums recomputed from scratch), and
//! that exactly the counters it should move did.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use lb_agent::dataplane::{
    BackendSpec, Dataplane, HandedFlow, Handing, Imported, MapSizes, Protocol, ServiceSpec,
};
use lb_common::{Config, Reason, REASON_COUNT};
use xlb_tests::{
    packet::{
        hexdump_diff, tcp_flags, verify_checksums, ExtHeader, Icmpv4, Icmpv6, Ipv4, Ipv6, Mac,
        PacketBuilder, Quote, Tcp, Udp,
    },
    xdp::{test_run, FixtureBed},
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

// The namespace's interfaces and neighbours.
const CL0_MAC: Mac = [2, 0, 0, 0, 1, 0];
const BE0_MAC: Mac = [2, 0, 0, 0, 2, 0];
const CLIENT_MAC: Mac = [2, 0, 0, 0, 1, 2];
const ROUTER_MAC: Mac = [2, 0, 0, 0, 1, 0xfe];
const B2_MAC: Mac = [2, 0, 0, 0, 2, 2];
const B3_MAC: Mac = [2, 0, 0, 0, 2, 3];
const B4_MAC: Mac = [2, 0, 0, 0, 2, 4];
/// Another host's MAC on each side: frames a promiscuous interface or a
/// flooding switch hands over, addressed to neither cl0 nor be0.
const OTHER_NODE_MAC: Mac = [2, 0, 0, 0, 1, 0x99];
const OTHER_BE_SIDE_MAC: Mac = [2, 0, 0, 0, 2, 0x99];

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const REMOTE_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const ROUTER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 254);
const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);
const VIP_NONEIGH: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 12);
const VIP_MULTI: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 13);
const B2: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 2);
const B3: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 3);
const B4: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 4);
const SNAT4: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 1);

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

fn client6() -> Ipv6Addr {
    v6("fd00::2")
}
fn vip6() -> Ipv6Addr {
    v6("2001:db8::10")
}
fn b6_2() -> Ipv6Addr {
    v6("fd02::2")
}
fn b6_3() -> Ipv6Addr {
    v6("fd02::3")
}
fn snat6() -> Ipv6Addr {
    v6("fd02::1")
}

fn backends(list: &[(IpAddr, u16)]) -> Vec<BackendSpec> {
    list.iter()
        .map(|&(ip, port)| BackendSpec {
            addr: SocketAddr::new(ip, port),
            weight: 1,
        })
        .collect()
}

fn svc(
    vip: IpAddr,
    port: u16,
    protocol: Protocol,
    snat: Option<IpAddr>,
    b: &[(IpAddr, u16)],
) -> ServiceSpec {
    ServiceSpec {
        snat,
        backends: backends(b),
        ..ServiceSpec::new(vip, port, protocol, [])
    }
}

fn base_services() -> Vec<ServiceSpec> {
    use Protocol::*;
    vec![
        svc(VIP.into(), 80, Tcp, None, &[(B2.into(), 8080)]),
        svc(VIP.into(), 53, Udp, None, &[(B2.into(), 5353)]),
        svc(
            VIP.into(),
            443,
            Tcp,
            Some(SNAT4.into()),
            &[(B3.into(), 8443)],
        ),
        svc(
            VIP.into(),
            54,
            Udp,
            Some(SNAT4.into()),
            &[(B3.into(), 5353)],
        ),
        svc(vip6().into(), 80, Tcp, None, &[(b6_2().into(), 8080)]),
        svc(
            vip6().into(),
            53,
            Udp,
            Some(snat6().into()),
            &[(b6_3().into(), 5353)],
        ),
        svc(
            vip6().into(),
            443,
            Tcp,
            Some(snat6().into()),
            &[(b6_3().into(), 8443)],
        ),
        svc(VIP_EMPTY.into(), 80, Tcp, None, &[]),
        svc(
            VIP_NONEIGH.into(),
            80,
            Tcp,
            None,
            &[(Ipv4Addr::new(10, 2, 0, 99).into(), 8080)],
        ),
        svc(
            VIP_MULTI.into(),
            80,
            Tcp,
            None,
            &[(B2.into(), 8080), (B3.into(), 8080), (B4.into(), 8080)],
        ),
    ]
}

// ---- Frame builders: client side and backend side. ----

fn from_client() -> PacketBuilder {
    PacketBuilder::new().eth(CLIENT_MAC, CL0_MAC)
}
fn to_backend(mac: Mac) -> PacketBuilder {
    PacketBuilder::new().eth(BE0_MAC, mac)
}
fn from_backend(mac: Mac) -> PacketBuilder {
    PacketBuilder::new().eth(mac, BE0_MAC)
}
fn to_client() -> PacketBuilder {
    PacketBuilder::new().eth(CL0_MAC, CLIENT_MAC)
}
fn ip4(src: Ipv4Addr, dst: Ipv4Addr, ttl: u8) -> Ipv4 {
    Ipv4::new(src, dst).ttl(ttl)
}
fn ip6(src: Ipv6Addr, dst: Ipv6Addr, hl: u8) -> Ipv6 {
    Ipv6::new(src, dst).hop_limit(hl)
}
fn syn(sport: u16, dport: u16) -> Tcp {
    Tcp::new(sport, dport)
        .seq(1000)
        .flags(tcp_flags::SYN)
        .payload(b"")
}
fn ack(sport: u16, dport: u16) -> Tcp {
    Tcp::new(sport, dport)
        .seq(1001)
        .ack(5001)
        .flags(tcp_flags::ACK)
        .payload(b"GET / HTTP/1.1\r\n\r\n")
}
fn synack(sport: u16, dport: u16) -> Tcp {
    Tcp::new(sport, dport)
        .seq(5000)
        .ack(1001)
        .flags(tcp_flags::SYN | tcp_flags::ACK)
}
fn udp(sport: u16, dport: u16) -> Udp {
    Udp::new(sport, dport).payload(b"query")
}

/// Where a fixture's packet enters.
#[derive(Clone, Copy, Debug)]
enum Ingress {
    Clients,
    Backends,
}

/// Which counters a fixture must move (besides exactly one reason).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Traffic {
    None,
    /// Forward packet counted on (service index in `base_services`, backend addr); new flow?
    Forward(usize, SocketAddr, bool),
    /// Reply packet counted on (service index, backend addr).
    Reply(usize, SocketAddr),
}

struct Fixture {
    name: &'static str,
    /// Packets sent first (their verdicts must not be drops).
    before: Vec<(Ingress, Vec<u8>)>,
    /// Applied (to the base services) before `before` runs.
    change: Option<fn(&mut Dataplane)>,
    ingress: Ingress,
    input: Vec<u8>,
    verdict: u32,
    reason: Reason,
    /// Expected output frame; `None`: the input, unchanged.
    output: Option<Vec<u8>>,
    traffic: Traffic,
}

fn fx(
    name: &'static str,
    ingress: Ingress,
    input: Vec<u8>,
    verdict: u32,
    reason: Reason,
) -> Fixture {
    Fixture {
        name,
        before: vec![],
        change: None,
        ingress,
        input,
        verdict,
        reason,
        output: None,
        traffic: Traffic::None,
    }
}

impl Fixture {
    fn out(mut self, output: Vec<u8>) -> Self {
        self.output = Some(output);
        self
    }
    fn after(mut self, ingress: Ingress, pkt: Vec<u8>) -> Self {
        self.before.push((ingress, pkt));
        self
    }
    fn traffic(mut self, t: Traffic) -> Self {
        self.traffic = t;
        self
    }
    fn change(mut self, f: fn(&mut Dataplane)) -> Self {
        self.change = Some(f);
        self
    }
}

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// The SNAT port the program picks first for a flow (its first probe).
fn first_snat_port(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, proto: u8) -> u16 {
    let key = lb_common::FlowKey {
        src: lb_common::net::ip_words(src),
        dst: lb_common::net::ip_words(dst),
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        family: lb_common::net::Family::of(src).number(),
        _pad: [0; 2],
    };
    let h = lb_common::hash::flow_hash(&key);
    lb_common::hash::snat_port_candidate(
        h,
        0,
        lb_common::DEFAULT_SNAT_PORT_MIN,
        lb_common::DEFAULT_SNAT_PORT_MAX,
    )
}

fn fixtures() -> Vec<Fixture> {
    use Ingress::*;
    use Reason::*;
    let c4 = |t: Tcp| from_client().ipv4(ip4(CLIENT, VIP, 64)).tcp(t).build();
    let mut v = vec![
        // ---- IPv4 TCP, NAT mode ----
        fx(
            "v4 tcp syn to VIP is DNATed and redirected to the backend",
            Clients,
            c4(syn(40000, 80)),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(syn(40000, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
        fx(
            "v4 tcp established packet follows its flow",
            Clients,
            c4(ack(40000, 80)),
            XDP_REDIRECT,
            Redirect,
        )
        .after(Clients, c4(syn(40000, 80)))
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(ack(40000, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), false)),
        fx(
            "v4 tcp from a routed client keeps the client address (NAT mode)",
            Clients,
            from_client()
                .eth(ROUTER_MAC, CL0_MAC)
                .ipv4(ip4(REMOTE_CLIENT, VIP, 50))
                .tcp(syn(41000, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(REMOTE_CLIENT, B2, 49))
                .tcp(syn(41000, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
        fx(
            "v4 tcp reply is translated back to the VIP and sent to the client",
            Backends,
            from_backend(B2_MAC)
                .ipv4(ip4(B2, CLIENT, 64))
                .tcp(synack(8080, 40000))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .after(Clients, c4(syn(40000, 80)))
        .out(to_client().ipv4(ip4(VIP, CLIENT, 63)).tcp(synack(80, 40000)).build())
        .traffic(Traffic::Reply(0, sa(B2, 8080))),
        fx(
            "v4 tcp reply to a routed client goes out through the router",
            Backends,
            from_backend(B2_MAC)
                .ipv4(ip4(B2, REMOTE_CLIENT, 64))
                .tcp(synack(8080, 41000))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .after(
            Clients,
            from_client()
                .ipv4(ip4(REMOTE_CLIENT, VIP, 50))
                .tcp(syn(41000, 80))
                .build(),
        )
        .out(
            PacketBuilder::new()
                .eth(CL0_MAC, ROUTER_MAC)
                .ipv4(ip4(VIP, REMOTE_CLIENT, 63))
                .tcp(synack(80, 41000))
                .build(),
        )
        .traffic(Traffic::Reply(0, sa(B2, 8080))),
        fx(
            "v4 packet from a backend port with no flow passes untouched",
            Backends,
            from_backend(B2_MAC)
                .ipv4(ip4(B2, CLIENT, 64))
                .tcp(synack(8080, 40999))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "v4 tcp FIN keeps the flow and is forwarded",
            Clients,
            c4(Tcp::new(40000, 80)
                .seq(2000)
                .ack(6000)
                .flags(tcp_flags::FIN | tcp_flags::ACK)),
            XDP_REDIRECT,
            Redirect,
        )
        .after(Clients, c4(syn(40000, 80)))
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(
                    Tcp::new(40000, 8080)
                        .seq(2000)
                        .ack(6000)
                        .flags(tcp_flags::FIN | tcp_flags::ACK),
                )
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), false)),
        // ---- IPv4 UDP ----
        fx(
            "v4 udp to VIP is DNATed",
            Clients,
            from_client().ipv4(ip4(CLIENT, VIP, 64)).udp(udp(40001, 53)).build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .udp(udp(40001, 5353))
                .build(),
        )
        .traffic(Traffic::Forward(1, sa(B2, 5353), true)),
        fx(
            "v4 udp with checksum 0 keeps checksum 0",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64))
                .udp(udp(40002, 53).zero_checksum())
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .udp(udp(40002, 5353).zero_checksum())
                .build(),
        )
        .traffic(Traffic::Forward(1, sa(B2, 5353), true)),
        fx(
            "v4 udp reply is translated back",
            Backends,
            from_backend(B2_MAC)
                .ipv4(ip4(B2, CLIENT, 64))
                .udp(udp(5353, 40001))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .after(
            Clients,
            from_client().ipv4(ip4(CLIENT, VIP, 64)).udp(udp(40001, 53)).build(),
        )
        .out(to_client().ipv4(ip4(VIP, CLIENT, 63)).udp(udp(53, 40001)).build())
        .traffic(Traffic::Reply(1, sa(B2, 5353))),
        // ---- SNAT mode ----
        {
            let p = first_snat_port(CLIENT.into(), VIP.into(), 40010, 443, 6);
            fx(
                "v4 tcp snat rewrites source to the node address and an allocated port",
                Clients,
                c4(syn(40010, 443)),
                XDP_REDIRECT,
                Redirect,
            )
            .out(to_backend(B3_MAC).ipv4(ip4(SNAT4, B3, 63)).tcp(syn(p, 8443)).build())
            .traffic(Traffic::Forward(2, sa(B3, 8443), true))
        },
        {
            let p = first_snat_port(CLIENT.into(), VIP.into(), 40010, 443, 6);
            fx(
                "v4 tcp snat reply goes back to the client from the VIP",
                Backends,
                from_backend(B3_MAC)
                    .ipv4(ip4(B3, SNAT4, 64))
                    .tcp(synack(8443, p))
                    .build(),
                XDP_REDIRECT,
                Redirect,
            )
            .after(Clients, c4(syn(40010, 443)))
            .out(to_client().ipv4(ip4(VIP, CLIENT, 63)).tcp(synack(443, 40010)).build())
            .traffic(Traffic::Reply(2, sa(B3, 8443)))
        },
        {
            let p = first_snat_port(CLIENT.into(), VIP.into(), 40011, 54, 17);
            fx(
                "v4 udp snat",
                Clients,
                from_client().ipv4(ip4(CLIENT, VIP, 64)).udp(udp(40011, 54)).build(),
                XDP_REDIRECT,
                Redirect,
            )
            .out(to_backend(B3_MAC).ipv4(ip4(SNAT4, B3, 63)).udp(udp(p, 5353)).build())
            .traffic(Traffic::Forward(3, sa(B3, 5353), true))
        },
        {
            let p = first_snat_port(CLIENT.into(), VIP.into(), 40011, 54, 17);
            fx(
                "v4 udp snat reply",
                Backends,
                from_backend(B3_MAC).ipv4(ip4(B3, SNAT4, 64)).udp(udp(5353, p)).build(),
                XDP_REDIRECT,
                Redirect,
            )
            .after(
                Clients,
                from_client().ipv4(ip4(CLIENT, VIP, 64)).udp(udp(40011, 54)).build(),
            )
            .out(to_client().ipv4(ip4(VIP, CLIENT, 63)).udp(udp(54, 40011)).build())
            .traffic(Traffic::Reply(3, sa(B3, 5353)))
        },
        fx(
            "v4 packet to the SNAT address on an unallocated port passes",
            Backends,
            from_backend(B3_MAC)
                .ipv4(ip4(B3, SNAT4, 64))
                .tcp(synack(8443, 12345))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        // ---- IPv6 ----
        fx(
            "v6 tcp syn to VIP is DNATed",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(40020, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv6(ip6(client6(), b6_2(), 63))
                .tcp(syn(40020, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(4, sa(b6_2(), 8080), true)),
        fx(
            "v6 tcp reply is translated back",
            Backends,
            from_backend(B2_MAC)
                .ipv6(ip6(b6_2(), client6(), 64))
                .tcp(synack(8080, 40020))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .after(
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(40020, 80))
                .build(),
        )
        .out(
            to_client()
                .ipv6(ip6(vip6(), client6(), 63))
                .tcp(synack(80, 40020))
                .build(),
        )
        .traffic(Traffic::Reply(4, sa(b6_2(), 8080))),
        {
            let p = first_snat_port(client6().into(), vip6().into(), 40021, 53, 17);
            fx(
                "v6 udp snat",
                Clients,
                from_client()
                    .ipv6(ip6(client6(), vip6(), 64))
                    .udp(udp(40021, 53))
                    .build(),
                XDP_REDIRECT,
                Redirect,
            )
            .out(
                to_backend(B3_MAC)
                    .ipv6(ip6(snat6(), b6_3(), 63))
                    .udp(udp(p, 5353))
                    .build(),
            )
            .traffic(Traffic::Forward(5, sa(b6_3(), 5353), true))
        },
        {
            let p = first_snat_port(client6().into(), vip6().into(), 40021, 53, 17);
            fx(
                "v6 udp snat reply",
                Backends,
                from_backend(B3_MAC)
                    .ipv6(ip6(b6_3(), snat6(), 64))
                    .udp(udp(5353, p))
                    .build(),
                XDP_REDIRECT,
                Redirect,
            )
            .after(
                Clients,
                from_client()
                    .ipv6(ip6(client6(), vip6(), 64))
                    .udp(udp(40021, 53))
                    .build(),
            )
            .out(to_client().ipv6(ip6(vip6(), client6(), 63)).udp(udp(53, 40021)).build())
            .traffic(Traffic::Reply(5, sa(b6_3(), 5353)))
        },
        {
            let p = first_snat_port(client6().into(), vip6().into(), 40022, 443, 6);
            fx(
                "v6 tcp snat",
                Clients,
                from_client()
                    .ipv6(ip6(client6(), vip6(), 64))
                    .tcp(syn(40022, 443))
                    .build(),
                XDP_REDIRECT,
                Redirect,
            )
            .out(
                to_backend(B3_MAC)
                    .ipv6(ip6(snat6(), b6_3(), 63))
                    .tcp(syn(p, 8443))
                    .build(),
            )
            .traffic(Traffic::Forward(6, sa(b6_3(), 8443), true))
        },
        fx(
            "v6 tcp behind hop-by-hop and destination-options headers is DNATed",
            Clients,
            from_client()
                .ipv6(
                    ip6(client6(), vip6(), 64)
                        .ext(ExtHeader::hop_by_hop())
                        .ext(ExtHeader::dest_opts()),
                )
                .tcp(syn(40023, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv6(
                    ip6(client6(), b6_2(), 63)
                        .ext(ExtHeader::hop_by_hop())
                        .ext(ExtHeader::dest_opts()),
                )
                .tcp(syn(40023, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(4, sa(b6_2(), 8080), true)),
        fx(
            "v6 tcp behind a routing header is DNATed",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64).ext(ExtHeader::routing(0, 0)))
                .tcp(syn(40024, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv6(ip6(client6(), b6_2(), 63).ext(ExtHeader::routing(0, 0)))
                .tcp(syn(40024, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(4, sa(b6_2(), 8080), true)),
        fx(
            "v6 atomic fragment (offset 0, no M flag) is not a fragment and is DNATed",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64).ext(ExtHeader::fragment(0, false, 7)))
                .tcp(syn(40025, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv6(ip6(client6(), b6_2(), 63).ext(ExtHeader::fragment(0, false, 7)))
                .tcp(syn(40025, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(4, sa(b6_2(), 8080), true)),
        fx(
            "v6 fragment to a VIP is dropped",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64).ext(ExtHeader::fragment(0, true, 9)))
                .udp(udp(40026, 53))
                .build(),
            XDP_DROP,
            DropFragment,
        ),
        // ---- VLAN ----
        fx(
            "VLAN-tagged v4 tcp to VIP whose route leaves another interface is rewritten and passed",
            Clients,
            from_client()
                .vlan(100)
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(40030, 80))
                .build(),
            XDP_PASS,
            PassFibFailed,
        )
        .out(
            from_client()
                .vlan(100)
                .ipv4(ip4(CLIENT, B2, 64))
                .tcp(syn(40030, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
        fx(
            "VLAN-tagged non-VIP traffic passes untouched",
            Clients,
            from_client()
                .vlan(100)
                .ipv4(ip4(CLIENT, Ipv4Addr::new(10, 0, 0, 1), 64))
                .tcp(syn(40031, 22))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        // ---- Not for us ----
        fx(
            "ARP passes",
            Clients,
            {
                let mut f = vec![0xff; 6];
                f.extend_from_slice(&CLIENT_MAC);
                f.extend_from_slice(&[0x08, 0x06]);
                f.extend_from_slice(&[0u8; 28]);
                f
            },
            XDP_PASS,
            PassNotIp,
        ),
        fx(
            "non-VIP v4 tcp passes untouched",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, Ipv4Addr::new(10, 0, 0, 1), 64))
                .tcp(syn(40040, 22))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "non-VIP v6 udp passes untouched",
            Clients,
            from_client()
                .ipv6(ip6(client6(), v6("fd00::1"), 64))
                .udp(udp(40041, 53))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "VIP on a port with no service passes",
            Clients,
            c4(syn(40042, 8081)),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "VIP on a service port but the wrong protocol passes",
            Clients,
            from_client().ipv4(ip4(CLIENT, VIP, 64)).udp(udp(40043, 80)).build(),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "another address on a service port passes",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, Ipv4Addr::new(192, 0, 2, 99), 64))
                .tcp(syn(40044, 80))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        fx(
            "GRE to a VIP passes (no L4 service)",
            Clients,
            from_client().ipv4(ip4(CLIENT, VIP, 64)).raw(47, &[0; 8]).build(),
            XDP_PASS,
            PassNoService,
        ),
        // ---- Truncated and malformed ----
        // (The kernel's test runner refuses frames under 14 bytes, so the
        // shortest case is an Ethernet header announcing IPv4 and nothing more.)
        fx(
            "Ethernet header alone, announcing IPv4, passes",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(1, 80))
                .truncate(14)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "VLAN tag cut short passes",
            Clients,
            from_client()
                .vlan(100)
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(1, 80))
                .truncate(16)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "IPv4 header cut short passes",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(1, 80))
                .truncate(14 + 12)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "IPv4 options cut short pass",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64).options(&[1, 1, 1, 1, 1, 1, 1, 0]))
                .tcp(syn(1, 80))
                .truncate(14 + 24)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "IPv6 header cut short passes",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(1, 80))
                .truncate(14 + 30)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "IPv6 extension header cut short passes",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64).ext(ExtHeader::hop_by_hop()))
                .tcp(syn(1, 80))
                .truncate(14 + 40 + 4)
                .build(),
            XDP_PASS,
            PassTruncated,
        ),
        fx(
            "TCP to a VIP without room for ports is dropped",
            Clients,
            c4(syn(40050, 80)).into_iter().take(14 + 20 + 2).collect(),
            XDP_DROP,
            DropMalformed,
        ),
        fx(
            "TCP to a VIP service with a short header is dropped",
            Clients,
            c4(syn(40051, 80)).into_iter().take(14 + 20 + 12).collect(),
            XDP_DROP,
            DropMalformed,
        ),
        fx(
            "UDP to a VIP service with a short header is dropped",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64))
                .udp(udp(40052, 53))
                .build()
                .into_iter()
                .take(14 + 20 + 6)
                .collect(),
            XDP_DROP,
            DropMalformed,
        ),
        fx(
            "IPv4 header length below 5 words passes",
            Clients,
            {
                let mut f = c4(syn(40053, 80));
                f[14] = 0x44;
                f
            },
            XDP_PASS,
            PassTruncated,
        ),
        // ---- IPv4 options ----
        fx(
            "v4 tcp with IP options is DNATed, options kept",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64).options(&[1, 1, 1, 0]))
                .tcp(syn(40060, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63).options(&[1, 1, 1, 0]))
                .tcp(syn(40060, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
        // ---- Fragments ----
        fx(
            "first v4 fragment to a VIP is dropped",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64).df(false).mf(true))
                .udp(udp(40070, 53))
                .build(),
            XDP_DROP,
            DropFragment,
        ),
        fx(
            "later v4 fragment to a VIP is dropped",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64).df(false).frag_offset(185))
                .raw(17, &[0; 16])
                .build(),
            XDP_DROP,
            DropFragment,
        ),
        fx(
            "v4 fragment to another address passes",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, Ipv4Addr::new(10, 0, 0, 1), 64).df(false).mf(true))
                .udp(udp(40071, 53))
                .build(),
            XDP_PASS,
            PassFragment,
        ),
        // ---- ICMP ----
        fx(
            "v4 echo request to a VIP is answered",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP, 64))
                .icmpv4(Icmpv4::echo_request(7, 1).payload(b"ping"))
                .build(),
            XDP_TX,
            EchoReply,
        )
        .out(
            to_client()
                .ipv4(ip4(VIP, CLIENT, 64))
                .icmpv4(Icmpv4::echo_reply(7, 1).payload(b"ping"))
                .build(),
        ),
        fx(
            "v6 echo request to a VIP is answered",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .icmpv6(Icmpv6::echo_request(8, 2).payload(b"ping6"))
                .build(),
            XDP_TX,
            EchoReply,
        )
        .out(
            to_client()
                .ipv6(ip6(vip6(), client6(), 64))
                .icmpv6(Icmpv6::echo_reply(8, 2).payload(b"ping6"))
                .build(),
        ),
        fx(
            "v4 echo request to another address passes",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, Ipv4Addr::new(10, 0, 0, 1), 64))
                .icmpv4(Icmpv4::echo_request(7, 1))
                .build(),
            XDP_PASS,
            PassNoService,
        ),
        {
            let quoted = PacketBuilder::new()
                .ipv4(ip4(VIP, CLIENT, 63))
                .tcp(ack(80, 40080))
                .build_ip();
            let backend_view = PacketBuilder::new()
                .ipv4(ip4(B2, CLIENT, 63))
                .tcp(ack(8080, 40080))
                .build_ip();
            fx(
                "v4 frag-needed about a VIP flow goes to its backend, translated",
                Clients,
                PacketBuilder::new()
                    .eth(ROUTER_MAC, CL0_MAC)
                    .ipv4(ip4(ROUTER, VIP, 64))
                    .icmpv4(Icmpv4::frag_needed(1400, &quoted, Quote::HeaderPlus8))
                    .build(),
                XDP_REDIRECT,
                IcmpToBackend,
            )
            .after(Clients, c4(syn(40080, 80)))
            .out(
                to_backend(B2_MAC)
                    .ipv4(ip4(ROUTER, B2, 63))
                    .icmpv4(Icmpv4::frag_needed(1400, &backend_view, Quote::HeaderPlus8))
                    .build(),
            )
        },
        {
            let p = first_snat_port(CLIENT.into(), VIP.into(), 40081, 443, 6);
            let quoted = PacketBuilder::new()
                .ipv4(ip4(VIP, CLIENT, 63))
                .tcp(ack(443, 40081))
                .build_ip();
            let backend_view = PacketBuilder::new()
                .ipv4(ip4(B3, SNAT4, 63))
                .tcp(ack(8443, p))
                .build_ip();
            fx(
                "v4 frag-needed about a SNAT flow gets the backend's own view",
                Clients,
                PacketBuilder::new()
                    .eth(ROUTER_MAC, CL0_MAC)
                    .ipv4(ip4(ROUTER, VIP, 64))
                    .icmpv4(Icmpv4::frag_needed(1400, &quoted, Quote::HeaderPlus8))
                    .build(),
                XDP_REDIRECT,
                IcmpToBackend,
            )
            .after(Clients, c4(syn(40081, 443)))
            .out(
                to_backend(B3_MAC)
                    .ipv4(ip4(ROUTER, B3, 63))
                    .icmpv4(Icmpv4::frag_needed(1400, &backend_view, Quote::HeaderPlus8))
                    .build(),
            )
        },
        {
            let quoted = PacketBuilder::new()
                .ipv6(ip6(vip6(), client6(), 63))
                .tcp(ack(80, 40082))
                .build_ip()[..48]
                .to_vec();
            let backend_view = PacketBuilder::new()
                .ipv6(ip6(b6_2(), client6(), 63))
                .tcp(ack(8080, 40082))
                .build_ip()[..48]
                .to_vec();
            fx(
                "v6 packet-too-big about a VIP flow goes to its backend, translated",
                Clients,
                from_client()
                    .ipv6(ip6(client6(), vip6(), 64))
                    .icmpv6(Icmpv6::packet_too_big(1280, &quoted))
                    .build(),
                XDP_REDIRECT,
                IcmpToBackend,
            )
            .after(
                Clients,
                from_client()
                    .ipv6(ip6(client6(), vip6(), 64))
                    .tcp(syn(40082, 80))
                    .build(),
            )
            .out(
                to_backend(B2_MAC)
                    .ipv6(ip6(client6(), b6_2(), 63))
                    .icmpv6(Icmpv6::packet_too_big(1280, &backend_view))
                    .build(),
            )
        },
        {
            let quoted = PacketBuilder::new()
                .ipv4(ip4(VIP, CLIENT, 63))
                .tcp(ack(8081, 40083))
                .build_ip();
            fx(
                "v4 frag-needed quoting no VIP service is dropped",
                Clients,
                PacketBuilder::new()
                    .eth(ROUTER_MAC, CL0_MAC)
                    .ipv4(ip4(ROUTER, VIP, 64))
                    .icmpv4(Icmpv4::frag_needed(1400, &quoted, Quote::HeaderPlus8))
                    .build(),
                XDP_DROP,
                DropIcmpNoFlow,
            )
        },
        // ---- Service states ----
        fx(
            "service with no backends drops new flows",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP_EMPTY, 64))
                .tcp(syn(40090, 80))
                .build(),
            XDP_DROP,
            DropNoBackend,
        ),
        fx(
            "backend without a neighbour entry: rewritten and passed to the kernel",
            Clients,
            from_client()
                .ipv4(ip4(CLIENT, VIP_NONEIGH, 64))
                .tcp(syn(40091, 80))
                .build(),
            XDP_PASS,
            PassNoNeigh,
        )
        .out(
            from_client()
                .ipv4(ip4(CLIENT, Ipv4Addr::new(10, 2, 0, 99), 64))
                .tcp(syn(40091, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(8, sa(Ipv4Addr::new(10, 2, 0, 99), 8080), true)),
        fx(
            "TTL 1 to a VIP passes so the kernel answers time-exceeded",
            Clients,
            from_client().ipv4(ip4(CLIENT, VIP, 1)).tcp(syn(40092, 80)).build(),
            XDP_PASS,
            PassTtlExpired,
        ),
        fx(
            "an established flow keeps its backend after the backend set changed",
            Clients,
            c4(ack(40093, 80)),
            XDP_REDIRECT,
            Redirect,
        )
        .after(Clients, c4(syn(40093, 80)))
        .change(|dp| {
            let mut s = base_services()[0].clone();
            s.backends = backends(&[(B4.into(), 8080)]);
            dp.set_service(&s).unwrap();
        })
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(ack(40093, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), false)),
        fx(
            "a new flow after the backend set changed goes to the new backend",
            Clients,
            c4(syn(40094, 80)),
            XDP_REDIRECT,
            Redirect,
        )
        .change(|dp| {
            let mut s = base_services()[0].clone();
            s.backends = backends(&[(B4.into(), 8080)]);
            dp.set_service(&s).unwrap();
        })
        .out(
            to_backend(B4_MAC)
                .ipv4(ip4(CLIENT, B4, 63))
                .tcp(syn(40094, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B4, 8080), true)),
        // ---- Source ranges (loadBalancerSourceRanges) ----
        fx(
            "source ranges: a client outside them is dropped and counted",
            Clients,
            c4(syn(40200, 80)),
            XDP_DROP,
            DropSourceRange,
        )
        .change(|dp| with_ranges(dp, 0, &["10.9.0.0/16", "198.51.100.0/24"])),
        fx(
            "source ranges: a client inside them is forwarded",
            Clients,
            c4(syn(40201, 80)),
            XDP_REDIRECT,
            Redirect,
        )
        .change(|dp| with_ranges(dp, 0, &["10.9.0.0/16", "10.0.0.0/24"]))
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(syn(40201, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
        fx(
            "source ranges: an established flow is cut once its client is no longer allowed",
            Clients,
            c4(ack(40202, 80)),
            XDP_DROP,
            DropSourceRange,
        )
        .after(Clients, c4(syn(40202, 80)))
        .change(|dp| with_ranges(dp, 0, &["10.0.0.3/32"])),
        fx(
            "source ranges: an empty allowed set refuses everyone",
            Clients,
            c4(syn(40203, 80)),
            XDP_DROP,
            DropSourceRange,
        )
        .change(|dp| with_ranges(dp, 0, &[])),
        fx(
            "source ranges: another service on the VIP stays open",
            Clients,
            c4(syn(40204, 443)),
            XDP_REDIRECT,
            Redirect,
        )
        .change(|dp| with_ranges(dp, 0, &["10.9.0.0/16"]))
        .out(
            to_backend(B3_MAC)
                .ipv4(ip4(
                    SNAT4,
                    B3,
                    63,
                ))
                .tcp(syn(first_snat_port(CLIENT.into(), VIP.into(), 40204, 443, 6), 8443))
                .build(),
        )
        .traffic(Traffic::Forward(2, sa(B3, 8443), true)),
        fx(
            "source ranges: v6 client outside them is dropped",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(40205, 80))
                .build(),
            XDP_DROP,
            DropSourceRange,
        )
        .change(|dp| with_ranges(dp, 4, &["2001:db8:ffff::/48"])),
        fx(
            "source ranges: v6 client inside them is forwarded",
            Clients,
            from_client()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(40206, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .change(|dp| with_ranges(dp, 4, &["2001:db8:ffff::/48", "::/0"]))
        .out(
            to_backend(B2_MAC)
                .ipv6(ip6(client6(), b6_2(), 63))
                .tcp(syn(40206, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(4, sa(b6_2(), 8080), true)),
    ];
    v.extend(foreign_frames());
    // Multi-backend service: the expected backend is computed from the live
    // table exactly as the data plane does (checked by the harness).
    v.push(fx(
        "multi-backend service sends the flow where Maglev says",
        Clients,
        from_client()
            .ipv4(ip4(CLIENT, VIP_MULTI, 64))
            .tcp(syn(40100, 80))
            .build(),
        XDP_REDIRECT,
        Redirect,
    ));
    v
}

/// Unicast frames addressed to another host's MAC: passed untouched with
/// or without a flow, whatever they carry; group frames as before.
fn foreign_frames() -> Vec<Fixture> {
    use Ingress::*;
    use Reason::*;
    let foreign = || PacketBuilder::new().eth(CLIENT_MAC, OTHER_NODE_MAC);
    let c4 = |t: Tcp| from_client().ipv4(ip4(CLIENT, VIP, 64)).tcp(t).build();
    let f4 = |t: Tcp| foreign().ipv4(ip4(CLIENT, VIP, 64)).tcp(t).build();
    let snat_syn = || c4(syn(40400, 443));
    let passed = |name, ingress, input, before: Option<(Ingress, Vec<u8>)>| {
        let f = fx(name, ingress, input, XDP_PASS, PassForeignMac);
        match before {
            Some((i, p)) => f.after(i, p),
            None => f,
        }
    };
    let u4 = |b: PacketBuilder, sport, dport| {
        b.ipv4(ip4(CLIENT, VIP, 64)).udp(udp(sport, dport)).build()
    };
    let reply = |dst_mac: Mac, t: Tcp| {
        PacketBuilder::new()
            .eth(B2_MAC, dst_mac)
            .ipv4(ip4(B2, CLIENT, 64))
            .tcp(t)
            .build()
    };
    vec![
        passed(
            "foreign MAC: a SYN to a VIP passes untouched and opens no flow",
            Clients,
            f4(syn(40300, 80)),
            None,
        ),
        passed(
            "foreign MAC: a SYN to an snat VIP passes untouched",
            Clients,
            f4(syn(40400, 443)),
            None,
        ),
        passed(
            "foreign MAC: an ACK without a flow passes untouched",
            Clients,
            f4(ack(40301, 80)),
            None,
        ),
        passed(
            "foreign MAC: an ACK of a flow this node holds passes untouched",
            Clients,
            f4(ack(40000, 80)),
            Some((Clients, c4(syn(40000, 80)))),
        ),
        passed(
            "foreign MAC: an ACK of an snat flow this node holds passes untouched",
            Clients,
            f4(ack(40400, 443)),
            Some((Clients, snat_syn())),
        ),
        passed(
            "foreign MAC: a UDP datagram without a flow passes untouched",
            Clients,
            u4(foreign(), 40302, 53),
            None,
        ),
        passed(
            "foreign MAC: a UDP datagram of a flow this node holds passes untouched",
            Clients,
            u4(foreign(), 40303, 53),
            Some((Clients, u4(from_client(), 40303, 53))),
        ),
        passed(
            "foreign MAC: a backend's reply without a flow passes untouched",
            Backends,
            reply(OTHER_BE_SIDE_MAC, synack(8080, 40304)),
            None,
        ),
        passed(
            "foreign MAC: a backend's reply of a flow this node holds passes untouched",
            Backends,
            reply(OTHER_BE_SIDE_MAC, synack(8080, 40000)),
            Some((Clients, c4(syn(40000, 80)))),
        ),
        passed(
            "foreign MAC: a VLAN-tagged SYN to a VIP passes untouched",
            Clients,
            foreign()
                .vlan(100)
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(40305, 80))
                .build(),
            None,
        ),
        passed(
            "foreign MAC: an echo request to a VIP is not answered",
            Clients,
            foreign()
                .ipv4(ip4(CLIENT, VIP, 64))
                .icmpv4(Icmpv4::echo_request(7, 2).payload(b"ping"))
                .build(),
            None,
        ),
        passed(
            "foreign MAC: a v6 SYN to a VIP passes untouched",
            Clients,
            foreign()
                .ipv6(ip6(client6(), vip6(), 64))
                .tcp(syn(40306, 80))
                .build(),
            None,
        ),
        // A group address is not another host's: an IPv4 multicast MAC
        // (01:00:5e:..) keeps today's handling, as ARP and NDP need.
        fx(
            "a group-addressed frame to a VIP is handled as before",
            Clients,
            PacketBuilder::new()
                .eth(CLIENT_MAC, [1, 0, 0x5e, 0, 0, 1])
                .ipv4(ip4(CLIENT, VIP, 64))
                .tcp(syn(40307, 80))
                .build(),
            XDP_REDIRECT,
            Redirect,
        )
        .out(
            to_backend(B2_MAC)
                .ipv4(ip4(CLIENT, B2, 63))
                .tcp(syn(40307, 8080))
                .build(),
        )
        .traffic(Traffic::Forward(0, sa(B2, 8080), true)),
    ]
}

/// Restricts base service `index` to `ranges`.
fn with_ranges(dp: &mut Dataplane, index: usize, ranges: &[&str]) {
    let mut s = base_services()[index].clone();
    s.source_ranges = Some(ranges.iter().map(|r| r.parse().unwrap()).collect());
    dp.set_service(&s).unwrap();
}

fn run(dp: &Dataplane, ingress: u32, input: &[u8]) -> (u32, Vec<u8>) {
    let (verdict, out, _) = test_run(dp.program(), ingress, input);
    (verdict, out)
}

type Snapshot = (
    BTreeMap<u32, [u64; 5]>,
    BTreeMap<u32, [u64; 5]>,
    [u64; REASON_COUNT as usize],
);

fn snapshot(dp: &Dataplane) -> Snapshot {
    let arr = |s: lb_common::TrafficStats| {
        [
            s.packets,
            s.bytes,
            s.new_flows,
            s.reply_packets,
            s.reply_bytes,
        ]
    };
    let mut services = BTreeMap::new();
    let mut backends = BTreeMap::new();
    for (key, spec) in dp.services() {
        let id = dp.service_id(key).unwrap();
        services.insert(id, arr(dp.service_stats(id).unwrap()));
        for b in &spec.backends {
            let bid = dp.backend_id(key, b.addr).unwrap();
            backends.insert(bid, arr(dp.backend_stats(bid).unwrap()));
        }
    }
    (services, backends, dp.reason_counts().unwrap())
}

#[test]
fn packet_fixtures_need_root() {
    let FixtureBed {
        mut dp,
        cl0,
        be0,
        ns: _ns,
    } = FixtureBed::new("xlb-fixtures");
    let fixtures = fixtures();
    assert!(
        fixtures.len() >= 40,
        "the fixture table must keep at least 40 cases"
    );
    let mut failures = Vec::new();
    for f in &fixtures {
        // Each fixture starts from the base services, no flows, zero counters.
        for s in base_services() {
            dp.set_service(&s).unwrap();
        }
        dp.clear_dynamic_state().unwrap();
        let mut errs = Vec::new();
        for (ing, pkt) in &f.before {
            let (v, _) = run(
                &dp,
                if matches!(ing, Ingress::Clients) {
                    cl0
                } else {
                    be0
                },
                pkt,
            );
            if v == XDP_DROP {
                errs.push(format!(
                    "setup packet dropped, reasons {:?}",
                    dp.reason_counts().unwrap()
                ));
            }
        }
        // The change comes after the setup packets: that is what "after" means.
        if let Some(change) = f.change {
            change(&mut dp);
        }
        let before = snapshot(&dp);
        let ingress = if matches!(f.ingress, Ingress::Clients) {
            cl0
        } else {
            be0
        };
        let (verdict, out) = run(&dp, ingress, &f.input);
        let after = snapshot(&dp);
        if verdict != f.verdict {
            errs.push(format!("verdict {verdict}, want {}", f.verdict));
        }
        let expected = f.output.clone().unwrap_or_else(|| f.input.clone());
        if f.name.starts_with("multi-backend") {
            check_multi(&dp, &f.input, &out, &mut errs);
        } else if out != expected {
            errs.push(format!(
                "output differs:\n{}",
                hexdump_diff(&expected, &out)
            ));
        }
        if f.output.is_some() && f.verdict != XDP_DROP {
            if let Err(e) = verify_checksums(&out) {
                errs.push(format!("checksum: {e}"));
            }
        }
        check_counters(&dp, f, &before, &after, &mut errs);
        if !errs.is_empty() {
            failures.push(format!("{}:\n  {}", f.name, errs.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixtures failed:\n{}",
        failures.len(),
        fixtures.len(),
        failures.join("\n")
    );
}

fn check_multi(dp: &Dataplane, input: &[u8], out: &[u8], errs: &mut Vec<String>) {
    let key = lb_common::net::service_key(VIP_MULTI.into(), 80, 6);
    let table = dp.live_table(&key).unwrap();
    let flow = lb_common::FlowKey {
        src: lb_common::net::ip_words(CLIENT.into()),
        dst: lb_common::net::ip_words(VIP_MULTI.into()),
        sport: 40100u16.to_be(),
        dport: 80u16.to_be(),
        proto: 6,
        family: lb_common::FAMILY_V4,
        _pad: [0; 2],
    };
    let id = table[(lb_common::hash::flow_hash(&flow) % table.len() as u32) as usize];
    let (ip, mac) = [(B2, B2_MAC), (B3, B3_MAC), (B4, B4_MAC)]
        .into_iter()
        .find(|(ip, _)| dp.backend_id(&key, sa(*ip, 8080)) == Some(id))
        .expect("table entry names a backend of the service");
    let _ = input;
    let want = to_backend(mac)
        .ipv4(ip4(CLIENT, ip, 63))
        .tcp(syn(40100, 8080))
        .build();
    if out != want {
        errs.push(format!(
            "multi-backend output differs:\n{}",
            hexdump_diff(&want, out)
        ));
    }
}

fn check_counters(
    dp: &Dataplane,
    f: &Fixture,
    before: &Snapshot,
    after: &Snapshot,
    errs: &mut Vec<String>,
) {
    for r in Reason::ALL {
        let d = after.2[r as usize] - before.2[r as usize];
        let want = u64::from(r == f.reason);
        if d != want {
            errs.push(format!("reason {}: moved by {d}, want {want}", r.name()));
        }
    }
    let services = base_services();
    let bytes = f.input.len() as u64;
    let (want_svc, want_backend, want) = match f.traffic {
        Traffic::None => (None, None, [0; 5]),
        Traffic::Forward(i, b, new) => {
            let key = services[i].key();
            (
                dp.service_id(&key),
                dp.backend_id(&key, b),
                [1, bytes, u64::from(new), 0, 0],
            )
        }
        Traffic::Reply(i, b) => {
            let key = services[i].key();
            (
                dp.service_id(&key),
                dp.backend_id(&key, b),
                [0, 0, 0, 1, bytes],
            )
        }
    };
    if f.name.starts_with("multi-backend") {
        return; // Its backend is computed; its reason is checked above.
    }
    // A backend that left the service (its flows stay) has no id any more;
    // then only the service counters and the untouched live backends are checked.
    if f.traffic != Traffic::None && want_svc.is_none() {
        errs.push("fixture names a service that is not programmed".into());
    }
    for (id, a) in &after.0 {
        let b = before.0.get(id).copied().unwrap_or([0; 5]);
        let d: Vec<u64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let w = if Some(*id) == want_svc {
            want.to_vec()
        } else {
            vec![0; 5]
        };
        if d != w {
            errs.push(format!("service {id} stats moved by {d:?}, want {w:?}"));
        }
    }
    for (id, a) in &after.1 {
        let b = before.1.get(id).copied().unwrap_or([0; 5]);
        let d: Vec<u64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let w = if Some(*id) == want_backend {
            want.to_vec()
        } else {
            vec![0; 5]
        };
        if d != w {
            errs.push(format!("backend {id} stats moved by {d:?}, want {w:?}"));
        }
    }
}

/// Pins the calling thread to one CPU (BPF_PROG_TEST_RUN runs the program
/// on the caller's CPU).
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; we set one bit and apply it to this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
}

/// A fixture bed with the base services, for tests that move a flow between
/// CPUs 0 and 1.
fn two_cpu_bed(name: &str) -> FixtureBed {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    assert!(
        cpus >= 2,
        "this test needs two CPUs to move a flow between them (found {cpus})"
    );
    let mut bed = FixtureBed::new(name);
    for s in base_services() {
        bed.dp.set_service(&s).unwrap();
    }
    bed
}

/// A TCP segment from the client to the IPv4 VIP.
fn c4(t: Tcp) -> Vec<u8> {
    from_client().ipv4(ip4(CLIENT, VIP, 64)).tcp(t).build()
}

/// A client that reuses its source port for a new connection (common once
/// the server closed first and holds the TIME_WAIT) must not meet the old
/// connection on another CPU: that CPU's stale entry would send the new
/// connection's packets to the old backend, which answers with a reset.
#[test]
fn a_reused_tuple_leaves_no_stale_flow_on_another_cpu_needs_root() {
    let mut bed = two_cpu_bed("xlb-fix-reuse");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    // The first connection from port 46100 lives on CPU 1, at B2.
    pin_to_cpu(1);
    let (v, out) = run(dp, cl0, &c4(syn(46100, 80)));
    assert_eq!(v, XDP_REDIRECT);
    let first = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(first.dst, std::net::IpAddr::from(B2));
    // The backends change; a new connection from the same port starts on
    // CPU 0, where Maglev now picks B3.
    dp.set_service(&svc(
        VIP.into(),
        80,
        Protocol::Tcp,
        None,
        &[(B3.into(), 8080)],
    ))
    .unwrap();
    pin_to_cpu(0);
    let (v, out) = run(dp, cl0, &c4(syn(46100, 80)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(
        xlb_tests::packet::parse(&out).unwrap().dst,
        std::net::IpAddr::from(B3)
    );
    // Its next segment lands on CPU 1, which saw the old connection.
    pin_to_cpu(1);
    ack_reaches(dp, cl0, 46100, (B3_MAC, B3), "the new connection on CPU 1");
}

/// An ACK from the client's `sport` to VIP:80 is forwarded, NATed, to
/// `backend` (its MAC and address) on port 8080.
fn ack_reaches(dp: &mut Dataplane, cl0: u32, sport: u16, backend: (Mac, Ipv4Addr), what: &str) {
    let (v, out) = run(dp, cl0, &c4(ack(sport, 80)));
    assert_eq!(v, XDP_REDIRECT, "{what}");
    let want = to_backend(backend.0)
        .ipv4(ip4(CLIENT, backend.1, 63))
        .tcp(ack(sport, 8080))
        .build();
    assert!(out == want, "{what}\n{}", hexdump_diff(&want, &out));
}

/// A flow's packets that land on another CPU than its first one (RSS
/// changes, IRQ moves) find the same entry there: the flow table is one for
/// all CPUs.
#[test]
fn a_flow_continues_on_another_cpu_needs_root() {
    let mut bed = two_cpu_bed("xlb-fix-cpu");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    pin_to_cpu(0);
    let (v, _) = run(dp, cl0, &c4(syn(45000, 80)));
    assert_eq!(v, XDP_REDIRECT);
    // SNAT flow too: the other CPU must find the same source port again.
    let (v, first) = run(dp, cl0, &c4(syn(45001, 443)));
    assert_eq!(v, XDP_REDIRECT);
    pin_to_cpu(1);
    let (v, out) = run(dp, cl0, &c4(ack(45000, 80)));
    assert_eq!(v, XDP_REDIRECT, "established packet on the other CPU");
    let want = to_backend(B2_MAC)
        .ipv4(ip4(CLIENT, B2, 63))
        .tcp(ack(45000, 8080))
        .build();
    assert!(out == want, "{}", hexdump_diff(&want, &out));
    let (v, out) = run(dp, cl0, &c4(ack(45001, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let p = first_snat_port(CLIENT.into(), VIP.into(), 45001, 443, 6);
    let want = to_backend(B3_MAC)
        .ipv4(ip4(SNAT4, B3, 63))
        .tcp(ack(p, 8443))
        .build();
    assert!(out == want, "{}", hexdump_diff(&want, &out));
    assert_eq!(xlb_tests::packet::parse(&first).unwrap().sport, Some(p));
}

/// A flow that moves to another CPU after its backend left the service (an
/// IRQ moved while pods were replaced) keeps its backend, and its SNAT port:
/// the flow table is one for all CPUs, so the other CPU finds it instead of
/// re-picking. It is not counted as a new flow. A SYN still starts afresh,
/// and resetting a backend's flows removes them.
#[test]
fn a_moved_flow_keeps_its_backend_after_a_backend_change_needs_root() {
    let mut bed = two_cpu_bed("xlb-fix-move");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    pin_to_cpu(0);
    assert_eq!(run(dp, cl0, &c4(syn(46000, 80))).0, XDP_REDIRECT);
    let (v, first) = run(dp, cl0, &c4(syn(46001, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let p = xlb_tests::packet::parse(&first).unwrap().sport.unwrap();

    // Both backends are replaced: Maglev now sends these flows elsewhere.
    dp.set_service(&svc(
        VIP.into(),
        80,
        Protocol::Tcp,
        None,
        &[(B3.into(), 8080)],
    ))
    .unwrap();
    dp.set_service(&svc(
        VIP.into(),
        443,
        Protocol::Tcp,
        Some(SNAT4.into()),
        &[(B2.into(), 8443)],
    ))
    .unwrap();
    let key80 = lb_common::net::service_key(VIP.into(), 80, 6);
    let id80 = dp.service_info(&key80).unwrap().id;
    let new_flows_before = dp.service_stats(id80).unwrap().new_flows;

    pin_to_cpu(1);
    // An ICMP error about the NAT flow, on CPU 1 before any of its packets:
    // it reaches the flow's backend, not Maglev's new pick.
    let quoted = PacketBuilder::new()
        .ipv4(ip4(VIP, CLIENT, 63))
        .tcp(ack(80, 46000))
        .build_ip();
    let backend_view = PacketBuilder::new()
        .ipv4(ip4(B2, CLIENT, 63))
        .tcp(ack(8080, 46000))
        .build_ip();
    let input = PacketBuilder::new()
        .eth(ROUTER_MAC, CL0_MAC)
        .ipv4(ip4(ROUTER, VIP, 64))
        .icmpv4(Icmpv4::frag_needed(1400, &quoted, Quote::HeaderPlus8))
        .build();
    let (v, out) = run(dp, cl0, &input);
    assert_eq!(v, XDP_REDIRECT);
    let want = to_backend(B2_MAC)
        .ipv4(ip4(ROUTER, B2, 63))
        .icmpv4(Icmpv4::frag_needed(1400, &backend_view, Quote::HeaderPlus8))
        .build();
    assert!(out == want, "ICMP on CPU 1\n{}", hexdump_diff(&want, &out));

    // The NAT flow's reply translation was lost (evicted): the flow's next
    // refresh (its first packet after a second idle) puts it back.
    let nat_reply = |dp: &Dataplane| {
        dp.reply_entries()
            .unwrap()
            .into_iter()
            .find(|(k, _)| u16::from_be(k.dport) == 46000)
    };
    let (reply_key, _) = nat_reply(dp).expect("the NAT flow's reply entry");
    dp.remove_reply(&reply_key).unwrap();
    ack_reaches(dp, cl0, 46000, (B2_MAC, B2), "NAT flow on CPU 1");
    assert!(nat_reply(dp).is_none(), "refreshed at most once a second");
    // Idle past the refresh interval (the data plane's coarse clock).
    std::thread::sleep(std::time::Duration::from_millis(1100));
    ack_reaches(dp, cl0, 46000, (B2_MAC, B2), "NAT flow on CPU 1, idle");
    let (k, r) = nat_reply(dp).expect("the reply entry is back");
    assert_eq!(k, reply_key);
    assert_eq!(r.vip, lb_common::net::ip_words(VIP.into()));
    let (v, out) = run(dp, cl0, &c4(ack(46001, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let want = to_backend(B3_MAC)
        .ipv4(ip4(SNAT4, B3, 63))
        .tcp(ack(p, 8443))
        .build();
    assert!(
        out == want,
        "SNAT flow on CPU 1\n{}",
        hexdump_diff(&want, &out)
    );
    assert_eq!(
        dp.service_stats(id80).unwrap().new_flows,
        new_flows_before,
        "a flow taken over from another CPU is not a new flow"
    );

    // A flow no CPU has seen goes where Maglev says.
    let (_, out) = run(dp, cl0, &c4(ack(46002, 80)));
    let want = to_backend(B3_MAC)
        .ipv4(ip4(CLIENT, B3, 63))
        .tcp(ack(46002, 8080))
        .build();
    assert!(out == want, "unknown flow\n{}", hexdump_diff(&want, &out));

    // Resetting B3:8443's flows forgets the SNAT flow: its next packet, on
    // CPU 0, goes to B2.
    assert!(dp.reset_flows_to(sa(B3, 8443)).unwrap() >= 1);
    pin_to_cpu(0);
    let (v, out) = run(dp, cl0, &c4(ack(46001, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let got = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(got.dst, IpAddr::V4(B2), "after the reset");

    // A SYN reusing the NAT flow's port starts afresh on the new backend,
    // and its entry follows it.
    let (_, out) = run(dp, cl0, &c4(syn(46000, 80)));
    let want = to_backend(B3_MAC)
        .ipv4(ip4(CLIENT, B3, 63))
        .tcp(syn(46000, 8080))
        .build();
    assert!(out == want, "SYN on CPU 0\n{}", hexdump_diff(&want, &out));
    let shared = dp.shared_flows().unwrap();
    let k = shared
        .iter()
        .find(|(k, _)| u16::from_be(k.sport) == 46000)
        .expect("the flow is in FLOWS");
    assert_eq!(k.1.backend_addr, lb_common::net::ip_words(B3.into()));
}

/// A refused client leaves nothing behind (no flow, no reply translation),
/// a change of ranges takes effect at once, and ranges the map cannot hold
/// are refused whole, leaving the service as it was.
#[test]
fn source_ranges_refuse_before_any_flow_state_needs_root() {
    let mut bed = two_cpu_bed("xlb-fix-ranges");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    with_ranges(dp, 0, &["10.9.0.0/16"]);
    for sport in 46200..46210 {
        let (v, _) = run(dp, cl0, &c4(syn(sport, 80)));
        assert_eq!(v, XDP_DROP);
    }
    assert!(
        dp.shared_flows().unwrap().is_empty(),
        "no flow for a refused client"
    );
    assert!(dp.reply_entries().unwrap().is_empty());
    let drops = dp.reason_counts().unwrap()[Reason::DropSourceRange as usize];
    assert_eq!(drops, 10);

    // Many ranges, the client's among them: a longest-prefix match.
    let mut many: Vec<String> = (0..2000)
        .map(|i| format!("172.{}.{}.0/24", 16 + i / 256, i % 256))
        .collect();
    many.push("10.0.0.2/32".into());
    let mut s = base_services()[0].clone();
    s.source_ranges = Some(many.iter().map(|r| r.parse().unwrap()).collect());
    dp.set_service(&s).unwrap();
    ack_reaches(dp, cl0, 46210, (B2_MAC, B2), "a client among 2001 ranges");

    // Too many for the map: refused, and the service keeps its 2001 ranges.
    let info = dp.service_info(&s.key()).unwrap();
    let mut huge = s.clone();
    huge.source_ranges = Some(
        (0..lb_common::MAX_SOURCE_RANGES)
            .map(|i| {
                format!("10.{}.{}.0/24", 100 + i / 65536, (i / 256) % 256)
                    .replace(".0/24", &format!(".{}/32", i % 256))
                    .parse()
                    .unwrap()
            })
            .collect(),
    );
    let err = dp.set_service(&huge).unwrap_err();
    assert!(err.to_string().contains("SOURCE_RANGES"), "{err}");
    assert_eq!(dp.service_info(&s.key()).unwrap(), info);
    assert_eq!(
        dp.services().find(|(k, _)| **k == s.key()).unwrap().1,
        &s,
        "the driver's view is unchanged too"
    );
    ack_reaches(dp, cl0, 46211, (B2_MAC, B2), "after the refused change");
    let (v, _) = run(
        dp,
        cl0,
        &from_client()
            .eth(ROUTER_MAC, CL0_MAC)
            .ipv4(ip4(REMOTE_CLIENT, VIP, 50))
            .tcp(syn(46212, 80))
            .build(),
    );
    assert_eq!(v, XDP_DROP, "a client outside the kept ranges");
}

/// The backends `count` connections (distinct source ports) from `client` to
/// VIP_MULTI:80 reach.
fn backends_reached(bed: &FixtureBed, client: Ipv4Addr, count: u16) -> Vec<IpAddr> {
    (0..count)
        .map(|i| {
            let pkt = from_client()
                .eth(ROUTER_MAC, CL0_MAC)
                .ipv4(ip4(client, VIP_MULTI, 50))
                .tcp(syn(47000 + i, 80))
                .build();
            let (v, out) = run(&bed.dp, bed.cl0, &pkt);
            assert_eq!(v, XDP_REDIRECT);
            xlb_tests::packet::parse(&out).unwrap().dst
        })
        .collect()
}

/// Session affinity: every connection of a client goes to one backend, and
/// a second node (another data plane with the same service) picks the same
/// one: the choice is computed, not remembered. Different clients still
/// spread, and without affinity one client's connections spread too.
#[test]
fn client_affinity_is_the_same_on_every_node_needs_root() {
    let multi = base_services().pop().unwrap();
    let mut affine = multi.clone();
    affine.client_affinity = true;
    let mut node1 = two_cpu_bed("xlb-fix-aff1");
    node1.dp.set_service(&affine).unwrap();
    let clients: Vec<Ipv4Addr> = (1..=20).map(|i| Ipv4Addr::new(198, 51, 100, i)).collect();
    let on_node1: Vec<IpAddr> = clients
        .iter()
        .map(|&c| {
            let reached = backends_reached(&node1, c, 50);
            assert!(
                reached.iter().all(|b| *b == reached[0]),
                "client {c} reached {reached:?}"
            );
            reached[0]
        })
        .collect();
    let distinct: std::collections::BTreeSet<_> = on_node1.iter().collect();
    assert!(
        distinct.len() >= 2,
        "clients spread over backends: {distinct:?}"
    );

    node1.dp.set_service(&multi).unwrap();
    let spread: std::collections::BTreeSet<_> = backends_reached(&node1, clients[0], 50)
        .into_iter()
        .collect();
    assert!(spread.len() >= 2, "without affinity connections spread");
    drop(node1);

    let mut node2 = two_cpu_bed("xlb-fix-aff2");
    node2.dp.set_service(&affine).unwrap();
    for (c, want) in clients.iter().zip(&on_node1) {
        assert_eq!(
            backends_reached(&node2, *c, 5),
            vec![*want; 5],
            "client {c} on node 2"
        );
    }
}

/// The flow table full: the least recently used flows are evicted, an
/// evicted flow's next packet is re-picked by Maglev onto the backend it had
/// (the backend set is unchanged), and the re-picks are counted.
#[test]
fn a_full_flow_table_evicts_and_evicted_flows_keep_their_backend_needs_root() {
    const TABLE: u32 = 1024;
    let sizes = MapSizes {
        flow_table_entries: TABLE,
        ..MapSizes::default()
    };
    let mut bed = FixtureBed::with("xlb-fix-full", None, sizes);
    pin_to_cpu(0);
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    let three = [(B2.into(), 8080), (B3.into(), 8080), (B4.into(), 8080)];
    dp.set_service(&svc(VIP.into(), 80, Protocol::Tcp, None, &three))
        .unwrap();
    assert_eq!(dp.flow_table_capacity(), TABLE);
    let backend_of = |out: &[u8]| xlb_tests::packet::parse(out).unwrap().dst;

    // 100 flows while the table has room: Maglev's picks.
    let first: Vec<(u16, IpAddr)> = (20000..20100)
        .map(|p| {
            let (v, out) = run(dp, cl0, &c4(syn(p, 80)));
            assert_eq!(v, XDP_REDIRECT);
            (p, backend_of(&out))
        })
        .collect();
    let spread: std::collections::BTreeSet<IpAddr> = first.iter().map(|f| f.1).collect();
    assert_eq!(spread.len(), 3, "Maglev spreads 100 flows over 3 backends");

    // Four times the table's size in new flows: it fills and evicts.
    for p in 30000..30000 + 4 * TABLE as u16 {
        assert_eq!(run(dp, cl0, &c4(syn(p, 80))).0, XDP_REDIRECT);
    }
    let flows = dp.shared_flows().unwrap();
    assert!(flows.len() <= TABLE as usize, "{} entries", flows.len());
    let kept = flows
        .iter()
        .filter(|(k, _)| (20000..20100).contains(&u16::from_be(k.sport)))
        .count();
    assert!(
        kept < 10,
        "{kept} of the 100 oldest flows are still in a full table"
    );

    // Their next packets go to the backends they had, and are counted.
    let repicked = dp.flows_repicked().unwrap();
    for (p, b) in &first {
        let (v, out) = run(dp, cl0, &c4(ack(*p, 80)));
        assert_eq!(v, XDP_REDIRECT);
        assert_eq!(backend_of(&out), *b, "evicted flow from port {p}");
    }
    let counted = dp.flows_repicked().unwrap() - repicked;
    assert!(
        counted as usize >= first.len() - kept,
        "{counted} re-picks counted for {} evicted flows",
        first.len() - kept
    );
}

/// Flood mode: above the threshold of new flows a second on a CPU, a NAT
/// flow that Maglev alone re-derives is forwarded without a flow-table
/// entry. Its SYN and its later packets reach Maglev's backend and are
/// counted untracked, the SYN once as a new flow. SNAT flows are still
/// written. Below the threshold a SYN replaces an entry for its tuple; in
/// flood mode it does not look for one (docs/datapath.md, "Flood mode").
/// With the threshold at 0 every new flow is written.
#[test]
fn flood_mode_forwards_stateless_flows_without_an_entry_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-flood");
    pin_to_cpu(0);
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    let three = [(B2.into(), 8080), (B3.into(), 8080), (B4.into(), 8080)];
    dp.set_service(&svc(VIP.into(), 80, Protocol::Tcp, None, &three))
        .unwrap();
    dp.set_service(&svc(
        VIP.into(),
        443,
        Protocol::Tcp,
        Some(SNAT4.into()),
        &[(B3.into(), 8443)],
    ))
    .unwrap();
    let id80 = dp
        .service_id(&lb_common::net::service_key(VIP.into(), 80, 6))
        .unwrap();
    let backend_of = |out: &[u8]| xlb_tests::packet::parse(out).unwrap().dst;
    let in_table = |dp: &Dataplane| -> std::collections::BTreeSet<u16> {
        let flows = dp.shared_flows().unwrap();
        flows.iter().map(|(k, _)| u16::from_be(k.sport)).collect()
    };
    dp.set_flood_threshold(3).unwrap();

    // Ten new flows in one second: the first three are written.
    let picked: Vec<(u16, IpAddr)> = (21000..21010)
        .map(|p| {
            let (v, out) = run(dp, cl0, &c4(syn(p, 80)));
            assert_eq!(v, XDP_REDIRECT, "SYN from {p}");
            (p, backend_of(&out))
        })
        .collect();
    assert_eq!(in_table(dp), (21000..21003).collect());
    assert_eq!(dp.flows_untracked().unwrap(), 7);
    assert_eq!(dp.service_stats(id80).unwrap().new_flows, 10);
    let spread: std::collections::BTreeSet<IpAddr> = picked.iter().map(|f| f.1).collect();
    assert!(spread.len() > 1, "Maglev spreads the flows: {spread:?}");

    // Their next packets reach the SYN's backend; the untracked ones stay
    // untracked (still above the threshold) and are not new flows again.
    for (p, b) in &picked {
        let (v, out) = run(dp, cl0, &c4(ack(*p, 80)));
        assert_eq!(v, XDP_REDIRECT);
        assert_eq!(backend_of(&out), *b, "ACK from {p}");
    }
    assert_eq!(in_table(dp), (21000..21003).collect());
    assert_eq!(dp.flows_untracked().unwrap(), 14);
    assert_eq!(dp.service_stats(id80).unwrap().new_flows, 10);

    // The agent writes the threshold again at every reload: the CPU's
    // window carries on, so the next new flow is still untracked.
    dp.set_flood_threshold(3).unwrap();
    assert_eq!(run(dp, cl0, &c4(syn(21010, 80))).0, XDP_REDIRECT);
    assert!(
        !in_table(dp).contains(&21010),
        "a reload restarted the window"
    );

    // An SNAT flow keeps its port in its entry: written in flood mode too.
    assert_eq!(run(dp, cl0, &c4(syn(21100, 443))).0, XDP_REDIRECT);
    assert!(
        in_table(dp).contains(&21100),
        "the SNAT flow is in the table"
    );

    // Below the threshold (raised above this window's count), a SYN
    // reusing a written tuple after the backends changed goes to Maglev's
    // new pick, and its entry replaces the old one: else the next packet
    // would follow the old entry to the old backend.
    dp.set_flood_threshold(1000).unwrap();
    let moved = picked[..3]
        .iter()
        .find(|(_, b)| *b != IpAddr::from(B4))
        .expect("one of the first three flows is not on B4");
    dp.set_service(&svc(
        VIP.into(),
        80,
        Protocol::Tcp,
        None,
        &[(B4.into(), 8080)],
    ))
    .unwrap();
    let (v, out) = run(dp, cl0, &c4(syn(moved.0, 80)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(backend_of(&out), IpAddr::from(B4));
    ack_reaches(dp, cl0, moved.0, (B4_MAC, B4), "the reused tuple's ACK");

    // Flood mode off: a new flow is written whatever the rate.
    dp.set_flood_threshold(0).unwrap();
    assert_eq!(run(dp, cl0, &c4(syn(21200, 80))).0, XDP_REDIRECT);
    assert!(in_table(dp).contains(&21200), "written with flood mode off");
}

/// A TCP segment from the client with `flags`.
fn c4_flags_to(sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    c4(Tcp::new(sport, dport).seq(2000).ack(5001).flags(flags))
}
fn c4_flags(sport: u16, flags: u8) -> Vec<u8> {
    c4(Tcp::new(sport, 80).seq(2000).ack(5001).flags(flags))
}

/// The data plane counts a backend's open flows for load-aware balancing:
/// each new flow once, each flow its client closes (FIN or RST) once,
/// whichever CPU sees it and however often the FIN is retransmitted; the
/// table walk finds the flows still open.
#[test]
fn open_flows_per_backend_are_counted_needs_root() {
    let mut bed = two_cpu_bed("xlb-fix-open");
    let (dp, cl0, be0) = (&mut bed.dp, bed.cl0, bed.be0);
    // VIP:80 has the one backend B2.
    let b2 = dp
        .backend_id(&base_services()[0].key(), sa(B2, 8080))
        .unwrap();
    for port in [45000, 45001, 45002] {
        let (v, _) = run(dp, cl0, &c4(syn(port, 80)));
        assert_eq!(v, XDP_REDIRECT);
    }
    assert_eq!(dp.backend_flows(b2).unwrap(), (3, 0));
    pin_to_cpu(0);
    let (v, _) = run(dp, cl0, &c4_flags(45000, tcp_flags::FIN | tcp_flags::ACK));
    assert_eq!(v, XDP_REDIRECT);
    // The FIN again, retransmitted on the other CPU, and the last ACK.
    pin_to_cpu(1);
    run(dp, cl0, &c4_flags(45000, tcp_flags::FIN | tcp_flags::ACK));
    run(dp, cl0, &c4_flags(45000, tcp_flags::ACK));
    assert_eq!(
        dp.backend_flows(b2).unwrap(),
        (3, 1),
        "one FIN, counted once"
    );
    let open = dp.open_flows_by_backend(Duration::from_secs(60)).unwrap();
    assert_eq!(open.get(&b2), Some(&2));
    // A reset for a flow the table does not know opens and closes it at once.
    run(dp, cl0, &c4_flags(47000, tcp_flags::RST));
    assert_eq!(dp.backend_flows(b2).unwrap(), (4, 2));
    let open = dp.open_flows_by_backend(Duration::from_secs(60)).unwrap();
    assert_eq!(open.get(&b2), Some(&2));
    // The backend resets a connection (an overloaded server closing without
    // reading): the client may never send again, so that closes it too.
    let rst = from_backend(B2_MAC)
        .ipv4(ip4(B2, CLIENT, 64))
        .tcp(Tcp::new(8080, 45001).seq(5001).flags(tcp_flags::RST))
        .build();
    let (v, _) = run(dp, be0, &rst);
    assert_eq!(v, XDP_REDIRECT, "the reset is translated back");
    run(dp, be0, &rst);
    assert_eq!(
        dp.backend_flows(b2).unwrap(),
        (4, 3),
        "the reset, counted once"
    );
    let open = dp.open_flows_by_backend(Duration::from_secs(60)).unwrap();
    assert_eq!(open.get(&b2), Some(&1));
}

/// A least-loaded service (load-aware) sends a new flow to the one of its
/// Maglev candidates (up to three distinct backends) with the fewest open
/// flows in `BACKEND_ACTIVE`, counts it there, and takes it off when the
/// client closes it.
#[test]
fn a_least_loaded_service_sends_new_flows_to_the_least_busy_candidate_needs_root() {
    let mut bed = FixtureBed::with("xlb-fix-least", None, MapSizes::default());
    pin_to_cpu(0);
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    let mut spec = svc(
        VIP.into(),
        80,
        Protocol::Tcp,
        None,
        &[(B2.into(), 8080), (B3.into(), 8080)],
    );
    spec.least_loaded = true;
    dp.set_service(&spec).unwrap();
    let id = |dp: &Dataplane, spec: &ServiceSpec, b: Ipv4Addr| {
        dp.backend_id(&spec.key(), sa(b, 8080)).unwrap()
    };
    let (b2, b3) = (id(dp, &spec, B2), id(dp, &spec, B3));
    let backend_of = |out: &[u8]| xlb_tests::packet::parse(out).unwrap().dst;
    let share = |dp: &mut Dataplane, ports: std::ops::Range<u16>, to: Ipv4Addr| {
        let n = ports.len();
        let hits = ports
            .filter(|&p| {
                let (v, out) = run(dp, cl0, &c4(syn(p, 80)));
                assert_eq!(v, XDP_REDIRECT);
                backend_of(&out) == IpAddr::from(to)
            })
            .count();
        hits as f64 / n as f64
    };

    // Two backends, B2 busy: the other candidate is drawn until it is B3
    // (up to 12 draws), so nearly every flow goes to B3.
    dp.set_backend_active(b2, 1000).unwrap();
    dp.set_backend_active(b3, 0).unwrap();
    let busy_b2 = share(dp, 20000..20200, B3);
    assert!(
        busy_b2 > 0.99,
        "{busy_b2} of new flows to B3 while B2 is busy"
    );
    // Each went into B3's count (B2's is above 1000 by its own).
    let active = |dp: &Dataplane, id: u32| dp.backend_active(id).unwrap();
    let on_b3 = (busy_b2 * 200.0).round() as i64;
    assert_eq!(active(dp, b3), on_b3);
    assert_eq!(active(dp, b2), 1000 + 200 - on_b3);

    // Three backends, two of them busy: a new flow compares all three (two
    // candidates would find the idle one for about two flows in three).
    spec.backends = backends(&[(B2.into(), 8080), (B3.into(), 8080), (B4.into(), 8080)]);
    dp.set_service(&spec).unwrap();
    let b4 = id(dp, &spec, B4);
    for (b, open) in [(b2, 1000), (b3, 1000), (b4, 0)] {
        dp.set_backend_active(b, open).unwrap();
    }
    let idle_b4 = share(dp, 22000..22200, B4);
    assert!(
        idle_b4 > 0.97,
        "{idle_b4} of new flows to B4, the only idle backend"
    );
    assert_eq!(active(dp, b4), (idle_b4 * 200.0).round() as i64);
    // The other way round: B4 is never the least busy of its candidates.
    for (b, open) in [(b2, 0), (b3, 0), (b4, 1000)] {
        dp.set_backend_active(b, open).unwrap();
    }
    let busy_b4 = share(dp, 21000..21200, B4);
    assert!(
        busy_b4 < 0.02,
        "{busy_b4} of new flows to B4 while it is busy"
    );

    // A client's FIN takes its flow off the count, once.
    let before = active(dp, b2) + active(dp, b3) + active(dp, b4);
    for _ in 0..2 {
        let (v, _) = run(dp, cl0, &c4_flags(21000, tcp_flags::FIN | tcp_flags::ACK));
        assert_eq!(v, XDP_REDIRECT);
    }
    assert_eq!(active(dp, b2) + active(dp, b3) + active(dp, b4), before - 1);
}

/// In NAT mode a backend that belongs to one service needs no per-flow
/// reply entry: a new flow writes only its flow entry, and the first reply
/// makes the reply entry from the backend's reverse translation, whether or
/// not this node forwarded the flow (another node of an ECMP group may
/// have). A reply to the node's own address (a health check) is left alone,
/// and a backend shared by two services keeps a reply entry per flow.
/// A node that takes an SNAT flow another node opened (`flow_sync`)
/// translates it exactly as that node did: its SNAT address and port, its
/// backend; its own new flows keep its own address. The bed plays both
/// nodes: the flow is opened, exported, the state cleared, and the service's
/// SNAT address changed to the second node's before the import.
#[test]
fn a_handed_snat_flow_is_translated_as_its_opening_node_did_needs_root() {
    const OTHER_NODE: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 9);
    let mut bed = FixtureBed::new("xlb-fix-handed");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    for s in base_services() {
        dp.set_service(&s).unwrap();
    }
    let (v, _) = run(dp, cl0, &c4(syn(40300, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let p = first_snat_port(CLIENT.into(), VIP.into(), 40300, 443, 6);
    let handed = dp.handed_flows(Handing::All).unwrap();
    assert_eq!(
        handed,
        vec![HandedFlow {
            protocol: Protocol::Tcp,
            client: sa(CLIENT, 40300),
            vip: sa(VIP, 443),
            backend: sa(B3, 8443),
            snat: Some(sa(SNAT4, p)),
            closed: false,
            idle_ms: handed[0].idle_ms,
        }]
    );

    // The second node: the same service with its own SNAT address.
    dp.clear_dynamic_state().unwrap();
    let mut snat = base_services()[2].clone();
    snat.snat = Some(OTHER_NODE.into());
    dp.set_service(&snat).unwrap();
    let stranger = HandedFlow {
        vip: sa(VIP, 444),
        ..handed[0]
    };
    let gone_backend = HandedFlow {
        backend: sa(B4, 8443),
        client: sa(CLIENT, 40301),
        ..handed[0]
    };
    let got = dp
        .import_flows(&[handed[0], stranger, gone_backend])
        .unwrap();
    assert_eq!(
        got,
        Imported {
            added: 1,
            unknown_service: 1,
            unknown_backend: 1,
            ..Imported::default()
        }
    );
    assert_eq!(
        dp.import_flows(&handed).unwrap().present,
        1,
        "kept, not replaced"
    );

    // Mid-connection: translated with the first node's address and port.
    let (v, out) = run(dp, cl0, &c4(ack(40300, 443)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(
        out,
        to_backend(B3_MAC)
            .ipv4(ip4(SNAT4, B3, 63))
            .tcp(ack(p, 8443))
            .build()
    );
    // The client's SYN sent again (its answer was late, and the router's
    // next hops changed meanwhile) keeps the handed flow: started afresh it
    // would reach the backend from this node's address, a second connection.
    let (v, out) = run(dp, cl0, &c4(syn(40300, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let resent = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(
        (resent.src, resent.sport),
        (IpAddr::from(SNAT4), Some(p)),
        "a retransmitted SYN"
    );
    // Once the client closed it, a SYN on its port is a new connection.
    run(dp, cl0, &c4_flags_to(40300, 443, 0x11));
    let (_, out) = run(dp, cl0, &c4(syn(40300, 443)));
    let reopened = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(
        reopened.src,
        IpAddr::from(OTHER_NODE),
        "a SYN after the FIN"
    );
    // A flow this node opens itself has its own address.
    let (_, out) = run(dp, cl0, &c4(syn(40302, 443)));
    let own = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(own.src, IpAddr::from(OTHER_NODE));
    // Handed on: all of them to a node that starts or leaves, only its own
    // in the periodic push (40300 is its own since it reopened here).
    assert_eq!(dp.handed_flows(Handing::All).unwrap().len(), 2);
    let mine = dp.handed_flows(Handing::OpenedHereSince(0)).unwrap();
    let mut ports: Vec<u16> = mine.iter().map(|f| f.client.port()).collect();
    ports.sort();
    assert_eq!(ports, [40300, 40302]);
    // Not handed on: a flow that is over for the program (closed and quiet
    // beyond `tcp_closing`, 10 s; snat and quiet beyond `tcp`, 15 min); a
    // quiet open one is, and an open nat one however quiet.
    let quiet = |port, closed, idle_ms| HandedFlow {
        client: sa(CLIENT, port),
        closed,
        idle_ms,
        ..handed[0]
    };
    let nat = HandedFlow {
        protocol: Protocol::Tcp,
        client: sa(CLIENT, 40313),
        vip: sa(VIP, 80),
        backend: sa(B2, 8080),
        snat: None,
        closed: false,
        idle_ms: 2_000_000,
    };
    let got = dp
        .import_flows(&[
            quiet(40310, true, 11_000),
            quiet(40311, true, 9_000),
            quiet(40312, false, 600_000),
            quiet(40314, false, 1_000_000),
            nat,
        ])
        .unwrap();
    assert_eq!(got.added, 5, "{got:?}");
    let mut ports: Vec<u16> = dp
        .handed_flows(Handing::All)
        .unwrap()
        .iter()
        .map(|f| f.client.port())
        .collect();
    ports.sort();
    assert_eq!(ports, [40300, 40302, 40311, 40312, 40313]);
}

/// A nat flow handed over keeps the backend the opening node gave it,
/// whichever Maglev would pick here (after a change of the backends, the
/// nodes' tables differ from when it opened); one opened here is handed on
/// without an SNAT address; a nat flow is not taken for an snat service.
#[test]
fn a_handed_nat_flow_keeps_its_backend_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-handed-nat");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    for s in base_services() {
        dp.set_service(&s).unwrap();
    }
    let to_multi = |sport| {
        from_client()
            .ipv4(ip4(CLIENT, VIP_MULTI, 64))
            .tcp(ack(sport, 80))
            .build()
    };
    let backends = [B2, B3, B4];
    let handed: Vec<HandedFlow> = backends
        .iter()
        .enumerate()
        .map(|(i, &b)| HandedFlow {
            protocol: Protocol::Tcp,
            client: sa(CLIENT, 40600 + i as u16),
            vip: sa(VIP_MULTI, 80),
            backend: sa(b, 8080),
            snat: None,
            closed: false,
            idle_ms: 0,
        })
        .collect();
    let got = dp.import_flows(&handed).unwrap();
    assert_eq!(got.added, 3, "{got:?}");
    // Each goes to its own backend: Maglev alone would send all three
    // ports' flows wherever it picks for each, not to all three in turn.
    for (i, &b) in backends.iter().enumerate() {
        let (v, out) = run(dp, cl0, &to_multi(40600 + i as u16));
        assert_eq!(v, XDP_REDIRECT);
        let p = xlb_tests::packet::parse(&out).unwrap();
        assert_eq!((p.dst, p.dport), (IpAddr::from(b), Some(8080)), "flow {i}");
    }
    // Opened here: handed on with no SNAT address.
    let (v, _) = run(
        dp,
        cl0,
        &from_client()
            .ipv4(ip4(CLIENT, VIP_MULTI, 64))
            .tcp(syn(40700, 80))
            .build(),
    );
    assert_eq!(v, XDP_REDIRECT);
    let mine = dp.handed_flows(Handing::OpenedHereSince(0)).unwrap();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!((mine[0].client, mine[0].snat), (sa(CLIENT, 40700), None));
    // The client's port used again through another node: a newer flow that
    // translates otherwise replaces the one here; an older one does not.
    let again = |backend, idle_ms| HandedFlow {
        client: sa(CLIENT, 40620),
        backend: sa(backend, 8080),
        idle_ms,
        ..handed[0]
    };
    assert_eq!(dp.import_flows(&[again(B2, 5_000)]).unwrap().added, 1);
    let got = dp.import_flows(&[again(B3, 0)]).unwrap();
    assert_eq!((got.replaced, got.present), (1, 0), "{got:?}");
    let got = dp.import_flows(&[again(B4, 60_000)]).unwrap();
    assert_eq!((got.replaced, got.present), (0, 1), "{got:?}");
    let (_, out) = run(dp, cl0, &to_multi(40620));
    let p = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!(p.dst, IpAddr::from(B3), "the newer flow");
    // Closed by its client through the node that handed it: marked closed
    // here too, so that a quiet closed copy holds a new connection's
    // packets instead of translating them as the old one (services with
    // `flow_sync`; see the hold's test).
    let got = dp
        .import_flows(&[HandedFlow {
            closed: true,
            ..again(B3, 0)
        }])
        .unwrap();
    assert_eq!(got.closed, 1, "{got:?}");
    let flows = dp.shared_flows().unwrap();
    let (_, f) = flows
        .iter()
        .find(|(k, _)| u16::from_be(k.sport) == 40620)
        .expect("the flow");
    assert_ne!(f.flags & lb_common::FLOW_F_CLOSED, 0);
    // Handed on by the node where it closed, with the flows it opened.
    run(
        dp,
        cl0,
        &from_client()
            .ipv4(ip4(CLIENT, VIP_MULTI, 64))
            .tcp(Tcp::new(40600, 80).seq(2000).ack(5001).flags(0x11))
            .build(),
    );
    let pushed = dp.handed_flows(Handing::OpenedHereSince(1)).unwrap();
    assert!(
        pushed.iter().any(|f| f.client.port() == 40600 && f.closed),
        "{pushed:?}"
    );
    // A nat flow for the snat service on VIP:443 is not taken.
    let mismatched = HandedFlow {
        vip: sa(VIP, 443),
        backend: sa(B3, 8443),
        client: sa(CLIENT, 40710),
        ..handed[0]
    };
    assert_eq!(dp.import_flows(&[mismatched]).unwrap().unknown_service, 1);
}

/// A node that started afresh (a pinned-map layout change) pulls its own
/// flows back from the peers it had handed them to: each gets its reply
/// translation again, so the backend's replies to this node's SNAT address
/// and port go back to the client instead of to the kernel (which resets
/// them), while the peer still forwards the client's side.
#[test]
fn a_flow_that_comes_home_has_its_replies_translated_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-home");
    let (dp, cl0, be0) = (&mut bed.dp, bed.cl0, bed.be0);
    for s in base_services() {
        dp.set_service(&s).unwrap();
    }
    let (v, _) = run(dp, cl0, &c4(syn(40500, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let p = first_snat_port(CLIENT.into(), VIP.into(), 40500, 443, 6);
    let handed = dp.handed_flows(Handing::All).unwrap();
    let reply = from_backend(B3_MAC)
        .ipv4(ip4(B3, SNAT4, 64))
        .tcp(ack(8443, p))
        .build();
    // Started afresh: no flow, no reply translation; the reply would go to
    // the kernel.
    dp.clear_dynamic_state().unwrap();
    assert_eq!(run(dp, be0, &reply).0, XDP_PASS);
    assert_eq!(dp.import_flows(&handed).unwrap().added, 1);
    let (v, out) = run(dp, be0, &reply);
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(
        out,
        to_client()
            .ipv4(ip4(VIP, CLIENT, 63))
            .tcp(ack(443, 40500))
            .build()
    );
    // Another node's flow (another SNAT address) gets no reply translation
    // here: its replies go to that node.
    dp.clear_dynamic_state().unwrap();
    let other = HandedFlow {
        snat: Some(SocketAddr::from(([10, 2, 0, 9], p))),
        ..handed[0]
    };
    assert_eq!(dp.import_flows(&[other]).unwrap().added, 1);
    assert!(dp.reply_entries().unwrap().is_empty());
}

/// With `flow_sync` (`SERVICE_F_HOLD_UNKNOWN`), a mid-connection TCP
/// packet of a flow this node does not know is dropped, not translated
/// afresh (its backend would answer a reset), until the flow exchange
/// brings the flow or `HOLD_UNKNOWN_NS` has passed since its first packet;
/// then Maglev picks again, as without the exchange. A SYN is never held.
#[test]
fn an_unknown_snat_flow_is_held_until_the_exchange_brings_it_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-hold");
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    for s in base_services() {
        dp.set_service(&s).unwrap();
    }
    let mut snat = base_services()[2].clone();
    snat.hold_unknown_flows = true;
    dp.set_service(&snat).unwrap();
    let held = |dp: &Dataplane| dp.reason_counts().unwrap()[Reason::DropHeldUnknownFlow as usize];

    // Held: dropped, twice.
    for n in 1..=2 {
        let (v, _) = run(dp, cl0, &c4(ack(40400, 443)));
        assert_eq!(v, XDP_DROP, "packet {n} of an unknown flow");
    }
    assert_eq!(held(dp), 2);
    // The exchange brings it: it goes as the node that opened it sent it.
    let other = SocketAddr::from(([10, 2, 0, 9], 20001));
    // Another node's flow from the client's port `cport`, as it hands it.
    let handed = |cport| HandedFlow {
        protocol: Protocol::Tcp,
        client: sa(CLIENT, cport),
        vip: sa(VIP, 443),
        backend: sa(B3, 8443),
        snat: Some(other),
        closed: false,
        idle_ms: 0,
    };
    let got = dp.import_flows(&[handed(40400)]).unwrap();
    assert_eq!(got.added, 1);
    let (v, out) = run(dp, cl0, &c4(ack(40400, 443)));
    assert_eq!(v, XDP_REDIRECT);
    let p = xlb_tests::packet::parse(&out).unwrap();
    assert_eq!((p.src, p.sport), (other.ip(), Some(other.port())));
    // A SYN is a new connection, never held.
    let (v, _) = run(dp, cl0, &c4(syn(40401, 443)));
    assert_eq!(v, XDP_REDIRECT);
    // Held no longer than HOLD_UNKNOWN_NS: then picked afresh.
    let (v, _) = run(dp, cl0, &c4(ack(40402, 443)));
    assert_eq!(v, XDP_DROP);
    std::thread::sleep(
        Duration::from_nanos(lb_common::HOLD_UNKNOWN_NS) + Duration::from_millis(100),
    );
    let (v, out) = run(dp, cl0, &c4(ack(40402, 443)));
    assert_eq!(v, XDP_REDIRECT, "after the hold");
    assert_eq!(
        xlb_tests::packet::parse(&out).unwrap().src,
        IpAddr::from(SNAT4)
    );
    assert_eq!(held(dp), 3);
    // The flow known, then lost again (evicted: here, every flow cleared):
    // a later episode is held afresh, not picked at once on the strength
    // of the first episode's entry.
    dp.clear_dynamic_state().unwrap();
    let (v, _) = run(dp, cl0, &c4(ack(40402, 443)));
    assert_eq!(v, XDP_DROP, "a later episode of the same flow");
    assert_eq!(held(dp), 1);
    // Held, then its retransmission comes long after the hold (a client
    // far into its backoff): picked afresh, not held again.
    std::thread::sleep(
        Duration::from_nanos(lb_common::HOLD_UNKNOWN_NS) * 3 + Duration::from_millis(100),
    );
    let (v, _) = run(dp, cl0, &c4(ack(40402, 443)));
    assert_eq!(v, XDP_REDIRECT, "a retransmission long after the hold");
    // Imported while held: known, so that a later loss is held afresh.
    let (v, _) = run(dp, cl0, &c4(ack(40404, 443)));
    assert_eq!(v, XDP_DROP);
    dp.import_flows(&[handed(40404)]).unwrap();
    std::thread::sleep(
        Duration::from_nanos(lb_common::HOLD_UNKNOWN_NS) + Duration::from_millis(100),
    );
    dp.clear_dynamic_state().unwrap();
    let (v, _) = run(dp, cl0, &c4(ack(40404, 443)));
    assert_eq!(v, XDP_DROP, "lost again after the import: held afresh");
    // A closed flow long quiet is a previous connection's: a packet other
    // than a SYN on its port is a new connection's, opened through another
    // node, and is held like an unknown flow's.
    assert_eq!(run(dp, cl0, &c4(syn(40405, 443))).0, XDP_REDIRECT);
    run(dp, cl0, &c4_flags_to(40405, 443, 0x11));
    let (v, _) = run(dp, cl0, &c4(ack(40405, 443)));
    assert_eq!(v, XDP_REDIRECT, "the closing connection's last ACK");
    std::thread::sleep(
        Duration::from_nanos(lb_common::CLOSED_STALE_NS) + Duration::from_millis(100),
    );
    let (v, _) = run(dp, cl0, &c4(ack(40405, 443)));
    assert_eq!(v, XDP_DROP, "a packet on a closed flow's port, a second on");
    // The exchange brings that new connection, translated exactly as the
    // closed one (the backend and the SNAT port follow from the tuple): it
    // takes the closed copy's place, and the packet's retransmission goes.
    let closed = dp
        .handed_flows(Handing::All)
        .unwrap()
        .into_iter()
        .find(|f| f.client.port() == 40405)
        .expect("the closed flow");
    assert!(closed.closed);
    let reopened = HandedFlow {
        closed: false,
        idle_ms: 0,
        ..closed
    };
    assert_eq!(dp.import_flows(&[reopened]).unwrap().replaced, 1);
    let (v, _) = run(dp, cl0, &c4(ack(40405, 443)));
    assert_eq!(v, XDP_REDIRECT, "the new connection's flow, brought");
    // Without the exchange an unknown flow is picked afresh at once.
    dp.set_service(&base_services()[2]).unwrap();
    let (v, _) = run(dp, cl0, &c4(ack(40403, 443)));
    assert_eq!(v, XDP_REDIRECT);
}

#[test]
fn nat_replies_are_translated_without_the_forward_flow_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-reverse");
    for s in base_services() {
        bed.dp.set_service(&s).unwrap();
    }
    let (dp, cl0, be0) = (&mut bed.dp, bed.cl0, bed.be0);
    dp.set_service(&svc(
        VIP.into(),
        8000,
        Protocol::Tcp,
        None,
        &[(B4.into(), 9000)],
    ))
    .unwrap();
    let replies_from = |dp: &Dataplane, port: u16| {
        dp.reply_entries()
            .unwrap()
            .into_iter()
            .filter(|(k, _)| u16::from_be(k.sport) == port)
            .count()
    };
    // A new flow: one entry, in the flow table only.
    let (v, _) = run(dp, cl0, &c4(syn(47000, 8000)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(replies_from(dp, 9000), 0, "no reply entry with the flow");
    // Its first reply is translated and makes the entry.
    let reply = |sport: u16, dst: Ipv4Addr| {
        from_backend(B4_MAC)
            .ipv4(ip4(B4, dst, 64))
            .tcp(synack(9000, sport))
            .build()
    };
    let (v, out) = run(dp, be0, &reply(47000, CLIENT));
    assert_eq!(v, XDP_REDIRECT);
    let want = to_client()
        .ipv4(ip4(VIP, CLIENT, 63))
        .tcp(synack(8000, 47000))
        .build();
    assert!(out == want, "first reply\n{}", hexdump_diff(&want, &out));
    assert_eq!(replies_from(dp, 9000), 1, "the first reply made the entry");

    // A node that never saw the flow (its state is gone here): the reply is
    // translated all the same, and the client's next packet reaches the
    // same backend (Maglev is the same on every node).
    dp.reset_flows_to(SocketAddr::new(B4.into(), 9000)).unwrap();
    assert_eq!(replies_from(dp, 9000), 0);
    let (v, out) = run(dp, be0, &reply(47001, CLIENT));
    assert_eq!(v, XDP_REDIRECT);
    let want = to_client()
        .ipv4(ip4(VIP, CLIENT, 63))
        .tcp(synack(8000, 47001))
        .build();
    assert!(
        out == want,
        "reply without state\n{}",
        hexdump_diff(&want, &out)
    );
    let (v, out) = run(dp, cl0, &c4(ack(47001, 8000)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(
        xlb_tests::packet::parse(&out).unwrap().dst,
        IpAddr::from(B4)
    );

    // A reply to this node's own address is not a service's.
    let input = reply(47002, SNAT4);
    let (v, out) = run(dp, be0, &input);
    assert_eq!(v, XDP_PASS, "a health check's answer goes to the node");
    assert!(out == input, "{}", hexdump_diff(&input, &out));

    // B2:8080 serves VIP:80 and VIP_MULTI:80: its flows keep an entry each,
    // and a reply from it that matches no flow is left alone.
    let (v, _) = run(dp, cl0, &c4(syn(47003, 80)));
    assert_eq!(v, XDP_REDIRECT);
    assert_eq!(replies_from(dp, 8080), 1, "a shared backend's flow");
    let input = from_backend(B2_MAC)
        .ipv4(ip4(B2, CLIENT, 64))
        .tcp(synack(8080, 47004))
        .build();
    let (v, out) = run(dp, be0, &input);
    assert_eq!(v, XDP_PASS);
    assert!(out == input, "{}", hexdump_diff(&input, &out));
}

/// `new_flow_limit`: new flows from one source prefix beyond the burst are
/// dropped and counted (`drop_flow_limit`) before they take any state;
/// another prefix, and the flows already admitted, go on.
#[test]
fn new_flows_beyond_the_limit_of_a_source_prefix_are_dropped_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-limit");
    for s in base_services() {
        bed.dp.set_service(&s).unwrap();
    }
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    let mut limited = svc(VIP.into(), 8001, Protocol::Tcp, None, &[(B4.into(), 9001)]);
    // One new flow a second per /24 after a burst of three; the packets
    // below come within milliseconds, so nothing refills meanwhile.
    limited.new_flow_limit = Some(lb_agent::dataplane::NewFlowLimit {
        per_second: 1,
        burst: 3,
        ipv4_prefix: 24,
        ipv6_prefix: 64,
    });
    dp.set_service(&limited).unwrap();
    let syn_from = |src: Ipv4Addr, sport: u16| {
        from_client()
            .ipv4(ip4(src, VIP, 64))
            .tcp(syn(sport, 8001))
            .build()
    };
    let limited_drops =
        |dp: &Dataplane| dp.reason_counts().unwrap()[Reason::DropFlowLimit as usize];
    let flows_before = dp.shared_flows().unwrap().len();
    // CLIENT (10.0.0.2) and ROUTER (10.0.0.254) share a /24: three flows in all.
    for (src, sport) in [(CLIENT, 48000), (ROUTER, 48001), (CLIENT, 48002)] {
        assert_eq!(
            run(dp, cl0, &syn_from(src, sport)).0,
            XDP_REDIRECT,
            "{src}:{sport}"
        );
    }
    let input = syn_from(ROUTER, 48003);
    let (v, out) = run(dp, cl0, &input);
    assert_eq!(v, XDP_DROP, "the fourth new flow of 10.0.0.0/24");
    assert!(out == input);
    assert_eq!(limited_drops(dp), 1);
    assert_eq!(
        dp.shared_flows().unwrap().len(),
        flows_before + 3,
        "a dropped flow takes no state"
    );
    // Another /24 has its own budget; an admitted flow goes on.
    assert_eq!(
        run(dp, cl0, &syn_from(REMOTE_CLIENT, 48004)).0,
        XDP_REDIRECT
    );
    let ack = from_client()
        .ipv4(ip4(CLIENT, VIP, 64))
        .tcp(ack(48000, 8001))
        .build();
    assert_eq!(run(dp, cl0, &ack).0, XDP_REDIRECT, "an admitted flow");
    // Other services of the same clients are not limited.
    assert_eq!(run(dp, cl0, &c4(syn(48005, 80))).0, XDP_REDIRECT);
    assert_eq!(limited_drops(dp), 1);

    // IPv6: sources are counted by their /64 (`ipv6_prefix`).
    let mut limited6 = svc(
        vip6().into(),
        8001,
        Protocol::Tcp,
        None,
        &[(b6_2().into(), 9001)],
    );
    limited6.new_flow_limit = limited.new_flow_limit;
    dp.set_service(&limited6).unwrap();
    let syn6_from = |src: Ipv6Addr, sport: u16| {
        from_client()
            .ipv6(ip6(src, vip6(), 64))
            .tcp(syn(sport, 8001))
            .build()
    };
    let same64 = v6("fd00::99:1");
    for (src, sport) in [(client6(), 49000), (same64, 49001), (client6(), 49002)] {
        assert_eq!(
            run(dp, cl0, &syn6_from(src, sport)).0,
            XDP_REDIRECT,
            "[{src}]:{sport}"
        );
    }
    assert_eq!(
        run(dp, cl0, &syn6_from(same64, 49003)).0,
        XDP_DROP,
        "the fourth new flow of fd00::/64"
    );
    assert_eq!(
        run(dp, cl0, &syn6_from(v6("fd00:0:0:1::2"), 49004)).0,
        XDP_REDIRECT,
        "another /64 has its own budget"
    );
    assert_eq!(limited_drops(dp), 2);
}

/// The SNAT source port search (`claim_snat_port`, its probes run by
/// `bpf_loop`): with two ports, a second client flow takes the one the
/// first left, a third finds none and is dropped as exhausted before it
/// takes any state, and a client flow that starts again finds its own port.
#[test]
fn snat_ports_are_probed_until_a_free_one_and_exhaustion_drops_needs_root() {
    let mut bed = FixtureBed::new("xlb-fix-snatports");
    for s in base_services() {
        bed.dp.set_service(&s).unwrap();
    }
    let (dp, cl0) = (&mut bed.dp, bed.cl0);
    dp.set_config(Config {
        snat_port_min: 40000,
        snat_port_max: 40001,
        ..Config::default()
    })
    .unwrap();
    let snat_port = |dp: &mut Dataplane, sport: u16| {
        let (v, out) = run(dp, cl0, &c4(syn(sport, 443)));
        (v == XDP_REDIRECT).then(|| xlb_tests::packet::parse(&out).unwrap().sport.unwrap())
    };
    let first = snat_port(dp, 46000).expect("the first flow gets a port");
    let second = snat_port(dp, 46001).expect("the second flow gets the other");
    let mut both = [first, second];
    both.sort();
    assert_eq!(both, [40000, 40001]);
    let exhausted =
        |dp: &Dataplane| dp.reason_counts().unwrap()[Reason::DropSnatExhausted as usize];
    let flows = dp.shared_flows().unwrap().len();
    assert_eq!(snat_port(dp, 46002), None, "no port is left");
    assert_eq!(exhausted(dp), 1);
    assert_eq!(
        dp.shared_flows().unwrap().len(),
        flows,
        "the dropped flow takes no state"
    );
    assert_eq!(
        snat_port(dp, 46000),
        Some(first),
        "a client flow starting again finds its own port"
    );
}

/// An interface whose MAC changes while the program runs: once the agent
/// reads it again (its 500 ms tick does), frames to the new MAC are
/// translated and frames to the old one are another host's.
#[test]
fn a_changed_interface_mac_is_followed_needs_root() {
    let mut bed = FixtureBed::new("xlb-fx-macchange");
    for s in base_services() {
        bed.dp.set_service(&s).unwrap();
    }
    let new_mac: Mac = [2, 0, 0, 0, 1, 0x42];
    let to = |mac: Mac, sport: u16| {
        PacketBuilder::new()
            .eth(CLIENT_MAC, mac)
            .ipv4(ip4(CLIENT, VIP, 64))
            .tcp(syn(sport, 80))
            .build()
    };
    assert_eq!(run(&bed.dp, bed.cl0, &to(CL0_MAC, 40500)).0, XDP_REDIRECT);
    assert!(
        bed.dp.refresh_interface_macs().unwrap().is_empty(),
        "nothing changed yet"
    );
    bed.ns.run("ip link set cl0 address 02:00:00:00:01:42");
    assert_eq!(
        bed.dp.refresh_interface_macs().unwrap(),
        ["cl0"],
        "the changed MAC is noticed"
    );
    let before = bed.dp.reason_counts().unwrap();
    assert_eq!(
        run(&bed.dp, bed.cl0, &to(new_mac, 40501)).0,
        XDP_REDIRECT,
        "a SYN to the new MAC is translated"
    );
    assert_eq!(
        run(&bed.dp, bed.cl0, &to(CL0_MAC, 40502)).0,
        XDP_PASS,
        "a SYN to the old MAC is another host's"
    );
    let after = bed.dp.reason_counts().unwrap();
    let moved = |r: Reason| after[r as usize] - before[r as usize];
    assert_eq!(
        (moved(Reason::Redirect), moved(Reason::PassForeignMac)),
        (1, 1)
    );
}

/// A TCP proxy to `to` that forwards what the client sends at `rate`
/// bytes a second, and the answers as they come: a slow but live peer (a
/// busy node, a thin link), in front of a real flow exchange.
async fn throttling_proxy(to: SocketAddr, rate: u64) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let mut buf = [0u8; 8192];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64)).await;
                }
                let _ = sw.shutdown().await;
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
        }
    });
    addr
}

/// A peer's push gets through however slowly it goes, as long as it goes:
/// 12,000 flows (960 KB) through a proxy that forwards 600 KB a second
/// take about 1.6 s, and are all imported by the real exchange behind it.
/// (A push was once given 1 s in all: a backlog that outgrew what a busy
/// peer takes in a second failed every round, and grew.)
#[test]
fn a_slow_peer_takes_a_push_bigger_than_a_second_needs_root() {
    use lb_agent::{
        config::FlowSyncConfig,
        flow_sync::{Exchange, Peers},
    };
    use std::sync::{Arc, Mutex};
    const FLOWS: u16 = 12_000;
    let mut dp = Dataplane::open_with(None, MapSizes::default()).expect("load (root needed)");
    for s in base_services() {
        dp.set_service(&s).unwrap();
    }
    let dp = Arc::new(Mutex::new(dp));
    let keys = vec![b"a flow exchange test key, 32 B..".to_vec()];
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = FlowSyncConfig {
        listen,
        peers: Vec::new(),
        discover_peers: false,
        keys: keys.clone(),
        key_file: Default::default(),
        interval: Duration::from_secs(3600),
        forget_after: Duration::from_secs(3600),
    };
    let other_node = Ipv4Addr::new(10, 2, 0, 9);
    let flows: Vec<HandedFlow> = (0..FLOWS)
        .map(|i| HandedFlow {
            protocol: Protocol::Tcp,
            client: sa(CLIENT, 10_000 + i),
            vip: sa(VIP, 443),
            backend: sa(B3, 8443),
            snat: Some(sa(other_node, 20_000 + i)),
            closed: false,
            idle_ms: 0,
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (result, took) = rt.block_on(async {
        let _exchange = Exchange::start(&cfg, dp.clone()).await.unwrap();
        let slow = throttling_proxy(listen, 600_000).await;
        let peers = Peers::new(&keys, Some(vec![slow]));
        let started = std::time::Instant::now();
        let mut results = peers.push(&flows, false).await;
        (results.pop().expect("one peer").1, started.elapsed())
    });
    assert_eq!(result, Ok(u32::from(FLOWS)), "after {took:?}");
    assert!(
        took > Duration::from_millis(1200),
        "the proxy forwarded 960 KB in {took:?}: too fast to tell"
    );
    let taken = dp.lock().unwrap().handed_flows(Handing::All).unwrap();
    assert_eq!(taken.len(), usize::from(FLOWS));
}
