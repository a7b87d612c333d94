//! The running state, read and reset: counters, the flow tables, the live
//! Maglev tables.

use super::*;

impl Dataplane {
    /// Packets per reason, summed over CPUs.
    pub fn reason_counts(&self) -> Result<[u64; REASON_COUNT as usize]> {
        let mut out = [0u64; REASON_COUNT as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            let v = self
                .maps
                .reason_stats
                .get(&(i as u32), 0)
                .map_err(map_err(names::REASON_STATS))?;
            *slot = v.iter().sum();
        }
        Ok(out)
    }

    /// Packets per reason, per CPU: `[cpu][reason]`.
    pub fn reason_counts_per_cpu(&self) -> Result<Vec<[u64; REASON_COUNT as usize]>> {
        let mut out: Vec<[u64; REASON_COUNT as usize]> = Vec::new();
        for r in Reason::ALL {
            let v = self
                .maps
                .reason_stats
                .get(&(r as u32), 0)
                .map_err(map_err(names::REASON_STATS))?;
            if out.is_empty() {
                out = vec![[0; REASON_COUNT as usize]; v.len()];
            }
            for (cpu, c) in v.iter().enumerate() {
                out[cpu][r as usize] = *c;
            }
        }
        Ok(out)
    }

    pub fn service_stats(&self, id: u32) -> Result<TrafficStats> {
        sum_stats(&self.maps.service_stats, id).map_err(map_err(names::SERVICE_STATS))
    }

    pub fn backend_stats(&self, id: u32) -> Result<TrafficStats> {
        sum_stats(&self.maps.backend_stats, id).map_err(map_err(names::BACKEND_STATS))
    }

    /// Every connection-table entry, with the CPU that holds it.
    pub fn conntrack(&self) -> Result<Vec<(FlowKey, usize, Flow)>> {
        let mut out = Vec::new();
        for item in self.maps.conntrack.iter() {
            let (k, per_cpu) = item.map_err(map_err(names::CONNTRACK))?;
            for (cpu, f) in per_cpu.iter().enumerate() {
                if f.created_ns != 0 {
                    out.push((k, cpu, *f));
                }
            }
        }
        Ok(out)
    }

    /// Every entry of the shared flow table.
    pub fn shared_flows(&self) -> Result<Vec<(FlowKey, Flow)>> {
        self.maps
            .shared_flows
            .iter()
            .map(|r| r.map_err(map_err(names::SHARED_FLOWS)))
            .collect()
    }

    pub fn reply_entries(&self) -> Result<Vec<(FlowKey, ReplyNat)>> {
        self.maps
            .reply_nat
            .iter()
            .map(|r| r.map_err(map_err(names::REPLY_NAT)))
            .collect()
    }

    /// Clears flows, reply translations and counters (between test cases).
    pub fn clear_dynamic_state(&mut self) -> Result<()> {
        let keys: Vec<_> = self
            .maps
            .conntrack
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::CONNTRACK))?;
        for k in keys {
            let _ = self.maps.conntrack.remove(&k);
        }
        let keys: Vec<_> = self
            .maps
            .shared_flows
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::SHARED_FLOWS))?;
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
        let services: BTreeSet<u32> = self.state.values().map(|p| p.info.id).collect();
        for id in services {
            zero_stats(&mut self.maps.service_stats, id).map_err(map_err(names::SERVICE_STATS))?;
        }
        let backends: BTreeSet<u32> = self
            .state
            .values()
            .flat_map(|p| p.backend_ids.iter().map(|x| x.1))
            .collect();
        for id in backends {
            zero_stats(&mut self.maps.backend_stats, id).map_err(map_err(names::BACKEND_STATS))?;
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
        let info = self.service_info(key)?;
        if info.backend_count == 0 {
            return Ok(Vec::new());
        }
        self.maps
            .maglev
            .read(
                info.table_base + info.active * info.table_size,
                info.table_size,
            )
            .map_err(DataplaneError::Mmap)
    }
}
