//! The data-plane driver: loads the XDP program and keeps its maps equal to
//! a set of services. Every service update is atomic for packets: backends
//! are written first, then the service's inactive Maglev table, then one
//! `SERVICES` update flips the service to it.

mod alloc;
#[cfg(test)]
mod compiled;
mod flow_limit;
mod handoff;
pub mod kernel;
mod macs;
mod pins;
mod reverse;
mod source_ranges;
mod state;
mod write;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use aya::{
    maps::{lpm_trie::LpmTrie, Array, DevMapHash, HashMap, Map, MapData, MapError, PerCpuArray},
    programs::{
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
        ProgramError, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader,
};
use ipnet::IpNet;
pub use lb_common::net::Protocol;
use lb_common::{
    maglev, map_names as names,
    net::{ip_words, service_key, words_ip, Family},
    BackendEntry, BackendLoad, Config, FloodWindow, Flow, FlowKey, FlowLimit, FlowTimes, L2Iface,
    L2Vip, L2VipKey, ReplyNat, ReverseKey, ReverseNat, ServiceInfo, ServiceKey, TrafficStats,
    FAMILY_V4, FAMILY_V6, FLOWS_ENTRIES, FLOW_EVENT_COUNT, FLOW_EVENT_REPICKED,
    FLOW_EVENT_UNTRACKED, FLOW_F_CLOSED, MAGLEV_POOL_ENTRIES, MAX_BACKENDS, MAX_SERVICES,
    PORT_F_BACKEND, PORT_F_SERVICE, PROTO_ICMP, PROTO_ICMPV6, REASON_COUNT,
    SERVICE_F_CLIENT_AFFINITY, SERVICE_F_FLOW_LIMIT, SERVICE_F_HOLD_UNKNOWN,
    SERVICE_F_LEAST_LOADED, SERVICE_F_SNAT, SERVICE_F_SOURCE_RANGES,
};

pub use self::flow_limit::NewFlowLimit;
pub use self::handoff::{FlowTable, HandedFlow, Handing, HandoffIds, Imported, Lifetimes};
use self::{
    alloc::{IdPool, RegionPool},
    pins::{check_bpffs, start_afresh_where_layout_changed},
    source_ranges::SourceRanges,
    write::{Ids, Placement, Reservation},
};
use crate::maps::{self as reads, MaglevPool};
use crate::netif::XdpAttached;

/// The sizes of the maps the config can size (entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// The Maglev pool: two tables of M entries per service, 8 bytes each
    /// in the kernel.
    pub maglev_pool_entries: u32,
    /// The flow table: one entry per flow, ~140 bytes each.
    pub flow_table_entries: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            maglev_pool_entries: MAGLEV_POOL_ENTRIES,
            flow_table_entries: FLOWS_ENTRIES,
        }
    }
}

/// Pins of maps that earlier versions had and this one does not use: removed
/// when the agent adopts a pin directory. `CONNTRACK` was a per-CPU copy of
/// the flow table; `SHARED_FLOWS` held flows without their SNAT address
/// (`FLOWS` has it).
const RETIRED_PINS: [&str; 2] = ["CONNTRACK", "SHARED_FLOWS"];

/// The XDP object, built from lb-ebpf by build.rs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// Name of the XDP program in the object.
pub const PROGRAM: &str = "xlb";
/// An XDP program that only passes: the benchmarks' floor.
pub const FLOOR_PROGRAM: &str = "xlb_floor";
/// Programs that each run one step of the data path alone, for
/// `xlb-bench`'s account of where a packet's time goes (lb-ebpf/src/steps.rs).
pub const STEP_PROGRAMS: [&str; 5] = [
    "xlb_step_clock",
    "xlb_step_mac_check",
    "xlb_step_service_lookup",
    "xlb_step_flow_lookup",
    "xlb_step_flow_insert",
];

/// A table region freed less than this long ago is not written again:
/// a packet that read the old `ServiceInfo` may still be reading its table.
/// (An XDP run takes microseconds; this is thousands of times that.)
const TABLE_QUARANTINE: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("loading the XDP object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map TX_PORTS: {0}")]
    TxPorts(aya::maps::xdp::XdpMapError),
    #[error("map {0} is missing from the object")]
    MissingMap(&'static str),
    #[error("program {0} is missing from the object")]
    MissingProgram(String),
    #[error("XDP program: {0}")]
    Program(#[from] ProgramError),
    #[error("service {service}: {reason}")]
    InvalidService { service: String, reason: String },
    #[error("{0} is full")]
    Full(&'static str),
    #[error("mapping MAGLEV into memory: {0}")]
    Mmap(std::io::Error),
    #[error("no interface named {0}")]
    NoInterface(String),
    #[error("XDP link on {0}: {1}")]
    Link(String, String),
    #[error("pin path {0}: {1}")]
    Pin(PathBuf, std::io::Error),
    #[error(
        "{0} is not on a BPF filesystem (bpffs), so the maps cannot be pinned there. \
         Mount one: `mount -t bpf bpffs /sys/fs/bpf`. Under `ip netns exec`, which mounts \
         a fresh /sys without it, run the agent with `nsenter --net=/var/run/netns/NAME` \
         instead (it keeps the host's /sys/fs/bpf, which lbctl and the next agent share)"
    )]
    NoBpffs(PathBuf),
    #[error("pinned state is inconsistent: {0} (run `lb-agent --cleanup` to start afresh)")]
    Adopt(String),
    #[error(
        "this kernel is Linux {release} ({running}); xlb needs Linux {} or newer: its XDP \
         program calls bpf_loop, which this kernel does not have",
        kernel::MINIMUM
    )]
    KernelTooOld {
        release: String,
        running: kernel::KernelVersion,
    },
}

type Result<T, E = DataplaneError> = std::result::Result<T, E>;

/// Refuses a kernel the program cannot load on, by name, before the
/// verifier would refuse it with a log.
fn check_kernel() -> Result<()> {
    let release = kernel::running_release();
    match kernel::decide(&release, kernel::has_bpf_loop) {
        kernel::Verdict::Fits => {}
        kernel::Verdict::Backported(v) => log::info!(
            "kernel {release} reports {v}, older than {}, but has bpf_loop: loading",
            kernel::MINIMUM
        ),
        kernel::Verdict::Unknown => log::warn!(
            "kernel release {release:?} does not parse; xlb needs Linux {} or newer",
            kernel::MINIMUM
        ),
        kernel::Verdict::TooOld(running) => {
            return Err(DataplaneError::KernelTooOld { release, running })
        }
    }
    Ok(())
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { name, source }
}

/// What a service should look like in the data plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSpec {
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// SNAT mode: the node address to use as source. `None`: NAT mode.
    pub snat: Option<IpAddr>,
    /// Maglev table size; `None` picks [`maglev::default_table_size`].
    pub table_size: Option<u32>,
    pub backends: Vec<BackendSpec>,
    /// Client networks allowed to reach the service (of the VIP's family,
    /// host bits clear). `None`: everyone; `Some` and empty: no one.
    pub source_ranges: Option<Vec<IpNet>>,
    /// Every connection of a client address goes to one backend.
    pub client_affinity: bool,
    /// New flows go to the least loaded of three Maglev candidates
    /// (`SERVICE_F_LEAST_LOADED`; load-aware services).
    pub least_loaded: bool,
    /// With `flow_sync`: hold a flow this node does not know
    /// (`SERVICE_F_HOLD_UNKNOWN`).
    pub hold_unknown_flows: bool,
    /// New flows a second per source prefix (`SERVICE_F_FLOW_LIMIT`).
    pub new_flow_limit: Option<NewFlowLimit>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSpec {
    pub addr: SocketAddr,
    pub weight: u32,
}

impl ServiceSpec {
    /// A nat service on `vip:port/protocol` over `backends`, each of weight
    /// 1, with nothing else set: the start of a spec that sets the rest by
    /// struct update (`ServiceSpec { snat, ..ServiceSpec::new(..) }`).
    pub fn new(
        vip: IpAddr,
        port: u16,
        protocol: Protocol,
        backends: impl IntoIterator<Item = SocketAddr>,
    ) -> ServiceSpec {
        ServiceSpec {
            vip,
            port,
            protocol,
            snat: None,
            table_size: None,
            backends: backends
                .into_iter()
                .map(|addr| BackendSpec { addr, weight: 1 })
                .collect(),
            source_ranges: None,
            client_affinity: false,
            least_loaded: false,
            hold_unknown_flows: false,
            new_flow_limit: None,
        }
    }

    pub fn key(&self) -> ServiceKey {
        service_key(self.vip, self.port, self.protocol.number())
    }

    fn name(&self) -> String {
        format!("{}/{}", SocketAddr::new(self.vip, self.port), self.protocol)
    }

    /// Checks what the data plane relies on; the config layer checks more.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| DataplaneError::InvalidService {
            service: self.name(),
            reason,
        };
        for b in &self.backends {
            if b.addr.is_ipv4() != self.vip.is_ipv4() {
                return Err(bad(format!(
                    "backend {} is not of the VIP's address family",
                    b.addr
                )));
            }
        }
        if let Some(snat) = self.snat {
            if snat.is_ipv4() != self.vip.is_ipv4() {
                return Err(bad(format!(
                    "SNAT address {snat} is not of the VIP's address family"
                )));
            }
        }
        for net in self.source_ranges.iter().flatten() {
            if net.addr().is_ipv4() != self.vip.is_ipv4() {
                return Err(bad(format!(
                    "source range {net} is not of the VIP's address family"
                )));
            }
            if net.trunc() != *net {
                return Err(bad(format!(
                    "source range {net} has host bits set (the network is {})",
                    net.trunc()
                )));
            }
        }
        let m = self.table_size();
        maglev::check_table_size(m, self.backends.len()).map_err(|e| bad(e.to_string()))?;
        Ok(())
    }

    pub fn table_size(&self) -> u32 {
        self.table_size
            .unwrap_or_else(|| maglev::default_table_size(self.backends.len()))
    }
}

fn echo_key(vip: IpAddr) -> ServiceKey {
    service_key(
        vip,
        0,
        if vip.is_ipv4() {
            PROTO_ICMP
        } else {
            PROTO_ICMPV6
        },
    )
}

/// Which side of the node an interface is on (`Dataplane::attach_as`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Clients and remote backends: takes redirects.
    Uplink,
    /// This node's Pods (`IFACE_F_POD`).
    Pod,
}

/// What the driver remembers of a service it programmed.
#[derive(Clone, Debug)]
struct Programmed {
    /// Shared with the desired state it was programmed from.
    spec: Arc<ServiceSpec>,
    info: ServiceInfo,
    /// Each backend's id, in `spec.backends` order.
    backend_ids: Vec<u32>,
    flipped: Instant,
}

impl Programmed {
    /// Each backend's address and id.
    fn backends(&self) -> impl Iterator<Item = (SocketAddr, u32)> + '_ {
        self.spec
            .backends
            .iter()
            .zip(&self.backend_ids)
            .map(|(b, id)| (b.addr, *id))
    }

    fn backend_id(&self, addr: SocketAddr) -> Option<u32> {
        self.backends().find(|(a, _)| *a == addr).map(|x| x.1)
    }
}

/// The loaded program and its maps.
pub struct Dataplane {
    ebpf: Ebpf,
    maps: Maps,
    ids: Ids,
    state: BTreeMap<ServiceKey, Programmed>,
    /// Regions freed recently, released to `ids.regions` after the quarantine.
    quarantined: Vec<(Instant, u32, u32)>,
    ports: Vec<u8>,
    /// Who uses each backend of the NAT services, and so what
    /// `BACKEND_REVERSE` holds.
    reverse: reverse::Users,
    pin_dir: Option<PathBuf>,
    /// Attachments without a pin directory, by interface (for `detach`).
    unpinned_links: BTreeMap<String, XdpLinkId>,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    /// Pins of another layout made this load start the state afresh.
    started_afresh: bool,
}

/// The program's maps, as the driver writes them.
struct Maps {
    services: HashMap<MapData, ServiceKey, ServiceInfo>,
    backends: Array<MapData, BackendEntry>,
    maglev: MaglevPool,
    port_flags: Array<MapData, u8>,
    config: Array<MapData, Config>,
    tx_ports: DevMapHash<MapData>,
    shared_flows: HashMap<MapData, FlowKey, Flow>,
    /// The flow table's size as the kernel holds it (a pinned table keeps
    /// the size it was created with).
    flow_table_entries: u32,
    reply_nat: HashMap<MapData, FlowKey, ReplyNat>,
    held_flows: HashMap<MapData, FlowKey, u64>,
    service_stats: PerCpuArray<MapData, TrafficStats>,
    backend_stats: PerCpuArray<MapData, TrafficStats>,
    reason_stats: PerCpuArray<MapData, u64>,
    flow_events: PerCpuArray<MapData, u64>,
    backend_closed: PerCpuArray<MapData, u64>,
    flow_times: Array<MapData, FlowTimes>,
    backend_load: Array<MapData, BackendLoad>,
    backend_active: Array<MapData, i64>,
    ranges: SourceRanges,
    l2_vips: HashMap<MapData, L2VipKey, L2Vip>,
    l2_ifaces: HashMap<MapData, u32, L2Iface>,
    backend_reverse: HashMap<MapData, ReverseKey, ReverseNat>,
    flow_limits: Array<MapData, FlowLimit>,
    iface_macs: macs::InterfaceMacs,
    flood: PerCpuArray<MapData, FloodWindow>,
}

impl Dataplane {
    /// Loads the program with fresh, unpinned maps (tests, benchmarks).
    pub fn load() -> Result<Self> {
        Self::open(None)
    }

    /// Loads the program. With `pin_dir`, every map is pinned there (BTF
    /// included, so `bpftool map dump pinned DIR/MAP` names the fields), and
    /// maps already pinned there are reused: a restarted agent adopts the
    /// running state (services, flows, counters) instead of starting empty.
    pub fn open(pin_dir: Option<&Path>) -> Result<Self> {
        Self::open_with(pin_dir, MapSizes::default())
    }

    /// As [`Dataplane::open`], with the sizes of the maps that the config
    /// sizes. Pinned maps keep the size they were created with.
    pub fn open_with(pin_dir: Option<&Path>, sizes: MapSizes) -> Result<Self> {
        check_kernel()?;
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(names::MAGLEV, sizes.maglev_pool_entries);
        loader.map_max_entries(names::FLOWS, sizes.flow_table_entries);
        let paths: Vec<(&str, PathBuf)> = match pin_dir {
            Some(dir) => {
                check_bpffs(dir)?;
                std::fs::create_dir_all(dir)
                    .map_err(|e| DataplaneError::Pin(dir.to_path_buf(), e))?;
                names::ALL.iter().map(|n| (*n, dir.join(n))).collect()
            }
            None => Vec::new(),
        };
        let mut started_afresh = false;
        if let Some(dir) = pin_dir {
            for old in RETIRED_PINS {
                let _ = std::fs::remove_file(dir.join(old));
            }
            started_afresh = start_afresh_where_layout_changed(dir)?
                .iter()
                .any(|n| !pins::COUNTERS.contains(n));
        }
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(OBJECT)?;
        // The program's aya-log events go to the `log` facade (and from there
        // to tracing). Taken before the program loads: it owns the log map.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(l) => Some(l),
            Err(e) => {
                log::warn!("eBPF logs unavailable: {e}");
                None
            }
        };
        let xdp: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or(DataplaneError::MissingProgram(PROGRAM.to_string()))?
            .try_into()?;
        load_retrying(xdp)?;
        let mut dp = Self::from_ebpf(ebpf, pin_dir.map(Path::to_path_buf))?;
        dp.logger = logger;
        dp.started_afresh = started_afresh;
        dp.adopt()?;
        Ok(dp)
    }

    fn from_ebpf(mut ebpf: Ebpf, pin_dir: Option<PathBuf>) -> Result<Self> {
        fn take(ebpf: &mut Ebpf, name: &'static str) -> Result<Map> {
            ebpf.take_map(name).ok_or(DataplaneError::MissingMap(name))
        }
        let flows = take(&mut ebpf, names::FLOWS)?;
        let flow_table_entries = match &flows {
            Map::LruHashMap(data) => data.info().map_err(map_err(names::FLOWS))?.max_entries(),
            _ => return Err(DataplaneError::MissingMap(names::FLOWS)),
        };
        let maglev_data = match take(&mut ebpf, names::MAGLEV)? {
            Map::Array(data) => data,
            _ => return Err(DataplaneError::MissingMap(names::MAGLEV)),
        };
        let maglev = MaglevPool::new(maglev_data).map_err(DataplaneError::Mmap)?;
        // A pinned pool keeps its size: use the kernel's, not the requested one.
        let pool_entries = maglev.entries();
        let maps = Maps {
            services: HashMap::try_from(take(&mut ebpf, names::SERVICES)?)
                .map_err(map_err(names::SERVICES))?,
            backends: Array::try_from(take(&mut ebpf, names::BACKENDS)?)
                .map_err(map_err(names::BACKENDS))?,
            maglev,
            port_flags: Array::try_from(take(&mut ebpf, names::PORT_FLAGS)?)
                .map_err(map_err(names::PORT_FLAGS))?,
            config: Array::try_from(take(&mut ebpf, names::CONFIG)?)
                .map_err(map_err(names::CONFIG))?,
            tx_ports: DevMapHash::try_from(take(&mut ebpf, names::TX_PORTS)?)
                .map_err(map_err(names::TX_PORTS))?,
            shared_flows: HashMap::try_from(flows).map_err(map_err(names::FLOWS))?,
            flow_table_entries,
            reply_nat: HashMap::try_from(take(&mut ebpf, names::REPLY_NAT)?)
                .map_err(map_err(names::REPLY_NAT))?,
            held_flows: HashMap::try_from(take(&mut ebpf, names::HELD_FLOWS)?)
                .map_err(map_err(names::HELD_FLOWS))?,
            service_stats: PerCpuArray::try_from(take(&mut ebpf, names::SERVICE_STATS)?)
                .map_err(map_err(names::SERVICE_STATS))?,
            backend_stats: PerCpuArray::try_from(take(&mut ebpf, names::BACKEND_STATS)?)
                .map_err(map_err(names::BACKEND_STATS))?,
            flow_events: PerCpuArray::try_from(take(&mut ebpf, names::FLOW_EVENTS)?)
                .map_err(map_err(names::FLOW_EVENTS))?,
            backend_closed: PerCpuArray::try_from(take(&mut ebpf, names::BACKEND_CLOSED)?)
                .map_err(map_err(names::BACKEND_CLOSED))?,
            flow_times: Array::try_from(take(&mut ebpf, names::FLOW_TIMES)?)
                .map_err(map_err(names::FLOW_TIMES))?,
            backend_load: Array::try_from(take(&mut ebpf, names::BACKEND_LOAD)?)
                .map_err(map_err(names::BACKEND_LOAD))?,
            backend_active: Array::try_from(take(&mut ebpf, names::BACKEND_ACTIVE)?)
                .map_err(map_err(names::BACKEND_ACTIVE))?,
            reason_stats: PerCpuArray::try_from(take(&mut ebpf, names::REASON_STATS)?)
                .map_err(map_err(names::REASON_STATS))?,
            ranges: SourceRanges::open(
                LpmTrie::try_from(take(&mut ebpf, names::SOURCE_RANGES)?)
                    .map_err(map_err(names::SOURCE_RANGES))?,
            )
            .map_err(map_err(names::SOURCE_RANGES))?,
            l2_vips: HashMap::try_from(take(&mut ebpf, names::L2_VIPS)?)
                .map_err(map_err(names::L2_VIPS))?,
            l2_ifaces: HashMap::try_from(take(&mut ebpf, names::L2_IFACES)?)
                .map_err(map_err(names::L2_IFACES))?,
            backend_reverse: HashMap::try_from(take(&mut ebpf, names::BACKEND_REVERSE)?)
                .map_err(map_err(names::BACKEND_REVERSE))?,
            flow_limits: Array::try_from(take(&mut ebpf, names::FLOW_LIMITS)?)
                .map_err(map_err(names::FLOW_LIMITS))?,
            flood: PerCpuArray::try_from(take(&mut ebpf, names::FLOOD)?)
                .map_err(map_err(names::FLOOD))?,
            iface_macs: macs::InterfaceMacs::new(
                Array::try_from(take(&mut ebpf, names::IFACE_MACS)?)
                    .map_err(map_err(names::IFACE_MACS))?,
                HashMap::try_from(take(&mut ebpf, names::IFACE_MACS_SPILL)?)
                    .map_err(map_err(names::IFACE_MACS_SPILL))?,
            ),
        };
        let mut dp = Self {
            maps,
            ebpf,
            state: BTreeMap::new(),
            ids: Ids {
                services: IdPool::new(MAX_SERVICES),
                backends: IdPool::new(MAX_BACKENDS),
                regions: RegionPool::new(pool_entries),
            },
            quarantined: Vec::new(),
            ports: vec![0; 65536],
            reverse: reverse::Users::default(),
            pin_dir,
            unpinned_links: BTreeMap::new(),
            logger: None,
            started_afresh: false,
        };
        if dp
            .maps
            .config
            .get(&0, 0)
            .map_err(map_err(names::CONFIG))?
            .snat_port_max
            == 0
        {
            dp.set_config(Config::default())?;
        }
        Ok(dp)
    }

    pub fn program(&self) -> &Xdp {
        self.ebpf
            .program(PROGRAM)
            .and_then(|p| <&Xdp>::try_from(p).ok())
            .expect("the object always has the xlb XDP program")
    }

    /// Emits the program's pending aya-log events through the `log` facade.
    pub fn flush_logs(&mut self) {
        if let Some(l) = &mut self.logger {
            l.flush();
        }
    }

    /// Loads and returns one of the object's benchmark programs, which
    /// share this data plane's maps: the floor ([`FLOOR_PROGRAM`]) or one
    /// of [`STEP_PROGRAMS`]. The agent never attaches them.
    pub fn bench_program(&mut self, name: &str) -> Result<&Xdp> {
        let p: &mut Xdp = self
            .ebpf
            .program_mut(name)
            .ok_or(DataplaneError::MissingProgram(name.to_string()))?
            .try_into()?;
        if p.fd().is_err() {
            load_retrying(p)?;
        }
        Ok(p)
    }

    fn program_mut(&mut self) -> &mut Xdp {
        self.ebpf
            .program_mut(PROGRAM)
            .and_then(|p| <&mut Xdp>::try_from(p).ok())
            .expect("the object always has the xlb XDP program")
    }

    /// Attaches to an interface and allows redirects to it. With a pin
    /// directory the attachment is a BPF link pinned as `link_<iface>`: it
    /// outlives the agent (forwarding goes on while it restarts), and a new
    /// agent swaps its program in atomically (`BPF_LINK_UPDATE`).
    ///
    /// An interface that cannot take native XDP (a Linux bridge: no
    /// `ndo_bpf`) is attached in generic mode instead, with a warning, and
    /// takes no redirects: a driver-mode program's frames cannot be handed
    /// to a device without `ndo_xdp_xmit`, so the kernel forwards to it.
    /// Returns the mode it attached in.
    pub fn attach(&mut self, iface: &str, mode: XdpMode) -> Result<XdpMode> {
        self.attach_as(iface, mode, Side::Uplink)
    }

    /// Attaches to a pod-side interface (the host side of this node's
    /// Pods: a CNI bridge, a Pod's veth) in generic mode, marked
    /// `IFACE_F_POD`, taking no redirects: replies of local Pods are
    /// translated there and redirected to an uplink, and everything else
    /// passes to the kernel as before. Generic because a bridge has no
    /// native XDP, and native XDP on a Pod's veth would take its peer's
    /// segmentation offloads away and lose the skb's checksum state.
    pub fn attach_pod_side(&mut self, iface: &str) -> Result<()> {
        self.attach_as(iface, XdpMode::Skb, Side::Pod).map(|_| ())
    }

    fn attach_as(&mut self, iface: &str, mode: XdpMode, side: Side) -> Result<XdpMode> {
        let ifindex = crate::netif::ifindex(iface)
            .ok_or_else(|| DataplaneError::NoInterface(iface.to_string()))?;
        // Before the program runs there: it acts only on frames to this MAC.
        let flags = match side {
            Side::Uplink => 0,
            Side::Pod => lb_common::IFACE_F_POD,
        };
        self.maps.iface_macs.learn_with(iface, flags)?;
        // An uplink takes redirects; a pod-side interface never does (one
        // that was an uplink before loses them now, before it runs as one).
        let allow = |dp: &mut Self| match side {
            Side::Uplink => dp.allow_redirect(ifindex),
            Side::Pod => dp.forbid_redirect(ifindex),
        };
        if side == Side::Pod {
            allow(self)?;
        }
        let link_pin = self
            .pin_dir
            .as_ref()
            .map(|d| d.join(pins::link_pin_name(iface)));
        let now = crate::netif::xdp_attached(ifindex).ok();
        let other_mode = matches!(
            (mode, now),
            (XdpMode::Skb, Some(XdpAttached::Driver))
                | (XdpMode::Driver, Some(XdpAttached::Generic))
        );
        if let Some(pin) = link_pin.as_ref().filter(|p| p.exists() && other_mode) {
            // A link keeps the mode it was created in: replace it. The
            // kernel allows one mode at a time, so the interface is without
            // XDP for the moment between the two.
            log::info!(
                "the pinned XDP link of {iface} is in {} mode, {} is configured: replacing it",
                if now == Some(XdpAttached::Driver) {
                    "native"
                } else {
                    "generic"
                },
                if mode == XdpMode::Driver {
                    "native"
                } else {
                    "generic"
                },
            );
            Self::unpin_link(iface, pin)?;
        }
        if let Some(pin) = link_pin.as_ref().filter(|p| p.exists()) {
            match self.update_pinned_link(iface, pin) {
                Ok(()) => {
                    allow(self)?;
                    return Ok(mode);
                }
                // The interface the link held was deleted (a namespace or
                // bond rebuilt, a driver reloaded): the kernel severed the
                // link. Replace it; the maps, and the flows in them, stay.
                Err(DataplaneError::Program(ProgramError::SyscallError(e)))
                    if e.io_error.raw_os_error() == Some(libc::ENOLINK) =>
                {
                    log::warn!(
                        "the pinned XDP link of {iface} was severed (the interface was deleted \
                         and created again): attaching anew, the maps and their flows are kept"
                    );
                    std::fs::remove_file(pin)
                        .map_err(|e| DataplaneError::Pin(pin.to_path_buf(), e))?;
                }
                Err(e) => return Err(e),
            }
        }
        match self.attach_new(iface, link_pin.as_deref(), mode) {
            Err(DataplaneError::Program(ProgramError::SyscallError(e)))
                if mode == XdpMode::Driver
                    && e.io_error.raw_os_error() == Some(libc::EOPNOTSUPP) =>
            {
                log::warn!(
                    "{iface} cannot take native XDP ({}: {}): attached in generic (skb) mode \
                     instead, which is slower; packets leaving through {iface} go through the \
                     kernel (set xdp_mode: generic to attach every interface so)",
                    e.call,
                    e.io_error
                );
                self.attach_new(iface, link_pin.as_deref(), XdpMode::Skb)?;
                Ok(XdpMode::Skb)
            }
            Err(e) => Err(e),
            Ok(()) => {
                allow(self)?;
                Ok(mode)
            }
        }
    }

    /// Takes `ifindex` out of `TX_PORTS` (absent is fine).
    fn forbid_redirect(&mut self, ifindex: u32) -> Result<()> {
        match self.maps.tx_ports.remove(ifindex) {
            Ok(()) => Ok(()),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(())
            }
            Err(e) => Err(map_err(names::TX_PORTS)(e)),
        }
    }

    /// Detaches from an interface no longer configured: its pinned link
    /// goes (the program with it) and redirects to it stop.
    pub fn detach(&mut self, iface: &str) -> Result<()> {
        if let Some(pin) = self
            .pin_dir
            .as_ref()
            .map(|d| d.join(pins::link_pin_name(iface)))
        {
            if pin.exists() {
                Self::unpin_link(iface, &pin)?;
            }
        }
        if let Some(id) = self.unpinned_links.remove(iface) {
            self.program_mut().detach(id)?;
        }
        // An interface that is gone left the devmap with it (the kernel
        // removes a device's entries when it unregisters).
        if let Some(ifindex) = crate::netif::ifindex(iface) {
            self.forbid_redirect(ifindex)?;
        }
        self.maps.iface_macs.forget(iface)
    }

    /// The interfaces with a pinned link (`link_<iface>`).
    pub fn pinned_interfaces(&self) -> Vec<String> {
        let Some(entries) = self
            .pin_dir
            .as_ref()
            .and_then(|d| std::fs::read_dir(d).ok())
        else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| pins::iface_of_link_pin(e.file_name().to_str()?))
            .collect()
    }

    /// Removes a link's pin; with the last reference gone the kernel
    /// detaches it.
    fn unpin_link(iface: &str, pin: &Path) -> Result<()> {
        let link = PinnedLink::from_pin(pin)
            .map_err(|e| DataplaneError::Link(iface.to_string(), e.to_string()))?;
        link.unpin()
            .map_err(|e| DataplaneError::Pin(pin.to_path_buf(), e))?;
        Ok(())
    }

    /// A new attachment, pinned as `pin` if given.
    fn attach_new(&mut self, iface: &str, pin: Option<&Path>, mode: XdpMode) -> Result<()> {
        let id = self.program_mut().attach(iface, mode)?;
        match pin {
            Some(pin) => {
                let link = self.program_mut().take_link(id)?;
                let fd_link = FdLink::try_from(link)
                    .map_err(|e| DataplaneError::Link(iface.to_string(), e.to_string()))?;
                fd_link
                    .pin(pin)
                    .map_err(|e| DataplaneError::Link(iface.to_string(), e.to_string()))?;
            }
            None => {
                self.unpinned_links.insert(iface.to_string(), id);
            }
        }
        Ok(())
    }

    /// Swaps this program into the pinned link `pin` (`BPF_LINK_UPDATE`).
    fn update_pinned_link(&mut self, iface: &str, pin: &Path) -> Result<()> {
        let pinned = PinnedLink::from_pin(pin)
            .map_err(|e| DataplaneError::Link(iface.to_string(), e.to_string()))?;
        let link = XdpLink::try_from(FdLink::from(pinned))
            .map_err(|e| DataplaneError::Link(iface.to_string(), e.to_string()))?;
        let id = self.program_mut().attach_to_link(link)?;
        // The pin keeps the link; our handle must not detach it on drop.
        let _ = self.program_mut().take_link(id)?;
        Ok(())
    }

    /// Detaches every pinned link and removes every pin under `pin_dir`.
    pub fn cleanup(pin_dir: &Path) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        let Ok(entries) = std::fs::read_dir(pin_dir) else {
            return Ok(removed);
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("link_") {
                // Unpinning drops the last reference: the program detaches.
                if let Ok(link) = PinnedLink::from_pin(&path) {
                    let _ = link.unpin();
                }
            }
            if path.exists() {
                std::fs::remove_file(&path).map_err(|e| DataplaneError::Pin(path.clone(), e))?;
            }
            removed.push(name);
        }
        std::fs::remove_dir(pin_dir).map_err(|e| DataplaneError::Pin(pin_dir.to_path_buf(), e))?;
        removed.sort();
        Ok(removed)
    }

    /// Tells the program `iface`'s MAC (`IFACE_MACS`): it acts only on
    /// unicast frames addressed to it. True when that changed the map.
    pub fn learn_interface(&mut self, iface: &str) -> Result<bool> {
        self.maps.iface_macs.learn(iface)
    }

    /// Reads the MACs of the interfaces learnt again (one may have changed
    /// while the agent runs): the names whose MAC or index changed.
    pub fn refresh_interface_macs(&mut self) -> Result<Vec<String>> {
        self.maps.iface_macs.refresh()
    }

    /// Lets the program redirect to `ifindex` (it must be able to take XDP frames).
    pub fn allow_redirect(&mut self, ifindex: u32) -> Result<()> {
        self.maps
            .tx_ports
            .insert(ifindex, ifindex, None, 0)
            .map_err(DataplaneError::TxPorts)
    }

    pub fn set_config(&mut self, cfg: Config) -> Result<()> {
        self.maps
            .config
            .set(0, cfg, 0)
            .map_err(map_err(names::CONFIG))
    }

    /// Flood mode's threshold: new flows a second on one CPU above which
    /// NAT flows that Maglev alone re-derives are forwarded without a
    /// flow-table entry (`lb_common::FloodWindow`); 0 turns it off. A
    /// freshly loaded program has it off until this is called. Each CPU's
    /// current window and count are kept: a reload does not restart them.
    pub fn set_flood_threshold(&mut self, new_flows_per_s: u32) -> Result<()> {
        let windows: Vec<FloodWindow> = match self.maps.flood.get(&0, 0) {
            Ok(v) => v.iter().copied().collect(),
            Err(_) => vec![FloodWindow::default(); reads::possible_cpus()],
        };
        let windows = windows
            .into_iter()
            .map(|w| FloodWindow {
                threshold: new_flows_per_s,
                ..w
            })
            .collect::<Vec<_>>();
        let values = aya::maps::PerCpuValues::try_from(windows)
            .expect("one value per possible CPU is what the kernel expects");
        self.maps
            .flood
            .set(0, values, 0)
            .map_err(map_err(names::FLOOD))
    }

    /// Whether the load found pins of another layout and started the
    /// services and flows afresh (`pins::start_afresh_where_layout_changed`):
    /// until the services are written, the program would pass their packets
    /// to the kernel, so they are written before it takes the links.
    pub fn started_afresh(&self) -> bool {
        self.started_afresh
    }

    pub fn services(&self) -> impl Iterator<Item = (&ServiceKey, &ServiceSpec)> {
        self.state.iter().map(|(k, p)| (k, &*p.spec))
    }

    /// Adds or updates a service. On error nothing changed.
    pub fn set_service(&mut self, spec: &ServiceSpec) -> Result<()> {
        self.set_shared_service(&Arc::new(spec.clone()))
    }

    /// [`Dataplane::set_service`] for a spec the caller keeps too: the
    /// driver shares it rather than keeping a copy.
    pub fn set_shared_service(&mut self, spec: &Arc<ServiceSpec>) -> Result<()> {
        spec.validate()?;
        self.release_quarantine();
        let key = spec.key();
        let old = self.state.get(&key).cloned();
        if old.as_ref().is_some_and(|o| o.spec == *spec) {
            return Ok(());
        }
        let m = spec.table_size();
        let (base, active, new_region) = self.place_table(old.as_ref(), m)?;

        // Everything taken from here on is given back if the change fails.
        let mut taken = Reservation::new(&mut self.ids);
        if new_region {
            taken.region(base, 2 * m);
        }
        // Backend ids: keep those of backends that stay.
        let mut ids = Vec::with_capacity(spec.backends.len());
        for b in &spec.backends {
            let id = match old.as_ref().and_then(|o| o.backend_id(b.addr)) {
                Some(id) => id,
                None => taken.backend_id()?,
            };
            ids.push(id);
        }
        let service_id = match &old {
            Some(o) => o.info.id,
            None => taken.service_id()?,
        };
        let placement = Placement {
            service_id,
            base,
            active,
            table_size: m,
            new_service: old.is_none(),
        };
        let info = self
            .maps
            .write_service(spec, &key, &placement, &ids, &taken.backends)?;
        taken.commit();

        if let Some(o) = &old {
            if new_region {
                self.quarantined
                    .push((Instant::now(), o.info.table_base, 2 * o.info.table_size));
            }
            for id in &o.backend_ids {
                if !ids.contains(id) {
                    self.ids.backends.free(*id);
                }
            }
        }
        let new = Programmed {
            spec: spec.clone(),
            info,
            backend_ids: ids,
            flipped: Instant::now(),
        };
        let touched = self.reverse.replace(&key, old.as_ref(), Some(&new));
        self.state.insert(key, new);
        self.sync_echo_markers(spec.vip)?;
        self.sync_port_flags()?;
        self.sync_reverse(touched)
    }

    /// Where a service's new table of size `m` goes: the inactive half of
    /// its region, or a new region (`true`) when the size changed.
    fn place_table(&mut self, old: Option<&Programmed>, m: u32) -> Result<(u32, u32, bool)> {
        match old {
            Some(o) if o.info.table_size == m => {
                let wait = TABLE_QUARANTINE.saturating_sub(o.flipped.elapsed());
                if wait.is_zero() {
                    Ok((o.info.table_base, 1 - o.info.active, false))
                } else if let Some(base) = self.ids.regions.alloc(2 * m) {
                    // Changed again while the half it retired may still be
                    // read: a fresh region now beats waiting (the old one
                    // is quarantined once the new one is live).
                    Ok((base, 0, true))
                } else {
                    // No room for a second region: wait the quarantine out.
                    std::thread::sleep(wait);
                    Ok((o.info.table_base, 1 - o.info.active, false))
                }
            }
            _ => match self.alloc_region(2 * m) {
                Some(base) => Ok((base, 0, true)),
                None => Err(DataplaneError::Full(names::MAGLEV)),
            },
        }
    }

    /// Removes a service. Its flows' reply translations stay until they expire.
    pub fn remove_service(&mut self, key: &ServiceKey) -> Result<()> {
        let Some(p) = self.state.remove(key) else {
            return Ok(());
        };
        if let Err(e) = self.maps.services.remove(key) {
            self.state.insert(*key, p);
            return Err(map_err(names::SERVICES)(e));
        }
        self.quarantined
            .push((Instant::now(), p.info.table_base, 2 * p.info.table_size));
        p.backend_ids
            .iter()
            .for_each(|id| self.ids.backends.free(*id));
        self.ids.services.free(p.info.id);
        let touched = self.reverse.replace(key, Some(&p), None);
        self.sync_echo_markers(p.spec.vip)?;
        self.sync_port_flags()?;
        self.sync_reverse(touched)
    }

    /// A free region of `len` entries. When the pool is full but regions
    /// are quarantined (retired by quick successive changes), waits for them
    /// rather than report the pool full.
    fn alloc_region(&mut self, len: u32) -> Option<u32> {
        loop {
            if let Some(base) = self.ids.regions.alloc(len) {
                return Some(base);
            }
            let oldest = self.quarantined.iter().map(|(t, _, _)| *t).min()?;
            std::thread::sleep(TABLE_QUARANTINE.saturating_sub(oldest.elapsed()));
            self.release_quarantine();
        }
    }

    fn release_quarantine(&mut self) {
        let now = Instant::now();
        let (due, keep): (Vec<_>, Vec<_>) = self
            .quarantined
            .drain(..)
            .partition(|(t, _, _)| now.duration_since(*t) >= TABLE_QUARANTINE);
        self.quarantined = keep;
        for (_, start, len) in due {
            if let Err(e) = self.maps.ranges.clear_region(start, len) {
                // Harmless but for the space: only a live scope is read.
                log::warn!("could not remove retired source ranges: {e}");
            }
            self.ids.regions.free(start, len);
        }
    }

    /// The echo marker of a VIP exists while any service uses the VIP.
    fn sync_echo_markers(&mut self, vip: IpAddr) -> Result<()> {
        let key = echo_key(vip);
        let first = self
            .state
            .values()
            .find(|p| p.spec.vip == vip)
            .map(|p| p.info.id);
        match first {
            Some(id) => {
                let marker = ServiceInfo {
                    id,
                    ..Default::default()
                };
                self.maps
                    .services
                    .insert(key, marker, 0)
                    .map_err(map_err(names::SERVICES))
            }
            None => match self.maps.services.remove(&key) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(map_err(names::SERVICES)(e)),
            },
        }
    }

    fn sync_port_flags(&mut self) -> Result<()> {
        let mut want = vec![0u8; 65536];
        for p in self.state.values() {
            want[p.spec.port as usize] |= PORT_F_SERVICE;
            for b in &p.spec.backends {
                want[b.addr.port() as usize] |= PORT_F_BACKEND;
            }
        }
        for (port, (&w, have)) in want.iter().zip(self.ports.iter_mut()).enumerate() {
            if w != *have {
                self.maps
                    .port_flags
                    .set(port as u32, w, 0)
                    .map_err(map_err(names::PORT_FLAGS))?;
                *have = w;
            }
        }
        Ok(())
    }

    /// Id of a programmed service.
    pub fn service_id(&self, key: &ServiceKey) -> Option<u32> {
        self.state.get(key).map(|p| p.info.id)
    }

    pub fn service_info(&self, key: &ServiceKey) -> Result<ServiceInfo> {
        self.maps
            .services
            .get(key, 0)
            .map_err(map_err(names::SERVICES))
    }

    /// Id of a backend of a programmed service.
    pub fn backend_id(&self, key: &ServiceKey, addr: SocketAddr) -> Option<u32> {
        self.state.get(key)?.backend_id(addr)
    }

    /// Rebuilds the driver's bookkeeping from maps a previous agent pinned:
    /// services (with their table regions and ids) and backends. Weights are
    /// not stored in the maps; adopted backends get weight 0, so the first
    /// `set_service` with the real spec rewrites the (identical) table.
    fn adopt(&mut self) -> Result<()> {
        let entries: Vec<(ServiceKey, ServiceInfo)> = self
            .maps
            .services
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::SERVICES))?;
        let mut markers = Vec::new();
        for (key, info) in entries {
            let Some(vip) = key_ip(&key) else { continue };
            if key.port == 0 {
                markers.push((key, vip));
                continue;
            }
            let Some(protocol) = Protocol::from_number(key.proto) else {
                continue;
            };
            let m = info.table_size;
            if !self.ids.regions.reserve(info.table_base, 2 * m)
                || !self.ids.services.reserve(info.id)
            {
                return Err(DataplaneError::Adopt(format!(
                    "service id {} or its table overlaps another",
                    info.id
                )));
            }
            let mut backend_ids: Vec<(SocketAddr, u32)> = Vec::new();
            if info.backend_count > 0 {
                let table = self
                    .maps
                    .maglev
                    .read(info.table_base + info.active * m, m)
                    .map_err(DataplaneError::Mmap)?;
                let ids: BTreeSet<u32> = table.into_iter().collect();
                for id in ids {
                    let b = self
                        .maps
                        .backends
                        .get(&id, 0)
                        .map_err(map_err(names::BACKENDS))?
                        .backend;
                    let ip = words_ip(&b.addr, b.family);
                    backend_ids.push((SocketAddr::new(ip, u16::from_be(b.port)), id));
                    self.ids.backends.reserve(id);
                }
            }
            let spec = Arc::new(ServiceSpec {
                vip,
                port: u16::from_be(key.port),
                protocol,
                snat: (info.flags & SERVICE_F_SNAT != 0)
                    .then(|| words_ip(&info.snat_addr, key.family)),
                table_size: Some(m),
                source_ranges: (info.flags & SERVICE_F_SOURCE_RANGES != 0)
                    .then(|| self.maps.ranges.ranges(info.range_scope(), key.family)),
                client_affinity: info.flags & SERVICE_F_CLIENT_AFFINITY != 0,
                least_loaded: info.flags & SERVICE_F_LEAST_LOADED != 0,
                hold_unknown_flows: info.flags & SERVICE_F_HOLD_UNKNOWN != 0,
                new_flow_limit: if info.flags & SERVICE_F_FLOW_LIMIT != 0 {
                    let l = self
                        .maps
                        .flow_limits
                        .get(&info.id, 0)
                        .map_err(map_err(names::FLOW_LIMITS))?;
                    Some(NewFlowLimit::from_map(&l))
                } else {
                    None
                },
                backends: backend_ids
                    .iter()
                    .map(|(a, _)| BackendSpec {
                        addr: *a,
                        weight: 0,
                    })
                    .collect(),
            });
            self.state.insert(
                key,
                Programmed {
                    spec,
                    info,
                    backend_ids: backend_ids.into_iter().map(|x| x.1).collect(),
                    flipped: Instant::now(),
                },
            );
        }
        for (key, vip) in markers {
            if !self.state.values().any(|p| p.spec.vip == vip) {
                let _ = self.maps.services.remove(&key);
            }
        }
        let live: Vec<u32> = self
            .state
            .values()
            .filter(|p| p.info.flags & SERVICE_F_SOURCE_RANGES != 0)
            .map(|p| p.info.range_scope())
            .collect();
        self.maps
            .ranges
            .retain(&live)
            .map_err(map_err(names::SOURCE_RANGES))?;
        for (port, have) in self.ports.iter_mut().enumerate() {
            *have = self
                .maps
                .port_flags
                .get(&(port as u32), 0)
                .map_err(map_err(names::PORT_FLAGS))?;
        }
        self.adopt_reverse()
    }

    /// Deletes the flows (and their reply translations) that go to `backend`:
    /// their next packet picks a backend afresh. Returns how many flows.
    pub fn reset_flows_to(&mut self, backend: SocketAddr) -> Result<usize> {
        let addr = ip_words(backend.ip());
        let port = backend.port().to_be();
        let mut keys = BTreeSet::new();
        for (k, f) in self.shared_flows()? {
            if f.backend_addr == addr && f.backend_port == port {
                let _ = self.maps.shared_flows.remove(&k);
                keys.insert(FlowKeyOrd(k));
            }
        }
        for (k, _) in self.reply_entries()? {
            if k.src == addr && k.sport == port {
                let _ = self.maps.reply_nat.remove(&k);
            }
        }
        Ok(keys.len())
    }
}

/// FlowKey ordered by its bytes, for sets.
#[derive(PartialEq, Eq)]
struct FlowKeyOrd(FlowKey);

impl PartialOrd for FlowKeyOrd {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for FlowKeyOrd {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let k = |f: &FlowKey| (f.src, f.dst, f.sport, f.dport, f.proto, f.family);
        k(&self.0).cmp(&k(&other.0))
    }
}

/// Loads a program, again when the kernel answers EAGAIN: the verifier
/// gives up with it when a signal is pending for the loading thread (a
/// child's SIGCHLD, a SIGHUP at start), as libbpf also retries.
fn load_retrying(p: &mut Xdp) -> Result<(), ProgramError> {
    let mut attempts = 1;
    loop {
        match p.load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempts < 5 =>
            {
                attempts += 1;
            }
            r => return r,
        }
    }
}

fn key_ip(key: &ServiceKey) -> Option<IpAddr> {
    (key.family == FAMILY_V4 || key.family == FAMILY_V6).then(|| words_ip(&key.addr, key.family))
}

fn zero_stats<T: aya::Pod + Default>(
    map: &mut PerCpuArray<MapData, T>,
    id: u32,
) -> Result<(), MapError> {
    map.set(id, crate::maps::zeroed_per_cpu(), 0)
}
