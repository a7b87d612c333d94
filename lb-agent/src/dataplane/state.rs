//! The running state, read and reset: counters, the flow table, the live
//! Maglev tables.

use super::*;

impl Dataplane {
    /// Packets per reason, summed over CPUs.
    pub fn reason_counts(&self) -> Result<reads::ReasonCounts> {
        reads::reason_counts(&self.maps.reason_stats).map_err(map_err(names::REASON_STATS))
    }

    /// Packets per reason, per CPU: `[cpu][reason]`.
    pub fn reason_counts_per_cpu(&self) -> Result<Vec<reads::ReasonCounts>> {
        reads::reason_counts_per_cpu(&self.maps.reason_stats).map_err(map_err(names::REASON_STATS))
    }

    pub fn service_stats(&self, id: u32) -> Result<TrafficStats> {
        reads::traffic(&self.maps.service_stats, id).map_err(map_err(names::SERVICE_STATS))
    }

    pub fn backend_stats(&self, id: u32) -> Result<TrafficStats> {
        reads::traffic(&self.maps.backend_stats, id).map_err(map_err(names::BACKEND_STATS))
    }

    /// Flows of a backend id opened and closed so far (by its client's FIN
    /// or RST), summed over CPUs; opened minus closed is its open flows,
    /// less those that vanished without a FIN (`open_flows_by_backend`).
    pub fn backend_flows(&self, id: u32) -> Result<(u64, u64)> {
        let opened = self.backend_stats(id)?.new_flows;
        let closed = reads::flow_event(&self.maps.backend_closed, id)
            .map_err(map_err(names::BACKEND_CLOSED))?;
        Ok((opened, closed))
    }

    /// How long a backend id's closed flows were open (`FLOW_TIMES`).
    pub fn backend_flow_times(&self, id: u32) -> Result<FlowTimes> {
        self.maps
            .flow_times
            .get(&id, 0)
            .map_err(map_err(names::FLOW_TIMES))
    }

    /// Records the load-aware controller's decision for a backend id (read
    /// by `lbctl backends`).
    pub fn set_backend_load(&mut self, id: u32, load: &BackendLoad) -> Result<()> {
        self.maps
            .backend_load
            .set(id, *load, 0)
            .map_err(map_err(names::BACKEND_LOAD))
    }

    /// A backend's shared open-flow count (`BACKEND_ACTIVE`).
    pub fn backend_active(&self, id: u32) -> Result<i64> {
        self.maps
            .backend_active
            .get(&id, 0)
            .map_err(map_err(names::BACKEND_ACTIVE))
    }

    /// Sets a backend's shared open-flow count (`BACKEND_ACTIVE`), which
    /// new flows of least-loaded services are placed by, to `open`: the
    /// count less the drift a table walk proved (`load_aware::walk_drift`),
    /// so that flows that vanished without a FIN or RST stop counting. A
    /// flow opened or closed between the read and this write is lost to it.
    pub fn set_backend_active(&mut self, id: u32, open: u64) -> Result<()> {
        self.maps
            .backend_active
            .set(id, open as i64, 0)
            .map_err(map_err(names::BACKEND_ACTIVE))
    }

    /// L2 mode: answer ARP/NDP on `ifindex` with `mac` until
    /// `valid_until_ns` (`maps::monotonic_now_ns`'s clock).
    pub fn set_l2_iface(&mut self, ifindex: u32, mac: [u8; 6], valid_until_ns: u64) -> Result<()> {
        let v = L2Iface {
            mac,
            _pad: [0; 2],
            valid_until_ns,
        };
        self.maps
            .l2_ifaces
            .insert(ifindex, v, 0)
            .map_err(map_err(names::L2_IFACES))
    }

    /// L2 mode: the interfaces answered on, by ifindex.
    pub fn l2_ifaces(&self) -> Result<BTreeMap<u32, L2Iface>> {
        let mut out = BTreeMap::new();
        for item in self.maps.l2_ifaces.iter() {
            let (k, v) = item.map_err(map_err(names::L2_IFACES))?;
            out.insert(k, v);
        }
        Ok(out)
    }

    pub fn remove_l2_iface(&mut self, ifindex: u32) -> Result<()> {
        match self.maps.l2_ifaces.remove(&ifindex) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(map_err(names::L2_IFACES)(e)),
        }
    }

    /// L2 mode: the VIPs this node answers for, and on which interface.
    pub fn l2_vips(&self) -> Result<BTreeMap<IpAddr, u32>> {
        Ok(reads::l2_vips(&self.maps.l2_vips)
            .map_err(map_err(names::L2_VIPS))?
            .into_iter()
            .collect())
    }

    /// L2 mode: this node now answers for `vip` on `ifindex`.
    pub fn set_l2_vip(&mut self, vip: IpAddr, ifindex: u32) -> Result<()> {
        self.maps
            .l2_vips
            .insert(l2_key(vip), L2Vip { ifindex, _pad: 0 }, 0)
            .map_err(map_err(names::L2_VIPS))
    }

    /// L2 mode: this node no longer answers for `vip`.
    pub fn remove_l2_vip(&mut self, vip: IpAddr) -> Result<()> {
        match self.maps.l2_vips.remove(&l2_key(vip)) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(map_err(names::L2_VIPS)(e)),
        }
    }

    /// The flow table's open flows per backend id: not closed, and seen
    /// within `active`. Walks the whole table (in batches: about 0.3 µs an
    /// entry), so the load controller calls it seldom and counts between
    /// walks.
    pub fn open_flows_by_backend(&self, active: Duration) -> Result<BTreeMap<u32, u64>> {
        let now = reads::coarse_now_ns();
        let mut out = BTreeMap::new();
        for (_, f) in self.flow_table()?.entries()? {
            let fresh = now.saturating_sub(f.last_seen_ns) <= active.as_nanos() as u64;
            if f.flags & FLOW_F_CLOSED == 0 && fresh {
                *out.entry(f.backend_id).or_default() += 1;
            }
        }
        Ok(out)
    }

    /// TCP packets (not SYNs) whose flow was not in the flow table, summed
    /// over CPUs: see `lb_common::FLOW_EVENT_REPICKED`.
    pub fn flows_repicked(&self) -> Result<u64> {
        reads::flow_event(&self.maps.flow_events, FLOW_EVENT_REPICKED)
            .map_err(map_err(names::FLOW_EVENTS))
    }

    /// Packets forwarded in flood mode without a flow-table entry, summed
    /// over CPUs: see `lb_common::FLOW_EVENT_UNTRACKED`.
    pub fn flows_untracked(&self) -> Result<u64> {
        reads::flow_event(&self.maps.flow_events, FLOW_EVENT_UNTRACKED)
            .map_err(map_err(names::FLOW_EVENTS))
    }

    /// How many flows the flow table holds before it evicts the least
    /// recently used.
    pub fn flow_table_capacity(&self) -> u32 {
        self.maps.flow_table_entries
    }

    /// Every entry of the flow table.
    pub fn shared_flows(&self) -> Result<Vec<(FlowKey, Flow)>> {
        reads::entries(&self.maps.shared_flows).map_err(map_err(names::FLOWS))
    }

    pub fn reply_entries(&self) -> Result<Vec<(FlowKey, ReplyNat)>> {
        reads::entries(&self.maps.reply_nat).map_err(map_err(names::REPLY_NAT))
    }

    /// Clears flows, reply translations and counters (between test cases).
    pub fn clear_dynamic_state(&mut self) -> Result<()> {
        let keys: Vec<_> = self
            .maps
            .shared_flows
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::FLOWS))?;
        for k in keys {
            let _ = self.maps.shared_flows.remove(&k);
        }
        let keys: Vec<_> = self
            .maps
            .reply_nat
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::REPLY_NAT))?;
        for k in keys {
            let _ = self.maps.reply_nat.remove(&k);
        }
        for i in 0..REASON_COUNT {
            zero_stats(&mut self.maps.reason_stats, i).map_err(map_err(names::REASON_STATS))?;
        }
        for i in 0..FLOW_EVENT_COUNT {
            zero_stats(&mut self.maps.flow_events, i).map_err(map_err(names::FLOW_EVENTS))?;
        }
        let services: BTreeSet<u32> = self.state.values().map(|p| p.info.id).collect();
        for id in services {
            zero_stats(&mut self.maps.service_stats, id).map_err(map_err(names::SERVICE_STATS))?;
        }
        let backends: BTreeSet<u32> = self
            .state
            .values()
            .flat_map(|p| p.backend_ids.iter().copied())
            .collect();
        for id in backends {
            zero_stats(&mut self.maps.backend_stats, id).map_err(map_err(names::BACKEND_STATS))?;
            zero_stats(&mut self.maps.backend_closed, id)
                .map_err(map_err(names::BACKEND_CLOSED))?;
            self.maps
                .flow_times
                .set(id, FlowTimes::default(), 0)
                .map_err(map_err(names::FLOW_TIMES))?;
        }
        Ok(())
    }

    /// Inserts a reply translation directly (tests of reply handling).
    pub fn insert_reply(&mut self, key: &FlowKey, value: &ReplyNat) -> Result<()> {
        self.maps
            .reply_nat
            .insert(key, value, 0)
            .map_err(map_err(names::REPLY_NAT))
    }

    /// Removes a reply translation (tests of reply handling).
    pub fn remove_reply(&mut self, key: &FlowKey) -> Result<()> {
        self.maps
            .reply_nat
            .remove(key)
            .map_err(map_err(names::REPLY_NAT))
    }

    /// The live Maglev table of a service (backend ids).
    pub fn live_table(&self, key: &ServiceKey) -> Result<Vec<u32>> {
        self.maps
            .maglev
            .live_table(&self.service_info(key)?)
            .map_err(DataplaneError::Mmap)
    }
}

fn l2_key(vip: IpAddr) -> L2VipKey {
    L2VipKey {
        addr: ip_words(vip),
        family: Family::of(vip).number(),
        _pad: [0; 3],
    }
}
