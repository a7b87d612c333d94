//! Who answers for a VIP: a rule every node computes the same from the same
//! membership, so that no election is needed. Rendezvous hashing: each VIP
//! goes to the member with the highest hash of (member name, VIP). Owners
//! spread evenly, and when a member leaves only its VIPs move.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// Which nodes may own a VIP: `None` any member; `Some(nodes)` only those
/// (`externalTrafficPolicy: Local`: the nodes with ready local endpoints).
pub type Eligible = Option<BTreeSet<String>>;

/// The owner of `vip` among `members`, or `None` if no member may own it.
pub fn owner<'m>(
    vip: IpAddr,
    members: &'m BTreeSet<String>,
    eligible: &Eligible,
) -> Option<&'m str> {
    members
        .iter()
        .filter(|m| eligible.as_ref().is_none_or(|e| e.contains(*m)))
        .max_by_key(|m| (score(m, vip), m.as_str()))
        .map(String::as_str)
}

/// The VIPs `me` owns when it sees `members` (itself included).
pub fn owned_by(
    me: &str,
    members: &BTreeSet<String>,
    vips: &BTreeMap<IpAddr, Eligible>,
) -> BTreeSet<IpAddr> {
    vips.iter()
        .filter(|(vip, eligible)| owner(**vip, members, eligible) == Some(me))
        .map(|(vip, _)| *vip)
        .collect()
}

/// FNV-1a over the name and the address, then a 64-bit finalizer
/// (splitmix64) so that near names and addresses score far apart. Fixed
/// here, not `std`'s hasher, so that nodes of different builds agree.
fn score(name: &str, vip: IpAddr) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let octets: Vec<u8> = match vip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    for b in name.bytes().chain([0]).chain(octets) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    fn vips(n: u8) -> BTreeMap<IpAddr, Eligible> {
        (1..=n)
            .map(|i| (IpAddr::from([192, 0, 2, i]), None))
            .collect()
    }

    #[test]
    fn every_vip_has_exactly_one_owner_and_owners_spread() {
        let all = nodes(&["node-a", "node-b", "node-c"]);
        let v = vips(90);
        let mut total = 0;
        for n in &all {
            let mine = owned_by(n, &all, &v).len();
            assert!((18..=42).contains(&mine), "{n} owns {mine} of 90");
            total += mine;
        }
        assert_eq!(total, 90);
    }

    #[test]
    fn a_member_leaving_moves_only_its_vips() {
        let all = nodes(&["node-a", "node-b", "node-c"]);
        let v = vips(60);
        let without_c = nodes(&["node-a", "node-b"]);
        for n in ["node-a", "node-b"] {
            let before = owned_by(n, &all, &v);
            let after = owned_by(n, &without_c, &v);
            assert!(before.is_subset(&after), "{n} lost a VIP when node-c left");
        }
        assert!(owned_by("node-c", &without_c, &v).is_empty());
    }

    #[test]
    fn only_eligible_nodes_own() {
        let all = nodes(&["node-a", "node-b", "node-c"]);
        let vip = IpAddr::from([192, 0, 2, 7]);
        let only_b = Some(nodes(&["node-b"]));
        assert_eq!(owner(vip, &all, &only_b), Some("node-b"));
        let gone = Some(nodes(&["node-x"]));
        assert_eq!(owner(vip, &all, &gone), None);
    }

    #[test]
    fn every_node_computes_the_same_owner_whatever_the_order() {
        let vip: IpAddr = "fd00::50".parse().unwrap();
        let a = nodes(&["c", "a", "b"]);
        let b = nodes(&["b", "c", "a"]);
        assert_eq!(owner(vip, &a, &None), owner(vip, &b, &None));
    }
}
