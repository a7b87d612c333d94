//! The program's pinned maps as one read-only layer: opening and checking
//! the pins, typed maps, and reading them the way the data plane does
//! (per-CPU sums, flow listings, the live Maglev table). lbctl reads through
//! it alone; the agent's `Dataplane` builds its writes on the same types and
//! readers. A change to a map's layout touches this module and lb-common.

pub mod batch;
mod maglev;
pub mod ranges;

use std::{io, mem::size_of, path::Path, path::PathBuf};

use aya::maps::{
    lpm_trie::LpmTrie, Array, HashMap, Map, MapData, MapError, MapInfo, PerCpuArray, PerCpuValues,
};
use lb_common::{
    map_names as names, BackendEntry, BackendLoad, Config, Flow, FlowKey, FlowLimit, L2Iface,
    L2Vip, L2VipKey, RangeKey, ReplyNat, ReverseKey, ReverseNat, ServiceInfo, ServiceKey,
    SourceKey, TrafficStats, REASON_COUNT,
};

pub use self::maglev::MaglevPool;

pub type ServicesMap = HashMap<MapData, ServiceKey, ServiceInfo>;
pub type BackendsMap = Array<MapData, BackendEntry>;
pub type StatsMap = PerCpuArray<MapData, TrafficStats>;
pub type ReasonsMap = PerCpuArray<MapData, u64>;
pub type FlowsMap = HashMap<MapData, FlowKey, Flow>;
pub type ReplyMap = HashMap<MapData, FlowKey, ReplyNat>;
pub type RangesMap = LpmTrie<MapData, RangeKey, u8>;
pub type L2VipsMap = HashMap<MapData, L2VipKey, L2Vip>;
pub type L2IfacesMap = HashMap<MapData, u32, L2Iface>;

/// Packets per reason, one array per CPU.
pub type ReasonCounts = [u64; REASON_COUNT as usize];

/// Key and value sizes of each pinned map, as this build lays them out.
pub fn expected_layout(name: &str) -> Option<(usize, usize)> {
    Some(match name {
        names::SERVICES => (size_of::<ServiceKey>(), size_of::<ServiceInfo>()),
        names::BACKENDS => (4, size_of::<BackendEntry>()),
        names::MAGLEV => (4, 4),
        names::FLOWS => (size_of::<FlowKey>(), size_of::<Flow>()),
        names::REPLY_NAT => (size_of::<FlowKey>(), size_of::<ReplyNat>()),
        names::PORT_FLAGS => (4, 1),
        names::CONFIG => (4, size_of::<Config>()),
        names::SERVICE_STATS | names::BACKEND_STATS => (4, size_of::<TrafficStats>()),
        names::REASON_STATS | names::FLOW_EVENTS | names::BACKEND_CLOSED => (4, 8),
        names::BACKEND_LOAD => (4, size_of::<BackendLoad>()),
        names::FLOW_TIMES => (4, size_of::<lb_common::FlowTimes>()),
        names::BACKEND_ACTIVE => (4, 8),
        names::SOURCE_RANGES => (4 + size_of::<RangeKey>(), 1),
        names::L2_VIPS => (size_of::<L2VipKey>(), size_of::<L2Vip>()),
        names::L2_IFACES => (4, size_of::<L2Iface>()),
        names::BACKEND_REVERSE => (size_of::<ReverseKey>(), size_of::<ReverseNat>()),
        names::FLOW_LIMITS => (4, size_of::<FlowLimit>()),
        names::SOURCE_RATES => (size_of::<SourceKey>(), 8),
        names::HELD_FLOWS => (size_of::<FlowKey>(), 8),
        _ => return None,
    })
}

/// Why a pinned map cannot be read as this build lays it out; `None`: it can.
pub fn layout_mismatch(name: &str, info: &MapInfo) -> Option<String> {
    let (key, value) = expected_layout(name)?;
    (info.key_size() as usize != key || info.value_size() as usize != value).then(|| {
        format!(
            "key/value sizes {}/{}, this version expects {key}/{value}",
            info.key_size(),
            info.value_size()
        )
    })
}

/// Errors of opening pinned maps, worded for the person at the terminal.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("no pinned xlb maps under {0}: is lb-agent running or has it run on this node?")]
    NotPinned(PathBuf),
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    #[error(
        "permission denied reading {0}: reading the maps needs root \
         (CAP_BPF and access to the BPF filesystem)"
    )]
    NeedRoot(PathBuf),
    #[error(
        "map {name} is not pinned under {dir} (other xlb maps are): \
         was it pinned by an lb-agent of another version?"
    )]
    Missing { name: &'static str, dir: PathBuf },
    #[error(
        "map {name} under {dir} does not have the layout this build expects ({why}): \
         lb-agent and lbctl of different versions?"
    )]
    Layout {
        name: &'static str,
        dir: PathBuf,
        why: String,
    },
    #[error("reading {0}: {1}")]
    Io(PathBuf, io::Error),
    #[error("opening pinned map {0}: {1}")]
    Map(PathBuf, MapError),
}

/// A pin directory checked to hold xlb maps. Each getter opens one pinned
/// map and checks its layout; nothing here writes.
pub struct PinnedMaps {
    dir: PathBuf,
}

impl PinnedMaps {
    /// Checks that `dir` exists and holds at least one of the xlb maps.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(OpenError::NotADirectory(dir.to_path_buf())),
            Err(e) => return Err(io_error(dir, e)),
        }
        if !names::ALL.iter().any(|n| dir.join(n).exists()) {
            return Err(OpenError::NotPinned(dir.to_path_buf()));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The pinned map `name`, its layout checked.
    pub fn data(&self, name: &'static str) -> Result<MapData, OpenError> {
        let path = self.dir.join(name);
        if let Err(e) = std::fs::symlink_metadata(&path) {
            return Err(match e.kind() {
                io::ErrorKind::NotFound => OpenError::Missing {
                    name,
                    dir: self.dir.clone(),
                },
                _ => io_error(&path, e),
            });
        }
        let data = MapData::from_pin(&path).map_err(|e| match &e {
            MapError::SyscallError(s)
                if matches!(s.io_error.raw_os_error(), Some(libc::EPERM | libc::EACCES)) =>
            {
                OpenError::NeedRoot(path.clone())
            }
            _ => OpenError::Map(path.clone(), e),
        })?;
        let info = data.info().map_err(|e| OpenError::Map(path.clone(), e))?;
        if let Some(why) = layout_mismatch(name, &info) {
            return Err(OpenError::Layout {
                name,
                dir: self.dir.clone(),
                why,
            });
        }
        Ok(data)
    }

    fn typed<M>(&self, name: &'static str) -> Result<M, OpenError>
    where
        M: TryFrom<Map, Error = MapError>,
    {
        let path = self.dir.join(name);
        let map =
            Map::from_map_data(self.data(name)?).map_err(|e| OpenError::Map(path.clone(), e))?;
        M::try_from(map).map_err(|e| OpenError::Layout {
            name,
            dir: self.dir.clone(),
            why: e.to_string(),
        })
    }

    pub fn services(&self) -> Result<ServicesMap, OpenError> {
        self.typed(names::SERVICES)
    }

    pub fn backends(&self) -> Result<BackendsMap, OpenError> {
        self.typed(names::BACKENDS)
    }

    /// The Maglev pool, mapped read-only.
    pub fn maglev(&self) -> Result<MaglevPool, OpenError> {
        let path = self.dir.join(names::MAGLEV);
        MaglevPool::read_only(self.data(names::MAGLEV)?).map_err(|e| OpenError::Io(path, e))
    }

    pub fn source_ranges(&self) -> Result<RangesMap, OpenError> {
        self.typed(names::SOURCE_RANGES)
    }

    pub fn shared_flows(&self) -> Result<FlowsMap, OpenError> {
        self.typed(names::FLOWS)
    }

    pub fn reply_nat(&self) -> Result<ReplyMap, OpenError> {
        self.typed(names::REPLY_NAT)
    }

    pub fn port_flags(&self) -> Result<Array<MapData, u8>, OpenError> {
        self.typed(names::PORT_FLAGS)
    }

    pub fn config(&self) -> Result<Array<MapData, Config>, OpenError> {
        self.typed(names::CONFIG)
    }

    pub fn service_stats(&self) -> Result<StatsMap, OpenError> {
        self.typed(names::SERVICE_STATS)
    }

    pub fn backend_stats(&self) -> Result<StatsMap, OpenError> {
        self.typed(names::BACKEND_STATS)
    }

    pub fn reason_stats(&self) -> Result<ReasonsMap, OpenError> {
        self.typed(names::REASON_STATS)
    }

    /// `BACKEND_CLOSED`; `None` when pinned by a version without it.
    pub fn backend_closed(&self) -> Result<Option<ReasonsMap>, OpenError> {
        self.optional(names::BACKEND_CLOSED)
    }

    /// `BACKEND_ACTIVE`; `None` when pinned by a version without it.
    pub fn backend_active(&self) -> Result<Option<Array<MapData, i64>>, OpenError> {
        self.optional(names::BACKEND_ACTIVE)
    }

    /// `BACKEND_LOAD`; `None` when pinned by a version without it.
    pub fn backend_load(&self) -> Result<Option<Array<MapData, BackendLoad>>, OpenError> {
        self.optional(names::BACKEND_LOAD)
    }

    fn optional<M>(&self, name: &'static str) -> Result<Option<M>, OpenError>
    where
        M: TryFrom<Map, Error = MapError>,
    {
        match self.typed(name) {
            Ok(m) => Ok(Some(m)),
            Err(OpenError::NotPinned(_) | OpenError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `L2_VIPS`; `None` when pinned by a version without L2 mode.
    pub fn l2_vips(&self) -> Result<Option<L2VipsMap>, OpenError> {
        self.optional(names::L2_VIPS)
    }

    /// `L2_IFACES`; `None` when pinned by a version without L2 mode.
    pub fn l2_ifaces(&self) -> Result<Option<L2IfacesMap>, OpenError> {
        self.optional(names::L2_IFACES)
    }

    /// `FLOW_LIMITS`; `None` when pinned by a version without it.
    pub fn flow_limits(&self) -> Result<Option<Array<MapData, FlowLimit>>, OpenError> {
        self.optional(names::FLOW_LIMITS)
    }

    /// `FLOW_EVENTS`; `None` when pinned by a version without it.
    pub fn flow_events(&self) -> Result<Option<ReasonsMap>, OpenError> {
        self.optional(names::FLOW_EVENTS)
    }
}

fn io_error(path: &Path, e: io::Error) -> OpenError {
    match e.kind() {
        io::ErrorKind::NotFound => OpenError::NotPinned(path.to_path_buf()),
        io::ErrorKind::PermissionDenied => OpenError::NeedRoot(path.to_path_buf()),
        _ => OpenError::Io(path.to_path_buf(), e),
    }
}

/// `REASON_STATS` as `[cpu][reason]`, over every possible CPU.
pub fn reason_counts_per_cpu(map: &ReasonsMap) -> Result<Vec<ReasonCounts>, MapError> {
    let mut out: Vec<ReasonCounts> = Vec::new();
    for r in 0..REASON_COUNT {
        let v = map.get(&r, 0)?;
        if out.is_empty() {
            out = vec![[0; REASON_COUNT as usize]; v.len()];
        }
        for (cpu, c) in v.iter().enumerate() {
            out[cpu][r as usize] = *c;
        }
    }
    Ok(out)
}

/// `REASON_STATS` summed over CPUs.
pub fn reason_counts(map: &ReasonsMap) -> Result<ReasonCounts, MapError> {
    let mut out = [0; REASON_COUNT as usize];
    for cpu in reason_counts_per_cpu(map)? {
        for (sum, c) in out.iter_mut().zip(cpu) {
            *sum += c;
        }
    }
    Ok(out)
}

/// `FLOW_EVENTS[event]` summed over CPUs.
pub fn flow_event(map: &ReasonsMap, event: u32) -> Result<u64, MapError> {
    Ok(map.get(&event, 0)?.iter().sum())
}

/// A service's or backend's traffic, summed over CPUs.
pub fn traffic(map: &StatsMap, id: u32) -> Result<TrafficStats, MapError> {
    Ok(TrafficStats::sum(map.get(&id, 0)?.iter()))
}

/// Every service (echo markers left out), in map order.
pub fn services(map: &ServicesMap) -> Result<Vec<(ServiceKey, ServiceInfo)>, MapError> {
    let mut out = Vec::new();
    for item in map.iter() {
        let (k, v) = item?;
        if !k.is_echo_marker() {
            out.push((k, v));
        }
    }
    Ok(out)
}

/// One service's entry; `None` when it is not programmed.
pub fn service(map: &ServicesMap, key: &ServiceKey) -> Result<Option<ServiceInfo>, MapError> {
    optional(map.get(key, 0))
}

/// `Ok(None)` for a key the map does not hold.
pub fn optional<T>(r: Result<T, MapError>) -> Result<Option<T>, MapError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every entry of a plain hash map (the shared flow table, reply translations).
pub fn entries<K: aya::Pod, V: aya::Pod>(
    map: &HashMap<MapData, K, V>,
) -> Result<Vec<(K, V)>, MapError> {
    map.iter().collect()
}

/// `CONFIG[0]`: the settings the program runs with.
pub fn config(map: &Array<MapData, Config>) -> Result<Config, MapError> {
    map.get(&0, 0)
}

/// `count` per-CPU values of `T::default()`, for resetting a counter.
pub fn zeroed_per_cpu<T: aya::Pod + Default>() -> PerCpuValues<T> {
    PerCpuValues::try_from(vec![T::default(); possible_cpus()])
        .expect("one value per possible CPU is what the kernel expects")
}

/// Number of possible CPUs: the length of every per-CPU value.
pub fn possible_cpus() -> usize {
    aya::util::nr_cpus().unwrap_or(1)
}

/// CPUs that are online; `None` if unknown.
pub fn online_cpus() -> Option<Vec<usize>> {
    aya::util::online_cpus()
        .ok()
        .map(|v| v.into_iter().map(|c| c as usize).collect())
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock of `bpf_ktime_get_ns`,
/// which L2 mode's deadlines (`L2Iface::valid_until_ns`) are compared with.
pub fn monotonic_now_ns() -> u64 {
    crate::sys::clock_ns(libc::CLOCK_MONOTONIC)
}

/// The VIPs this node answers for in L2 mode: (VIP, ifindex).
pub fn l2_vips(map: &L2VipsMap) -> Result<Vec<(std::net::IpAddr, u32)>, MapError> {
    let mut out = Vec::new();
    for item in map.iter() {
        let (k, v) = item?;
        out.push((lb_common::net::words_ip(&k.addr, k.family), v.ifindex));
    }
    out.sort();
    Ok(out)
}

/// `CLOCK_MONOTONIC_COARSE` now, in nanoseconds: the clock of the data
/// plane's `bpf_ktime_get_coarse_ns` timestamps.
pub fn coarse_now_ns() -> u64 {
    crate::sys::clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}
