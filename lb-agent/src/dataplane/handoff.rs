//! Flows handed from node to node (docs/bgp.md, "A node that leaves"):
//! exported by what names them on every node (addresses and ports, not this
//! node's ids), and imported by a node the router may send them to next, so
//! that it translates them exactly as the node that opened them: to the
//! same backend (which Maglev alone does not promise once the backends or
//! their weights changed) and, in snat mode, from the same source.

use lb_common::{
    FLOW_F_CLOSED, FLOW_F_HANDED, PROTO_TCP, PROTO_UDP, REPLY_F_CLOSING, SERVICE_F_SNAT,
};

use super::*;

/// `bpf_map_update_elem`'s "only if absent" (linux/bpf.h).
const BPF_NOEXIST: u64 = 1;

/// A flow as another node needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedFlow {
    pub protocol: Protocol,
    pub client: SocketAddr,
    pub vip: SocketAddr,
    pub backend: SocketAddr,
    /// The source address and port the opening node gave it (snat mode).
    pub snat: Option<SocketAddr>,
    /// The client sent a FIN or RST.
    pub closed: bool,
    /// Time since its latest packet, in milliseconds.
    pub idle_ms: u32,
}

/// Which flows to hand over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handing {
    /// Every one, also those other nodes handed to this one: a node that
    /// starts or leaves.
    All,
    /// Those this node opened at or after a time (`coarse_now_ns`'s clock),
    /// and those whose client closed them here since (so that the other
    /// nodes' copies are known closed when the client's port is used
    /// again): the periodic sync.
    OpenedHereSince(u64),
}

/// What an import did with the flows it was given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    /// Written to the flow table.
    pub added: usize,
    /// Already there (this node's own flow, or one imported before): kept.
    pub present: usize,
    /// Already there with another translation, or closed where the handed
    /// one is open, and older: replaced (the client's port was used again,
    /// or its SYN was answered through another node).
    pub replaced: usize,
    /// Already there as handed over, and closed since by its client
    /// through another node: marked closed here too.
    pub closed: usize,
    /// No service on that VIP, port and protocol here, or one of the
    /// other mode (nat, snat).
    pub unknown_service: usize,
    /// The service here has no such backend.
    pub unknown_backend: usize,
}

/// This node's ids of the services and their backends, by what names
/// them on every node, and the reply translations' lifetimes: what an
/// import needs from the data plane's state.
#[derive(Clone, Debug, Default)]
pub struct HandoffIds {
    services: BTreeMap<ServiceKey, HandoffService>,
    lifetimes: Lifetimes,
}

#[derive(Clone, Debug, Default)]
struct HandoffService {
    id: u32,
    backends: Vec<(SocketAddr, u32)>,
    /// This node's SNAT address for the service (snat mode).
    snat_addr: Option<[u32; 4]>,
}

/// Seconds a flow and its reply translation live without traffic
/// (`Config`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Lifetimes {
    tcp: u32,
    tcp_closing: u32,
    udp: u32,
}

impl Lifetimes {
    /// Seconds, as the program picks them (`lifetime_ns` in lb-ebpf).
    fn of(&self, proto: u8, closed: bool) -> u32 {
        match (proto, closed) {
            (PROTO_TCP, false) => self.tcp,
            (PROTO_TCP, true) => self.tcp_closing,
            _ => self.udp,
        }
    }
}

/// The flow table through handles of its own, so that the flow exchange
/// walks and writes it without holding the data plane; walked in batches
/// (`crate::maps::batch`). With it, the reply translations, for the flows
/// that come back to the node that opened them.
pub struct FlowTable {
    data: MapData,
    map: HashMap<MapData, FlowKey, Flow>,
    replies: HashMap<MapData, FlowKey, ReplyNat>,
    held: HashMap<MapData, FlowKey, u64>,
}

impl Dataplane {
    /// A handle of its own on the flow table: a duplicate of the driver's
    /// fd. Not opened by id, which needs CAP_SYS_ADMIN (the chart does not
    /// grant it).
    pub fn flow_table(&self) -> Result<FlowTable> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        let open = |map: &MapData, name: &'static str| {
            let dup = map
                .fd()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| map_err(name)(MapError::IoError(e)))?;
            MapData::from_fd(dup).map_err(map_err(name))
        };
        let flows = self.maps.shared_flows.map();
        let map = HashMap::try_from(Map::LruHashMap(open(flows, names::FLOWS)?))
            .map_err(map_err(names::FLOWS))?;
        let replies = open(self.maps.reply_nat.map(), names::REPLY_NAT)?;
        let replies =
            HashMap::try_from(Map::LruHashMap(replies)).map_err(map_err(names::REPLY_NAT))?;
        let held = open(self.maps.held_flows.map(), names::HELD_FLOWS)?;
        let held = HashMap::try_from(Map::LruHashMap(held)).map_err(map_err(names::HELD_FLOWS))?;
        Ok(FlowTable {
            data: open(flows, names::FLOWS)?,
            map,
            replies,
            held,
        })
    }

    /// The ids an import needs, as programmed now.
    pub fn handoff_ids(&self) -> HandoffIds {
        let cfg = self.maps.config.get(&0, 0).unwrap_or_default();
        HandoffIds {
            services: self
                .state
                .iter()
                .map(|(k, p)| {
                    let service = HandoffService {
                        id: p.info.id,
                        backends: p.backends().collect(),
                        snat_addr: (p.info.flags & SERVICE_F_SNAT != 0).then_some(p.info.snat_addr),
                    };
                    (*k, service)
                })
                .collect(),
            lifetimes: Lifetimes {
                tcp: cfg.tcp_timeout_s,
                tcp_closing: cfg.tcp_closing_timeout_s,
                udp: cfg.udp_timeout_s,
            },
        }
    }

    /// The flows in the flow table that `which` names.
    pub fn handed_flows(&self, which: Handing) -> Result<Vec<HandedFlow>> {
        let lifetimes = self.handoff_ids().lifetimes;
        self.flow_table()?.handed_flows(&lifetimes, which)
    }

    /// Writes flows another node opened into the flow table, under this
    /// node's ids for their service and backend. A flow already in the table
    /// is left as it is: this node's own state wins.
    pub fn import_flows(&mut self, flows: &[HandedFlow]) -> Result<Imported> {
        let ids = self.handoff_ids();
        import(
            &mut self.maps.shared_flows,
            &mut self.maps.reply_nat,
            &mut self.maps.held_flows,
            &ids,
            flows,
        )
    }
}

impl FlowTable {
    /// [`Dataplane::handed_flows`], with the lifetimes taken from it
    /// beforehand ([`HandoffIds::lifetimes`]).
    pub fn handed_flows(&self, lifetimes: &Lifetimes, which: Handing) -> Result<Vec<HandedFlow>> {
        Ok(export(self.entries()?, lifetimes, which))
    }

    /// Every entry, read in batches.
    pub fn entries(&self) -> Result<Vec<(FlowKey, Flow)>> {
        use std::os::fd::AsFd;
        crate::maps::batch::hash_entries(self.data.fd().as_fd())
            .map_err(|e| map_err(names::FLOWS)(MapError::IoError(e)))
    }

    /// [`Dataplane::import_flows`], with ids taken from it beforehand.
    pub fn import_flows(&mut self, ids: &HandoffIds, flows: &[HandedFlow]) -> Result<Imported> {
        import(&mut self.map, &mut self.replies, &mut self.held, ids, flows)
    }

    /// Removes the flows other nodes handed over that are translated with
    /// the SNAT address `snat` (with `udp_only`, its UDP ones); how many.
    /// This node's own flows stay.
    pub fn forget_handed(&mut self, snat: IpAddr, udp_only: bool) -> Result<usize> {
        let mut gone = 0;
        for (k, f) in self.entries()? {
            let theirs = f.flags & FLOW_F_HANDED != 0 && f.snat_port != 0;
            if !theirs
                || words_ip(&f.snat_addr, k.family) != snat
                || (udp_only && k.proto != PROTO_UDP)
            {
                continue;
            }
            match self.map.remove(&k) {
                Ok(()) => gone += 1,
                // Expired (LRU) since the walk.
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(map_err(names::FLOWS)(e)),
            }
        }
        Ok(gone)
    }
}

impl HandoffIds {
    /// How long flows live without traffic, as programmed now.
    pub fn lifetimes(&self) -> Lifetimes {
        self.lifetimes
    }

    /// The SNAT addresses this node's own services translate with.
    pub fn own_snat_addresses(&self) -> BTreeSet<IpAddr> {
        self.services
            .iter()
            .filter_map(|(k, s)| s.snat_addr.map(|a| words_ip(&a, k.family)))
            .collect()
    }
}

/// The flows `which` names, but none that is over for the program: a
/// closed one quiet past `tcp_closing` (on a service with the exchange it
/// takes one quiet for a second as a previous connection's,
/// `CLOSED_STALE_NS`), or an snat one quiet past its lifetime (its port
/// may be another flow's). A busy table holds such flows by the thousand
/// (they wait for the LRU), and they would only weigh every exchange. An
/// open nat flow never expires: however quiet, it keeps its backend.
fn export(entries: Vec<(FlowKey, Flow)>, lifetimes: &Lifetimes, which: Handing) -> Vec<HandedFlow> {
    let now = crate::maps::coarse_now_ns();
    let mut out = Vec::new();
    for (k, f) in entries {
        let idle = now.saturating_sub(f.last_seen_ns);
        let over_after_s = if f.flags & FLOW_F_CLOSED != 0 {
            Some(lifetimes.of(k.proto, true))
        } else {
            (f.snat_port != 0).then(|| lifetimes.of(k.proto, false))
        };
        if over_after_s.is_some_and(|s| idle > s as u64 * 1_000_000_000) {
            continue;
        }
        let wanted = match which {
            Handing::All => true,
            Handing::OpenedHereSince(t) => {
                (f.flags & FLOW_F_HANDED == 0 && f.created_ns >= t)
                    || (f.flags & FLOW_F_CLOSED != 0 && f.last_seen_ns >= t)
            }
        };
        if !wanted {
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
            snat: (f.snat_port != 0).then(|| at(&f.snat_addr, f.snat_port)),
            closed: f.flags & FLOW_F_CLOSED != 0,
            idle_ms: (now.saturating_sub(f.last_seen_ns) / 1_000_000).min(u32::MAX as u64) as u32,
        });
    }
    out
}

/// Writes the flows; for one that comes back to the node that opened it
/// (its SNAT address is this node's: a node that started afresh pulls its
/// flows back from the peers it handed them to), its reply translation
/// too, if absent. Without it the backends' replies to this node's address
/// would reach its kernel, which resets them, and a new flow could take
/// the port. A flow the program holds (`HELD_FLOWS`) is known from now
/// on: its entry goes, so that a later loss of it is held afresh.
fn import(
    map: &mut HashMap<MapData, FlowKey, Flow>,
    replies: &mut HashMap<MapData, FlowKey, ReplyNat>,
    held: &mut HashMap<MapData, FlowKey, u64>,
    ids: &HandoffIds,
    flows: &[HandedFlow],
) -> Result<Imported> {
    let now = crate::maps::coarse_now_ns();
    let mut done = Imported::default();
    for h in flows {
        let skey = service_key(h.vip.ip(), h.vip.port(), h.protocol.number());
        let Some(service) = ids
            .services
            .get(&skey)
            .filter(|s| s.snat_addr.is_some() == h.snat.is_some())
        else {
            done.unknown_service += 1;
            continue;
        };
        let service_id = &service.id;
        let Some(&(_, backend_id)) = service.backends.iter().find(|(a, _)| *a == h.backend) else {
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
            snat_addr: h.snat.map(|a| ip_words(a.ip())).unwrap_or_default(),
            backend_port: h.backend.port().to_be(),
            snat_port: h.snat.map(|a| a.port().to_be()).unwrap_or(0),
            backend_id,
            service_id: *service_id,
            // Not counted in this node's open flows (FLOW_F_COUNTED): its
            // closing must not take one off.
            flags: FLOW_F_HANDED | if h.closed { FLOW_F_CLOSED } else { 0 },
            created_ns: last_seen,
            last_seen_ns: last_seen,
        };
        match map.insert(key, flow, BPF_NOEXIST) {
            Ok(()) => {
                done.added += 1;
                // Absent for most (never held): nothing to do then.
                let _ = held.remove(&key);
            }
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                match map.get(&key, 0) {
                    Ok(old) if superseded(&old, &flow) => {
                        map.insert(key, flow, 0).map_err(map_err(names::FLOWS))?;
                        done.replaced += 1;
                        let _ = held.remove(&key);
                    }
                    // Only a handed copy: a flow of this node's own is
                    // counted open (FLOW_F_COUNTED), and only the program's
                    // own close takes it off.
                    Ok(old)
                        if h.closed
                            && old.flags & (FLOW_F_HANDED | FLOW_F_CLOSED) == FLOW_F_HANDED =>
                    {
                        let closed = Flow {
                            flags: old.flags | FLOW_F_CLOSED,
                            last_seen_ns: old.last_seen_ns.max(flow.last_seen_ns),
                            ..old
                        };
                        map.insert(key, closed, 0).map_err(map_err(names::FLOWS))?;
                        done.closed += 1;
                    }
                    _ => done.present += 1,
                }
            }
            Err(e) => return Err(map_err(names::FLOWS)(e)),
        }
        // A nat flow's replies are translated back by the backend's
        // reverse entry, or the program puts its reply entry back.
        if h.snat.is_some() && Some(flow.snat_addr) == service.snat_addr {
            let (reply_key, reply) = reply_of(&key, &flow, h.closed, &ids.lifetimes, now);
            match replies.insert(reply_key, reply, BPF_NOEXIST) {
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() != Some(libc::EEXIST) =>
                {
                    return Err(map_err(names::REPLY_NAT)(MapError::SyscallError(e)))
                }
                _ => {}
            }
        }
    }
    Ok(done)
}

/// Whether a flow in the table gives way to one handed over for the same
/// client and VIP: they translate differently (another backend or source),
/// or the one here is closed and the handed one open, and the handed one
/// saw its latest packet later. Both a node's own and a handed flow can be
/// stale so: a connection that ended through another node leaves its flow
/// open here, and when the client uses the port again the new
/// connection's flow must win wherever it is handed. The new connection
/// is often translated exactly as the old one (the backend and the SNAT
/// port follow from the tuple): a closed copy that stayed would soon count
/// as a previous connection's (`CLOSED_STALE_NS`), and its packets would
/// be held until picked afresh and reset.
fn superseded(old: &Flow, new: &Flow) -> bool {
    let differs = (
        old.backend_addr,
        old.backend_port,
        old.snat_addr,
        old.snat_port,
    ) != (
        new.backend_addr,
        new.backend_port,
        new.snat_addr,
        new.snat_port,
    );
    let reopened = old.flags & FLOW_F_CLOSED != 0 && new.flags & FLOW_F_CLOSED == 0;
    (differs || reopened) && new.last_seen_ns > old.last_seen_ns
}

/// The reply translation of an SNAT flow, as the program writes it when it
/// opens one: replies from the backend to the SNAT address and port go
/// back as from the VIP to the client. Its route is left for the program
/// to look up (`fib.ifindex` 0).
fn reply_of(
    key: &FlowKey,
    flow: &Flow,
    closed: bool,
    lifetimes: &Lifetimes,
    now: u64,
) -> (FlowKey, ReplyNat) {
    let reply_key = FlowKey {
        src: flow.backend_addr,
        dst: flow.snat_addr,
        sport: flow.backend_port,
        dport: flow.snat_port,
        proto: key.proto,
        family: key.family,
        _pad: [0; 2],
    };
    let seconds = lifetimes.of(key.proto, closed);
    let reply = ReplyNat {
        vip: key.dst,
        client: key.src,
        vport: key.dport,
        cport: key.sport,
        service_id: flow.service_id,
        backend_id: flow.backend_id,
        flags: if closed { REPLY_F_CLOSING } else { 0 },
        expires_ns: now + seconds as u64 * 1_000_000_000,
        fib: Default::default(),
    };
    (reply_key, reply)
}
