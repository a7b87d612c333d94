//! The write side: which ids and table regions a change takes (given back
//! if it fails), and how a service's backends, ranges and table are
//! written before the one `SERVICES` update that makes them live.

use std::net::IpAddr;

use lb_common::{
    maglev, map_names as names, Backend, BackendEntry, BackendLoad, FlowTimes, ServiceInfo,
    ServiceKey, SERVICE_F_CLIENT_AFFINITY, SERVICE_F_FLOW_LIMIT, SERVICE_F_HOLD_UNKNOWN,
    SERVICE_F_LEAST_LOADED, SERVICE_F_SNAT, SERVICE_F_SOURCE_RANGES,
};

use super::{
    alloc::{IdPool, RegionPool},
    ip_words, map_err, zero_stats, DataplaneError, Family, Maps, Result, ServiceSpec,
};

/// Which service ids, backend ids and Maglev regions are taken.
pub(super) struct Ids {
    pub(super) services: IdPool,
    pub(super) backends: IdPool,
    pub(super) regions: RegionPool,
}

/// What one `set_service` call took from [`Ids`]: given back when dropped,
/// unless the change went through ([`Reservation::commit`]).
pub(super) struct Reservation<'a> {
    pub(super) ids: &'a mut Ids,
    pub(super) backends: Vec<u32>,
    pub(super) service: Option<u32>,
    pub(super) region: Option<(u32, u32)>,
}

impl<'a> Reservation<'a> {
    pub(super) fn new(ids: &'a mut Ids) -> Self {
        Self {
            ids,
            backends: Vec::new(),
            service: None,
            region: None,
        }
    }

    pub(super) fn backend_id(&mut self) -> Result<u32> {
        let id = self
            .ids
            .backends
            .alloc()
            .ok_or(DataplaneError::Full(names::BACKENDS))?;
        self.backends.push(id);
        Ok(id)
    }

    pub(super) fn service_id(&mut self) -> Result<u32> {
        let id = self
            .ids
            .services
            .alloc()
            .ok_or(DataplaneError::Full(names::SERVICES))?;
        self.service = Some(id);
        Ok(id)
    }

    /// Takes charge of a region allocated for this change.
    pub(super) fn region(&mut self, base: u32, len: u32) {
        self.region = Some((base, len));
    }

    pub(super) fn commit(mut self) {
        self.backends.clear();
        self.service = None;
        self.region = None;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        for id in self.backends.drain(..) {
            self.ids.backends.free(id);
        }
        if let Some(id) = self.service.take() {
            self.ids.services.free(id);
        }
        if let Some((base, len)) = self.region.take() {
            self.ids.regions.free(base, len);
        }
    }
}

/// Where a service's new table goes and what it is called.
pub(super) struct Placement {
    pub(super) service_id: u32,
    pub(super) base: u32,
    /// The half of the region the new table takes.
    pub(super) active: u32,
    pub(super) table_size: u32,
    pub(super) new_service: bool,
}

impl Maps {
    /// Writes a service's backends, ranges and inactive table, then flips
    /// its `SERVICES` entry to them: the one write packets see.
    pub(super) fn write_service(
        &mut self,
        spec: &ServiceSpec,
        key: &ServiceKey,
        p: &Placement,
        ids: &[u32],
        fresh: &[u32],
    ) -> Result<ServiceInfo> {
        // The ranges go under the scope of the table about to go live.
        let (base, active, m) = (p.base, p.active, p.table_size);
        let scope = base + active * m;
        let ranges = spec.source_ranges.as_deref().unwrap_or_default();
        if !self.ranges.fits(scope, ranges.len()) {
            return Err(DataplaneError::Full(names::SOURCE_RANGES));
        }
        self.ranges
            .write(scope, ranges)
            .map_err(map_err(names::SOURCE_RANGES))?;
        for (b, id) in spec.backends.iter().zip(ids) {
            let value = Backend {
                addr: ip_words(b.addr.ip()),
                port: b.addr.port().to_be(),
                family: Family::of(b.addr.ip()).number(),
                _pad: 0,
            };
            // A fresh entry: the data path looks the route up again.
            let entry = BackendEntry {
                backend: value,
                ..Default::default()
            };
            self.backends
                .set(*id, entry, 0)
                .map_err(map_err(names::BACKENDS))?;
        }
        for &id in fresh {
            zero_stats(&mut self.backend_stats, id).map_err(map_err(names::BACKEND_STATS))?;
            zero_stats(&mut self.backend_closed, id).map_err(map_err(names::BACKEND_CLOSED))?;
            self.flow_times
                .set(id, FlowTimes::default(), 0)
                .map_err(map_err(names::FLOW_TIMES))?;
            self.backend_load
                .set(id, BackendLoad::default(), 0)
                .map_err(map_err(names::BACKEND_LOAD))?;
            self.backend_active
                .set(id, 0, 0)
                .map_err(map_err(names::BACKEND_ACTIVE))?;
        }
        if p.new_service {
            zero_stats(&mut self.service_stats, p.service_id)
                .map_err(map_err(names::SERVICE_STATS))?;
        }
        // Before the flip, like the backends: the flag and the limit go
        // live together.
        if let Some(limit) = spec.new_flow_limit {
            self.flow_limits
                .set(p.service_id, limit.to_map(), 0)
                .map_err(map_err(names::FLOW_LIMITS))?;
        }
        let mb: Vec<_> = spec
            .backends
            .iter()
            .map(|b| {
                let mut addr = [0u8; 16];
                match b.addr.ip() {
                    IpAddr::V4(a) => addr[..4].copy_from_slice(&a.octets()),
                    IpAddr::V6(a) => addr = a.octets(),
                }
                maglev::MaglevBackend {
                    addr,
                    port: b.addr.port(),
                    weight: b.weight,
                }
            })
            .collect();
        let table = maglev::build_table(&mb, m).map_err(|e| DataplaneError::InvalidService {
            service: spec.name(),
            reason: e.to_string(),
        })?;
        let live = !table.is_empty();
        if live {
            let slot = base + active * m;
            self.maglev
                .write(slot, table.iter().map(|&i| ids[i as usize]))
                .map_err(DataplaneError::Mmap)?;
        }
        let info = ServiceInfo {
            id: p.service_id,
            flags: service_flags(spec),
            table_base: base,
            table_size: m,
            active,
            backend_count: if live {
                mb.iter().filter(|b| b.weight > 0).count() as u32
            } else {
                0
            },
            snat_addr: spec.snat.map(ip_words).unwrap_or_default(),
        };
        // The flip: one whole-value replacement of the service entry.
        self.services
            .insert(key, info, 0)
            .map_err(map_err(names::SERVICES))?;
        Ok(info)
    }
}

/// `ServiceInfo::flags` for a spec.
fn service_flags(spec: &ServiceSpec) -> u32 {
    let mut flags = 0;
    if spec.snat.is_some() {
        flags |= SERVICE_F_SNAT;
    }
    if spec.client_affinity {
        flags |= SERVICE_F_CLIENT_AFFINITY;
    }
    if spec.source_ranges.is_some() {
        flags |= SERVICE_F_SOURCE_RANGES;
    }
    if spec.least_loaded {
        flags |= SERVICE_F_LEAST_LOADED;
    }
    if spec.new_flow_limit.is_some() {
        flags |= SERVICE_F_FLOW_LIMIT;
    }
    if spec.hold_unknown_flows {
        flags |= SERVICE_F_HOLD_UNKNOWN;
    }
    flags
}
