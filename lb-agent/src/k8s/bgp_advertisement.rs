//! The `BGPAdvertisement` custom resource: communities and LOCAL_PREF for
//! the VIPs of some pools, on some nodes; and the task that turns the ones
//! selecting this node into what its routes carry.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;

use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::LabelSelector};
use kube::{runtime::watcher, Api, Client, CustomResource, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify};
use tracing::{info, warn};

use super::{
    bgp_peer::BGPPeer,
    crd::LoadBalancerPool,
    ipam::Pool,
    selects,
    watch::{store, this_node},
};
use crate::{bgp::Advertisement, config::parse_community};

/// BGP attributes for the VIPs of the pools its `poolSelector` matches
/// (every pool without one), announced by the nodes its `nodeSelector`
/// matches (every node without one).
///
/// ```yaml
/// apiVersion: xlb.dev/v1alpha1
/// kind: BGPAdvertisement
/// metadata: { name: public-edge }
/// spec:
///   poolSelector: { matchLabels: { exposure: public } }
///   communities: ["65000:100"]
///   localPref: 200
/// ```
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "xlb.dev",
    version = "v1alpha1",
    kind = "BGPAdvertisement",
    plural = "bgpadvertisements",
    shortname = "bgpadv",
    printcolumn = r#"{"name":"Communities","type":"string","jsonPath":".spec.communities"}"#,
    printcolumn = r#"{"name":"LocalPref","type":"integer","jsonPath":".spec.localPref"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BgpAdvertisementSpec {
    /// The LoadBalancerPools (by their labels) whose VIPs get these
    /// attributes; every pool without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_selector: Option<LabelSelector>,
    /// The nodes (by their labels) that announce with them; every node
    /// without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// The BGPPeers (by their labels) the VIPs go to: with it, the
    /// selected pools' VIPs go only to the selected BGPPeers that peer
    /// with the node (and to those of other advertisements with a
    /// peerSelector covering them), never to any other session. Without
    /// it, no limit of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_selector: Option<LabelSelector>,
    /// Standard communities, `ASN:VALUE` (each 0-65535).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communities: Vec<String>,
    /// Large communities (RFC 8092), `GLOBAL:LOCAL1:LOCAL2` (each
    /// 0-4294967295).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub large_communities: Vec<String>,
    /// LOCAL_PREF (iBGP peers only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // schemars says `uint32`, a format Kubernetes does not know.
    #[schemars(extend("format" = "int64"))]
    pub local_pref: Option<u32>,
    /// Announce each IPv4 VIP as its covering prefix of this length (one
    /// route for all the VIPs in it) instead of a /32. Every IPv4 range of
    /// the selected pools must be whole prefixes of this length, so that
    /// nothing outside a pool is announced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 32), extend("format" = "int32"))]
    pub aggregation_length: Option<u8>,
    /// The same for IPv6 (instead of a /128).
    #[serde(
        default,
        rename = "aggregationLengthV6",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(max = 128), extend("format" = "int32"))]
    pub aggregation_length_v6: Option<u8>,
}

/// Why `len` cannot aggregate the `family` ranges of `ranges`, if so: it is
/// longer than the family's addresses, or a range is not whole prefixes
/// of that length (a covering prefix would take in addresses outside it).
fn aggregation_problem(len: Option<u8>, v4: bool, ranges: &[(IpAddr, IpAddr)]) -> Option<String> {
    let len = len?;
    let (field, bits) = if v4 {
        ("aggregationLength", 32)
    } else {
        ("aggregationLengthV6", 128)
    };
    if len > bits {
        return Some(format!("{field} {len} is longer than {bits}"));
    }
    for &(first, last) in ranges.iter().filter(|(f, _)| f.is_ipv4() == v4) {
        let head = IpNet::new(first, len).expect("checked length").trunc();
        let tail = IpNet::new(last, len).expect("checked length");
        if head.addr() != first || tail.broadcast() != last {
            return Some(format!(
                "{field} {len} would announce addresses outside the pool range {first}-{last} (a /{len} starts at {} and its last address is {})",
                head.addr(),
                tail.broadcast()
            ));
        }
    }
    None
}

/// The advertisements that select a node with `labels`, each with the
/// address ranges of the pools it selects and the addresses of the
/// BGPPeers its peerSelector selects among this node's. One that cannot be
/// used (a bad selector or community; a selected pool whose addresses do
/// not parse is only left out of it) is left out with why, by name.
pub fn advertisements_for_node(
    objects: &[&BGPAdvertisement],
    pools: &[&LoadBalancerPool],
    bgp_peers: &[&BGPPeer],
    labels: &BTreeMap<String, String>,
) -> (Vec<Advertisement>, BTreeMap<String, String>) {
    let mut out = Vec::new();
    let mut problems = BTreeMap::new();
    let mut objects = objects.to_vec();
    objects.sort_by_key(|o| o.name_any());
    for o in objects {
        let name = o.name_any();
        let spec = &o.spec;
        let advert = (|| {
            if !selects(&spec.node_selector, labels).map_err(|e| format!("nodeSelector: {e}"))? {
                return Ok(None);
            }
            let mut communities = Vec::new();
            for c in &spec.communities {
                communities.push(parse_community(c).ok_or_else(|| {
                    format!("{c:?} is not a community ASN:VALUE (each 0 to 65535)")
                })?);
            }
            let mut large_communities = Vec::new();
            for c in &spec.large_communities {
                large_communities.push(crate::config::parse_large_community(c).ok_or_else(
                    || {
                        format!(
                            "{c:?} is not a large community GLOBAL:LOCAL1:LOCAL2 (each 0 to 4294967295)"
                        )
                    },
                )?);
            }
            let mut covers = Vec::new();
            for p in pools {
                if !selects(&spec.pool_selector, p.labels())
                    .map_err(|e| format!("poolSelector: {e}"))?
                {
                    continue;
                }
                // A pool the allocator refuses hands out nothing to announce.
                if let Ok(pool) = Pool::parse(&p.name_any(), &p.spec) {
                    covers.extend(pool.ranges().iter().map(|r| (r.first(), r.last())));
                }
            }
            let peers = match &spec.peer_selector {
                None => None,
                Some(selector) => {
                    let mut selected = BTreeSet::new();
                    for b in bgp_peers {
                        let chosen = selects(&Some(selector.clone()), b.labels())
                            .map_err(|e| format!("peerSelector: {e}"))?;
                        // A BGPPeer whose own selector is broken peers with
                        // no node.
                        let here = selects(&b.spec.node_selector, labels).unwrap_or(false);
                        if let (true, true, Ok(addr)) =
                            (chosen, here, b.spec.address.parse::<IpAddr>())
                        {
                            selected.insert(addr);
                        }
                    }
                    Some(selected)
                }
            };
            for (len, v4) in [
                (spec.aggregation_length, true),
                (spec.aggregation_length_v6, false),
            ] {
                if let Some(problem) = aggregation_problem(len, v4, &covers) {
                    return Err(problem);
                }
            }
            Ok::<_, String>(Some(Advertisement {
                name: name.clone(),
                covers,
                communities,
                large_communities,
                local_pref: spec.local_pref,
                aggregation_length: spec.aggregation_length,
                aggregation_length_v6: spec.aggregation_length_v6,
                peers,
            }))
        })();
        match advert {
            Ok(Some(a)) => out.push(a),
            Ok(None) => {}
            Err(e) => {
                problems.insert(name, e);
            }
        }
    }
    (out, problems)
}

/// Watches the BGPAdvertisements, the pools and this node's labels;
/// publishes what this node's routes carry whenever it changes. Each
/// advertisement left out is logged once, with why, while it lasts.
pub fn spawn(client: Client, node_name: String) -> watch::Receiver<Vec<Advertisement>> {
    let (tx, rx) = watch::channel(Vec::new());
    let changed = Arc::new(Notify::new());
    let all = watcher::Config::default;
    let objects = store(
        "bgpadvertisements",
        Api::<BGPAdvertisement>::all(client.clone()),
        all(),
        &changed,
    );
    let pools = store(
        "loadbalancerpools",
        Api::<LoadBalancerPool>::all(client.clone()),
        all(),
        &changed,
    );
    let peers = store(
        "bgppeers",
        Api::<BGPPeer>::all(client.clone()),
        all(),
        &changed,
    );
    let nodes = store(
        "nodes",
        Api::<Node>::all(client),
        this_node(&node_name),
        &changed,
    );
    tokio::spawn(async move {
        let ready = futures::future::join4(
            objects.wait_until_ready(),
            pools.wait_until_ready(),
            peers.wait_until_ready(),
            nodes.wait_until_ready(),
        )
        .await;
        if ready.0.is_err() || ready.1.is_err() || ready.2.is_err() || ready.3.is_err() {
            return;
        }
        let mut logged: BTreeMap<String, String> = BTreeMap::new();
        let mut to_no_one_logged: BTreeSet<String> = BTreeSet::new();
        loop {
            let state = objects.state();
            let refs: Vec<&BGPAdvertisement> = state.iter().map(Arc::as_ref).collect();
            let pool_state = pools.state();
            let pool_refs: Vec<&LoadBalancerPool> = pool_state.iter().map(Arc::as_ref).collect();
            let labels = nodes
                .state()
                .iter()
                .find(|n| n.name_any() == node_name)
                .map(|n| n.labels().clone())
                .unwrap_or_default();
            let peer_state = peers.state();
            let peer_refs: Vec<&BGPPeer> = peer_state.iter().map(Arc::as_ref).collect();
            let (adverts, problems) =
                advertisements_for_node(&refs, &pool_refs, &peer_refs, &labels);
            for (name, why) in &problems {
                if logged.get(name) != Some(why) {
                    warn!(bgpadvertisement = %name, "BGPAdvertisement not used on this node: {why}");
                }
            }
            logged = problems;
            let to_no_one: BTreeSet<String> = adverts
                .iter()
                .filter(|a| a.peers.as_ref().is_some_and(BTreeSet::is_empty))
                .map(|a| a.name.clone())
                .collect();
            for name in to_no_one.difference(&to_no_one_logged) {
                warn!(bgpadvertisement = %name, "BGPAdvertisement's peerSelector selects no BGPPeer of this node: the VIPs it covers are announced to no peer from here");
            }
            to_no_one_logged = to_no_one;
            if *tx.borrow() != adverts {
                info!(
                    advertisements = ?adverts.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
                    "BGP advertisements of this node"
                );
                if tx.send(adverts).is_err() {
                    return;
                }
            }
            changed.notified().await;
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(name: &str, spec: serde_json::Value) -> BGPAdvertisement {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "BGPAdvertisement",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap()
    }

    fn pool(name: &str, labels: serde_json::Value, addresses: &[&str]) -> LoadBalancerPool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
            "metadata": {"name": name, "labels": labels}, "spec": {"addresses": addresses},
        }))
        .unwrap()
    }

    #[test]
    fn an_advertisement_covers_the_pools_and_nodes_it_selects() {
        let public = pool(
            "public",
            serde_json::json!({"exposure": "public"}),
            &["192.0.2.0/28"],
        );
        let internal = pool("internal", serde_json::json!({}), &["10.9.0.10-10.9.0.20"]);
        let edge = advert(
            "edge",
            serde_json::json!({"poolSelector": {"matchLabels": {"exposure": "public"}},
                "nodeSelector": {"matchLabels": {"rack": "a"}},
                "communities": ["65000:100"], "largeCommunities": ["65000:100:1"],
                "localPref": 200}),
        );
        let everywhere = advert("all", serde_json::json!({"communities": ["65000:7"]}));
        let bad = advert("bad", serde_json::json!({"communities": ["65000:x"]}));
        let bad_large = advert(
            "bad-large",
            serde_json::json!({"largeCommunities": ["65000:1"]}),
        );
        let rack_a: BTreeMap<String, String> = [("rack".to_string(), "a".to_string())].into();
        let (out, problems) = advertisements_for_node(
            &[&edge, &everywhere, &bad, &bad_large],
            &[&public, &internal],
            &[],
            &rack_a,
        );
        assert_eq!(out.len(), 2, "{out:?}");
        let all = &out[0];
        assert_eq!(all.name, "all");
        assert_eq!(all.covers.len(), 2);
        let edge = &out[1];
        assert_eq!(
            edge.covers,
            [("192.0.2.0".parse().unwrap(), "192.0.2.15".parse().unwrap())]
        );
        assert_eq!(
            (edge.communities.clone(), edge.local_pref),
            (vec![(65000, 100)], Some(200))
        );
        assert_eq!(edge.large_communities, [(65000, 100, 1)]);
        assert!(problems["bad"].contains("65000:x"), "{problems:?}");
        assert!(
            problems["bad-large"].contains("not a large community"),
            "{problems:?}"
        );
        // Another rack: only the one for every node.
        let (out, _) = advertisements_for_node(
            &[&advert(
                "edge",
                serde_json::json!({"nodeSelector": {"matchLabels": {"rack": "a"}}}),
            )],
            &[&public],
            &[],
            &BTreeMap::new(),
        );
        assert!(out.is_empty());
    }

    #[test]
    fn aggregation_must_keep_to_the_pools() {
        let cidr = pool(
            "cidr",
            serde_json::json!({}),
            &["192.0.2.0/24", "2001:db8::/112"],
        );
        let range = pool(
            "range",
            serde_json::json!({}),
            &["198.51.100.16-198.51.100.31"],
        );
        let agg = |name: &str, v4: u8, v6: u8| {
            advert(
                name,
                serde_json::json!({"aggregationLength": v4, "aggregationLengthV6": v6}),
            )
        };
        let fits = agg("fits", 28, 120);
        let wide = agg("wide", 23, 128);
        let odd = agg("odd", 27, 128);
        let long = agg("long", 33, 128);
        let (out, problems) = advertisements_for_node(
            &[&fits, &wide, &odd, &long],
            &[&cidr, &range],
            &[],
            &BTreeMap::new(),
        );
        assert_eq!(out.len(), 1, "{problems:?}");
        assert_eq!(
            (out[0].aggregation_length, out[0].aggregation_length_v6),
            (Some(28), Some(120))
        );
        // A /23 would take in 192.0.2.0/24's neighbour; 198.51.100.16-31 is
        // a /28, not whole /27s.
        assert!(
            problems["wide"].contains("outside the pool range 192.0.2.0-192.0.2.255"),
            "{problems:?}"
        );
        assert!(
            problems["odd"].contains("198.51.100.16-198.51.100.31"),
            "{problems:?}"
        );
        assert!(problems["long"].contains("longer than 32"), "{problems:?}");
    }

    #[test]
    fn a_peer_selector_picks_the_bgppeers_of_this_node_by_their_labels() {
        let bgp_peer =
            |name: &str, labels: serde_json::Value, spec: serde_json::Value| -> BGPPeer {
                serde_json::from_value(serde_json::json!({
                    "apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
                    "metadata": {"name": name, "labels": labels}, "spec": spec,
                }))
                .unwrap()
            };
        let tor_a = bgp_peer(
            "tor-a",
            serde_json::json!({"role": "tor"}),
            serde_json::json!({"address": "10.0.1.254", "asn": 65000,
                "nodeSelector": {"matchLabels": {"rack": "a"}}}),
        );
        let tor_b = bgp_peer(
            "tor-b",
            serde_json::json!({"role": "tor"}),
            serde_json::json!({"address": "10.0.2.254", "asn": 65000,
                "nodeSelector": {"matchLabels": {"rack": "b"}}}),
        );
        let edge = bgp_peer(
            "edge",
            serde_json::json!({"role": "edge"}),
            serde_json::json!({"address": "10.0.9.1", "asn": 65200}),
        );
        let internal = pool("internal", serde_json::json!({}), &["10.9.0.0/24"]);
        let to_tor = advert(
            "internal-to-tor",
            serde_json::json!({"peerSelector": {"matchLabels": {"role": "tor"}}}),
        );
        let to_nobody = advert(
            "nobody",
            serde_json::json!({"peerSelector": {"matchLabels": {"role": "spine"}}}),
        );
        let broken = advert(
            "broken",
            serde_json::json!({"peerSelector": {"matchExpressions": [{"key": "role", "operator": "Sideways"}]}}),
        );
        let rack_a: BTreeMap<String, String> = [("rack".to_string(), "a".to_string())].into();
        let (out, problems) = advertisements_for_node(
            &[&to_tor, &to_nobody, &broken],
            &[&internal],
            &[&tor_a, &tor_b, &edge],
            &rack_a,
        );
        let peers = |name: &str| {
            out.iter()
                .find(|a| a.name == name)
                .unwrap()
                .peers
                .clone()
                .unwrap()
                .into_iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        };
        // Rack a's router only: rack b's does not peer with this node.
        assert_eq!(peers("internal-to-tor"), ["10.0.1.254"]);
        assert!(peers("nobody").is_empty());
        assert!(problems["broken"].contains("peerSelector"), "{problems:?}");
    }
}
