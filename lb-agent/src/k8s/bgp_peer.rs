//! The `BGPPeer` custom resource: a router the agents of the nodes its
//! selector matches peer with, and the task that turns the BGPPeers
//! matching this node's labels into the speaker's peers.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::core::v1::{Node, ObjectReference, Secret},
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};
use kube::{
    runtime::{
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        watcher,
    },
    Api, Client, CustomResource, ResourceExt,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify};
use tracing::{info, warn};

use super::{
    selects,
    watch::{store, this_node},
    CONTROLLER_NAME,
};
use crate::{
    bgp::task::Sessions,
    config::{check_peer, BgpPeer, RawBfd, RawPeer},
};

/// A BGP neighbour for the nodes its `nodeSelector` matches (every node
/// without one). Cluster-scoped: racks differ by node labels.
///
/// ```yaml
/// apiVersion: xlb.dev/v1alpha1
/// kind: BGPPeer
/// metadata: { name: rack-a-tor }
/// spec:
///   address: 10.0.1.254
///   asn: 65000
///   holdTime: 9s
///   bfd: { minRx: 100ms, minTx: 100ms, multiplier: 3 }
///   passwordSecret: { name: bgp-auth, key: rack-a }
///   nodeSelector: { matchLabels: { topology.kubernetes.io/zone: rack-a } }
/// ```
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "xlb.dev",
    version = "v1alpha1",
    kind = "BGPPeer",
    plural = "bgppeers",
    shortname = "bgppeer",
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".spec.address"}"#,
    printcolumn = r#"{"name":"ASN","type":"integer","jsonPath":".spec.asn"}"#,
    printcolumn = r#"{"name":"BFD","type":"boolean","jsonPath":".spec.bfd","priority":1}"#
)]
#[serde(rename_all = "camelCase")]
pub struct BgpPeerSpec {
    /// The router's address (IPv4 or IPv6).
    pub address: String,
    /// The router's AS number.
    // schemars says `uint32` (and `uint16`, `uint8` below), formats
    // Kubernetes does not know (the API server warns); `int64` with
    // schemars' minimum and maximum is what it validates.
    #[schemars(extend("format" = "int64"))]
    pub asn: u32,
    /// The router's BGP port (default 179).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub port: Option<u16>,
    /// Duration, at least 3s (default 9s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_time: Option<String>,
    /// Duration (default a third of the hold time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive_time: Option<String>,
    /// eBGP multihop: the TTL of the session's packets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub multihop_ttl: Option<u8>,
    /// BGP graceful restart's restart time, 1s-4095s (default off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graceful_restart: Option<String>,
    /// The TCP-MD5 password: a key of a Secret in the agents' namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret: Option<SecretKey>,
    /// BFD on the session (BIRD only; GoBGP has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bfd: Option<BfdSpec>,
    /// The nodes that peer with this router; every node without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
}

/// A key of a Secret in the agents' namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct SecretKey {
    pub name: String,
    pub key: String,
}

/// BFD timers (each 10ms-10s; defaults 100ms, 100ms, 3).
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BfdSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_rx: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_tx: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub multiplier: Option<u8>,
}

/// The peers a node takes: the config file's, then every BGPPeer whose
/// selector matches `labels`, by name. A BGPPeer that cannot be used (a
/// bad field or selector, a missing password, an address the config or
/// another BGPPeer already has) is left out with the reason; the others
/// are used. `password(name, key)` reads a Secret's key.
pub fn peers_for_node(
    config: &[BgpPeer],
    objects: &[&BGPPeer],
    labels: &BTreeMap<String, String>,
    password: impl Fn(&SecretKey) -> Result<String, String>,
) -> (Vec<BgpPeer>, BTreeMap<String, String>) {
    let mut peers = config.to_vec();
    let mut problems = BTreeMap::new();
    let mut objects = objects.to_vec();
    objects.sort_by_key(|o| o.name_any());
    for o in objects {
        let name = o.name_any();
        let spec = &o.spec;
        let matches =
            selects(&spec.node_selector, labels).map_err(|e| format!("nodeSelector: {e}"));
        let peer = matches.and_then(|m| {
            if !m {
                return Ok(None);
            }
            let password = spec.password_secret.as_ref().map(&password).transpose()?;
            let raw = RawPeer {
                address: spec.address.clone(),
                asn: spec.asn,
                port: spec.port,
                hold_time: spec.hold_time.clone(),
                keepalive: spec.keepalive_time.clone(),
                password,
                multihop_ttl: spec.multihop_ttl,
                graceful_restart: spec.graceful_restart.clone(),
                bfd: spec.bfd.as_ref().map(|b| RawBfd {
                    min_rx: b.min_rx.clone(),
                    min_tx: b.min_tx.clone(),
                    multiplier: b.multiplier,
                }),
            };
            let peer = check_peer(raw)?;
            if peers.iter().any(|p| p.address == peer.address) {
                return Err(format!(
                    "{} is already a peer of this node (the config file's or another BGPPeer's)",
                    peer.address
                ));
            }
            Ok(Some(peer))
        });
        match peer {
            Ok(Some(p)) => peers.push(p),
            Ok(None) => {}
            Err(e) => {
                problems.insert(name, e);
            }
        }
    }
    (peers, problems)
}

/// How often Secrets are read again (their changes are not watched).
const REREAD: Duration = Duration::from_secs(30);

/// Watches the BGPPeers and this node's labels; publishes this node's
/// peers (the config file's first) whenever they change. Each BGPPeer left
/// out is logged once, with why, while it lasts.
pub fn spawn(
    client: Client,
    node_name: String,
    namespace: String,
    config: Vec<BgpPeer>,
) -> watch::Receiver<Vec<BgpPeer>> {
    let (tx, rx) = watch::channel(config.clone());
    let changed = Arc::new(Notify::new());
    let objects = store(
        "bgppeers",
        Api::<BGPPeer>::all(client.clone()),
        watcher::Config::default(),
        &changed,
    );
    let nodes = store(
        "nodes",
        Api::<Node>::all(client.clone()),
        this_node(&node_name),
        &changed,
    );
    let secrets = Api::<Secret>::namespaced(client, &namespace);
    tokio::spawn(async move {
        if objects.wait_until_ready().await.is_err() || nodes.wait_until_ready().await.is_err() {
            return;
        }
        let mut logged: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let state = objects.state();
            let refs: Vec<&BGPPeer> = state.iter().map(Arc::as_ref).collect();
            let labels = nodes
                .state()
                .iter()
                .find(|n| n.name_any() == node_name)
                .map(|n| n.labels().clone())
                .unwrap_or_default();
            // The Secrets the matching peers name, read before the pure part.
            let mut read: BTreeMap<(String, String), Result<String, String>> = BTreeMap::new();
            let wanted: BTreeSet<(String, String)> = refs
                .iter()
                .filter_map(|o| o.spec.password_secret.as_ref())
                .map(|s| (s.name.clone(), s.key.clone()))
                .collect();
            for (name, key) in wanted {
                let value = secret_key(&secrets, &namespace, &name, &key).await;
                read.insert((name, key), value);
            }
            let (peers, problems) = peers_for_node(&config, &refs, &labels, |s| {
                read.get(&(s.name.clone(), s.key.clone()))
                    .cloned()
                    .unwrap_or_else(|| Err("not read".into()))
            });
            for (name, why) in &problems {
                if logged.get(name) != Some(why) {
                    warn!(bgppeer = %name, "BGPPeer not used on this node: {why}");
                }
            }
            logged = problems;
            if *tx.borrow() != peers {
                info!(
                    peers = ?peers.iter().map(|p| p.address.to_string()).collect::<Vec<_>>(),
                    "BGP peers of this node"
                );
                if tx.send(peers).is_err() {
                    return;
                }
            }
            let _ = tokio::time::timeout(REREAD, changed.notified()).await;
        }
    });
    rx
}

/// A session not established this long after it appeared is reported
/// (an unreachable peer, or one that does not peer with this node).
const NOT_ESTABLISHED_AFTER: Duration = Duration::from_secs(30);

/// What a change of the speaker's sessions is reported as: an Event on
/// this node's Node object (`kubectl describe node`, `kubectl get events`),
/// one per change, so that the API server's load stays small.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionEvent {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// The Events for the sessions going from `before` to `now`; `waiting`
/// holds since when each peer was seen without its session (and whether
/// that was reported), updated here.
pub fn session_events(
    before: &Sessions,
    now: &Sessions,
    waiting: &mut BTreeMap<IpAddr, (Instant, bool)>,
    at: Instant,
) -> Vec<SessionEvent> {
    let mut out = Vec::new();
    waiting.retain(|peer, _| now.get(peer) == Some(&false));
    for (&peer, &up) in now {
        match (before.get(&peer).copied(), up) {
            (Some(false) | None, true) => out.push(SessionEvent {
                warning: false,
                reason: "BGPSessionEstablished",
                note: format!("BGP session with {peer} established"),
            }),
            (Some(true), false) => {
                waiting.insert(peer, (at, true));
                out.push(SessionEvent {
                    warning: true,
                    reason: "BGPSessionDown",
                    note: format!("BGP session with {peer} went down"),
                });
            }
            (_, false) => {
                let (since, reported) = waiting.entry(peer).or_insert((at, false));
                if !*reported && at.duration_since(*since) >= NOT_ESTABLISHED_AFTER {
                    *reported = true;
                    out.push(SessionEvent {
                        warning: true,
                        reason: "BGPSessionNotEstablished",
                        note: format!(
                            "no BGP session with {peer} after {}s: is it reachable, and does it peer with this node?",
                            NOT_ESTABLISHED_AFTER.as_secs()
                        ),
                    });
                }
            }
            (Some(true), true) => {}
        }
    }
    out
}

/// Reports the speaker's session changes as Events on this node's Node.
pub fn report_sessions(client: Client, node_name: String, mut sessions: watch::Receiver<Sessions>) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: CONTROLLER_NAME.to_string(),
            instance: Some(node_name.clone()),
        },
    );
    let node = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node_name),
        ..Default::default()
    };
    tokio::spawn(async move {
        let mut before = Sessions::new();
        let mut waiting = BTreeMap::new();
        loop {
            // Also every few seconds: a session that never comes up
            // changes nothing.
            let tick = tokio::time::timeout(Duration::from_secs(5), sessions.changed()).await;
            if matches!(tick, Ok(Err(_))) {
                return;
            }
            let now = sessions.borrow_and_update().clone();
            for e in session_events(&before, &now, &mut waiting, Instant::now()) {
                let event = KubeEvent {
                    type_: if e.warning {
                        EventType::Warning
                    } else {
                        EventType::Normal
                    },
                    reason: e.reason.into(),
                    note: Some(e.note),
                    action: "Peer".into(),
                    secondary: None,
                };
                if let Err(err) = recorder.publish(&event, &node).await {
                    warn!(reason = event.reason, "could not publish an Event: {err}");
                }
            }
            before = now;
        }
    });
}

/// A Secret's key as text; why not, if it cannot be read.
async fn secret_key(
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
    key: &str,
) -> Result<String, String> {
    let secret = secrets
        .get_opt(name)
        .await
        .map_err(|e| format!("reading Secret {namespace}/{name}: {e}"))?
        .ok_or_else(|| format!("password Secret {namespace}/{name} is missing"))?;
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .ok_or_else(|| format!("password Secret {namespace}/{name} has no key {key:?}"))?;
    String::from_utf8(bytes.0.clone())
        .map_err(|_| format!("password Secret {namespace}/{name} key {key:?} is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(name: &str, spec: serde_json::Value) -> BGPPeer {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_node_takes_the_peers_its_labels_select() {
        let a = object(
            "rack-a",
            serde_json::json!({"address": "10.0.1.254", "asn": 65000,
                "nodeSelector": {"matchLabels": {"rack": "a"}}, "bfd": {}}),
        );
        let b = object(
            "rack-b",
            serde_json::json!({"address": "10.0.2.254", "asn": 65000, "holdTime": "6s",
                "nodeSelector": {"matchExpressions": [{"key": "rack", "operator": "In", "values": ["b"]}]}}),
        );
        let all = object(
            "edge",
            serde_json::json!({"address": "10.0.9.1", "asn": 65100, "passwordSecret": {"name": "s", "key": "k"}}),
        );
        let objects = [&a, &b, &all];
        let pw = |s: &SecretKey| Ok(format!("{}-{}", s.name, s.key));
        let (peers, problems) = peers_for_node(&[], &objects, &labels(&[("rack", "a")]), pw);
        let addrs: Vec<String> = peers.iter().map(|p| p.address.to_string()).collect();
        // By name: edge, rack-a.
        assert_eq!(addrs, ["10.0.9.1", "10.0.1.254"]);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(peers[0].password.as_deref(), Some("s-k"));
        assert_eq!(peers[1].bfd, Some(crate::config::Bfd::DEFAULT));
        let (peers, _) = peers_for_node(&[], &objects, &labels(&[("rack", "b")]), pw);
        assert_eq!(peers[1].address.to_string(), "10.0.2.254");
        assert_eq!(peers[1].hold_time, Duration::from_secs(6));
        let (peers, _) = peers_for_node(&[], &objects, &labels(&[]), pw);
        assert_eq!(peers.len(), 1);
    }

    #[test]
    fn a_bad_bgppeer_is_left_out_with_why_and_the_others_stay() {
        let config = check_peer(RawPeer {
            address: "10.0.0.254".into(),
            asn: 65000,
            ..Default::default()
        })
        .unwrap();
        let good = object(
            "good",
            serde_json::json!({"address": "10.0.3.254", "asn": 65000}),
        );
        let cases = [
            (
                object(
                    "bad-hold",
                    serde_json::json!({"address": "10.0.4.254", "asn": 1, "holdTime": "1s"}),
                ),
                "hold_time",
            ),
            (
                object(
                    "bad-address",
                    serde_json::json!({"address": "rack-a-tor", "asn": 1}),
                ),
                "not an IP address",
            ),
            (
                object(
                    "same-as-config",
                    serde_json::json!({"address": "10.0.0.254", "asn": 1}),
                ),
                "already a peer",
            ),
            (
                object(
                    "no-secret",
                    serde_json::json!({"address": "10.0.5.254", "asn": 1,
                    "passwordSecret": {"name": "missing", "key": "k"}}),
                ),
                "Secret xlb-system/missing is missing",
            ),
            (
                object(
                    "bad-selector",
                    serde_json::json!({"address": "10.0.6.254", "asn": 1,
                    "nodeSelector": {"matchExpressions": [{"key": "rack", "operator": "Near"}]}}),
                ),
                "nodeSelector",
            ),
        ];
        for (bad, why) in &cases {
            let (peers, problems) = peers_for_node(
                std::slice::from_ref(&config),
                &[bad, &good],
                &labels(&[]),
                |s| Err(format!("password Secret xlb-system/{} is missing", s.name)),
            );
            let addrs: Vec<String> = peers.iter().map(|p| p.address.to_string()).collect();
            assert_eq!(addrs, ["10.0.0.254", "10.0.3.254"], "{}", bad.name_any());
            let got = &problems[&bad.name_any()];
            assert!(got.contains(why), "{}: {got}", bad.name_any());
        }
    }

    #[test]
    fn session_changes_become_events_once() {
        let a: IpAddr = "10.0.1.254".parse().unwrap();
        let b: IpAddr = "10.0.2.254".parse().unwrap();
        let t0 = Instant::now();
        let mut waiting = BTreeMap::new();
        let reasons = |v: Vec<SessionEvent>| v.into_iter().map(|e| e.reason).collect::<Vec<_>>();
        let s = |pairs: &[(IpAddr, bool)]| pairs.iter().copied().collect::<Sessions>();
        // a comes up; b is new and down: nothing yet.
        let e = session_events(&s(&[]), &s(&[(a, true), (b, false)]), &mut waiting, t0);
        assert_eq!(reasons(e), ["BGPSessionEstablished"]);
        let same = s(&[(a, true), (b, false)]);
        assert!(
            session_events(&same, &same, &mut waiting, t0 + Duration::from_secs(29)).is_empty()
        );
        // b still down after 30 s: said once.
        let e = session_events(&same, &same, &mut waiting, t0 + Duration::from_secs(30));
        assert_eq!(reasons(e), ["BGPSessionNotEstablished"]);
        assert!(
            session_events(&same, &same, &mut waiting, t0 + Duration::from_secs(90)).is_empty()
        );
        // a goes down (said at once, and not again as not established).
        let down = s(&[(a, false), (b, false)]);
        let e = session_events(&same, &down, &mut waiting, t0 + Duration::from_secs(91));
        assert_eq!(reasons(e), ["BGPSessionDown"]);
        assert!(
            session_events(&down, &down, &mut waiting, t0 + Duration::from_secs(200)).is_empty()
        );
        let e = session_events(&down, &s(&[(a, true), (b, true)]), &mut waiting, t0);
        assert_eq!(
            reasons(e),
            ["BGPSessionEstablished", "BGPSessionEstablished"]
        );
    }
}
