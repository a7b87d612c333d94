//! Types and constants shared by the XDP program (lb-ebpf) and userspace
//! (lb-agent, lbctl, tests).
//!
//! Byte order: addresses and ports are kept exactly as they appear on the
//! wire (network order), stored in native integers. An IPv4 address fills
//! `addr[0]` and leaves `addr[1..4]` zero. Userspace converts with
//! [`addr_from_v4`] / [`addr_from_v6`] so that both sides hash the same words.
#![no_std]

#[cfg(feature = "std")]
extern crate std;

pub mod hash;
#[cfg(feature = "std")]
pub mod maglev;
#[cfg(feature = "std")]
pub mod net;

/// Address families as stored in keys (values of `AF_INET`/`AF_INET6`).
pub const FAMILY_V4: u8 = 2;
pub const FAMILY_V6: u8 = 10;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

// ---- Map sizes. docs/maps.md lists the memory each one costs. ----

/// `SERVICES`: (VIP, port, protocol) entries, including the echo markers.
pub const MAX_SERVICES: u32 = 4096;
/// `BACKENDS` and `BACKEND_STATS`: backend slots, indexed by backend id (one
/// per service and backend: 1000 services of 100 backends fit).
pub const MAX_BACKENDS: u32 = 131072;
/// `MAGLEV`: one pool of u32 backend ids holding every service's two tables.
/// 2^22 entries (32 MiB: the kernel spaces array elements 8 bytes apart)
/// hold 128 services at the default table size.
pub const MAGLEV_POOL_ENTRIES: u32 = 1 << 22;
/// `FLOWS`: the flow table, shared by all CPUs (LRU; each CPU's LRU
/// list holds an equal share).
pub const FLOWS_ENTRIES: u32 = 1 << 18;
/// `REPLY_NAT`: reverse translations, shared by all CPUs (LRU).
pub const REPLY_NAT_ENTRIES: u32 = 1 << 19;
/// `SOURCE_RANGES`: allowed client prefixes of all services. Each service
/// holds its ranges twice while a change is being made (old and new table).
pub const MAX_SOURCE_RANGES: u32 = 16384;
/// `TX_PORTS`: interfaces the program may redirect to (devmap).
pub const MAX_TX_PORTS: u32 = 256;
/// `PORT_FLAGS`: one byte per L4 port number.
pub const PORT_FLAGS_ENTRIES: u32 = 65536;
/// `L2_VIPS`: service IPs this node answers ARP/NDP for (L2 mode).
pub const MAX_L2_VIPS: u32 = 4096;
/// `L2_IFACES`: interfaces L2 mode answers on.
pub const MAX_L2_IFACES: u32 = 64;
/// `IFACE_MACS`: slots of the attached interfaces' MACs, by
/// `ifindex % IFACE_SLOTS` (a power of two); an interface whose slot is
/// taken goes to `IFACE_MACS_SPILL`.
pub const IFACE_SLOTS: u32 = 1024;
pub const MAX_IFACE_SPILL: u32 = 256;

/// Maglev table size used when a service does not set one (prime).
pub const DEFAULT_MAGLEV_SIZE: u32 = 16381;
/// Largest table size a service may set (prime).
pub const MAX_MAGLEV_SIZE: u32 = 65537;

/// Default port range the program allocates SNAT source ports from. It sits
/// below the kernel's default ephemeral range (32768-60999) so that the
/// node's own connections from the SNAT address do not collide with it.
pub const DEFAULT_SNAT_PORT_MIN: u16 = 10000;
pub const DEFAULT_SNAT_PORT_MAX: u16 = 32767;
/// How many ports the program probes before it gives up on a new SNAT flow.
pub const SNAT_PROBES: u32 = 16;

/// `FLOW_EVENTS[0]`: TCP packets other than a SYN whose flow was not in the
/// flow table (evicted while the table was full, or begun before this node
/// saw it): re-picked by Maglev, so they keep their backend while the
/// backend set is unchanged.
pub const FLOW_EVENT_REPICKED: u32 = 0;
/// `FLOW_EVENTS[1]`: packets forwarded in flood mode without a flow-table
/// entry (see [`FloodWindow`]): Maglev alone carries their flows.
pub const FLOW_EVENT_UNTRACKED: u32 = 1;
pub const FLOW_EVENT_COUNT: u32 = 2;

/// Flood mode's default: new flows a second on one CPU above which flows
/// that Maglev alone re-derives are forwarded without a flow-table entry.
/// Katran's default (`MAX_CONN_RATE`).
pub const DEFAULT_FLOOD_THRESHOLD: u32 = 125_000;

/// `FLOOD` (per CPU, index 0): this CPU's count of new flows in the current
/// one-second window, and the threshold the agent wrote (0: flood mode off).
/// Not pinned: the agent writes the threshold whenever it loads the program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct FloodWindow {
    /// When the window began (`bpf_ktime_get_ns`); the data plane's to write.
    pub start_ns: u64,
    /// New flows since `start_ns`; the data plane's to write.
    pub new_flows: u32,
    /// The agent's: above this many new flows in a window, flood mode.
    pub threshold: u32,
}

/// Names of the maps as they are pinned under `/sys/fs/bpf/xlb/`.
pub mod map_names {
    pub const SERVICES: &str = "SERVICES";
    pub const BACKENDS: &str = "BACKENDS";
    pub const MAGLEV: &str = "MAGLEV";
    pub const FLOWS: &str = "FLOWS";
    pub const REPLY_NAT: &str = "REPLY_NAT";
    pub const TX_PORTS: &str = "TX_PORTS";
    pub const PORT_FLAGS: &str = "PORT_FLAGS";
    pub const CONFIG: &str = "CONFIG";
    pub const SERVICE_STATS: &str = "SERVICE_STATS";
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    pub const REASON_STATS: &str = "REASON_STATS";
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    pub const FLOW_EVENTS: &str = "FLOW_EVENTS";
    pub const BACKEND_CLOSED: &str = "BACKEND_CLOSED";
    pub const BACKEND_LOAD: &str = "BACKEND_LOAD";
    pub const BACKEND_ACTIVE: &str = "BACKEND_ACTIVE";
    pub const L2_VIPS: &str = "L2_VIPS";
    pub const L2_IFACES: &str = "L2_IFACES";
    pub const BACKEND_REVERSE: &str = "BACKEND_REVERSE";
    pub const FLOW_LIMITS: &str = "FLOW_LIMITS";
    pub const SOURCE_RATES: &str = "SOURCE_RATES";
    pub const HELD_FLOWS: &str = "HELD_FLOWS";
    pub const FLOW_TIMES: &str = "FLOW_TIMES";
    /// Not pinned: the agent writes them whenever it attaches (the MACs) or
    /// loads the program (`FLOOD`'s threshold).
    pub const FLOOD: &str = "FLOOD";
    /// Not pinned: the agent writes them whenever it attaches.
    pub const IFACE_MACS: &str = "IFACE_MACS";
    pub const IFACE_MACS_SPILL: &str = "IFACE_MACS_SPILL";
    pub const ALL: [&str; 23] = [
        SERVICES,
        BACKENDS,
        MAGLEV,
        FLOWS,
        REPLY_NAT,
        TX_PORTS,
        PORT_FLAGS,
        CONFIG,
        SERVICE_STATS,
        BACKEND_STATS,
        REASON_STATS,
        SOURCE_RANGES,
        FLOW_EVENTS,
        BACKEND_CLOSED,
        BACKEND_LOAD,
        BACKEND_ACTIVE,
        L2_VIPS,
        L2_IFACES,
        BACKEND_REVERSE,
        FLOW_LIMITS,
        SOURCE_RATES,
        HELD_FLOWS,
        FLOW_TIMES,
    ];
}

/// Value of `IFACE_MACS` and `IFACE_MACS_SPILL`: an attached interface and
/// its MAC. The program acts only on unicast frames addressed to it
/// (docs/datapath.md); `ifindex` 0 is an empty slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IfaceMac {
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// `IFACE_F_*`.
    pub flags: u8,
    pub _pad: [u8; 5],
}

/// `IfaceMac::flags`: a pod-side interface (the host side of this node's
/// Pods: a CNI bridge, a Pod's veth), attached in generic mode. Replies
/// arriving there come from local Pods, whose veths hand over unfinished
/// (CHECKSUM_PARTIAL) checksums, and are translated only when their route
/// leaves by an attached uplink (docs/datapath.md, "Pod-side interfaces").
pub const IFACE_F_POD: u8 = 1;

/// Key of `SERVICES`. Written by the agent.
/// `proto` ICMP/ICMPv6 with `port` 0 marks a VIP whose echo requests are answered.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}

/// `ServiceInfo::flags`: also rewrite the source (SNAT mode).
pub const SERVICE_F_SNAT: u32 = 1;
/// `ServiceInfo::flags`: session affinity by client address. New flows are
/// placed by a hash of the client address alone, so every connection of a
/// client goes to one backend, on every node alike.
pub const SERVICE_F_CLIENT_AFFINITY: u32 = 2;
/// `ServiceInfo::flags`: only clients in the service's `SOURCE_RANGES`
/// entries (scope [`ServiceInfo::range_scope`]) may reach it.
pub const SERVICE_F_SOURCE_RANGES: u32 = 4;
/// `ServiceInfo::flags`: a new flow goes to the one of its Maglev
/// candidates (the usual pick and up to two more distinct backends drawn
/// by [`hash::next_candidate`]) with the fewest open flows in
/// `BACKEND_ACTIVE` (load-aware services): least connections over
/// [`hash::LEAST_LOADED_CANDIDATES`] choices, decided per connection.
pub const SERVICE_F_LEAST_LOADED: u32 = 8;
/// `ServiceInfo::flags`: new flows are limited per source prefix by the
/// service's `FLOW_LIMITS` entry.
pub const SERVICE_F_FLOW_LIMIT: u32 = 16;
/// `ServiceInfo::flags` (services with `flow_sync`): a TCP packet other
/// than a SYN whose flow this node does not know is dropped for up to
/// [`HOLD_UNKNOWN_NS`] after its first such packet, instead of being
/// translated afresh (to another source port in snat mode, or to another
/// backend once the backends changed, either answered with a reset): the
/// flow exchange brings the flow meanwhile, and the client's
/// retransmission finds it.
pub const SERVICE_F_HOLD_UNKNOWN: u32 = 32;
/// How long a flow unknown to this node is held (`SERVICE_F_HOLD_UNKNOWN`):
/// covers the flow exchange's default push interval (500 ms) and the
/// client's first retransmissions (200, 600, 1400 ms after).
pub const HOLD_UNKNOWN_NS: u64 = 2_000_000_000;
/// A SYN for a flow another node handed over (`FLOW_F_HANDED`), not
/// closed and seen within this long, keeps that flow instead of starting
/// afresh: it is the client's retransmission (at 1 and 3 s) of the SYN
/// that opened it on the other node, sent again because the answer was
/// late, and come here because the router's next hops changed meanwhile.
/// Started afresh it would reach the backend from this node's SNAT address
/// as a second connection, and the client's would be reset.
pub const HANDED_SYN_NS: u64 = 4_000_000_000;
/// A closed flow (the client's FIN or RST seen) whose latest packet is
/// older than this no longer takes a TCP packet other than a SYN on a
/// service with `SERVICE_F_HOLD_UNKNOWN`: the connection it was is over
/// (its last ACKs and retransmitted FINs come sooner), so the packet is of
/// a new connection on the same client port, opened through another node
/// whose flow the exchange brings. It is held as unknown meanwhile.
pub const CLOSED_STALE_NS: u64 = 1_000_000_000;
/// `HELD_FLOWS`: flows being held, with when their first packet came (LRU).
pub const HELD_FLOWS_ENTRIES: u32 = 1 << 14;

/// Value of `FLOW_LIMITS`, indexed by service id: new flows from one
/// source prefix may come every `period_ns` on average, and run up to
/// `burst_ns` ahead of that schedule (GCRA: `(burst - 1) * period`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowLimit {
    pub period_ns: u64,
    pub burst_ns: u64,
    /// What the agent was asked for (the two above come from them).
    pub per_second: u32,
    pub burst: u32,
    /// Source prefix lengths the limit applies per.
    pub prefix_v4: u8,
    pub prefix_v6: u8,
    pub _pad: [u8; 6],
}

/// Key of `SOURCE_RATES`: a service and a client prefix (address masked).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceKey {
    pub addr: [u32; 4],
    pub service_id: u32,
    pub family: u8,
    pub _pad: [u8; 3],
}

/// `SOURCE_RATES`: prefixes whose new-flow schedule is remembered (LRU).
pub const SOURCE_RATES_ENTRIES: u32 = 1 << 16;

/// Value of `SERVICES`. Written by the agent as one whole value, so the data
/// path sees either the old or the new table, never a mix.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Index into `SERVICE_STATS`.
    pub id: u32,
    pub flags: u32,
    /// First of the service's two tables in `MAGLEV`.
    pub table_base: u32,
    /// Maglev table size M (prime).
    pub table_size: u32,
    /// Which of the two tables is live: entries `table_base + active * M ..`.
    pub active: u32,
    /// Backends in the live table; 0 means "drop new flows".
    pub backend_count: u32,
    /// Source address for SNAT mode (same family as the VIP).
    pub snat_addr: [u32; 4],
}

impl ServiceInfo {
    /// First entry of the live table in `MAGLEV`.
    #[inline(always)]
    pub fn live_start(&self) -> u32 {
        self.table_base + self.active * self.table_size
    }

    /// Scope of this service's entries in `SOURCE_RANGES`: the Maglev slot
    /// of its live table, which is unique among live services and changes
    /// with every update, so the ranges flip together with the table.
    #[inline(always)]
    pub fn range_scope(&self) -> u32 {
        self.live_start()
    }
}

/// Data of a `SOURCE_RANGES` key (after the LPM trie's prefix length): the
/// service's scope, matched in full, then the client prefix. An entry for
/// `a.b.c.d/n` has prefix length `32 + n`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RangeKey {
    /// Big-endian, so that the trie's bitwise match reads it as one number.
    pub scope: [u8; 4],
    /// As in keys: network order, IPv4 in the first word.
    pub addr: [u32; 4],
}

/// Prefix length of a `SOURCE_RANGES` key that matches any client address.
pub const RANGE_LOOKUP_PREFIX: u32 = 32 + 128;

/// A backend's address; part of `BackendEntry` (the value of `BACKENDS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backend {
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub family: u8,
    pub _pad: u8,
}

/// A flow as seen in a packet: key of `FLOWS` (client -> VIP direction)
/// and of `REPLY_NAT` (backend -> client or SNAT address direction).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    /// Network order.
    pub sport: u16,
    /// Network order.
    pub dport: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

/// Value of `FLOWS`. Written by the data path on a new flow;
/// `last_seen_ns` by whichever CPU sees the flow, at most once a second.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    pub backend_addr: [u32; 4],
    /// The source address of an SNAT flow: the service's SNAT address on
    /// the node that opened it (a flow shared by a leaving node keeps
    /// that node's); zero in NAT mode.
    pub snat_addr: [u32; 4],
    /// Network order.
    pub backend_port: u16,
    /// SNAT source port (network order), 0 in NAT mode.
    pub snat_port: u16,
    pub backend_id: u32,
    pub service_id: u32,
    /// `FLOW_F_*`.
    pub flags: u32,
    /// `bpf_ktime_get_coarse_ns` of the flow's creation and of its latest
    /// packet (updated at most once a second).
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

/// `Flow::flags`: the client sent a FIN or RST; counted once in
/// `BACKEND_CLOSED`, so that opened minus closed is the backend's open flows.
pub const FLOW_F_CLOSED: u32 = 1;
/// `Flow::flags`: the flow was counted in `BACKEND_ACTIVE` when it opened,
/// and is taken off when it closes.
pub const FLOW_F_COUNTED: u32 = 2;
/// `Flow::flags`, set by the agent only: another node opened the flow and
/// handed it over (`flow_sync`); this node does not hand it on as its own.
pub const FLOW_F_HANDED: u32 = 4;

/// Buckets of `FlowTimes`.
pub const FLOW_TIME_BUCKETS: usize = 16;

/// Value of `FLOW_TIMES`, per backend id: how many of its flows closed
/// (`FLOW_F_CLOSED`) after how long open, in buckets that double: bucket 0
/// holds flows shorter than 2^20 ns (1 ms), bucket k the span
/// [2^(19+k), 2^(20+k)) ns, and the last every flow of 2^34 ns (17 s) or
/// more. The agent's load-aware flow time is their mean over a backend's
/// recent closes, which neither its rate of new flows nor its long-lived
/// flows move.
pub type FlowTimes = [u32; FLOW_TIME_BUCKETS];

/// The `FlowTimes` bucket of a flow open for `ns`. Compares, no loop and no
/// count of leading zeros (which the BPF target lowers to a long sequence).
#[inline(always)]
pub fn flow_time_bucket(ns: u64) -> usize {
    let mut v = ns >> 19;
    if v >= 1 << (FLOW_TIME_BUCKETS - 1) {
        return FLOW_TIME_BUCKETS - 1;
    }
    let mut b = 0;
    if v >= 1 << 8 {
        v >>= 8;
        b += 8;
    }
    if v >= 1 << 4 {
        v >>= 4;
        b += 4;
    }
    if v >= 1 << 2 {
        v >>= 2;
        b += 2;
    }
    if v >= 2 {
        b += 1;
    }
    b
}

/// Where bucket `b` of `FlowTimes` starts, in ns.
pub const fn flow_time_bucket_start(b: usize) -> u64 {
    if b == 0 {
        0
    } else {
        1 << (19 + b)
    }
}

/// Value of `BACKEND_LOAD`, indexed by backend id: what the agent's
/// load-aware controller decided and why, for `lbctl backends`. The data
/// path does not read it. `flags` 0: the backend is not load-aware.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendLoad {
    /// The weight given to Maglev.
    pub weight: u32,
    /// The load factor and pressure, in thousandths.
    pub factor_milli: u32,
    pub pressure_milli: u32,
    /// Open flows as the agent counts them.
    pub open_flows: u32,
    /// The health check's latency (µs); `u32::MAX`: none.
    pub latency_us: u32,
    /// The agent check's report: `LOAD_REPORT_*`, and the percentage.
    pub report: u32,
    pub report_pct: u32,
    /// `LOAD_F_*`.
    pub flags: u32,
    /// Its cgroup's CPU load, in thousandths (1000: all of its limit; up
    /// to 2000: held back as well); `u32::MAX`: not read.
    pub cpu_milli: u32,
}

/// `BackendLoad::flags`: written by a load-aware controller.
pub const LOAD_F_SET: u32 = 1;
/// `BackendLoad::report`.
pub const LOAD_REPORT_NONE: u32 = 0;
pub const LOAD_REPORT_PERCENT: u32 = 1;
pub const LOAD_REPORT_DRAIN: u32 = 2;
pub const LOAD_REPORT_DOWN: u32 = 3;

/// Key of `L2_VIPS`: a service IP this node owns in L2 mode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct L2VipKey {
    pub addr: [u32; 4],
    pub family: u8,
    pub _pad: [u8; 3],
}

/// Value of `L2_VIPS`: the interface the VIP is answered on (the one whose
/// subnet holds it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Vip {
    pub ifindex: u32,
    pub _pad: u32,
}

/// Value of `L2_IFACES`, keyed by ifindex: the MAC answers carry, and until
/// when (CLOCK_MONOTONIC ns, as `bpf_ktime_get_ns`) the agent vouches for
/// its ownership. The agent renews it several times a `valid` period; an
/// agent that crashed or froze stops renewing, and the program stops
/// answering by itself, so a node that can no longer take part in the
/// membership never answers beside the new owner.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Iface {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    pub valid_until_ns: u64,
}

/// Value of `BACKENDS`, indexed by backend id: the backend, written by the
/// agent before any table names the id, and the FIB's answer for it, which
/// the data path caches there (the agent's writes reset it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendEntry {
    pub backend: Backend,
    pub _pad: u32,
    pub fib: FibCache,
}

/// The FIB's answer for a destination (a backend, or a reply's client),
/// kept so that packets skip `bpf_fib_lookup` (which costs more than the rest of the
/// path). Looked up again when older than a second, so route and neighbour
/// changes take effect within a second. `ifindex` 0: nothing cached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FibCache {
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub ifindex: u32,
    pub checked_ns: u64,
}

/// Value of `REPLY_NAT` (shared by all CPUs): how to translate a reply back.
/// Replies become `vip:vport -> client:cport`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplyNat {
    pub vip: [u32; 4],
    pub client: [u32; 4],
    /// Network order.
    pub vport: u16,
    /// Network order.
    pub cport: u16,
    pub service_id: u32,
    pub backend_id: u32,
    /// `REPLY_F_*`.
    pub flags: u32,
    /// `bpf_ktime_get_coarse_ns` after which the entry (and in SNAT mode its
    /// port) may be taken by a new flow.
    pub expires_ns: u64,
    /// Where replies go (backend -> client direction).
    pub fib: FibCache,
}

/// `ReplyNat::flags`: a TCP FIN or RST was seen; the short lifetime applies.
pub const REPLY_F_CLOSING: u32 = 1;

/// Key of `BACKEND_REVERSE`: a backend address, port and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReverseKey {
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}

/// Value of `BACKEND_REVERSE`, written by the agent for a backend that
/// belongs to exactly one NAT-mode service: its replies become
/// `vip:vport -> client` without a per-flow entry, so a new NAT flow writes
/// only its flow entry, and any node can translate the replies of a flow
/// that another node forwarded (the reply entry is made by the first reply).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReverseNat {
    pub vip: [u32; 4],
    /// Network order.
    pub vport: u16,
    pub _pad: u16,
    pub service_id: u32,
    pub backend_id: u32,
}

/// Value of `CONFIG` (array, index 0). Written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Host order, inclusive.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// Idle time after which a flow's reply translation (and SNAT port) may be reused.
    pub tcp_timeout_s: u32,
    /// The same once a FIN or RST has been seen.
    pub tcp_closing_timeout_s: u32,
    pub udp_timeout_s: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            snat_port_min: DEFAULT_SNAT_PORT_MIN,
            snat_port_max: DEFAULT_SNAT_PORT_MAX,
            tcp_timeout_s: 900,
            tcp_closing_timeout_s: 10,
            udp_timeout_s: 60,
        }
    }
}

/// `PORT_FLAGS` bits, indexed by port (host order). Cheap array lookups that
/// let traffic on unrelated ports skip the hash lookups.
pub const PORT_F_SERVICE: u8 = 1;
pub const PORT_F_BACKEND: u8 = 2;

/// Values of `SERVICE_STATS` (per service id) and `BACKEND_STATS` (per
/// backend id), per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficStats {
    /// Client -> backend direction.
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// Backend -> client direction (translated replies).
    pub reply_packets: u64,
    pub reply_bytes: u64,
}

impl TrafficStats {
    /// The sum of per-CPU values (or of several services' counters).
    pub fn sum<'a>(values: impl IntoIterator<Item = &'a TrafficStats>) -> TrafficStats {
        values
            .into_iter()
            .fold(TrafficStats::default(), |a, s| TrafficStats {
                packets: a.packets + s.packets,
                bytes: a.bytes + s.bytes,
                new_flows: a.new_flows + s.new_flows,
                reply_packets: a.reply_packets + s.reply_packets,
                reply_bytes: a.reply_bytes + s.reply_bytes,
            })
    }
}

/// Why the program returned what it did: index of `REASON_STATS` (per CPU).
/// Every packet is counted under exactly one reason.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// Not IPv4/IPv6 (ARP, LLDP, ...): passed.
    PassNotIp = 0,
    /// Headers too short to tell where the packet goes: passed to the kernel, which drops it.
    PassTruncated = 1,
    /// Not for a VIP service and not a reply: passed untouched.
    PassNoService = 2,
    /// VIP traffic rewritten, but the FIB has no neighbour yet: passed to the kernel.
    PassNoNeigh = 3,
    /// VIP traffic rewritten, but the FIB could not forward it (no route, forwarding
    /// disabled, egress not redirectable): passed to the kernel.
    PassFibFailed = 4,
    /// TTL / hop limit would expire: passed so the kernel sends time-exceeded.
    PassTtlExpired = 5,
    /// Forwarded out of the ingress interface.
    Tx = 6,
    /// Forwarded out of another interface.
    Redirect = 7,
    /// VIP traffic with a truncated or invalid transport header.
    DropMalformed = 8,
    /// An IP fragment addressed to a VIP (policy: dropped, see docs/datapath.md).
    DropFragment = 9,
    /// The service has no backends.
    DropNoBackend = 10,
    /// No free SNAT port after `SNAT_PROBES` tries.
    DropSnatExhausted = 11,
    /// Maglev entry or backend slot unreadable (agent bug or racing cleanup).
    DropTableError = 12,
    /// ICMP error about a VIP flow that no longer exists / cannot be resolved.
    DropIcmpNoFlow = 13,
    /// Echo request to a VIP answered (also counted as Tx).
    EchoReply = 14,
    /// ICMP frag-needed / packet-too-big forwarded to the flow's backend.
    IcmpToBackend = 15,
    /// IP fragment to a non-VIP address: passed.
    PassFragment = 16,
    /// A client outside the service's source ranges (`loadBalancerSourceRanges`).
    DropSourceRange = 17,
    /// An ARP request for a VIP this node owns in L2 mode, answered (XDP_TX).
    ArpReply = 18,
    /// An IPv6 Neighbor Solicitation for a VIP this node owns, answered (XDP_TX).
    NdpAdvert = 19,
    /// A new flow beyond its service's `new_flow_limit` for its source prefix.
    DropFlowLimit = 20,
    /// A TCP packet of a flow this node does not know, held while the flow
    /// exchange brings it (`SERVICE_F_HOLD_UNKNOWN`).
    DropHeldUnknownFlow = 21,
    /// A unicast frame addressed to another MAC than the receiving
    /// interface's (a promiscuous port, a switch flooding): passed untouched,
    /// and the kernel drops it as it would without XDP.
    PassForeignMac = 22,
}

pub const REASON_COUNT: u32 = 23;

impl Reason {
    pub const ALL: [Reason; REASON_COUNT as usize] = [
        Reason::PassNotIp,
        Reason::PassTruncated,
        Reason::PassNoService,
        Reason::PassNoNeigh,
        Reason::PassFibFailed,
        Reason::PassTtlExpired,
        Reason::Tx,
        Reason::Redirect,
        Reason::DropMalformed,
        Reason::DropFragment,
        Reason::DropNoBackend,
        Reason::DropSnatExhausted,
        Reason::DropTableError,
        Reason::DropIcmpNoFlow,
        Reason::EchoReply,
        Reason::IcmpToBackend,
        Reason::PassFragment,
        Reason::DropSourceRange,
        Reason::ArpReply,
        Reason::NdpAdvert,
        Reason::DropFlowLimit,
        Reason::DropHeldUnknownFlow,
        Reason::PassForeignMac,
    ];

    /// Stable snake_case name, used in metrics and lbctl.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::PassNotIp => "pass_not_ip",
            Reason::PassTruncated => "pass_truncated",
            Reason::PassNoService => "pass_no_service",
            Reason::PassNoNeigh => "pass_no_neigh",
            Reason::PassFibFailed => "pass_fib_failed",
            Reason::PassTtlExpired => "pass_ttl_expired",
            Reason::Tx => "tx",
            Reason::Redirect => "redirect",
            Reason::DropMalformed => "drop_malformed",
            Reason::DropFragment => "drop_fragment",
            Reason::DropNoBackend => "drop_no_backend",
            Reason::DropSnatExhausted => "drop_snat_exhausted",
            Reason::DropTableError => "drop_table_error",
            Reason::DropIcmpNoFlow => "drop_icmp_no_flow",
            Reason::EchoReply => "echo_reply",
            Reason::IcmpToBackend => "icmp_to_backend",
            Reason::PassFragment => "pass_fragment",
            Reason::DropSourceRange => "drop_source_range",
            Reason::ArpReply => "arp_reply",
            Reason::NdpAdvert => "ndp_advert",
            Reason::DropFlowLimit => "drop_flow_limit",
            Reason::DropHeldUnknownFlow => "drop_held_unknown_flow",
            Reason::PassForeignMac => "pass_foreign_mac",
        }
    }
}

/// Stores an IPv4 address (as octets) the way keys hold it.
pub const fn addr_from_v4(octets: [u8; 4]) -> [u32; 4] {
    [u32::from_ne_bytes(octets), 0, 0, 0]
}

/// Stores an IPv6 address (as octets) the way keys hold it.
pub const fn addr_from_v6(o: [u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

/// The octets of a stored address (16; the first 4 for IPv4).
pub fn addr_octets(addr: &[u32; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, w) in addr.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    out
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are #[repr(C)] plain data with explicit padding.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceInfo {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for BackendLoad {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for Flow {}
    unsafe impl aya::Pod for ReplyNat {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for TrafficStats {}
    unsafe impl aya::Pod for FibCache {}
    unsafe impl aya::Pod for BackendEntry {}
    unsafe impl aya::Pod for RangeKey {}
    unsafe impl aya::Pod for L2VipKey {}
    unsafe impl aya::Pod for L2Vip {}
    unsafe impl aya::Pod for L2Iface {}
    unsafe impl aya::Pod for IfaceMac {}
    unsafe impl aya::Pod for ReverseKey {}
    unsafe impl aya::Pod for ReverseNat {}
    unsafe impl aya::Pod for FlowLimit {}
    unsafe impl aya::Pod for SourceKey {}
    unsafe impl aya::Pod for FloodWindow {}
}

// Layouts are part of the pinned-map ABI: a change here needs a new map name.
const _: () = {
    assert!(core::mem::size_of::<ServiceKey>() == 20);
    assert!(core::mem::size_of::<ServiceInfo>() == 40);
    assert!(core::mem::size_of::<Backend>() == 20);
    assert!(core::mem::size_of::<FlowKey>() == 40);
    assert!(core::mem::size_of::<Flow>() == 64);
    assert!(core::mem::size_of::<ReplyNat>() == 80);
    assert!(core::mem::size_of::<Config>() == 16);
    assert!(core::mem::size_of::<FibCache>() == 24);
    assert!(core::mem::size_of::<BackendEntry>() == 48);
    assert!(core::mem::size_of::<TrafficStats>() == 40);
    assert!(core::mem::size_of::<RangeKey>() == 20);
    assert!(core::mem::size_of::<L2VipKey>() == 20);
    assert!(core::mem::size_of::<L2Vip>() == 8);
    assert!(core::mem::size_of::<L2Iface>() == 16);
    assert!(core::mem::size_of::<IfaceMac>() == 16);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_flow_time_falls_in_the_bucket_that_spans_it() {
        let mut edges = [0u64, 1, (1 << 20) - 1, 1 << 20, u64::MAX].to_vec();
        for k in 19..=40 {
            edges.extend([(1u64 << k) - 1, 1 << k, (1 << k) + 1, 3 << (k - 1)]);
        }
        for ns in edges {
            let b = flow_time_bucket(ns);
            // The bucket by its definition: the highest set bit above 2^19.
            let want = (63 - (ns >> 19).max(1).leading_zeros() as usize).min(FLOW_TIME_BUCKETS - 1);
            assert_eq!(b, want, "{ns} ns");
            assert!(flow_time_bucket_start(b) <= ns, "{ns} ns below bucket {b}");
            if b + 1 < FLOW_TIME_BUCKETS {
                assert!(
                    ns < flow_time_bucket_start(b + 1),
                    "{ns} ns above bucket {b}"
                );
            }
        }
    }
}
