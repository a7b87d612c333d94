//! Every map the program uses, with BTF so that `bpftool map dump` shows
//! field names. Sizes come from lb-common; docs/maps.md lists their memory.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_COMMON_LRU, BPF_F_NO_PREALLOC},
    btf_maps::{Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use lb_common::{
    BackendEntry, BackendLoad, Config, FloodWindow, Flow, FlowKey, FlowLimit, FlowTimes, IfaceMac,
    L2Iface, L2Vip, L2VipKey, RangeKey, ReplyNat, ReverseKey, ReverseNat, ServiceInfo, ServiceKey,
    SourceKey, TrafficStats, FLOWS_ENTRIES, FLOW_EVENT_COUNT, HELD_FLOWS_ENTRIES, IFACE_SLOTS,
    MAGLEV_POOL_ENTRIES, MAX_BACKENDS, MAX_IFACE_SPILL, MAX_L2_IFACES, MAX_L2_VIPS, MAX_SERVICES,
    MAX_SOURCE_RANGES, MAX_TX_PORTS, PORT_FLAGS_ENTRIES, REASON_COUNT, REPLY_NAT_ENTRIES,
    SOURCE_RATES_ENTRIES,
};

const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;
/// LRU lists per CPU instead of one locked global list: inserts on
/// different CPUs do not contend (each CPU gets max_entries / CPUs of them).
const NO_COMMON_LRU: usize = BPF_F_NO_COMMON_LRU as usize;
/// The agent writes Maglev tables through a memory mapping: one store per
/// entry instead of one syscall.
const MMAPABLE: usize = BPF_F_MMAPABLE as usize;

/// (VIP, port, protocol) -> service. Not preallocated: an update replaces the
/// element under RCU, so a reader never sees half of an old and a new value.
#[btf_map]
pub static SERVICES: HashMap<ServiceKey, ServiceInfo, { MAX_SERVICES as usize }, NO_PREALLOC> =
    HashMap::new();

/// Backend id -> address. Filled before any Maglev table names the id.
#[btf_map]
pub static BACKENDS: Array<BackendEntry, { MAX_BACKENDS as usize }> = Array::new();

/// Pool of Maglev entries (backend ids). Each service owns two tables of its
/// size M here and flips between them, see `ServiceInfo::active`.
#[btf_map]
pub static MAGLEV: Array<u32, { MAGLEV_POOL_ENTRIES as usize }, MMAPABLE> = Array::new();

/// Client flow -> chosen backend: the flow table, one for all CPUs, so that
/// a flow keeps its backend whichever CPU its packets land on (RSS is only
/// stable until IRQ affinity or the indirection table changes). One insert
/// per new flow; per-CPU LRU lists (`NO_COMMON_LRU`) keep inserts on
/// different CPUs from contending for one lock.
#[btf_map]
pub static FLOWS: LruHashMap<FlowKey, Flow, { FLOWS_ENTRIES as usize }, NO_COMMON_LRU> =
    LruHashMap::new();

/// Per CPU: flow events by `FLOW_EVENT_*` index.
#[btf_map]
pub static FLOW_EVENTS: PerCpuArray<u64, { FLOW_EVENT_COUNT as usize }> = PerCpuArray::new();

/// Reply flow -> how to translate it back. Shared by all CPUs: replies hash
/// to a different receive queue than the requests they answer.
#[btf_map]
pub static REPLY_NAT: LruHashMap<FlowKey, ReplyNat, { REPLY_NAT_ENTRIES as usize }> =
    LruHashMap::new();

/// Reverse translations of backends that belong to one NAT-mode service
/// (written by the agent): replies without a `REPLY_NAT` entry are
/// translated from here, and the first one makes the entry.
#[btf_map]
pub static BACKEND_REVERSE: HashMap<
    ReverseKey,
    ReverseNat,
    { MAX_BACKENDS as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Per service id: its new-flow limit (`SERVICE_F_FLOW_LIMIT`).
#[btf_map]
pub static FLOW_LIMITS: Array<FlowLimit, { MAX_SERVICES as usize }> = Array::new();

/// Per service and source prefix: when its next new flow is due (GCRA's
/// theoretical arrival time, `bpf_ktime_get_coarse_ns`). Shared by all
/// CPUs without locks: CPUs racing on one prefix may let a few more in.
#[btf_map]
pub static SOURCE_RATES: LruHashMap<SourceKey, u64, { SOURCE_RATES_ENTRIES as usize }> =
    LruHashMap::new();

/// Flows of `SERVICE_F_HOLD_UNKNOWN` services this node did not know when a
/// mid-connection packet came, with that packet's time: held until
/// `HOLD_UNKNOWN_NS` after it (docs/bgp.md). Removed once the flow is
/// known (picked afresh by the program, or imported by the agent).
#[btf_map]
pub static HELD_FLOWS: LruHashMap<FlowKey, u64, { HELD_FLOWS_ENTRIES as usize }> =
    LruHashMap::new();

/// ifindex -> ifindex for interfaces XDP may redirect to. A miss makes
/// `bpf_redirect_map` return XDP_PASS, so the kernel forwards instead.
#[btf_map]
pub static TX_PORTS: DevMapHash<{ MAX_TX_PORTS as usize }> = DevMapHash::new();

/// Port (host order) -> PORT_F_* bits: lets unrelated traffic skip the hash maps.
#[btf_map]
pub static PORT_FLAGS: Array<u8, { PORT_FLAGS_ENTRIES as usize }> = Array::new();

/// Global settings, index 0.
#[btf_map]
pub static CONFIG: Array<Config, 1> = Array::new();

#[btf_map]
pub static SERVICE_STATS: PerCpuArray<TrafficStats, { MAX_SERVICES as usize }> = PerCpuArray::new();

#[btf_map]
pub static BACKEND_STATS: PerCpuArray<TrafficStats, { MAX_BACKENDS as usize }> = PerCpuArray::new();

/// Per CPU, per backend id: flows whose client sent a FIN or RST (each
/// counted once, `FLOW_F_CLOSED`). With `BACKEND_STATS.new_flows`, the
/// agent's count of a backend's open flows (load-aware balancing).
#[btf_map]
pub static BACKEND_CLOSED: PerCpuArray<u64, { MAX_BACKENDS as usize }> = PerCpuArray::new();

/// Per backend id: how long its closed flows were open, in doubling
/// buckets (`FlowTimes`), shared by all CPUs (atomic adds): the load-aware
/// controller's flow time.
#[btf_map]
pub static FLOW_TIMES: Array<FlowTimes, { MAX_BACKENDS as usize }> = Array::new();

/// Per backend id: the load-aware controller's decision, for lbctl. Not
/// read here; declared so that it is created and pinned with the others.
#[btf_map]
pub static BACKEND_LOAD: Array<BackendLoad, { MAX_BACKENDS as usize }> = Array::new();

/// Per backend id: open flows of `SERVICE_F_LEAST_LOADED` services, shared
/// by all CPUs (atomic adds): the count new flows are placed by. The agent
/// sets it to its walk's count now and then, so flows that vanished
/// without a FIN or RST do not weigh forever.
#[btf_map]
pub static BACKEND_ACTIVE: Array<i64, { MAX_BACKENDS as usize }> = Array::new();

/// Packets per `lb_common::Reason`.
#[btf_map]
pub static REASON_STATS: PerCpuArray<u64, { REASON_COUNT as usize }> = PerCpuArray::new();

/// (service scope, client prefix) -> 1: the clients a service with
/// `SERVICE_F_SOURCE_RANGES` admits. Longest-prefix match, so a lookup
/// costs the same with one range or thousands.
#[btf_map]
pub static SOURCE_RANGES: LpmTrie<RangeKey, u8, { MAX_SOURCE_RANGES as usize }> = LpmTrie::new();

/// L2 mode: the service IPs this node owns now, and the interface each is
/// answered on. The agent adds and removes them as ownership moves.
#[btf_map]
pub static L2_VIPS: HashMap<L2VipKey, L2Vip, { MAX_L2_VIPS as usize }> = HashMap::new();

/// L2 mode: ifindex -> the MAC to answer with, and until when the agent
/// vouches for its VIPs (see `lb_common::L2Iface`).
#[btf_map]
pub static L2_IFACES: HashMap<u32, L2Iface, { MAX_L2_IFACES as usize }> = HashMap::new();

/// The attached interfaces' MACs, at `ifindex % IFACE_SLOTS` (`mac::for_us`):
/// an array, so that the lookup on every frame is a bounds check and an
/// offset, not a hash. Not pinned: the agent writes it when it attaches.
#[btf_map]
pub static IFACE_MACS: Array<IfaceMac, { IFACE_SLOTS as usize }> = Array::new();

/// ifindex -> MAC of an attached interface whose `IFACE_MACS` slot another
/// interface holds.
#[btf_map]
pub static IFACE_MACS_SPILL: HashMap<u32, IfaceMac, { MAX_IFACE_SPILL as usize }> = HashMap::new();

/// Per CPU: new flows in the current second and the agent's flood threshold
/// (`FloodWindow`, `flood::over_threshold`).
#[btf_map]
pub static FLOOD: PerCpuArray<FloodWindow, 1> = PerCpuArray::new();
