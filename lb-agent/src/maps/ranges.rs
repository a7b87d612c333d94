//! `SOURCE_RANGES` read back: which client prefixes a service's scope
//! holds, and whether one admits an address, as the program matches it.

use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    MapData, MapError,
};
use ipnet::IpNet;
use lb_common::{
    net::{ip_words, words_ip},
    RangeKey, FAMILY_V6, RANGE_LOOKUP_PREFIX,
};

/// The ranges a map holds under `scope`, for a service of `family`, sorted
/// (read-only: lbctl uses it on the pinned map).
pub fn read_ranges(
    map: &LpmTrie<MapData, RangeKey, u8>,
    scope: u32,
    family: u8,
) -> Result<Vec<IpNet>, MapError> {
    let mut out = Vec::new();
    for k in map.keys() {
        let k = k?;
        if u32::from_be_bytes(k.data().scope) == scope {
            out.extend(net_of(&k, family));
        }
    }
    out.sort();
    Ok(out)
}

/// Whether `scope`'s ranges admit the client `addr` (stored words): the
/// kernel's longest-prefix match, as the data plane does it.
pub fn admits(
    map: &LpmTrie<MapData, RangeKey, u8>,
    scope: u32,
    addr: [u32; 4],
) -> Result<bool, MapError> {
    let k = Key::new(
        RANGE_LOOKUP_PREFIX,
        RangeKey {
            scope: scope.to_be_bytes(),
            addr,
        },
    );
    match map.get(&k, 0) {
        Ok(_) => Ok(true),
        Err(MapError::KeyNotFound) => Ok(false),
        Err(e) => Err(e),
    }
}

pub(crate) fn net_of(k: &Key<RangeKey>, family: u8) -> Option<IpNet> {
    let bits = if family == FAMILY_V6 { 128 } else { 32 };
    let prefix = k.prefix_len().checked_sub(32).filter(|p| *p <= bits)?;
    IpNet::new(words_ip(&k.data().addr, family), prefix as u8).ok()
}

pub(crate) fn key(scope: u32, net: &IpNet) -> Key<RangeKey> {
    Key::new(
        32 + u32::from(net.prefix_len()),
        RangeKey {
            scope: scope.to_be_bytes(),
            addr: ip_words(net.network()),
        },
    )
}
