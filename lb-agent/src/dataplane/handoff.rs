//! SNAT flows handed from node to node (docs/bgp.md, "A node that leaves"):
//! exported by what names them on every node (addresses and ports, not this
//! node's ids), and imported by a node the router may send them to next, so
//! that it translates them exactly as the node that opened them.

use lb_common::{FLOW_F_CLOSED, FLOW_F_HANDED, SERVICE_F_SNAT};

use super::*;

/// `bpf_map_update_elem`'s "only if absent" (linux/bpf.h).
const BPF_NOEXIST: u64 = 1;

/// An SNAT flow as another node needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedFlow {
    pub protocol: Protocol,
    pub client: SocketAddr,
    pub vip: SocketAddr,
    pub backend: SocketAddr,
    /// The source address and port the opening node gave it.
    pub snat: SocketAddr,
    /// The client sent a FIN or RST.
    pub closed: bool,
    /// Time since its latest packet, in milliseconds.
    pub idle_ms: u32,
}

/// Which SNAT flows to hand over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handing {
    /// Every one, also those other nodes handed to this one: a node that
    /// starts or leaves.
    All,
    /// Those this node opened at or after a time (`coarse_now_ns`'s clock):
    /// the periodic sync.
    OpenedHereSince(u64),
}

/// What an import did with the flows it was given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    /// Written to the flow table.
    pub added: usize,
    /// Already there (this node's own flow, or one imported before): kept.
    pub present: usize,
    /// No SNAT service on that VIP, port and protocol here.
    pub unknown_service: usize,
    /// The service here has no such backend.
    pub unknown_backend: usize,
}

/// This node's ids of the SNAT services and their backends, by what names
/// them on every node: what an import needs from the data plane's state.
#[derive(Clone, Debug, Default)]
pub struct HandoffIds(BTreeMap<ServiceKey, (u32, Vec<(SocketAddr, u32)>)>);

/// The flow table through handles of its own, so that the flow exchange
/// walks and writes it without holding the data plane; walked in batches
/// (`crate::maps::batch`).
pub struct FlowTable {
    data: MapData,
    map: HashMap<MapData, FlowKey, Flow>,
}

impl Dataplane {
    /// A handle of its own on the flow table: a duplicate of the driver's
    /// fd. Not opened by id, which needs CAP_SYS_ADMIN (the chart does not
    /// grant it).
    pub fn flow_table(&self) -> Result<FlowTable> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        let fd = self.maps.shared_flows.map().fd().as_fd();
        let open = || {
            let dup = fd
                .try_clone_to_owned()
                .map_err(|e| map_err(names::FLOWS)(MapError::IoError(e)))?;
            MapData::from_fd(dup).map_err(map_err(names::FLOWS))
        };
        let map = HashMap::try_from(Map::LruHashMap(open()?)).map_err(map_err(names::FLOWS))?;
        Ok(FlowTable { data: open()?, map })
    }

    /// The ids an import needs, as programmed now.
    pub fn handoff_ids(&self) -> HandoffIds {
        HandoffIds(
            self.state
                .iter()
                .filter(|(_, p)| p.info.flags & SERVICE_F_SNAT != 0)
                .map(|(k, p)| (*k, (p.info.id, p.backend_ids.clone())))
                .collect(),
        )
    }

    /// The SNAT flows in the flow table that `which` names.
    pub fn snat_flows(&self, which: Handing) -> Result<Vec<HandedFlow>> {
        self.flow_table()?.snat_flows(which)
    }

    /// Writes flows another node opened into the flow table, under this
    /// node's ids for their service and backend. A flow already in the table
    /// is left as it is: this node's own state wins.
    pub fn import_flows(&mut self, flows: &[HandedFlow]) -> Result<Imported> {
        let ids = self.handoff_ids();
        import(&mut self.maps.shared_flows, &ids, flows)
    }
}

impl FlowTable {
    /// [`Dataplane::snat_flows`].
    pub fn snat_flows(&self, which: Handing) -> Result<Vec<HandedFlow>> {
        Ok(export(self.entries()?, which))
    }

    /// Every entry, read in batches.
    pub fn entries(&self) -> Result<Vec<(FlowKey, Flow)>> {
        use std::os::fd::AsFd;
        crate::maps::batch::hash_entries(self.data.fd().as_fd())
            .map_err(|e| map_err(names::FLOWS)(MapError::IoError(e)))
    }

    /// [`Dataplane::import_flows`], with ids taken from it beforehand.
    pub fn import_flows(&mut self, ids: &HandoffIds, flows: &[HandedFlow]) -> Result<Imported> {
        import(&mut self.map, ids, flows)
    }
}

fn export(entries: Vec<(FlowKey, Flow)>, which: Handing) -> Vec<HandedFlow> {
    let now = crate::maps::coarse_now_ns();
    let mut out = Vec::new();
    for (k, f) in entries {
        let wanted = match which {
            Handing::All => true,
            Handing::OpenedHereSince(t) => f.flags & FLOW_F_HANDED == 0 && f.created_ns >= t,
        };
        if f.snat_port == 0 || !wanted {
            continue;
        }
        let Some(protocol) = Protocol::from_number(k.proto) else {
            continue;
        };
        let at = |words: &[u32; 4], port_be: u16| {
            SocketAddr::new(words_ip(words, k.family), u16::from_be(port_be))
        };
        out.push(HandedFlow {
            protocol,
            client: at(&k.src, k.sport),
            vip: at(&k.dst, k.dport),
            backend: at(&f.backend_addr, f.backend_port),
            snat: at(&f.snat_addr, f.snat_port),
            closed: f.flags & FLOW_F_CLOSED != 0,
            idle_ms: (now.saturating_sub(f.last_seen_ns) / 1_000_000).min(u32::MAX as u64) as u32,
        });
    }
    out
}

fn import(
    map: &mut HashMap<MapData, FlowKey, Flow>,
    ids: &HandoffIds,
    flows: &[HandedFlow],
) -> Result<Imported> {
    let now = crate::maps::coarse_now_ns();
    let mut done = Imported::default();
    for h in flows {
        let skey = service_key(h.vip.ip(), h.vip.port(), h.protocol.number());
        let Some((service_id, backends)) = ids.0.get(&skey) else {
            done.unknown_service += 1;
            continue;
        };
        let Some(&(_, backend_id)) = backends.iter().find(|(a, _)| *a == h.backend) else {
            done.unknown_backend += 1;
            continue;
        };
        let key = FlowKey {
            src: ip_words(h.client.ip()),
            dst: skey.addr,
            sport: h.client.port().to_be(),
            dport: skey.port,
            proto: skey.proto,
            family: skey.family,
            _pad: [0; 2],
        };
        let last_seen = now.saturating_sub(h.idle_ms as u64 * 1_000_000);
        let flow = Flow {
            backend_addr: ip_words(h.backend.ip()),
            snat_addr: ip_words(h.snat.ip()),
            backend_port: h.backend.port().to_be(),
            snat_port: h.snat.port().to_be(),
            backend_id,
            service_id: *service_id,
            // Not counted in this node's open flows (FLOW_F_COUNTED): its
            // closing must not take one off.
            flags: FLOW_F_HANDED | if h.closed { FLOW_F_CLOSED } else { 0 },
            created_ns: last_seen,
            last_seen_ns: last_seen,
        };
        match map.insert(key, flow, BPF_NOEXIST) {
            Ok(()) => done.added += 1,
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                done.present += 1
            }
            Err(e) => return Err(map_err(names::FLOWS)(e)),
        }
    }
    Ok(done)
}
