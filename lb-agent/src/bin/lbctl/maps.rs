//! Opening the maps lb-agent pins under the pin directory, and reading
//! them the way the data plane does. Everything here is read-only: lbctl
//! never writes a map.

use std::{
    io,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    ptr::NonNull,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{
    lpm_trie::LpmTrie, Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap,
    PerCpuValues,
};
use lb_common::{
    map_names as names, BackendEntry, Config, Flow, FlowKey, RangeKey, ReplyNat, ServiceInfo,
    ServiceKey, TrafficStats, PROTO_ICMP, PROTO_ICMPV6, REASON_COUNT,
};

/// `BPF_F_MMAPABLE` (uapi/linux/bpf.h): the map's memory can be mapped.
const BPF_F_MMAPABLE: u32 = 1 << 10;
/// Bytes between two array elements in an mmapped array map: the kernel
/// rounds the value size (4 for MAGLEV's u32) up to 8.
const ARRAY_STRIDE: usize = 8;

pub type StatsMap = PerCpuArray<MapData, TrafficStats>;

/// The pin directory, checked to hold xlb maps.
pub struct Maps {
    dir: PathBuf,
}

fn not_pinned(dir: &Path) -> anyhow::Error {
    anyhow!(
        "no pinned xlb maps under {}: is lb-agent running or has it run on this node?",
        dir.display()
    )
}

fn need_root(path: &Path) -> anyhow::Error {
    anyhow!(
        "permission denied reading {}: lbctl needs root (CAP_BPF and access to the BPF filesystem)",
        path.display()
    )
}

impl Maps {
    /// Checks that `dir` exists and holds at least one of the xlb maps.
    pub fn open(dir: &Path) -> Result<Self> {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!("{} is not a directory", dir.display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(not_pinned(dir)),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Err(need_root(dir)),
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        }
        let any = names::ALL.iter().any(|n| dir.join(n).exists());
        if !any {
            return Err(not_pinned(dir));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    fn data(&self, name: &'static str) -> Result<MapData> {
        let path = self.dir.join(name);
        match std::fs::symlink_metadata(&path) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => bail!(
                "map {name} is not pinned under {} (other xlb maps are): \
                 was it pinned by an lb-agent of another version?",
                self.dir.display()
            ),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Err(need_root(&path)),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
        MapData::from_pin(&path).map_err(|e| match &e {
            MapError::SyscallError(s)
                if matches!(s.io_error.raw_os_error(), Some(libc::EPERM | libc::EACCES)) =>
            {
                need_root(&path)
            }
            _ => anyhow!(e).context(format!("opening pinned map {}", path.display())),
        })
    }

    fn map(&self, name: &'static str) -> Result<Map> {
        Map::from_map_data(self.data(name)?).with_context(|| format!("map {name}"))
    }

    /// Converts to a typed map; a key or value size mismatch means the map
    /// was pinned by an lb-agent built with other types.
    fn typed<M>(&self, name: &'static str) -> Result<M>
    where
        M: TryFrom<Map, Error = MapError>,
    {
        M::try_from(self.map(name)?).map_err(|e| {
            anyhow!(e).context(format!(
                "map {name} under {} does not have the layout this lbctl expects \
                 (lb-agent and lbctl of different versions?)",
                self.dir.display()
            ))
        })
    }

    pub fn services(&self) -> Result<HashMap<MapData, ServiceKey, ServiceInfo>> {
        self.typed(names::SERVICES)
    }

    pub fn backends(&self) -> Result<Array<MapData, BackendEntry>> {
        self.typed(names::BACKENDS)
    }

    pub fn maglev(&self) -> Result<Maglev> {
        Maglev::new(self.data(names::MAGLEV)?)
    }

    pub fn source_ranges(&self) -> Result<LpmTrie<MapData, RangeKey, u8>> {
        self.typed(names::SOURCE_RANGES)
    }

    pub fn conntrack(&self) -> Result<PerCpuHashMap<MapData, FlowKey, Flow>> {
        self.typed(names::CONNTRACK)
    }

    pub fn shared_flows(&self) -> Result<HashMap<MapData, FlowKey, Flow>> {
        self.typed(names::SHARED_FLOWS)
    }

    pub fn reply_nat(&self) -> Result<HashMap<MapData, FlowKey, ReplyNat>> {
        self.typed(names::REPLY_NAT)
    }

    pub fn port_flags(&self) -> Result<Array<MapData, u8>> {
        self.typed(names::PORT_FLAGS)
    }

    pub fn config(&self) -> Result<Config> {
        let map: Array<MapData, Config> = self.typed(names::CONFIG)?;
        map.get(&0, 0).context("reading CONFIG[0]")
    }

    pub fn service_stats(&self) -> Result<StatsMap> {
        self.typed(names::SERVICE_STATS)
    }

    pub fn backend_stats(&self) -> Result<StatsMap> {
        self.typed(names::BACKEND_STATS)
    }

    /// `REASON_STATS` as `[cpu][reason]` over every possible CPU.
    pub fn reason_counts_per_cpu(&self) -> Result<Vec<[u64; REASON_COUNT as usize]>> {
        let map: PerCpuArray<MapData, u64> = self.typed(names::REASON_STATS)?;
        let mut out: Vec<[u64; REASON_COUNT as usize]> = Vec::new();
        for r in 0..REASON_COUNT {
            let v = map
                .get(&r, 0)
                .with_context(|| format!("reading REASON_STATS[{r}]"))?;
            if out.is_empty() {
                out = vec![[0; REASON_COUNT as usize]; v.len()];
            }
            for (cpu, c) in v.iter().enumerate() {
                out[cpu][r as usize] = *c;
            }
        }
        Ok(out)
    }
}

/// `true` for the `SERVICES` entries that only mark a VIP whose echo
/// requests are answered (ICMP/ICMPv6, port 0): not services.
pub fn is_echo_marker(key: &ServiceKey) -> bool {
    key.port == 0 && (key.proto == PROTO_ICMP || key.proto == PROTO_ICMPV6)
}

/// Every service (echo markers left out), sorted by key.
pub fn list_services(
    map: &HashMap<MapData, ServiceKey, ServiceInfo>,
) -> Result<Vec<(ServiceKey, ServiceInfo)>> {
    let mut out = Vec::new();
    for item in map.iter() {
        let (k, v) = item.context("reading SERVICES")?;
        if !is_echo_marker(&k) {
            out.push((k, v));
        }
    }
    out.sort_by_key(|a| crate::services::sort_key(&a.0));
    Ok(out)
}

/// One service's entry; `None` when it is not programmed.
pub fn get_service(
    map: &HashMap<MapData, ServiceKey, ServiceInfo>,
    key: &ServiceKey,
) -> Result<Option<ServiceInfo>> {
    match map.get(key, 0) {
        Ok(v) => Ok(Some(v)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(e) => Err(e).context("reading SERVICES"),
    }
}

/// The sum of a per-CPU traffic counter over CPUs.
pub fn sum_stats(values: &PerCpuValues<TrafficStats>) -> TrafficStats {
    sum_traffic(values.iter())
}

pub fn sum_traffic<'a>(values: impl Iterator<Item = &'a TrafficStats>) -> TrafficStats {
    values.fold(TrafficStats::default(), |a, s| TrafficStats {
        packets: a.packets + s.packets,
        bytes: a.bytes + s.bytes,
        new_flows: a.new_flows + s.new_flows,
        reply_packets: a.reply_packets + s.reply_packets,
        reply_bytes: a.reply_bytes + s.reply_bytes,
    })
}

pub fn read_stats(map: &StatsMap, id: u32, name: &str) -> Result<TrafficStats> {
    let v = map
        .get(&id, 0)
        .with_context(|| format!("reading {name}[{id}]"))?;
    Ok(sum_stats(&v))
}

/// Reader of the `MAGLEV` pool.
///
/// The map is created with `BPF_F_MMAPABLE`, so lbctl maps it read-only
/// (`PROT_READ`, `MAP_SHARED`) and reads a whole table with plain loads;
/// entry i is the u32 at byte 8 * i. If the map cannot be mapped (an older
/// agent created it without the flag, or mmap fails) it falls back to one
/// `bpf_map_lookup_elem` per entry, which is 16381 syscalls for a default
/// table: slower but fine for a CLI.
pub enum Maglev {
    Mapped(Mapped),
    Syscalls(Array<MapData, u32>),
}

pub struct Mapped {
    // Keeps the fd (and so the mapping's backing) alive.
    _map: MapData,
    base: NonNull<u8>,
    len: usize,
    entries: u32,
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `Maglev::new` mapped.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl Maglev {
    fn new(data: MapData) -> Result<Self> {
        let info = data.info().context("reading MAGLEV's map info")?;
        let entries = info.max_entries();
        if info.map_flags() & BPF_F_MMAPABLE != 0 && info.value_size() == 4 {
            match mmap_read_only(&data, entries as usize * ARRAY_STRIDE) {
                Ok((base, len)) => {
                    return Ok(Self::Mapped(Mapped {
                        _map: data,
                        base,
                        len,
                        entries,
                    }))
                }
                Err(_) => { /* fall back to syscalls below */ }
            }
        }
        let array = Array::try_from(Map::from_map_data(data)?).context(
            "map MAGLEV does not have the layout this lbctl expects \
             (lb-agent and lbctl of different versions?)",
        )?;
        Ok(Self::Syscalls(array))
    }

    fn entries(&self) -> u32 {
        match self {
            Self::Mapped(m) => m.entries,
            Self::Syscalls(a) => a.len(),
        }
    }

    /// Entry `idx` of the pool.
    pub fn get(&self, idx: u32) -> Result<u32> {
        if idx >= self.entries() {
            bail!(
                "MAGLEV index {idx} is past the pool ({} entries)",
                self.entries()
            );
        }
        match self {
            // SAFETY: idx < entries, and the mapping covers entries * STRIDE bytes.
            Self::Mapped(m) => Ok(unsafe {
                m.base
                    .as_ptr()
                    .add(idx as usize * ARRAY_STRIDE)
                    .cast::<u32>()
                    .read_volatile()
            }),
            Self::Syscalls(a) => a
                .get(&idx, 0)
                .with_context(|| format!("reading MAGLEV[{idx}]")),
        }
    }

    /// `len` entries from `start`.
    pub fn read(&self, start: u32, len: u32) -> Result<Vec<u32>> {
        if start as u64 + len as u64 > self.entries() as u64 {
            bail!(
                "MAGLEV range {start}+{len} is past the pool ({} entries): \
                 SERVICES names a table the pool does not hold",
                self.entries()
            );
        }
        (start..start + len).map(|i| self.get(i)).collect()
    }

    /// The live table of a service (backend ids); empty when it has no
    /// backends (the data plane then drops new flows).
    pub fn live_table(&self, info: &ServiceInfo) -> Result<Vec<u32>> {
        if info.backend_count == 0 || info.table_size == 0 {
            return Ok(Vec::new());
        }
        self.read(
            info.table_base + info.active * info.table_size,
            info.table_size,
        )
    }
}

fn mmap_read_only(data: &MapData, bytes: usize) -> io::Result<(NonNull<u8>, usize)> {
    let page = 4096usize;
    let len = bytes.div_ceil(page) * page;
    // SAFETY: a read-only shared mapping of a BPF array map fd, as the
    // kernel documents for BPF_F_MMAPABLE maps.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            data.fd().as_fd().as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let base = NonNull::new(p.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
    Ok((base, len))
}

/// `CLOCK_MONOTONIC_COARSE` now, in nanoseconds: the clock of the data
/// plane's `bpf_ktime_get_coarse_ns` timestamps.
pub fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPUs that are online (for the `stats` columns); `None` if unknown.
pub fn online_cpus() -> Option<Vec<usize>> {
    aya::util::online_cpus()
        .ok()
        .map(|v| v.into_iter().map(|c| c as usize).collect())
}
