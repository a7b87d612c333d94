//! `BACKEND_REVERSE`: the reverse translation of every backend that belongs
//! to exactly one NAT-mode service. With it a new NAT flow writes one map
//! entry (its flow), and any node can translate a flow's replies, including
//! a flow that another node of an ECMP group forwarded. A backend address
//! and port shared by two NAT services is ambiguous from its replies alone:
//! those flows keep a per-flow reply entry, made with the flow.

use std::collections::BTreeMap;

use aya::maps::MapError;
use lb_common::{map_names as names, net::ip_words, ReverseKey, ReverseNat};

use super::{map_err, Dataplane, Result};

impl Dataplane {
    /// What `BACKEND_REVERSE` should hold for the programmed services.
    fn wanted_reverse(&self) -> BTreeMap<ReverseKey, ReverseNat> {
        let mut seen: BTreeMap<ReverseKey, Option<ReverseNat>> = BTreeMap::new();
        for (key, p) in self.state.iter().filter(|(_, p)| p.spec.snat.is_none()) {
            for (addr, id) in &p.backend_ids {
                let rk = ReverseKey {
                    addr: ip_words(addr.ip()),
                    port: addr.port().to_be(),
                    proto: key.proto,
                    family: key.family,
                };
                let v = ReverseNat {
                    vip: key.addr,
                    vport: key.port,
                    _pad: 0,
                    service_id: p.info.id,
                    backend_id: *id,
                };
                // A second service with this backend makes it ambiguous.
                seen.entry(rk).and_modify(|e| *e = None).or_insert(Some(v));
            }
        }
        seen.into_iter()
            .filter_map(|(k, v)| Some((k, v?)))
            .collect()
    }

    /// Brings `BACKEND_REVERSE` to what the services need; called after
    /// every service change.
    pub(super) fn sync_reverse(&mut self) -> Result<()> {
        let want = self.wanted_reverse();
        let stale: Vec<ReverseKey> = self
            .reverse
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        for k in stale {
            match self.maps.backend_reverse.remove(&k) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err(names::BACKEND_REVERSE)(e)),
            }
            self.reverse.remove(&k);
        }
        for (k, v) in want {
            if self.reverse.get(&k) != Some(&v) {
                self.maps
                    .backend_reverse
                    .insert(k, v, 0)
                    .map_err(map_err(names::BACKEND_REVERSE))?;
                self.reverse.insert(k, v);
            }
        }
        Ok(())
    }

    /// On adoption: takes the pinned entries as the current ones, then
    /// corrects them to the adopted services.
    pub(super) fn adopt_reverse(&mut self) -> Result<()> {
        self.reverse = self
            .maps
            .backend_reverse
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(names::BACKEND_REVERSE))?;
        self.sync_reverse()
    }

    /// The reverse translations as programmed (lbctl, tests).
    pub fn reverse_entries(&self) -> &BTreeMap<ReverseKey, ReverseNat> {
        &self.reverse
    }
}
