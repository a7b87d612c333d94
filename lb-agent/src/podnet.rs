//! Pod-side interfaces: the host side of this node's Pods (a CNI bridge
//! such as `cni0`, or a Pod's own veth with routed CNIs). Replies of local
//! Pods enter the node there and never cross an uplink's XDP program, so
//! the agent attaches the program to them too (docs/datapath.md,
//! "Pod-side interfaces").
//!
//! Which ones (`pod_interfaces: auto`): the interfaces the main routing
//! table reaches a backend through directly (no gateway), apart from the
//! uplinks, loopback, tunnels and interfaces without a MAC. A backend on
//! this node is such a route's destination (`10.244.1.0/24 dev cni0`);
//! one on another node is reached through a gateway (flannel's
//! `10.244.2.0/24 via 10.244.2.0 dev flannel.1 onlink`, host-gw's `via`
//! the node) or the default route. Decided again every half second, so a
//! bridge the CNI creates with the first Pod, after the agent started, is
//! taken within that time, and one deleted is let go.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::netif::MainRoute;

/// Drivers of tunnels and overlays (Ethernet ones have MACs too): what
/// arrives there comes from other nodes, not from this node's Pods.
const TUNNEL_DRIVERS: [&str; 10] = [
    "vxlan",
    "geneve",
    "ipip",
    "ip_gre",
    "ip6_gre",
    "ip6_tunnel",
    "sit",
    "wireguard",
    "ip_vti",
    "tun",
];

/// `pod_interfaces` in the config file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodInterfaces {
    /// None: only the uplinks carry the program.
    None,
    /// Found by the agent (this module).
    Auto,
    /// These, whenever they exist.
    Named(Vec<String>),
}

/// The interface indexes the routes reach `backends` through directly,
/// each backend by its longest matching route; `excluded` says which
/// interfaces may not be pod-side (uplinks, tunnels, ...).
pub fn pod_side_indexes(
    routes: &[MainRoute],
    backends: impl IntoIterator<Item = IpAddr>,
    excluded: impl Fn(u32) -> bool,
) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for b in backends {
        let best = routes
            .iter()
            .filter(|r| r.dst.contains(&b))
            .max_by_key(|r| r.dst.prefix_len());
        if let Some(ifindex) = best.and_then(|r| r.direct) {
            if !excluded(ifindex) {
                out.insert(ifindex);
            }
        }
    }
    out
}

/// Whether the interface `name` may never be pod-side: an uplink,
/// loopback, a tunnel, one without an Ethernet MAC (the program could not
/// mark it: its flag lives beside the MAC in `IFACE_MACS`).
pub fn never_pod_side(name: &str, uplinks: &[String]) -> bool {
    uplinks.iter().any(|u| u == name)
        || name == "lo"
        || crate::netif::driver(name).is_ok_and(|d| TUNNEL_DRIVERS.contains(&d.as_str()))
        || crate::netif::interface_mac(name).is_none_or(|m| m == [0; 6])
}

/// The pod-side interfaces wanted now, by name with their index.
pub fn desired(
    setting: &PodInterfaces,
    uplinks: &[String],
    backends: impl IntoIterator<Item = IpAddr>,
) -> std::io::Result<BTreeMap<String, u32>> {
    match setting {
        PodInterfaces::None => Ok(BTreeMap::new()),
        PodInterfaces::Named(names) => Ok(names
            .iter()
            .filter(|n| !uplinks.contains(n))
            .filter_map(|n| Some((n.clone(), crate::netif::ifindex(n)?)))
            .collect()),
        PodInterfaces::Auto => {
            let routes = crate::netif::main_routes()?;
            let names: BTreeMap<u32, String> = routes
                .iter()
                .filter_map(|r| r.direct)
                .filter_map(|i| Some((i, crate::netif::ifname(i)?)))
                .collect();
            let found = pod_side_indexes(&routes, backends, |i| {
                names.get(&i).is_none_or(|n| never_pod_side(n, uplinks))
            });
            Ok(found
                .into_iter()
                .filter_map(|i| Some((names.get(&i)?.clone(), i)))
                .collect())
        }
    }
}

/// What to change: detach these (gone, or not wanted), attach these (new,
/// or the same name with a new index: the interface was deleted and made
/// again, its old link severed).
pub fn changes(
    attached: &BTreeMap<String, u32>,
    wanted: &BTreeMap<String, u32>,
) -> (Vec<String>, Vec<String>) {
    let detach = attached
        .iter()
        .filter(|(n, i)| wanted.get(*n) != Some(i))
        .map(|(n, _)| n.clone())
        .collect();
    let attach = wanted
        .iter()
        .filter(|(n, i)| attached.get(*n) != Some(i))
        .map(|(n, _)| n.clone())
        .collect();
    (detach, attach)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(dst: &str, direct: Option<u32>) -> MainRoute {
        MainRoute {
            dst: dst.parse().unwrap(),
            direct,
        }
    }

    /// A flannel node: its Pods behind cni0 (5), the uplink eth0 (2), the
    /// other node's Pods through flannel.1 (4), the default route.
    fn flannel_node() -> Vec<MainRoute> {
        vec![
            route("0.0.0.0/0", None),
            route("192.168.1.0/24", Some(2)),
            route("10.244.2.0/24", None),
            route("10.244.1.0/24", Some(5)),
            route("fd00:1::/64", Some(5)),
        ]
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn a_local_backend_names_the_bridge_a_remote_one_nothing() {
        let routes = flannel_node();
        let uplink = |i: u32| i == 2;
        assert_eq!(
            pod_side_indexes(&routes, ips(&["10.244.1.7", "10.244.2.9"]), uplink),
            BTreeSet::from([5])
        );
        assert!(pod_side_indexes(&routes, ips(&["10.244.2.9", "8.8.8.8"]), uplink).is_empty());
        assert_eq!(
            pod_side_indexes(&routes, ips(&["fd00:1::7"]), uplink),
            BTreeSet::from([5])
        );
        // A backend on the uplink's own subnet (a VM, a hostNetwork Pod of
        // another node) names no pod-side interface.
        assert!(pod_side_indexes(&routes, ips(&["192.168.1.20"]), uplink).is_empty());
    }

    #[test]
    fn the_longest_route_decides() {
        // A routed CNI: one /32 per Pod on its own veth, inside a wider
        // route through a gateway.
        let routes = vec![
            route("10.244.0.0/16", None),
            route("10.244.1.5/32", Some(11)),
            route("10.244.1.6/32", Some(12)),
        ];
        assert_eq!(
            pod_side_indexes(
                &routes,
                ips(&["10.244.1.5", "10.244.1.6", "10.244.1.7"]),
                |_| false
            ),
            BTreeSet::from([11, 12])
        );
        // A /32 through a gateway hides the direct /24 under it.
        let routes = vec![
            route("10.244.1.0/24", Some(5)),
            route("10.244.1.5/32", None),
        ];
        assert!(pod_side_indexes(&routes, ips(&["10.244.1.5"]), |_| false).is_empty());
    }

    #[test]
    fn before_the_bridge_exists_nothing_is_wanted() {
        let routes: Vec<MainRoute> = flannel_node()
            .into_iter()
            .filter(|r| r.direct != Some(5))
            .collect();
        assert!(pod_side_indexes(&routes, ips(&["10.244.1.7"]), |i| i == 2).is_empty());
    }

    #[test]
    fn a_bridge_made_again_is_attached_again() {
        let attached = BTreeMap::from([("cni0".to_string(), 5), ("veth1".to_string(), 9)]);
        let wanted = BTreeMap::from([("cni0".to_string(), 17), ("veth2".to_string(), 10)]);
        let (detach, attach) = changes(&attached, &wanted);
        assert_eq!(detach, ["cni0", "veth1"]);
        assert_eq!(attach, ["cni0", "veth2"]);
        let (detach, attach) = changes(&wanted, &wanted);
        assert!(detach.is_empty() && attach.is_empty());
    }
}
