//! Pod-side interfaces: the host side of this node's Pods (a CNI bridge
//! such as `cni0`, or a Pod's own veth with routed CNIs). Replies of local
//! Pods enter the node there and never cross an uplink's XDP program, so
//! the agent attaches the program to them too (docs/datapath.md,
//! "Pod-side interfaces").
//!
//! Which ones (`pod_interfaces: auto`): the interfaces the main routing
//! table reaches a backend through directly (no gateway), apart from the
//! uplinks, loopback, tunnels and interfaces without a MAC, and the
//! Ethernet overlays it reaches one through a gateway. A backend on this
//! node is such a route's destination (`10.244.1.0/24 dev cni0`); one on
//! another node is reached through flannel's overlay (`10.244.2.0/24 via
//! 10.244.2.0 dev flannel.1 onlink`), and answers the SNAT address inside
//! this node's Pod CIDR back through it; host-gw's `via` the node leaves by
//! an uplink. Decided again every half second, so a bridge the CNI creates
//! with the first Pod, after the agent started, is taken within that time,
//! and one deleted is let go.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::netif::MainRoute;

/// Drivers of Ethernet overlays: other nodes' Pods are reached through
/// them (flannel's `flannel.1`), and answer through them too when the SNAT
/// address lies in this node's Pod CIDR.
const OVERLAY_DRIVERS: [&str; 2] = ["vxlan", "geneve"];

/// Drivers of the other tunnels: no Ethernet header for the program to
/// parse, or nothing of this node's Pods behind them.
const TUNNEL_DRIVERS: [&str; 8] = [
    "ipip",
    "ip_gre",
    "ip6_gre",
    "ip6_tunnel",
    "sit",
    "wireguard",
    "ip_vti",
    "tun",
];

/// What an interface can be to the pod-side hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Never pod-side: an uplink, loopback, a tunnel, one without a MAC.
    Never,
    /// The host side of this node's Pods: a bridge, a Pod's veth.
    Pods,
    /// An Ethernet overlay to the other nodes' Pods.
    Overlay,
}

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

/// The longest route of `routes` to `ip`.
fn best_route(routes: &[MainRoute], ip: IpAddr) -> Option<&MainRoute> {
    routes
        .iter()
        .filter(|r| r.dst.contains(&ip))
        .max_by_key(|r| r.dst.prefix_len())
}

/// The pod-side interface a backend's replies come back through, by its
/// longest matching route: the interface it is directly on (a bridge, a
/// veth), or the overlay its gateway is behind.
fn pod_side_of(route: &MainRoute, side: &impl Fn(u32) -> Side) -> Option<u32> {
    match (route.direct, route.gateway) {
        (Some(i), _) if side(i) != Side::Never => Some(i),
        (_, Some(i)) if side(i) == Side::Overlay => Some(i),
        _ => None,
    }
}

/// The interface indexes `backends` answer through (see [`pod_side_of`]);
/// `side` says what each interface can be.
pub fn pod_side_indexes(
    routes: &[MainRoute],
    backends: impl IntoIterator<Item = IpAddr>,
    side: impl Fn(u32) -> Side,
) -> BTreeSet<u32> {
    backends
        .into_iter()
        .filter_map(|b| pod_side_of(best_route(routes, b)?, &side))
        .collect()
}

/// Whether `ip` is reached through an overlay (another node's Pod behind
/// `flannel.1`). The kernel forwards into it, and the pod network may
/// masquerade what it forwards there from outside (flannel's `--ip-masq`
/// does): a client's address does not survive the way.
pub fn through_overlay(routes: &[MainRoute], ip: IpAddr, side: impl Fn(u32) -> Side) -> bool {
    best_route(routes, ip)
        .and_then(|r| r.direct.or(r.gateway))
        .is_some_and(|i| side(i) == Side::Overlay)
}

/// What the interface `name` can be: never an uplink, loopback, a tunnel
/// without Ethernet, or one without a MAC (the program could not mark it:
/// its flag lives beside the MAC in `IFACE_MACS`).
pub fn side(name: &str, uplinks: &[String]) -> Side {
    if uplinks.iter().any(|u| u == name)
        || name == "lo"
        || crate::netif::interface_mac(name).is_none_or(|m| m == [0; 6])
    {
        return Side::Never;
    }
    match crate::netif::driver(name) {
        Ok(d) if OVERLAY_DRIVERS.contains(&d.as_str()) => Side::Overlay,
        Ok(d) if TUNNEL_DRIVERS.contains(&d.as_str()) => Side::Never,
        _ => Side::Pods,
    }
}

/// Each routed interface's index, name and [`Side`].
pub fn sides(routes: &[MainRoute], uplinks: &[String]) -> BTreeMap<u32, (String, Side)> {
    routes
        .iter()
        .flat_map(|r| [r.direct, r.gateway])
        .flatten()
        .filter_map(|i| {
            let name = crate::netif::ifname(i)?;
            let s = side(&name, uplinks);
            Some((i, (name, s)))
        })
        .collect()
}

/// The SNAT address a Kubernetes node uses unless one is set: its own
/// address inside its Pod CIDRs (`pod_cidrs`), of the family asked for.
/// The pod network routes it back to this node, through the overlay too,
/// and flannel does not masquerade what comes from it. The subnet's own
/// first address (flannel's `flannel.1` holds it) only when nothing else
/// is there: this node's Pods see it as an address of their own subnet.
pub fn pod_network_address(
    pod_cidrs: &[ipnet::IpNet],
    local: &[IpAddr],
    v4: bool,
) -> Option<IpAddr> {
    local
        .iter()
        .filter(|a| a.is_ipv4() == v4)
        .filter_map(|a| Some((pod_cidrs.iter().find(|c| c.contains(a))?, *a)))
        .min_by_key(|(cidr, a)| (*a == cidr.network(), *a))
        .map(|(_, a)| a)
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
            let sides = sides(&routes, uplinks);
            let found = pod_side_indexes(&routes, backends, |i| {
                sides.get(&i).map_or(Side::Never, |s| s.1)
            });
            Ok(found
                .into_iter()
                .filter_map(|i| Some((sides.get(&i)?.0.clone(), i)))
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
            gateway: None,
            via: None,
        }
    }

    fn via(dst: &str, gateway: u32) -> MainRoute {
        MainRoute {
            gateway: Some(gateway),
            ..route(dst, None)
        }
    }

    /// A flannel node: its Pods behind cni0 (5), the uplink eth0 (2), the
    /// other node's Pods through flannel.1 (4), the default route by eth0.
    fn flannel_node() -> Vec<MainRoute> {
        vec![
            via("0.0.0.0/0", 2),
            route("192.168.1.0/24", Some(2)),
            via("10.244.2.0/24", 4),
            route("10.244.1.0/24", Some(5)),
            route("fd00:1::/64", Some(5)),
        ]
    }

    /// eth0 (2) is the uplink, flannel.1 (4) the overlay, the rest Pods'.
    fn flannel_sides(i: u32) -> Side {
        match i {
            2 => Side::Never,
            4 => Side::Overlay,
            _ => Side::Pods,
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn a_local_backend_names_the_bridge_a_remote_one_the_overlay() {
        let routes = flannel_node();
        assert_eq!(
            pod_side_indexes(&routes, ips(&["10.244.1.7"]), flannel_sides),
            BTreeSet::from([5])
        );
        assert_eq!(
            pod_side_indexes(&routes, ips(&["10.244.1.7", "10.244.2.9"]), flannel_sides),
            BTreeSet::from([4, 5])
        );
        assert_eq!(
            pod_side_indexes(&routes, ips(&["fd00:1::7"]), flannel_sides),
            BTreeSet::from([5])
        );
        // A backend on the uplink's own subnet (a VM, a hostNetwork Pod of
        // another node) or behind the default route names nothing.
        assert!(
            pod_side_indexes(&routes, ips(&["192.168.1.20", "8.8.8.8"]), flannel_sides).is_empty()
        );
        // host-gw: the other node's Pods through a gateway on the uplink.
        let host_gw = vec![via("10.244.2.0/24", 2), route("10.244.1.0/24", Some(5))];
        assert!(pod_side_indexes(&host_gw, ips(&["10.244.2.9"]), flannel_sides).is_empty());
        // Only an overlay takes a gateway's route: not a Pod's veth.
        let veth_gateway = vec![via("10.244.2.0/24", 7)];
        assert!(pod_side_indexes(&veth_gateway, ips(&["10.244.2.9"]), flannel_sides).is_empty());
    }

    #[test]
    fn only_a_backend_behind_the_overlay_is_through_it() {
        let routes = flannel_node();
        let through = |ip: &str| through_overlay(&routes, ip.parse().unwrap(), flannel_sides);
        assert!(through("10.244.2.9"));
        assert!(!through("10.244.1.7"));
        assert!(!through("192.168.1.20"));
        assert!(!through("8.8.8.8"));
    }

    #[test]
    fn the_snat_default_is_the_nodes_address_in_its_pod_cidr() {
        let cidrs: Vec<ipnet::IpNet> = vec![
            "10.244.1.0/24".parse().unwrap(),
            "fd00:1::/64".parse().unwrap(),
        ];
        let pick = |local: &[&str], v4| pod_network_address(&cidrs, &ips(local), v4);
        // flannel VXLAN before the first Pod: only flannel.1's address.
        let vxlan = ["192.168.1.10", "10.244.1.0"];
        assert_eq!(pick(&vxlan, true), Some("10.244.1.0".parse().unwrap()));
        // With the bridge: its address, which the Pods see as their gateway.
        let bridge = ["192.168.1.10", "10.244.1.0", "10.244.1.1", "fd00:1::1"];
        assert_eq!(pick(&bridge, true), Some("10.244.1.1".parse().unwrap()));
        assert_eq!(pick(&bridge, false), Some("fd00:1::1".parse().unwrap()));
        // host-gw before the first Pod: nothing inside (the uplink's then).
        assert_eq!(pick(&["192.168.1.10", "10.244.2.1"], true), None);
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
                |_| Side::Pods
            ),
            BTreeSet::from([11, 12])
        );
        // A /32 through a gateway hides the direct /24 under it.
        let routes = vec![
            route("10.244.1.0/24", Some(5)),
            route("10.244.1.5/32", None),
        ];
        assert!(pod_side_indexes(&routes, ips(&["10.244.1.5"]), |_| Side::Pods).is_empty());
    }

    #[test]
    fn before_the_bridge_exists_nothing_is_wanted() {
        let routes: Vec<MainRoute> = flannel_node()
            .into_iter()
            .filter(|r| r.direct != Some(5))
            .collect();
        assert!(pod_side_indexes(&routes, ips(&["10.244.1.7"]), flannel_sides).is_empty());
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
