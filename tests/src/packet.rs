//! Packet builder and checker for test fixtures.
//!
//! Building a frame:
//!
//! ```
//! use std::net::Ipv4Addr;
//! use xlb_tests::packet::{tcp_flags, verify_checksums, Ipv4, PacketBuilder, Tcp};
//!
//! let frame = PacketBuilder::new()
//!     .eth([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
//!     .vlan(100)
//!     .ipv4(Ipv4::new(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)).ttl(64))
//!     .tcp(Tcp::new(40000, 80).seq(1).flags(tcp_flags::SYN))
//!     .build();
//! verify_checksums(&frame).unwrap();
//! ```
//!
//! Checking a frame: [`verify_checksums`] recomputes every checksum from
//! scratch, [`parse`] returns a [`Parsed`] summary for assertions, and
//! [`hexdump_diff`] renders a byte-level diff for failed fixture comparisons.
//!
//! Everything here panics on builder misuse (it is test code) and returns
//! `Err(String)` describing the layer and the problem when checking frames.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A MAC address.
pub type Mac = [u8; 6];

/// EtherType of IPv4.
pub const ETH_P_IPV4: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86DD;
/// TPID of an 802.1Q VLAN tag.
pub const ETH_P_8021Q: u16 = 0x8100;

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
const IPV4_MIN_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
const ICMP_HLEN: usize = 8;

/// IP protocol / IPv6 next-header numbers.
pub mod proto {
    /// IPv6 hop-by-hop options extension header.
    pub const HOP_BY_HOP: u8 = 0;
    /// ICMP (for IPv4).
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// IPv6 routing extension header.
    pub const ROUTING: u8 = 43;
    /// IPv6 fragment extension header.
    pub const FRAGMENT: u8 = 44;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// IPv6 "no next header".
    pub const NO_NEXT: u8 = 59;
    /// IPv6 destination options extension header.
    pub const DEST_OPTS: u8 = 60;
}

/// TCP flag bits, combine with `|`.
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;
    /// URG.
    pub const URG: u8 = 0x20;
    /// ECE.
    pub const ECE: u8 = 0x40;
    /// CWR.
    pub const CWR: u8 = 0x80;
}

/// ICMP and ICMPv6 type numbers used by the helpers.
pub mod icmp_types {
    /// ICMPv4 echo reply.
    pub const V4_ECHO_REPLY: u8 = 0;
    /// ICMPv4 destination unreachable.
    pub const V4_DEST_UNREACH: u8 = 3;
    /// ICMPv4 destination unreachable code "fragmentation needed and DF set".
    pub const V4_CODE_FRAG_NEEDED: u8 = 4;
    /// ICMPv4 echo request.
    pub const V4_ECHO_REQUEST: u8 = 8;
    /// ICMPv4 time exceeded.
    pub const V4_TIME_EXCEEDED: u8 = 11;
    /// ICMPv6 destination unreachable.
    pub const V6_DEST_UNREACH: u8 = 1;
    /// ICMPv6 packet too big.
    pub const V6_PACKET_TOO_BIG: u8 = 2;
    /// ICMPv6 time exceeded.
    pub const V6_TIME_EXCEEDED: u8 = 3;
    /// ICMPv6 echo request.
    pub const V6_ECHO_REQUEST: u8 = 128;
    /// ICMPv6 echo reply.
    pub const V6_ECHO_REPLY: u8 = 129;
}

// ---------------------------------------------------------------------------
// Checksums
// ---------------------------------------------------------------------------

/// RFC 1071 Internet checksum over the concatenation of `parts`.
///
/// Parts may have odd lengths; bytes are paired across part boundaries as if
/// the parts were one buffer. Returns the complemented sum, i.e. the value to
/// store in a checksum field that was zero while summing.
pub fn internet_checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u64 = 0;
    let mut high = true;
    for &byte in parts.iter().flat_map(|p| p.iter()) {
        sum += if high {
            u64::from(byte) << 8
        } else {
            u64::from(byte)
        };
        high = !high;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// TCP/UDP/ICMPv6 pseudo-header for `src`/`dst` (both must be the same family).
fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let len = u16::try_from(len).expect("L4 length exceeds 65535");
            let mut p = Vec::with_capacity(12);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.push(0);
            p.push(proto);
            p.extend_from_slice(&len.to_be_bytes());
            p
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let len = u32::try_from(len).expect("L4 length exceeds u32");
            let mut p = Vec::with_capacity(40);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, proto]);
            p
        }
        _ => panic!("pseudo-header with mixed address families: {src} / {dst}"),
    }
}

/// Checksum of an L4 segment whose checksum field is at `csum_off`; the field
/// is treated as zero whatever it currently holds.
fn l4_checksum(src: IpAddr, dst: IpAddr, proto: u8, segment: &[u8], csum_off: usize) -> u16 {
    let pseudo = pseudo_header(src, dst, proto, segment.len());
    internet_checksum(&[
        &pseudo,
        &segment[..csum_off],
        &[0, 0],
        &segment[csum_off + 2..],
    ])
}

/// Checksum over `data` with the 16-bit field at `csum_off` treated as zero.
fn plain_checksum(data: &[u8], csum_off: usize) -> u16 {
    internet_checksum(&[&data[..csum_off], &[0, 0], &data[csum_off + 2..]])
}

fn put_u16(buf: &mut [u8], off: usize, v: u16) {
    buf[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

fn get_u16(buf: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([buf[off], buf[off + 1]])
}

fn get_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

// ---------------------------------------------------------------------------
// Builder: layer descriptions
// ---------------------------------------------------------------------------

/// IPv4 header description. Defaults: TTL 64, id 0, DF set, MF clear,
/// offset 0, TOS 0, no options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub ttl: u8,
    pub tos: u8,
    pub id: u16,
    pub df: bool,
    pub mf: bool,
    /// Fragment offset in 8-octet units (13 bits).
    pub frag_offset: u16,
    /// Raw options bytes; length must be a multiple of 4 and at most 40.
    pub options: Vec<u8>,
}

impl Ipv4 {
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr) -> Self {
        Self {
            src,
            dst,
            ttl: 64,
            tos: 0,
            id: 0,
            df: true,
            mf: false,
            frag_offset: 0,
            options: Vec::new(),
        }
    }
    pub fn ttl(mut self, ttl: u8) -> Self {
        self.ttl = ttl;
        self
    }
    pub fn tos(mut self, tos: u8) -> Self {
        self.tos = tos;
        self
    }
    pub fn id(mut self, id: u16) -> Self {
        self.id = id;
        self
    }
    pub fn df(mut self, df: bool) -> Self {
        self.df = df;
        self
    }
    pub fn mf(mut self, mf: bool) -> Self {
        self.mf = mf;
        self
    }
    /// Fragment offset in 8-octet units.
    pub fn frag_offset(mut self, units: u16) -> Self {
        assert!(
            units < 0x2000,
            "IPv4 fragment offset {units} exceeds 13 bits"
        );
        self.frag_offset = units;
        self
    }
    /// Raw options (multiple of 4 bytes, at most 40); IHL grows accordingly.
    pub fn options(mut self, options: &[u8]) -> Self {
        assert!(
            options.len().is_multiple_of(4) && options.len() <= 40,
            "IPv4 options must be a multiple of 4 bytes and at most 40, got {}",
            options.len()
        );
        self.options = options.to_vec();
        self
    }

    fn header(&self, proto: u8, payload_len: usize) -> Vec<u8> {
        let hlen = IPV4_MIN_HLEN + self.options.len();
        let total = u16::try_from(hlen + payload_len).expect("IPv4 total length exceeds 65535");
        let mut flags_off = self.frag_offset;
        if self.df {
            flags_off |= 0x4000;
        }
        if self.mf {
            flags_off |= 0x2000;
        }
        let mut h = vec![0u8; hlen];
        h[0] = 0x40 | (hlen / 4) as u8;
        h[1] = self.tos;
        put_u16(&mut h, 2, total);
        put_u16(&mut h, 4, self.id);
        put_u16(&mut h, 6, flags_off);
        h[8] = self.ttl;
        h[9] = proto;
        h[12..16].copy_from_slice(&self.src.octets());
        h[16..20].copy_from_slice(&self.dst.octets());
        h[20..].copy_from_slice(&self.options);
        let csum = plain_checksum(&h, 10);
        put_u16(&mut h, 10, csum);
        h
    }
}

/// IPv6 extension header, emitted in the order given, before the L4 header.
/// Next-header and length fields are filled in by the builder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtHeader {
    /// Hop-by-hop options (0). `options` are raw TLVs; PadN/Pad1 padding to a
    /// multiple of 8 bytes is appended automatically.
    HopByHop { options: Vec<u8> },
    /// Routing header (43). `data` is everything after the first 4 bytes
    /// (next header, length, type, segments left); zero-padded to 8n bytes.
    Routing {
        routing_type: u8,
        segments_left: u8,
        data: Vec<u8>,
    },
    /// Destination options (60), padded like [`ExtHeader::HopByHop`].
    DestOpts { options: Vec<u8> },
    /// Fragment header (44). `offset` is in 8-octet units.
    Fragment { offset: u16, more: bool, id: u32 },
}

impl ExtHeader {
    /// Hop-by-hop header with only padding (8 bytes).
    pub fn hop_by_hop() -> Self {
        Self::HopByHop {
            options: Vec::new(),
        }
    }
    /// Destination options header with only padding (8 bytes).
    pub fn dest_opts() -> Self {
        Self::DestOpts {
            options: Vec::new(),
        }
    }
    /// Routing header with 4 reserved zero bytes of data (8 bytes).
    pub fn routing(routing_type: u8, segments_left: u8) -> Self {
        Self::Routing {
            routing_type,
            segments_left,
            data: vec![0; 4],
        }
    }
    /// Fragment header; `offset` in 8-octet units.
    pub fn fragment(offset: u16, more: bool, id: u32) -> Self {
        assert!(
            offset < 0x2000,
            "IPv6 fragment offset {offset} exceeds 13 bits"
        );
        Self::Fragment { offset, more, id }
    }

    /// The next-header number identifying this extension header.
    pub fn proto(&self) -> u8 {
        match self {
            Self::HopByHop { .. } => proto::HOP_BY_HOP,
            Self::Routing { .. } => proto::ROUTING,
            Self::DestOpts { .. } => proto::DEST_OPTS,
            Self::Fragment { .. } => proto::FRAGMENT,
        }
    }

    fn bytes(&self, next: u8) -> Vec<u8> {
        let mut b = match self {
            Self::HopByHop { options } | Self::DestOpts { options } => {
                let mut b = vec![next, 0];
                b.extend_from_slice(options);
                let pad = (8 - b.len() % 8) % 8;
                match pad {
                    0 => {}
                    1 => b.push(0), // Pad1
                    n => {
                        b.push(1); // PadN
                        b.push((n - 2) as u8);
                        b.resize(b.len() + n - 2, 0);
                    }
                }
                b
            }
            Self::Routing {
                routing_type,
                segments_left,
                data,
            } => {
                let mut b = vec![next, 0, *routing_type, *segments_left];
                b.extend_from_slice(data);
                b.resize(b.len().div_ceil(8).max(1) * 8, 0);
                b
            }
            Self::Fragment { offset, more, id } => {
                let mut b = vec![next, 0];
                b.extend_from_slice(&((offset << 3) | u16::from(*more)).to_be_bytes());
                b.extend_from_slice(&id.to_be_bytes());
                return b; // length field is reserved (0) for fragment headers
            }
        };
        let units = b.len() / 8 - 1;
        b[1] = u8::try_from(units).expect("IPv6 extension header too long");
        b
    }
}

/// IPv6 header description. Defaults: hop limit 64, traffic class 0, flow
/// label 0, no extension headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub flow_label: u32,
    pub ext: Vec<ExtHeader>,
}

impl Ipv6 {
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr) -> Self {
        Self {
            src,
            dst,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            ext: Vec::new(),
        }
    }
    pub fn hop_limit(mut self, hop_limit: u8) -> Self {
        self.hop_limit = hop_limit;
        self
    }
    pub fn traffic_class(mut self, tc: u8) -> Self {
        self.traffic_class = tc;
        self
    }
    pub fn flow_label(mut self, label: u32) -> Self {
        assert!(label < 1 << 20, "flow label {label:#x} exceeds 20 bits");
        self.flow_label = label;
        self
    }
    /// Appends an extension header to the chain (emitted in call order).
    pub fn ext(mut self, ext: ExtHeader) -> Self {
        self.ext.push(ext);
        self
    }

    /// Fixed header plus extension headers.
    fn headers(&self, proto: u8, l4_len: usize) -> Vec<u8> {
        let mut exts = Vec::new();
        for (i, e) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(proto, ExtHeader::proto);
            exts.extend_from_slice(&e.bytes(next));
        }
        let payload_len =
            u16::try_from(exts.len() + l4_len).expect("IPv6 payload length exceeds 65535");
        let first_next = self.ext.first().map_or(proto, ExtHeader::proto);
        let vtf = (6u32 << 28) | (u32::from(self.traffic_class) << 20) | self.flow_label;
        let mut h = Vec::with_capacity(IPV6_HLEN + exts.len());
        h.extend_from_slice(&vtf.to_be_bytes());
        h.extend_from_slice(&payload_len.to_be_bytes());
        h.push(first_next);
        h.push(self.hop_limit);
        h.extend_from_slice(&self.src.octets());
        h.extend_from_slice(&self.dst.octets());
        h.extend_from_slice(&exts);
        h
    }
}

/// TCP segment description. Defaults: seq 0, ack 0, no flags, window 65535,
/// no options, empty payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tcp {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// See [`tcp_flags`].
    pub flags: u8,
    pub window: u16,
    /// Raw options; length must be a multiple of 4 and at most 40.
    pub options: Vec<u8>,
    pub payload: Vec<u8>,
}

impl Tcp {
    pub fn new(sport: u16, dport: u16) -> Self {
        Self {
            sport,
            dport,
            seq: 0,
            ack: 0,
            flags: 0,
            window: 65535,
            options: Vec::new(),
            payload: Vec::new(),
        }
    }
    pub fn seq(mut self, seq: u32) -> Self {
        self.seq = seq;
        self
    }
    /// Sets the acknowledgment number (set the ACK flag via [`Tcp::flags`]).
    pub fn ack(mut self, ack: u32) -> Self {
        self.ack = ack;
        self
    }
    /// Sets the flag byte, e.g. `tcp_flags::SYN | tcp_flags::ACK`.
    pub fn flags(mut self, flags: u8) -> Self {
        self.flags = flags;
        self
    }
    pub fn window(mut self, window: u16) -> Self {
        self.window = window;
        self
    }
    /// Raw options (multiple of 4 bytes, at most 40); data offset grows accordingly.
    pub fn options(mut self, options: &[u8]) -> Self {
        assert!(
            options.len().is_multiple_of(4) && options.len() <= 40,
            "TCP options must be a multiple of 4 bytes and at most 40, got {}",
            options.len()
        );
        self.options = options.to_vec();
        self
    }
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    fn bytes(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let hlen = TCP_MIN_HLEN + self.options.len();
        let mut b = vec![0u8; hlen];
        put_u16(&mut b, 0, self.sport);
        put_u16(&mut b, 2, self.dport);
        b[4..8].copy_from_slice(&self.seq.to_be_bytes());
        b[8..12].copy_from_slice(&self.ack.to_be_bytes());
        b[12] = ((hlen / 4) as u8) << 4;
        b[13] = self.flags;
        put_u16(&mut b, 14, self.window);
        b[20..].copy_from_slice(&self.options);
        b.extend_from_slice(&self.payload);
        let csum = l4_checksum(src, dst, proto::TCP, &b, 16);
        put_u16(&mut b, 16, csum);
        b
    }
}

/// UDP datagram description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Udp {
    pub sport: u16,
    pub dport: u16,
    pub payload: Vec<u8>,
    /// Emit checksum 0 ("no checksum"). Valid over IPv4 only; over IPv6 this
    /// builds an invalid packet (handy as a negative case).
    pub zero_checksum: bool,
}

impl Udp {
    pub fn new(sport: u16, dport: u16) -> Self {
        Self {
            sport,
            dport,
            payload: Vec::new(),
            zero_checksum: false,
        }
    }
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }
    /// Emit checksum 0 instead of computing it (see [`Udp::zero_checksum`]).
    pub fn zero_checksum(mut self) -> Self {
        self.zero_checksum = true;
        self
    }

    fn bytes(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let len = u16::try_from(UDP_HLEN + self.payload.len()).expect("UDP length exceeds 65535");
        let mut b = vec![0u8; UDP_HLEN];
        put_u16(&mut b, 0, self.sport);
        put_u16(&mut b, 2, self.dport);
        put_u16(&mut b, 4, len);
        b.extend_from_slice(&self.payload);
        if !self.zero_checksum {
            let csum = match l4_checksum(src, dst, proto::UDP, &b, 6) {
                0 => 0xffff,
                c => c,
            };
            put_u16(&mut b, 6, csum);
        }
        b
    }
}

/// How much of an inner packet an ICMP error quotes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Quote {
    /// The inner IPv4 header (IHL-sized, with options) plus the first 8 bytes
    /// of its payload, as routers do (RFC 792).
    #[default]
    HeaderPlus8,
    /// The whole inner packet.
    All,
    /// The first `n` bytes (or the whole packet if shorter).
    Bytes(usize),
}

impl Quote {
    fn apply(self, inner: &[u8]) -> &[u8] {
        let n = match self {
            Self::HeaderPlus8 => {
                let ihl = inner.first().map_or(0, |b| usize::from(b & 0x0f) * 4);
                ihl + 8
            }
            Self::All => inner.len(),
            Self::Bytes(n) => n,
        };
        &inner[..n.min(inner.len())]
    }
}

/// ICMPv4 message: type, code, the 4 "rest of header" bytes, and a body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Icmpv4 {
    pub icmp_type: u8,
    pub code: u8,
    /// Bytes 4..8 of the ICMP header (id/seq for echo, unused/MTU for errors).
    pub rest: [u8; 4],
    pub body: Vec<u8>,
}

impl Icmpv4 {
    /// Any ICMP message.
    pub fn new(icmp_type: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Self {
        Self {
            icmp_type,
            code,
            rest,
            body: body.to_vec(),
        }
    }
    /// Echo request (type 8) with empty payload.
    pub fn echo_request(id: u16, seq: u16) -> Self {
        Self::new(icmp_types::V4_ECHO_REQUEST, 0, echo_rest(id, seq), &[])
    }
    /// Echo reply (type 0) with empty payload.
    pub fn echo_reply(id: u16, seq: u16) -> Self {
        Self::new(icmp_types::V4_ECHO_REPLY, 0, echo_rest(id, seq), &[])
    }
    /// Destination unreachable / fragmentation needed (type 3 code 4) with
    /// next-hop MTU, quoting `inner` (an IPv4 packet, starting at its IP header).
    pub fn frag_needed(mtu: u16, inner: &[u8], quote: Quote) -> Self {
        let m = mtu.to_be_bytes();
        Self::new(
            icmp_types::V4_DEST_UNREACH,
            icmp_types::V4_CODE_FRAG_NEEDED,
            [0, 0, m[0], m[1]],
            quote.apply(inner),
        )
    }
    /// Sets the body (echo payload).
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.body = payload.to_vec();
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = vec![self.icmp_type, self.code, 0, 0];
        b.extend_from_slice(&self.rest);
        b.extend_from_slice(&self.body);
        let csum = plain_checksum(&b, 2);
        put_u16(&mut b, 2, csum);
        b
    }
}

/// ICMPv6 message: type, code, the 4 "rest of header" bytes, and a body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Icmpv6 {
    pub icmp_type: u8,
    pub code: u8,
    /// Bytes 4..8 of the message (id/seq for echo, MTU for packet too big).
    pub rest: [u8; 4],
    pub body: Vec<u8>,
}

impl Icmpv6 {
    /// Any ICMPv6 message.
    pub fn new(icmp_type: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Self {
        Self {
            icmp_type,
            code,
            rest,
            body: body.to_vec(),
        }
    }
    /// Echo request (type 128) with empty payload.
    pub fn echo_request(id: u16, seq: u16) -> Self {
        Self::new(icmp_types::V6_ECHO_REQUEST, 0, echo_rest(id, seq), &[])
    }
    /// Echo reply (type 129) with empty payload.
    pub fn echo_reply(id: u16, seq: u16) -> Self {
        Self::new(icmp_types::V6_ECHO_REPLY, 0, echo_rest(id, seq), &[])
    }
    /// Packet too big (type 2) with `mtu`, quoting all of `inner` (an IPv6
    /// packet starting at its fixed header). Pass a shorter slice (see
    /// [`truncate`]) to quote less.
    pub fn packet_too_big(mtu: u32, inner: &[u8]) -> Self {
        Self::new(icmp_types::V6_PACKET_TOO_BIG, 0, mtu.to_be_bytes(), inner)
    }
    /// Sets the body (echo payload).
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.body = payload.to_vec();
        self
    }

    fn bytes(&self, src: IpAddr, dst: IpAddr) -> Vec<u8> {
        let mut b = vec![self.icmp_type, self.code, 0, 0];
        b.extend_from_slice(&self.rest);
        b.extend_from_slice(&self.body);
        let csum = l4_checksum(src, dst, proto::ICMPV6, &b, 2);
        put_u16(&mut b, 2, csum);
        b
    }
}

fn echo_rest(id: u16, seq: u16) -> [u8; 4] {
    let (i, s) = (id.to_be_bytes(), seq.to_be_bytes());
    [i[0], i[1], s[0], s[1]]
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum IpLayer {
    V4(Ipv4),
    V6(Ipv6),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum L4 {
    Tcp(Tcp),
    Udp(Udp),
    Icmpv4(Icmpv4),
    Icmpv6(Icmpv6),
    Raw { proto: u8, bytes: Vec<u8> },
}

// ---------------------------------------------------------------------------
// Builder
// ---------------------------------------------------------------------------

/// Chainable frame builder: Ethernet (+ optional VLAN) / IPv4 or IPv6 / L4.
///
/// Default MACs: src `02:00:00:00:00:01`, dst `02:00:00:00:00:02`. Setting a
/// second IP layer or L4 layer replaces the first. [`PacketBuilder::build`]
/// panics if the IP or L4 layer is missing, or if ICMPv4 is put over IPv6 or
/// ICMPv6 over IPv4 (use [`PacketBuilder::raw`] for odd combinations).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PacketBuilder {
    src_mac: Mac,
    dst_mac: Mac,
    vlan: Option<u16>,
    ip: Option<IpLayer>,
    l4: Option<L4>,
    truncate: Option<usize>,
}

impl Default for PacketBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl PacketBuilder {
    pub fn new() -> Self {
        Self {
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            vlan: None,
            ip: None,
            l4: None,
            truncate: None,
        }
    }
    /// Sets source and destination MAC.
    pub fn eth(mut self, src: Mac, dst: Mac) -> Self {
        self.src_mac = src;
        self.dst_mac = dst;
        self
    }
    pub fn src_mac(mut self, mac: Mac) -> Self {
        self.src_mac = mac;
        self
    }
    pub fn dst_mac(mut self, mac: Mac) -> Self {
        self.dst_mac = mac;
        self
    }
    /// Adds one 802.1Q tag (TPID 0x8100, PCP 0, DEI 0) with VLAN id `vid`.
    pub fn vlan(mut self, vid: u16) -> Self {
        assert!(vid < 0x1000, "VLAN id {vid} exceeds 12 bits");
        self.vlan = Some(vid);
        self
    }
    pub fn ipv4(mut self, ip: Ipv4) -> Self {
        self.ip = Some(IpLayer::V4(ip));
        self
    }
    pub fn ipv6(mut self, ip: Ipv6) -> Self {
        self.ip = Some(IpLayer::V6(ip));
        self
    }
    pub fn tcp(mut self, tcp: Tcp) -> Self {
        self.l4 = Some(L4::Tcp(tcp));
        self
    }
    pub fn udp(mut self, udp: Udp) -> Self {
        self.l4 = Some(L4::Udp(udp));
        self
    }
    pub fn icmpv4(mut self, icmp: Icmpv4) -> Self {
        self.l4 = Some(L4::Icmpv4(icmp));
        self
    }
    pub fn icmpv6(mut self, icmp: Icmpv6) -> Self {
        self.l4 = Some(L4::Icmpv6(icmp));
        self
    }
    /// Arbitrary bytes after the IP headers with protocol/next-header
    /// `proto`, emitted verbatim (e.g. the data of a non-first fragment).
    pub fn raw(mut self, proto: u8, bytes: &[u8]) -> Self {
        self.l4 = Some(L4::Raw {
            proto,
            bytes: bytes.to_vec(),
        });
        self
    }
    /// Cuts the output of [`build`](Self::build) / [`build_ip`](Self::build_ip)
    /// to at most `len` bytes, after all lengths and checksums are computed.
    pub fn truncate(mut self, len: usize) -> Self {
        self.truncate = Some(len);
        self
    }

    /// The complete Ethernet frame.
    pub fn build(&self) -> Vec<u8> {
        let ip = self.ip_packet();
        let (ethertype, _) = self.ip_info();
        let mut f = Vec::with_capacity(ETH_HLEN + VLAN_HLEN + ip.len());
        f.extend_from_slice(&self.dst_mac);
        f.extend_from_slice(&self.src_mac);
        if let Some(vid) = self.vlan {
            f.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
            f.extend_from_slice(&vid.to_be_bytes());
        }
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&ip);
        self.cut(f)
    }

    /// Only the IP packet (no Ethernet header), e.g. to quote inside an ICMP error.
    pub fn build_ip(&self) -> Vec<u8> {
        self.cut(self.ip_packet())
    }

    fn cut(&self, v: Vec<u8>) -> Vec<u8> {
        match self.truncate {
            Some(len) => truncate(&v, len),
            None => v,
        }
    }

    fn ip_info(&self) -> (u16, (IpAddr, IpAddr)) {
        match &self.ip {
            Some(IpLayer::V4(ip)) => (ETH_P_IPV4, (ip.src.into(), ip.dst.into())),
            Some(IpLayer::V6(ip)) => (ETH_P_IPV6, (ip.src.into(), ip.dst.into())),
            None => panic!("PacketBuilder: no IP layer, call .ipv4() or .ipv6()"),
        }
    }

    fn ip_packet(&self) -> Vec<u8> {
        let (_, (src, dst)) = self.ip_info();
        let is_v4 = matches!(self.ip, Some(IpLayer::V4(_)));
        let (proto, l4) = match &self.l4 {
            Some(L4::Tcp(t)) => (proto::TCP, t.bytes(src, dst)),
            Some(L4::Udp(u)) => (proto::UDP, u.bytes(src, dst)),
            Some(L4::Icmpv4(i)) => {
                assert!(is_v4, "PacketBuilder: ICMPv4 over IPv6, use .raw()");
                (proto::ICMP, i.bytes())
            }
            Some(L4::Icmpv6(i)) => {
                assert!(!is_v4, "PacketBuilder: ICMPv6 over IPv4, use .raw()");
                (proto::ICMPV6, i.bytes(src, dst))
            }
            Some(L4::Raw { proto, bytes }) => (*proto, bytes.clone()),
            None => {
                panic!("PacketBuilder: no L4 layer, call .tcp()/.udp()/.icmpv4()/.icmpv6()/.raw()")
            }
        };
        let mut p = match &self.ip {
            Some(IpLayer::V4(ip)) => ip.header(proto, l4.len()),
            Some(IpLayer::V6(ip)) => ip.headers(proto, l4.len()),
            None => unreachable!(),
        };
        p.extend_from_slice(&l4);
        p
    }
}

/// Returns the first `len` bytes of `packet` (all of it if shorter), without
/// fixing any length or checksum field.
pub fn truncate(packet: &[u8], len: usize) -> Vec<u8> {
    packet[..len.min(packet.len())].to_vec()
}

// ---------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------

/// Fragment information from an IPv4 header or an IPv6 fragment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// Offset in 8-octet units.
    pub offset: u16,
    /// More-fragments flag.
    pub more: bool,
    /// IPv4 identification or IPv6 fragment identification.
    pub id: u32,
}

/// The packet quoted inside an ICMP / ICMPv6 error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InnerPacket {
    pub ip_version: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// L4 protocol after any extension headers.
    pub proto: u8,
    /// TCP/UDP ports, if at least 4 bytes of the inner L4 header are quoted.
    pub sport: Option<u16>,
    pub dport: Option<u16>,
}

/// Summary of a frame for test assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    pub src_mac: Mac,
    pub dst_mac: Mac,
    pub vlan: Option<u16>,
    /// 4 or 6.
    pub ip_version: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IPv4 TTL or IPv6 hop limit.
    pub ttl: u8,
    /// IPv4 identification (None for IPv6).
    pub ipv4_id: Option<u16>,
    /// IPv4 DF flag (false for IPv6).
    pub df: bool,
    /// Set for any fragment (MF set or offset != 0).
    pub fragment: Option<Fragment>,
    /// IPv6 extension header types in order (empty for IPv4).
    pub ext_headers: Vec<u8>,
    /// IPv4 protocol, or IPv6 next header after the extension headers.
    pub l4_proto: u8,
    /// Offset of the IP header within the frame.
    pub ip_offset: usize,
    /// Offset of the L4 header within the frame (after IPv4 options / IPv6 ext headers).
    pub l4_offset: usize,
    /// TCP/UDP ports (None for other protocols and non-first fragments).
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    pub tcp_flags: Option<u8>,
    pub tcp_seq: Option<u32>,
    pub tcp_ack: Option<u32>,
    pub icmp_type: Option<u8>,
    pub icmp_code: Option<u8>,
    /// Identifier / sequence of ICMP(v6) echo request/reply.
    pub icmp_echo_id: Option<u16>,
    pub icmp_echo_seq: Option<u16>,
    /// Next-hop MTU of ICMPv4 frag-needed or ICMPv6 packet-too-big.
    pub mtu: Option<u32>,
    /// Quoted packet of an ICMP(v6) error.
    pub inner: Option<InnerPacket>,
    /// Bytes after the L4 header (TCP/UDP/ICMP); for other protocols and
    /// non-first fragments, everything after the IP headers. Excludes
    /// Ethernet padding beyond the IP length.
    pub payload: Vec<u8>,
}

/// Result of parsing one IP packet (outer or quoted).
struct IpView<'a> {
    version: u8,
    src: IpAddr,
    dst: IpAddr,
    ttl: u8,
    ipv4_id: Option<u16>,
    df: bool,
    fragment: Option<Fragment>,
    ext_headers: Vec<u8>,
    proto: u8,
    /// IPv4 header bytes (with options); empty for IPv6.
    v4_header: &'a [u8],
    /// Offset of L4 within the IP packet.
    l4_offset: usize,
    /// Bytes after the IP headers, up to the IP length (or what is available
    /// when not strict).
    l4: &'a [u8],
}

impl IpView<'_> {
    /// True unless this is a non-first fragment.
    fn has_l4_header(&self) -> bool {
        self.fragment.is_none_or(|f| f.offset == 0)
    }
}

struct EthView {
    src_mac: Mac,
    dst_mac: Mac,
    vlan: Option<u16>,
    ethertype: u16,
    ip_offset: usize,
}

fn parse_eth(frame: &[u8]) -> Result<EthView, String> {
    if frame.len() < ETH_HLEN {
        return Err(format!(
            "Ethernet: frame truncated: {} bytes, need {ETH_HLEN}",
            frame.len()
        ));
    }
    let mut dst_mac = [0u8; 6];
    let mut src_mac = [0u8; 6];
    dst_mac.copy_from_slice(&frame[0..6]);
    src_mac.copy_from_slice(&frame[6..12]);
    let mut ethertype = get_u16(frame, 12);
    let mut ip_offset = ETH_HLEN;
    let mut vlan = None;
    if ethertype == ETH_P_8021Q {
        if frame.len() < ETH_HLEN + VLAN_HLEN {
            return Err(format!(
                "VLAN: frame truncated: {} bytes, need {}",
                frame.len(),
                ETH_HLEN + VLAN_HLEN
            ));
        }
        vlan = Some(get_u16(frame, 14) & 0x0fff);
        ethertype = get_u16(frame, 16);
        ip_offset += VLAN_HLEN;
    }
    Ok(EthView {
        src_mac,
        dst_mac,
        vlan,
        ethertype,
        ip_offset,
    })
}

/// Parses an IP packet. `strict`: the packet must hold the full IP length
/// (outer packets); otherwise (quoted packets) missing bytes are tolerated
/// after the IP headers.
fn parse_ip(pkt: &[u8], strict: bool) -> Result<IpView<'_>, String> {
    match pkt.first().map(|b| b >> 4) {
        Some(4) => parse_ipv4(pkt, strict),
        Some(6) => parse_ipv6(pkt, strict),
        Some(v) => Err(format!("IP: unknown version {v}")),
        None => Err("IP: no bytes".to_string()),
    }
}

fn parse_ipv4(pkt: &[u8], strict: bool) -> Result<IpView<'_>, String> {
    if pkt.len() < IPV4_MIN_HLEN {
        return Err(format!(
            "IPv4: header truncated: {} bytes, need {IPV4_MIN_HLEN}",
            pkt.len()
        ));
    }
    let hlen = usize::from(pkt[0] & 0x0f) * 4;
    if hlen < IPV4_MIN_HLEN {
        return Err(format!("IPv4: IHL {} is below 5", hlen / 4));
    }
    if pkt.len() < hlen {
        return Err(format!(
            "IPv4: header truncated: {} bytes, IHL says {hlen}",
            pkt.len()
        ));
    }
    let total = usize::from(get_u16(pkt, 2));
    if total < hlen {
        return Err(format!(
            "IPv4: total length {total} is below header length {hlen}"
        ));
    }
    if strict && total > pkt.len() {
        return Err(format!(
            "IPv4: packet truncated: total length {total}, {} bytes available",
            pkt.len()
        ));
    }
    let flags_off = get_u16(pkt, 6);
    let id = get_u16(pkt, 4);
    let offset = flags_off & 0x1fff;
    let more = flags_off & 0x2000 != 0;
    let fragment = (more || offset != 0).then_some(Fragment {
        offset,
        more,
        id: u32::from(id),
    });
    Ok(IpView {
        version: 4,
        src: IpAddr::V4(Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15])),
        dst: IpAddr::V4(Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19])),
        ttl: pkt[8],
        ipv4_id: Some(id),
        df: flags_off & 0x4000 != 0,
        fragment,
        ext_headers: Vec::new(),
        proto: pkt[9],
        v4_header: &pkt[..hlen],
        l4_offset: hlen,
        l4: &pkt[hlen..total.min(pkt.len())],
    })
}

fn parse_ipv6(pkt: &[u8], strict: bool) -> Result<IpView<'_>, String> {
    if pkt.len() < IPV6_HLEN {
        return Err(format!(
            "IPv6: header truncated: {} bytes, need {IPV6_HLEN}",
            pkt.len()
        ));
    }
    let total = IPV6_HLEN + usize::from(get_u16(pkt, 4));
    if strict && total > pkt.len() {
        return Err(format!(
            "IPv6: packet truncated: payload length {} + 40, {} bytes available",
            total - IPV6_HLEN,
            pkt.len()
        ));
    }
    let end = total.min(pkt.len());
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src.copy_from_slice(&pkt[8..24]);
    dst.copy_from_slice(&pkt[24..40]);

    let mut next = pkt[6];
    let mut off = IPV6_HLEN;
    let mut ext_headers = Vec::new();
    let mut fragment = None;
    loop {
        match next {
            proto::HOP_BY_HOP | proto::ROUTING | proto::DEST_OPTS => {
                if off + 2 > end {
                    return Err(format!(
                        "IPv6: extension header {next} at offset {off} truncated"
                    ));
                }
                let len = (usize::from(pkt[off + 1]) + 1) * 8;
                if off + len > end {
                    return Err(format!(
                        "IPv6: extension header {next} at offset {off} truncated: length {len}, {} bytes left",
                        end - off
                    ));
                }
                ext_headers.push(next);
                next = pkt[off];
                off += len;
            }
            proto::FRAGMENT => {
                if off + 8 > end {
                    return Err(format!("IPv6: fragment header at offset {off} truncated"));
                }
                ext_headers.push(next);
                let fo = get_u16(pkt, off + 2);
                let frag = Fragment {
                    offset: fo >> 3,
                    more: fo & 1 != 0,
                    id: get_u32(pkt, off + 4),
                };
                next = pkt[off];
                off += 8;
                if frag.more || frag.offset != 0 {
                    fragment = Some(frag);
                }
                if frag.offset != 0 {
                    break; // the rest is fragment data, not headers
                }
            }
            _ => break,
        }
        if ext_headers.len() > 16 {
            return Err("IPv6: more than 16 extension headers".to_string());
        }
    }
    Ok(IpView {
        version: 6,
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        ttl: pkt[7],
        ipv4_id: None,
        df: false,
        fragment,
        ext_headers,
        proto: next,
        v4_header: &[],
        l4_offset: off,
        l4: &pkt[off..end],
    })
}

fn is_icmp_error(version: u8, icmp_type: u8) -> bool {
    match version {
        4 => matches!(icmp_type, 3 | 4 | 5 | 11 | 12),
        _ => matches!(icmp_type, 1..=4),
    }
}

fn icmp_proto(version: u8) -> u8 {
    if version == 4 {
        proto::ICMP
    } else {
        proto::ICMPV6
    }
}

fn parse_inner(quoted: &[u8]) -> Result<InnerPacket, String> {
    let ip = parse_ip(quoted, false).map_err(|e| format!("ICMP quoted packet: {e}"))?;
    let ports =
        (matches!(ip.proto, proto::TCP | proto::UDP) && ip.has_l4_header() && ip.l4.len() >= 4)
            .then(|| (get_u16(ip.l4, 0), get_u16(ip.l4, 2)));
    Ok(InnerPacket {
        ip_version: ip.version,
        src: ip.src,
        dst: ip.dst,
        proto: ip.proto,
        sport: ports.map(|p| p.0),
        dport: ports.map(|p| p.1),
    })
}

/// Parses a frame into a [`Parsed`] summary. Does not check checksums (see
/// [`verify_checksums`]). Fails on truncated headers or a frame shorter than
/// the IP length; bytes beyond the IP length (Ethernet padding) are ignored.
pub fn parse(frame: &[u8]) -> Result<Parsed, String> {
    let eth = parse_eth(frame)?;
    if eth.ethertype != ETH_P_IPV4 && eth.ethertype != ETH_P_IPV6 {
        return Err(format!(
            "Ethernet: unsupported EtherType {:#06x}",
            eth.ethertype
        ));
    }
    let ip = parse_ip(&frame[eth.ip_offset..], true)?;
    let want_version = if eth.ethertype == ETH_P_IPV4 { 4 } else { 6 };
    if ip.version != want_version {
        return Err(format!(
            "IP: EtherType {:#06x} but IP version {}",
            eth.ethertype, ip.version
        ));
    }
    let mut p = Parsed {
        src_mac: eth.src_mac,
        dst_mac: eth.dst_mac,
        vlan: eth.vlan,
        ip_version: ip.version,
        src: ip.src,
        dst: ip.dst,
        ttl: ip.ttl,
        ipv4_id: ip.ipv4_id,
        df: ip.df,
        fragment: ip.fragment,
        ext_headers: ip.ext_headers.clone(),
        l4_proto: ip.proto,
        ip_offset: eth.ip_offset,
        l4_offset: eth.ip_offset + ip.l4_offset,
        sport: None,
        dport: None,
        tcp_flags: None,
        tcp_seq: None,
        tcp_ack: None,
        icmp_type: None,
        icmp_code: None,
        icmp_echo_id: None,
        icmp_echo_seq: None,
        mtu: None,
        inner: None,
        payload: ip.l4.to_vec(),
    };
    if !ip.has_l4_header() {
        return Ok(p);
    }
    let l4 = ip.l4;
    let need = |name: &str, n: usize| {
        if l4.len() < n {
            Err(format!(
                "{name}: header truncated: {} bytes, need {n}",
                l4.len()
            ))
        } else {
            Ok(())
        }
    };
    match ip.proto {
        proto::TCP => {
            need("TCP", TCP_MIN_HLEN)?;
            let hlen = usize::from(l4[12] >> 4) * 4;
            if hlen < TCP_MIN_HLEN {
                return Err(format!("TCP: data offset {} is below 5", hlen / 4));
            }
            need("TCP", hlen)?;
            p.sport = Some(get_u16(l4, 0));
            p.dport = Some(get_u16(l4, 2));
            p.tcp_seq = Some(get_u32(l4, 4));
            p.tcp_ack = Some(get_u32(l4, 8));
            p.tcp_flags = Some(l4[13]);
            p.payload = l4[hlen..].to_vec();
        }
        proto::UDP => {
            need("UDP", UDP_HLEN)?;
            p.sport = Some(get_u16(l4, 0));
            p.dport = Some(get_u16(l4, 2));
            p.payload = l4[UDP_HLEN..].to_vec();
        }
        x if x == icmp_proto(ip.version) => {
            let name = if ip.version == 4 { "ICMP" } else { "ICMPv6" };
            need(name, ICMP_HLEN)?;
            let (ty, code) = (l4[0], l4[1]);
            p.icmp_type = Some(ty);
            p.icmp_code = Some(code);
            p.payload = l4[ICMP_HLEN..].to_vec();
            let echo = match ip.version {
                4 => matches!(ty, icmp_types::V4_ECHO_REQUEST | icmp_types::V4_ECHO_REPLY),
                _ => matches!(ty, icmp_types::V6_ECHO_REQUEST | icmp_types::V6_ECHO_REPLY),
            };
            if echo {
                p.icmp_echo_id = Some(get_u16(l4, 4));
                p.icmp_echo_seq = Some(get_u16(l4, 6));
            }
            if ip.version == 4
                && ty == icmp_types::V4_DEST_UNREACH
                && code == icmp_types::V4_CODE_FRAG_NEEDED
            {
                p.mtu = Some(u32::from(get_u16(l4, 6)));
            }
            if ip.version == 6 && ty == icmp_types::V6_PACKET_TOO_BIG {
                p.mtu = Some(get_u32(l4, 4));
            }
            if is_icmp_error(ip.version, ty) {
                p.inner = Some(parse_inner(&l4[ICMP_HLEN..])?);
            }
        }
        _ => {}
    }
    Ok(p)
}

// ---------------------------------------------------------------------------
// Checksum verification
// ---------------------------------------------------------------------------

fn check(layer: &str, expected: u16, found: u16) -> Result<(), String> {
    if expected == found {
        Ok(())
    } else {
        Err(format!(
            "{layer} checksum mismatch: expected {expected:#06x}, found {found:#06x}"
        ))
    }
}

/// Recomputes and checks every checksum in `frame`:
///
/// - IPv4 header checksum (with options);
/// - TCP, UDP (pseudo-header over the IPv6 destination in the fixed header;
///   routing headers are not followed), ICMP, ICMPv6;
/// - for ICMPv4 errors, the quoted inner IPv4 header checksum (the quote must
///   contain the full inner header); for ICMPv6 errors the quote must parse.
///
/// UDP checksum 0 is accepted over IPv4 and rejected over IPv6. L4 checks are
/// skipped for fragments (MF set or offset != 0): the L4 checksum covers the
/// reassembled datagram, which a single fragment doesn't hold. Other L4
/// protocols are not checked. MACs, VLAN, IPv6 traffic class / flow label /
/// hop limit and IPv6 extension header contents are not covered by any
/// checksum. Truncated packets are reported as errors.
pub fn verify_checksums(frame: &[u8]) -> Result<(), String> {
    let parsed = parse(frame)?;
    let ip = parse_ip(&frame[parsed.ip_offset..], true)?;
    if ip.version == 4 {
        check(
            "IPv4 header",
            plain_checksum(ip.v4_header, 10),
            get_u16(ip.v4_header, 10),
        )?;
    }
    if ip.fragment.is_some() {
        return Ok(());
    }
    let l4 = ip.l4;
    match ip.proto {
        proto::TCP => check(
            "TCP",
            l4_checksum(ip.src, ip.dst, proto::TCP, l4, 16),
            get_u16(l4, 16),
        ),
        proto::UDP => {
            let udp_len = usize::from(get_u16(l4, 4));
            if udp_len != l4.len() {
                return Err(format!(
                    "UDP: length field {udp_len} != {} bytes of IP payload",
                    l4.len()
                ));
            }
            let found = get_u16(l4, 6);
            if found == 0 {
                return if ip.version == 4 {
                    Ok(())
                } else {
                    Err("UDP checksum is 0 over IPv6 (not allowed)".to_string())
                };
            }
            let expected = match l4_checksum(ip.src, ip.dst, proto::UDP, l4, 6) {
                0 => 0xffff,
                c => c,
            };
            check("UDP", expected, found)
        }
        proto::ICMP if ip.version == 4 => {
            check("ICMP", plain_checksum(l4, 2), get_u16(l4, 2))?;
            if is_icmp_error(4, l4[0]) {
                let inner = &l4[ICMP_HLEN..];
                let iv = parse_ip(inner, false).map_err(|e| format!("ICMP quoted packet: {e}"))?;
                if iv.version != 4 {
                    return Err(format!(
                        "ICMP quoted packet: IP version {} inside ICMPv4",
                        iv.version
                    ));
                }
                check(
                    "ICMP quoted IPv4 header",
                    plain_checksum(iv.v4_header, 10),
                    get_u16(iv.v4_header, 10),
                )?;
            }
            Ok(())
        }
        proto::ICMPV6 if ip.version == 6 => {
            check(
                "ICMPv6",
                l4_checksum(ip.src, ip.dst, proto::ICMPV6, l4, 2),
                get_u16(l4, 2),
            )?;
            if let Some(inner) = &parsed.inner {
                if inner.ip_version != 6 {
                    return Err(format!(
                        "ICMPv6 quoted packet: IP version {} inside ICMPv6",
                        inner.ip_version
                    ));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------
// Hexdump diff
// ---------------------------------------------------------------------------

/// Line-by-line hexdump diff, 16 bytes per line. Equal lines are printed once
/// with a leading space; differing lines are printed as a `-` (expected) and
/// `+` (actual) pair followed by a line with `^^` under each differing byte.
/// Bytes missing on one side are shown as `..`.
pub fn hexdump_diff(expected: &[u8], actual: &[u8]) -> String {
    let max = expected.len().max(actual.len());
    let ndiff = (0..max)
        .filter(|&i| expected.get(i) != actual.get(i))
        .count();
    let mut out = String::new();
    let _ = write!(
        out,
        "expected {} bytes, actual {} bytes",
        expected.len(),
        actual.len()
    );
    match (0..max).find(|&i| expected.get(i) != actual.get(i)) {
        Some(first) => {
            let _ = writeln!(out, ", {ndiff} bytes differ, first at offset {first:#06x}");
        }
        None => {
            let _ = writeln!(out, ", identical");
        }
    }
    let hex_line = |data: &[u8], start: usize| -> String {
        let mut s = String::new();
        for i in start..(start + 16).min(max) {
            if i == start + 8 {
                s.push(' ');
            }
            match data.get(i) {
                Some(b) => {
                    let _ = write!(s, " {b:02x}");
                }
                None => s.push_str(" .."),
            }
        }
        s
    };
    for start in (0..max).step_by(16) {
        let end = (start + 16).min(max);
        let differs = (start..end).any(|i| expected.get(i) != actual.get(i));
        if !differs {
            let _ = writeln!(out, "  {start:04x} {}", hex_line(expected, start));
            continue;
        }
        let _ = writeln!(out, "- {start:04x} {}", hex_line(expected, start));
        let _ = writeln!(out, "+ {start:04x} {}", hex_line(actual, start));
        let mut marks = String::from("       ");
        for i in start..end {
            if i == start + 8 {
                marks.push(' ');
            }
            marks.push_str(if expected.get(i) != actual.get(i) {
                " ^^"
            } else {
                "   "
            });
        }
        let _ = writeln!(out, "{}", marks.trim_end());
    }
    out
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    const V4_SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
    const V4_DST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
    const V6_SRC: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
    const V6_DST: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0xbeef, 2);
    const MAC_A: Mac = [0x02, 0x11, 0x22, 0x33, 0x44, 0x55];
    const MAC_B: Mac = [0x02, 0x66, 0x77, 0x88, 0x99, 0xaa];

    fn v4() -> PacketBuilder {
        PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .ipv4(Ipv4::new(V4_SRC, V4_DST).id(0x1234))
    }

    fn v6() -> PacketBuilder {
        PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .ipv6(Ipv6::new(V6_SRC, V6_DST))
    }

    fn inner_v4_tcp() -> Vec<u8> {
        PacketBuilder::new()
            .ipv4(Ipv4::new(V4_DST, V4_SRC).ttl(63).id(7))
            .tcp(
                Tcp::new(80, 40000)
                    .seq(99)
                    .flags(tcp_flags::ACK)
                    .payload(&[0xab; 1400]),
            )
            .build_ip()
    }

    fn inner_v6_udp() -> Vec<u8> {
        PacketBuilder::new()
            .ipv6(Ipv6::new(V6_DST, V6_SRC).hop_limit(63))
            .udp(Udp::new(53, 5353).payload(&[0xcd; 1400]))
            .build_ip()
    }

    /// Unfragmented sample frames whose IP and L4 checksums cover every IPv4
    /// header / L4 byte.
    fn samples() -> Vec<(&'static str, Vec<u8>)> {
        vec![
            (
                "v4 tcp syn",
                v4().tcp(Tcp::new(40000, 80).seq(1).flags(tcp_flags::SYN))
                    .build(),
            ),
            (
                "v4 vlan tcp payload odd",
                v4().vlan(42)
                    .tcp(
                        Tcp::new(40000, 80)
                            .seq(0xdeadbeef)
                            .ack(0x01020304)
                            .flags(tcp_flags::PSH | tcp_flags::ACK)
                            .payload(b"hello, world!"),
                    )
                    .build(),
            ),
            (
                "v4 options tcp options",
                PacketBuilder::new()
                    .ipv4(
                        Ipv4::new(V4_SRC, V4_DST)
                            .options(&[0x94, 0x04, 0, 0, 1, 1, 1, 0])
                            .ttl(3),
                    )
                    .tcp(
                        Tcp::new(1, 2)
                            .flags(tcp_flags::SYN)
                            .options(&[2, 4, 0x05, 0xb4, 1, 1, 4, 2]),
                    )
                    .build(),
            ),
            (
                "v4 udp",
                v4().udp(Udp::new(5000, 53).payload(b"abc")).build(),
            ),
            (
                "v4 icmp echo request",
                v4().icmpv4(Icmpv4::echo_request(0x4242, 1).payload(b"ping!"))
                    .build(),
            ),
            (
                "v4 icmp echo reply",
                v4().icmpv4(Icmpv4::echo_reply(0x4242, 1)).build(),
            ),
            (
                "v4 icmp frag needed",
                v4().icmpv4(Icmpv4::frag_needed(
                    1400,
                    &inner_v4_tcp(),
                    Quote::HeaderPlus8,
                ))
                .build(),
            ),
            (
                "v4 icmp frag needed quote all",
                v4().icmpv4(Icmpv4::frag_needed(
                    1400,
                    &inner_v4_tcp()[..100],
                    Quote::All,
                ))
                .build(),
            ),
            (
                "v6 tcp",
                v6().tcp(Tcp::new(40000, 443).seq(5).flags(tcp_flags::SYN))
                    .build(),
            ),
            (
                "v6 vlan udp",
                v6().vlan(7).udp(Udp::new(5000, 53).payload(b"odd")).build(),
            ),
            (
                "v6 icmpv6 echo",
                v6().icmpv6(Icmpv6::echo_request(9, 10).payload(b"x"))
                    .build(),
            ),
            (
                "v6 icmpv6 ptb",
                v6().icmpv6(Icmpv6::packet_too_big(1280, &inner_v6_udp()[..1232]))
                    .build(),
            ),
        ]
    }

    fn ext_chain_sample() -> Vec<u8> {
        PacketBuilder::new()
            .ipv6(
                Ipv6::new(V6_SRC, V6_DST)
                    .ext(ExtHeader::hop_by_hop())
                    .ext(ExtHeader::routing(4, 0))
                    .ext(ExtHeader::DestOpts {
                        options: vec![0x1e, 1, 0xaa],
                    })
                    .ext(ExtHeader::fragment(0, false, 0xcafe)),
            )
            .tcp(Tcp::new(1000, 2000).flags(tcp_flags::RST))
            .build()
    }

    #[test]
    fn built_packets_verify() {
        for (name, f) in samples() {
            verify_checksums(&f).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        verify_checksums(&ext_chain_sample()).unwrap();
        verify_checksums(&v4().udp(Udp::new(1, 2).zero_checksum()).build()).unwrap();
    }

    #[test]
    fn udp_zero_checksum_rules() {
        let f = v4()
            .udp(Udp::new(1, 2).payload(b"x").zero_checksum())
            .build();
        assert_eq!(get_u16(&f, 14 + 20 + 6), 0);
        verify_checksums(&f).unwrap();
        let f = v6()
            .udp(Udp::new(1, 2).payload(b"x").zero_checksum())
            .build();
        let err = verify_checksums(&f).unwrap_err();
        assert!(err.contains("IPv6"), "{err}");
    }

    /// Frame offsets whose corruption must be detected: from the IP header to
    /// the end, except for IPv6 the bytes no checksum covers: version /
    /// traffic class / flow label (0..4), hop limit (7), and next header (6),
    /// which is tested separately in `ipv6_next_header_change_detected`
    /// because an unknown protocol is (correctly) not checked at all.
    fn covered_bytes(f: &[u8]) -> Vec<usize> {
        let p = parse(f).unwrap();
        let ip = p.ip_offset;
        (ip..f.len())
            .filter(|&i| p.ip_version == 4 || !(0..4).chain(6..8).any(|o| i == ip + o))
            .collect()
    }

    #[test]
    fn any_single_byte_flip_is_detected() {
        for (name, f) in samples() {
            for i in covered_bytes(&f) {
                for mask in [0xff, 0x01, 0x80] {
                    let mut g = f.clone();
                    g[i] ^= mask;
                    assert!(
                        verify_checksums(&g).is_err(),
                        "{name}: flipping byte {i} with {mask:#04x} not detected\n{}",
                        hexdump_diff(&f, &g)
                    );
                }
            }
        }
    }

    #[test]
    fn uncovered_bytes_do_not_fail() {
        for (name, f) in samples() {
            let p = parse(&f).unwrap();
            let mut g = f.clone();
            for b in &mut g[..12] {
                *b ^= 0xff; // MACs
            }
            if p.vlan.is_some() {
                g[15] ^= 0x0f; // VLAN id
            }
            if p.ip_version == 6 {
                g[p.ip_offset + 7] ^= 0xff; // hop limit
                g[p.ip_offset + 1] ^= 0x0f; // flow label
            }
            verify_checksums(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn ipv6_next_header_change_detected() {
        let f = v6().tcp(Tcp::new(1, 2)).build();
        let mut g = f.clone();
        g[14 + 6] = proto::UDP;
        assert!(verify_checksums(&g).is_err());
    }

    #[test]
    fn ipv6_ext_chain_l4_flip_detected() {
        let f = ext_chain_sample();
        let p = parse(&f).unwrap();
        for i in p.l4_offset..f.len() {
            let mut g = f.clone();
            g[i] ^= 0xff;
            assert!(verify_checksums(&g).is_err(), "byte {i}");
        }
    }

    #[test]
    fn inner_header_checksum_checked() {
        let mut f = v4()
            .icmpv4(Icmpv4::frag_needed(1400, &inner_v4_tcp(), Quote::default()))
            .build();
        let icmp = 14 + 20;
        // Corrupt the quoted TTL, then fix the ICMP checksum so only the
        // inner IPv4 header checksum is wrong.
        f[icmp + 8 + 8] ^= 0x01;
        let c = plain_checksum(&f[icmp..], 2);
        put_u16(&mut f, icmp + 2, c);
        let err = verify_checksums(&f).unwrap_err();
        assert!(err.contains("quoted IPv4 header"), "{err}");
    }

    #[test]
    fn fragments_skip_l4_check() {
        // Non-first fragment: arbitrary data, only the IPv4 header checksum matters.
        let f = PacketBuilder::new()
            .ipv4(Ipv4::new(V4_SRC, V4_DST).id(5).df(false).frag_offset(185))
            .raw(proto::UDP, &[1, 2, 3, 4, 5, 6, 7, 8, 9])
            .build();
        verify_checksums(&f).unwrap();
        let p = parse(&f).unwrap();
        assert_eq!(
            p.fragment,
            Some(Fragment {
                offset: 185,
                more: false,
                id: 5
            })
        );
        assert_eq!(p.sport, None);
        assert_eq!(p.payload, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        let mut g = f.clone();
        g[14 + 10] ^= 1;
        assert!(verify_checksums(&g).unwrap_err().contains("IPv4 header"));

        // First fragment: ports are parsed.
        let f = PacketBuilder::new()
            .ipv4(Ipv4::new(V4_SRC, V4_DST).df(false).mf(true))
            .udp(Udp::new(7, 9).payload(&[0; 16]))
            .build();
        let p = parse(&f).unwrap();
        assert_eq!((p.sport, p.dport), (Some(7), Some(9)));
        assert!(p.fragment.unwrap().more);

        // IPv6 non-first fragment.
        let f = PacketBuilder::new()
            .ipv6(Ipv6::new(V6_SRC, V6_DST).ext(ExtHeader::fragment(100, true, 77)))
            .raw(proto::TCP, &[0xee; 24])
            .build();
        verify_checksums(&f).unwrap();
        let p = parse(&f).unwrap();
        assert_eq!(p.l4_proto, proto::TCP);
        assert_eq!(p.ext_headers, [proto::FRAGMENT]);
        assert_eq!(
            p.fragment,
            Some(Fragment {
                offset: 100,
                more: true,
                id: 77
            })
        );
        assert_eq!(p.sport, None);
    }

    #[test]
    fn truncated_packets_fail() {
        let f = v4().tcp(Tcp::new(1, 2).payload(b"0123456789")).build();
        for len in [0, 13, 14, 33, 34, 40, 53, f.len() - 1] {
            let t = truncate(&f, len);
            assert_eq!(t.len(), len);
            assert!(verify_checksums(&t).is_err(), "len {len}");
            assert!(parse(&t).is_err(), "len {len}");
        }
        let t = v4()
            .tcp(Tcp::new(1, 2).payload(b"0123456789"))
            .truncate(50)
            .build();
        assert_eq!(t, truncate(&f, 50));
        assert!(verify_checksums(&t).unwrap_err().contains("truncated"));
        // Ethernet padding after the IP packet is fine.
        let mut padded = v4().udp(Udp::new(1, 2)).build();
        padded.resize(60, 0);
        verify_checksums(&padded).unwrap();
        assert!(parse(&padded).unwrap().payload.is_empty());
    }

    /// Independent checksum: sum 16-bit words with an end-around carry on every
    /// addition (no deferred folding), odd byte padded with zero.
    fn naive_checksum(data: &[u8]) -> u16 {
        let mut padded = data.to_vec();
        if padded.len() % 2 == 1 {
            padded.push(0);
        }
        let mut acc: u16 = 0;
        for w in padded.chunks(2) {
            let (s, carry) = acc.overflowing_add(u16::from_be_bytes([w[0], w[1]]));
            acc = s + u16::from(carry);
        }
        !acc
    }

    #[test]
    fn known_answer_ipv4_header() {
        // Published example (Wikipedia, "Internet checksum" / IPv4 header
        // checksum): 4500 0073 0000 4000 4011 [b861] c0a8 0001 c0a8 00c7.
        let f = PacketBuilder::new()
            .ipv4(
                Ipv4::new(
                    Ipv4Addr::new(192, 168, 0, 1),
                    Ipv4Addr::new(192, 168, 0, 199),
                )
                .ttl(64),
            )
            .udp(Udp::new(1, 2).payload(&[0; 0x73 - 28]))
            .build_ip();
        let expected: [u8; 20] = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(f[..20], expected, "\n{}", hexdump_diff(&expected, &f[..20]));
    }

    #[test]
    fn known_answer_ipv4_tcp() {
        // Hand-assembled SYN: 10.0.0.1:12345 -> 10.0.0.2:80, seq 1, win 8192,
        // payload "hi", id 1, DF, TTL 64.
        let mut want: Vec<u8> = vec![
            0x45, 0x00, 0x00, 0x2a, 0x00, 0x01, 0x40, 0x00, 0x40, 0x06, 0x00,
            0x00, // csum @10
            10, 0, 0, 1, 10, 0, 0, 2, // addresses
            0x30, 0x39, 0x00, 0x50, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0x20, 0x00, 0x00,
            0x00, // csum @36
            0x00, 0x00, b'h', b'i',
        ];
        // Independent computation of both checksums.
        let ip_csum = naive_checksum(&want[..20]);
        let mut pseudo = vec![10, 0, 0, 1, 10, 0, 0, 2, 0, 6, 0, 22];
        pseudo.extend_from_slice(&want[20..]);
        let tcp_csum = naive_checksum(&pseudo);
        // Values worked out by hand (ones-complement sums of the words above).
        assert_eq!(ip_csum, 0x26cb);
        assert_eq!(tcp_csum, 0xe2ea);
        want[10..12].copy_from_slice(&ip_csum.to_be_bytes());
        want[36..38].copy_from_slice(&tcp_csum.to_be_bytes());

        let got = PacketBuilder::new()
            .ipv4(Ipv4::new(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)).id(1))
            .tcp(
                Tcp::new(12345, 80)
                    .seq(1)
                    .window(8192)
                    .flags(tcp_flags::SYN)
                    .payload(b"hi"),
            )
            .build_ip();
        assert_eq!(got, want, "\n{}", hexdump_diff(&want, &got));
    }

    #[test]
    fn checksum_helper_matches_naive() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1001).collect();
        for len in [0, 1, 2, 3, 64, 999, 1001] {
            assert_eq!(
                internet_checksum(&[&data[..len]]),
                naive_checksum(&data[..len])
            );
            let (a, b) = data[..len].split_at(len / 3);
            assert_eq!(internet_checksum(&[a, b]), naive_checksum(&data[..len]));
        }
    }

    #[test]
    fn round_trip_v4_tcp() {
        let f = PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .vlan(100)
            .ipv4(Ipv4::new(V4_SRC, V4_DST).ttl(17).id(0xbeef).df(false))
            .tcp(
                Tcp::new(40000, 80)
                    .seq(11)
                    .ack(22)
                    .flags(tcp_flags::SYN | tcp_flags::ACK)
                    .payload(b"data"),
            )
            .build();
        let p = parse(&f).unwrap();
        assert_eq!(p.src_mac, MAC_A);
        assert_eq!(p.dst_mac, MAC_B);
        assert_eq!(p.vlan, Some(100));
        assert_eq!(p.ip_version, 4);
        assert_eq!(p.src, IpAddr::V4(V4_SRC));
        assert_eq!(p.dst, IpAddr::V4(V4_DST));
        assert_eq!(p.ttl, 17);
        assert_eq!(p.ipv4_id, Some(0xbeef));
        assert!(!p.df);
        assert_eq!(p.fragment, None);
        assert_eq!(p.l4_proto, proto::TCP);
        assert_eq!(p.ip_offset, 18);
        assert_eq!(p.l4_offset, 38);
        assert_eq!(p.sport, Some(40000));
        assert_eq!(p.dport, Some(80));
        assert_eq!(p.tcp_flags, Some(tcp_flags::SYN | tcp_flags::ACK));
        assert_eq!(p.tcp_seq, Some(11));
        assert_eq!(p.tcp_ack, Some(22));
        assert_eq!(p.icmp_type, None);
        assert_eq!(p.payload, b"data");
    }

    #[test]
    fn round_trip_v4_options_udp() {
        let f = PacketBuilder::new()
            .ipv4(Ipv4::new(V4_SRC, V4_DST).options(&[1, 1, 1, 0]))
            .udp(Udp::new(53, 1053).payload(b"q"))
            .build();
        let p = parse(&f).unwrap();
        assert_eq!(f[14], 0x46);
        assert_eq!(p.l4_offset, 14 + 24);
        assert_eq!((p.sport, p.dport), (Some(53), Some(1053)));
        assert_eq!(p.l4_proto, proto::UDP);
        assert!(p.df);
        assert_eq!(p.payload, b"q");
    }

    #[test]
    fn round_trip_v6_ext_chain() {
        let f = ext_chain_sample();
        let p = parse(&f).unwrap();
        assert_eq!(p.ip_version, 6);
        assert_eq!(p.src, IpAddr::V6(V6_SRC));
        assert_eq!(p.dst, IpAddr::V6(V6_DST));
        assert_eq!(p.ttl, 64);
        assert_eq!(
            p.ext_headers,
            [
                proto::HOP_BY_HOP,
                proto::ROUTING,
                proto::DEST_OPTS,
                proto::FRAGMENT
            ]
        );
        // Atomic fragment (offset 0, M=0) is not reported as a fragment.
        assert_eq!(p.fragment, None);
        assert_eq!(p.l4_proto, proto::TCP);
        assert_eq!(p.l4_offset, 14 + 40 + 8 * 4);
        assert_eq!(p.tcp_flags, Some(tcp_flags::RST));
        assert_eq!((p.sport, p.dport), (Some(1000), Some(2000)));
        // Extension header wire format.
        let ip = 14;
        assert_eq!(f[ip + 6], proto::HOP_BY_HOP);
        assert_eq!(&f[ip + 40..ip + 48], &[43, 0, 1, 4, 0, 0, 0, 0]);
        assert_eq!(&f[ip + 48..ip + 56], &[60, 0, 4, 0, 0, 0, 0, 0]);
        assert_eq!(&f[ip + 56..ip + 64], &[44, 0, 0x1e, 1, 0xaa, 1, 1, 0]);
        assert_eq!(&f[ip + 64..ip + 72], &[6, 0, 0, 0, 0, 0, 0xca, 0xfe]);
        assert_eq!(get_u16(&f, ip + 4), 32 + 20);
    }

    #[test]
    fn round_trip_icmp() {
        let f = v4()
            .icmpv4(Icmpv4::echo_request(0x1111, 0x2222).payload(b"abc"))
            .build();
        let p = parse(&f).unwrap();
        assert_eq!(p.l4_proto, proto::ICMP);
        assert_eq!((p.icmp_type, p.icmp_code), (Some(8), Some(0)));
        assert_eq!(
            (p.icmp_echo_id, p.icmp_echo_seq),
            (Some(0x1111), Some(0x2222))
        );
        assert_eq!(p.payload, b"abc");
        assert_eq!(p.inner, None);

        let inner = inner_v4_tcp();
        let f = v4()
            .icmpv4(Icmpv4::frag_needed(1400, &inner, Quote::HeaderPlus8))
            .build();
        let p = parse(&f).unwrap();
        assert_eq!((p.icmp_type, p.icmp_code), (Some(3), Some(4)));
        assert_eq!(p.mtu, Some(1400));
        assert_eq!(p.payload, &inner[..28]);
        assert_eq!(
            p.inner,
            Some(InnerPacket {
                ip_version: 4,
                src: IpAddr::V4(V4_DST),
                dst: IpAddr::V4(V4_SRC),
                proto: proto::TCP,
                sport: Some(80),
                dport: Some(40000),
            })
        );
        let f = v4()
            .icmpv4(Icmpv4::frag_needed(1400, &inner, Quote::Bytes(64)))
            .build();
        assert_eq!(parse(&f).unwrap().payload, &inner[..64]);
        let f = v4()
            .icmpv4(Icmpv4::frag_needed(1400, &inner, Quote::All))
            .build();
        assert_eq!(parse(&f).unwrap().payload, inner);

        let inner6 = inner_v6_udp();
        let f = v6()
            .icmpv6(Icmpv6::packet_too_big(1280, &truncate(&inner6, 1232)))
            .build();
        verify_checksums(&f).unwrap();
        let p = parse(&f).unwrap();
        assert_eq!(p.l4_proto, proto::ICMPV6);
        assert_eq!((p.icmp_type, p.icmp_code), (Some(2), Some(0)));
        assert_eq!(p.mtu, Some(1280));
        assert_eq!(p.payload, &inner6[..1232]);
        assert_eq!(
            p.inner,
            Some(InnerPacket {
                ip_version: 6,
                src: IpAddr::V6(V6_DST),
                dst: IpAddr::V6(V6_SRC),
                proto: proto::UDP,
                sport: Some(53),
                dport: Some(5353),
            })
        );

        let f = v6().icmpv6(Icmpv6::echo_reply(3, 4)).build();
        let p = parse(&f).unwrap();
        assert_eq!(
            (p.icmp_type, p.icmp_echo_id, p.icmp_echo_seq),
            (Some(129), Some(3), Some(4))
        );
    }

    #[test]
    fn verify_error_names_layer_and_values() {
        let mut f = v4().tcp(Tcp::new(1, 2)).build();
        let found = get_u16(&f, 14 + 20 + 16);
        put_u16(&mut f, 14 + 20 + 16, found ^ 0x0100);
        let err = verify_checksums(&f).unwrap_err();
        assert_eq!(
            err,
            format!(
                "TCP checksum mismatch: expected {found:#06x}, found {:#06x}",
                found ^ 0x0100
            )
        );
    }

    #[test]
    fn hexdump_diff_marks_bytes() {
        let a: Vec<u8> = (0..20).collect();
        let mut b = a.clone();
        b[3] = 0xff;
        b.truncate(18);
        let d = hexdump_diff(&a, &b);
        let lines: Vec<&str> = d.lines().collect();
        assert_eq!(
            lines[0],
            "expected 20 bytes, actual 18 bytes, 3 bytes differ, first at offset 0x0003"
        );
        assert_eq!(
            lines[1],
            "- 0000  00 01 02 03 04 05 06 07  08 09 0a 0b 0c 0d 0e 0f"
        );
        assert_eq!(
            lines[2],
            "+ 0000  00 01 02 ff 04 05 06 07  08 09 0a 0b 0c 0d 0e 0f"
        );
        assert_eq!(lines[3], "                 ^^");
        assert_eq!(lines[4], "- 0010  10 11 12 13");
        assert_eq!(lines[5], "+ 0010  10 11 .. ..");
        assert_eq!(lines[6], "              ^^ ^^");
        assert!(hexdump_diff(&a, &a).contains("identical"));
    }

    // --- cross-checks against etherparse ---------------------------------

    #[test]
    fn etherparse_builds_what_we_build() {
        use etherparse::PacketBuilder as Ep;

        // IPv4 / VLAN / TCP
        let mut theirs = Vec::new();
        Ep::ethernet2(MAC_A, MAC_B)
            .single_vlan(42.try_into().unwrap())
            .ipv4(V4_SRC.octets(), V4_DST.octets(), 33)
            .tcp(40000, 80, 7, 1000)
            .syn()
            .ack(9)
            .write(&mut theirs, b"payload")
            .unwrap();
        let ours = PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .vlan(42)
            .ipv4(Ipv4::new(V4_SRC, V4_DST).ttl(33))
            .tcp(
                Tcp::new(40000, 80)
                    .seq(7)
                    .ack(9)
                    .window(1000)
                    .flags(tcp_flags::SYN | tcp_flags::ACK)
                    .payload(b"payload"),
            )
            .build();
        assert_eq!(ours, theirs, "\n{}", hexdump_diff(&theirs, &ours));

        // IPv6 / UDP
        let mut theirs = Vec::new();
        Ep::ethernet2(MAC_A, MAC_B)
            .ipv6(V6_SRC.octets(), V6_DST.octets(), 5)
            .udp(1234, 53)
            .write(&mut theirs, b"odd")
            .unwrap();
        let ours = PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .ipv6(Ipv6::new(V6_SRC, V6_DST).hop_limit(5))
            .udp(Udp::new(1234, 53).payload(b"odd"))
            .build();
        assert_eq!(ours, theirs, "\n{}", hexdump_diff(&theirs, &ours));

        // IPv4 / ICMP echo, IPv6 / ICMPv6 echo
        let mut theirs = Vec::new();
        Ep::ethernet2(MAC_A, MAC_B)
            .ipv4(V4_SRC.octets(), V4_DST.octets(), 64)
            .icmpv4_echo_request(5, 6)
            .write(&mut theirs, b"ping")
            .unwrap();
        let ours = PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .ipv4(Ipv4::new(V4_SRC, V4_DST))
            .icmpv4(Icmpv4::echo_request(5, 6).payload(b"ping"))
            .build();
        assert_eq!(ours, theirs, "\n{}", hexdump_diff(&theirs, &ours));

        let mut theirs = Vec::new();
        Ep::ethernet2(MAC_A, MAC_B)
            .ipv6(V6_SRC.octets(), V6_DST.octets(), 64)
            .icmpv6_echo_reply(5, 6)
            .write(&mut theirs, b"pong!")
            .unwrap();
        let ours = PacketBuilder::new()
            .eth(MAC_A, MAC_B)
            .ipv6(Ipv6::new(V6_SRC, V6_DST))
            .icmpv6(Icmpv6::echo_reply(5, 6).payload(b"pong!"))
            .build();
        assert_eq!(ours, theirs, "\n{}", hexdump_diff(&theirs, &ours));
    }

    #[test]
    fn etherparse_agrees_with_our_parse_and_checksums() {
        use etherparse::{NetSlice, SlicedPacket, TransportSlice};

        let mut frames: Vec<Vec<u8>> = samples().into_iter().map(|(_, f)| f).collect();
        frames.push(ext_chain_sample());
        for f in frames {
            let ours = parse(&f).unwrap();
            let theirs = SlicedPacket::from_ethernet(&f).unwrap();
            let (src, dst, ttl) = match theirs.net.as_ref().unwrap() {
                NetSlice::Ipv4(s) => (
                    IpAddr::V4(s.header().source_addr()),
                    IpAddr::V4(s.header().destination_addr()),
                    s.header().ttl(),
                ),
                NetSlice::Ipv6(s) => (
                    IpAddr::V6(s.header().source_addr()),
                    IpAddr::V6(s.header().destination_addr()),
                    s.header().hop_limit(),
                ),
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!((ours.src, ours.dst, ours.ttl), (src, dst, ttl));
            match theirs.transport.as_ref().unwrap() {
                TransportSlice::Tcp(t) => {
                    assert_eq!(ours.sport, Some(t.source_port()));
                    assert_eq!(ours.dport, Some(t.destination_port()));
                    assert_eq!(ours.tcp_seq, Some(t.sequence_number()));
                    assert_eq!(ours.payload, t.payload());
                    let expected = match (src, dst) {
                        (IpAddr::V4(s), IpAddr::V4(d)) => t
                            .to_header()
                            .calc_checksum_ipv4_raw(s.octets(), d.octets(), t.payload())
                            .unwrap(),
                        (IpAddr::V6(s), IpAddr::V6(d)) => t
                            .to_header()
                            .calc_checksum_ipv6_raw(s.octets(), d.octets(), t.payload())
                            .unwrap(),
                        _ => unreachable!(),
                    };
                    assert_eq!(t.checksum(), expected);
                }
                TransportSlice::Udp(u) => {
                    assert_eq!(ours.sport, Some(u.source_port()));
                    assert_eq!(ours.dport, Some(u.destination_port()));
                    assert_eq!(ours.payload, u.payload());
                }
                TransportSlice::Icmpv4(i) => {
                    assert_eq!(ours.icmp_type, Some(i.type_u8()));
                    assert_eq!(ours.icmp_code, Some(i.code_u8()));
                    assert_eq!(
                        i.checksum(),
                        i.header().icmp_type.calc_checksum(i.payload())
                    );
                }
                TransportSlice::Icmpv6(i) => {
                    assert_eq!(ours.icmp_type, Some(i.type_u8()));
                    let (IpAddr::V6(s), IpAddr::V6(d)) = (src, dst) else {
                        unreachable!()
                    };
                    let expected = i
                        .header()
                        .icmp_type
                        .calc_checksum(s.octets(), d.octets(), i.payload())
                        .unwrap();
                    assert_eq!(i.checksum(), expected);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
}
