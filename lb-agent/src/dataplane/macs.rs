//! The MACs of the attached interfaces (`IFACE_MACS`): the program acts
//! only on unicast frames addressed to the receiving interface
//! (lb-ebpf/src/mac.rs). A slot per `ifindex % IFACE_SLOTS`; an interface
//! whose slot another holds goes to `IFACE_MACS_SPILL`.

use std::collections::BTreeMap;

use aya::maps::{Array, HashMap, MapData, MapError};
use lb_common::{map_names as names, IfaceMac, IFACE_SLOTS};

use super::{map_err, Result};

pub(super) struct InterfaceMacs {
    slots: Array<MapData, IfaceMac>,
    spill: HashMap<MapData, u32, IfaceMac>,
    /// As written: interface name -> (ifindex, MAC).
    known: BTreeMap<String, (u32, [u8; 6])>,
    /// `IFACE_F_*` per interface name, written with its MAC.
    flags: BTreeMap<String, u8>,
}

fn slot_of(ifindex: u32) -> u32 {
    ifindex & (IFACE_SLOTS - 1)
}

impl InterfaceMacs {
    pub(super) fn new(
        slots: Array<MapData, IfaceMac>,
        spill: HashMap<MapData, u32, IfaceMac>,
    ) -> Self {
        Self {
            slots,
            spill,
            known: BTreeMap::new(),
            flags: BTreeMap::new(),
        }
    }

    /// Reads `iface`'s index and MAC and writes them if they changed. An
    /// interface without a MAC (a tunnel) is left unnamed: every frame on
    /// it is taken as for this node.
    pub(super) fn learn(&mut self, iface: &str) -> Result<bool> {
        let flags = self.flags.get(iface).copied().unwrap_or(0);
        self.learn_with(iface, flags)
    }

    /// As [`Self::learn`], with the interface's `IFACE_F_*` flags
    /// (rewritten when they changed).
    pub(super) fn learn_with(&mut self, iface: &str, flags: u8) -> Result<bool> {
        let old_flags = self.flags.insert(iface.to_string(), flags).unwrap_or(0);
        if old_flags != flags {
            // Written afresh below, with the new flags.
            self.forget_written(iface)?;
        }
        let now = crate::netif::ifindex(iface)
            .and_then(|index| Some((index, crate::netif::interface_mac(iface)?)));
        let before = self.known.get(iface).copied();
        if now == before {
            return Ok(false);
        }
        if let Some((index, _)) = before {
            self.remove(index)?;
            self.known.remove(iface);
        }
        if let Some((index, mac)) = now {
            self.write(index, mac, flags)?;
            self.known.insert(iface.to_string(), (index, mac));
        }
        Ok(true)
    }

    /// Forgets `iface` (it was detached): no longer re-read, its slot freed.
    pub(super) fn forget(&mut self, iface: &str) -> Result<()> {
        self.flags.remove(iface);
        self.forget_written(iface)
    }

    fn forget_written(&mut self, iface: &str) -> Result<()> {
        if let Some((index, _)) = self.known.get(iface).copied() {
            self.remove(index)?;
            self.known.remove(iface);
        }
        Ok(())
    }

    /// Reads every known interface again: the names whose index or MAC changed.
    pub(super) fn refresh(&mut self) -> Result<Vec<String>> {
        let names: Vec<String> = self.known.keys().cloned().collect();
        let mut changed = Vec::new();
        for name in names {
            if self.learn(&name)? {
                changed.push(name);
            }
        }
        Ok(changed)
    }

    fn write(&mut self, ifindex: u32, mac: [u8; 6], flags: u8) -> Result<()> {
        let entry = IfaceMac {
            ifindex,
            mac,
            flags,
            _pad: [0; 5],
        };
        let slot = slot_of(ifindex);
        let held = self
            .slots
            .get(&slot, 0)
            .map_err(map_err(names::IFACE_MACS))?;
        if held.ifindex == 0 || held.ifindex == ifindex {
            self.slots
                .set(slot, entry, 0)
                .map_err(map_err(names::IFACE_MACS))
        } else {
            self.spill
                .insert(ifindex, entry, 0)
                .map_err(map_err(names::IFACE_MACS_SPILL))
        }
    }

    fn remove(&mut self, ifindex: u32) -> Result<()> {
        let slot = slot_of(ifindex);
        let held = self
            .slots
            .get(&slot, 0)
            .map_err(map_err(names::IFACE_MACS))?;
        if held.ifindex != ifindex {
            return match self.spill.remove(&ifindex) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(map_err(names::IFACE_MACS_SPILL)(e)),
            };
        }
        // A spilled interface of the same slot moves in, so that the slot
        // never reads empty while one of its interfaces is known.
        let heir = self
            .known
            .iter()
            .find(|(_, (i, _))| *i != ifindex && slot_of(*i) == slot)
            .map(|(name, &(i, mac))| (i, mac, self.flags.get(name).copied().unwrap_or(0)));
        let value = match heir {
            Some((i, mac, flags)) => IfaceMac {
                ifindex: i,
                mac,
                flags,
                _pad: [0; 5],
            },
            None => IfaceMac::default(),
        };
        self.slots
            .set(slot, value, 0)
            .map_err(map_err(names::IFACE_MACS))?;
        if let Some((i, _, _)) = heir {
            match self.spill.remove(&i) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err(names::IFACE_MACS_SPILL)(e)),
            }
        }
        Ok(())
    }
}
