//! `SOURCE_RANGES`: the client prefixes each service admits
//! (`loadBalancerSourceRanges`), kept in an LPM trie under the service's
//! scope (`ServiceInfo::range_scope`, the slot of its live Maglev table).
//!
//! A change writes the new ranges under the scope of the table about to go
//! live; the `SERVICES` flip switches ranges and table together. Entries of
//! retired scopes stay until the scope is written again or its table region
//! is released, so a packet that read the old `ServiceInfo` still finds them.

use std::collections::BTreeMap;

use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    MapData, MapError,
};
use ipnet::IpNet;
use lb_common::{RangeKey, MAX_SOURCE_RANGES};

use crate::maps::ranges::{key, net_of};

pub struct SourceRanges {
    map: LpmTrie<MapData, RangeKey, u8>,
    /// What the map holds, by scope.
    at: BTreeMap<u32, Vec<Key<RangeKey>>>,
}

impl SourceRanges {
    /// Wraps the map and reads what a previous agent left in it.
    pub fn open(map: LpmTrie<MapData, RangeKey, u8>) -> Result<Self, MapError> {
        let mut at: BTreeMap<u32, Vec<Key<RangeKey>>> = BTreeMap::new();
        for k in map.keys() {
            let k = k?;
            at.entry(u32::from_be_bytes(k.data().scope))
                .or_default()
                .push(k);
        }
        Ok(Self { map, at })
    }

    fn len(&self) -> usize {
        self.at.values().map(Vec::len).sum()
    }

    /// Whether `count` more ranges fit once `scope`'s entries are replaced.
    pub fn fits(&self, scope: u32, count: usize) -> bool {
        let replaced = self.at.get(&scope).map_or(0, Vec::len);
        self.len() - replaced + count <= MAX_SOURCE_RANGES as usize
    }

    /// Makes `scope` hold exactly `ranges` (networks, host bits clear).
    pub fn write(&mut self, scope: u32, ranges: &[IpNet]) -> Result<(), MapError> {
        self.clear(scope)?;
        let mut written = Vec::with_capacity(ranges.len());
        for net in ranges {
            let k = key(scope, net);
            let res = self.map.insert(&k, 1u8, 0);
            written.push(k);
            if let Err(e) = res {
                self.at.insert(scope, written);
                return Err(e);
            }
        }
        if !written.is_empty() {
            self.at.insert(scope, written);
        }
        Ok(())
    }

    /// Removes every entry of `scope`.
    pub fn clear(&mut self, scope: u32) -> Result<(), MapError> {
        if let Some(keys) = self.at.remove(&scope) {
            for (i, k) in keys.iter().enumerate() {
                match self.map.remove(k) {
                    Ok(()) | Err(MapError::KeyNotFound) => {}
                    Err(e) => {
                        self.at.insert(scope, keys[i..].to_vec());
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes the entries of every scope in `[start, start + len)` (a table
    /// region being released).
    pub fn clear_region(&mut self, start: u32, len: u32) -> Result<(), MapError> {
        let scopes: Vec<u32> = self
            .at
            .range(start..start.saturating_add(len))
            .map(|(s, _)| *s)
            .collect();
        scopes.into_iter().try_for_each(|s| self.clear(s))
    }

    /// Removes the entries of every scope not in `live` (after adoption).
    pub fn retain(&mut self, live: &[u32]) -> Result<(), MapError> {
        let stale: Vec<u32> = self
            .at
            .keys()
            .filter(|s| !live.contains(s))
            .copied()
            .collect();
        stale.into_iter().try_for_each(|s| self.clear(s))
    }

    /// The ranges `scope` holds, for a service of the family `family`.
    pub fn ranges(&self, scope: u32, family: u8) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = self
            .at
            .get(&scope)
            .into_iter()
            .flatten()
            .filter_map(|k| net_of(k, family))
            .collect();
        out.sort();
        out
    }
}
