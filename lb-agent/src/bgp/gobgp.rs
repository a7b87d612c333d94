//! The GoBGP 3.x driver: talks to `gobgpd` over its gRPC API (package
//! `apipb`, service `GobgpApi`, by default on `127.0.0.1:50051`).
//!
//! The API subset lives in `lb-agent/proto/` (compiled by `build.rs`); its
//! field numbers are GoBGP 3.x's (`lb-agent/proto/check-against-gobgpd.py`
//! checks them against an installed `gobgpd`).
//!
//! # Which paths are ours
//!
//! [`Announcer::apply`] lists the IPv4 and IPv6 unicast paths of
//! GoBGP's global RIB and only ever considers paths that
//!
//! - are locally originated, i.e. were added through the API or the `gobgp`
//!   CLI rather than learned from a BGP peer (GoBGP reports their
//!   `neighbor_ip` as `"<nil>"`). Routes learned from peers are never
//!   touched;
//! - with [`Ownership::Marked`], carry the marker community. The marker is
//!   added to every path we announce and left out of the [`Route`]s we
//!   report, so other local paths in the same `gobgpd` (operator statics,
//!   another tool) are left alone. With [`Ownership::LocallyOriginated`]
//!   (the default) every local route belongs to the agent: use it with a
//!   `gobgpd` dedicated to the agent.
//!
//! GoBGP keeps one local path per prefix (a new AddPath for a prefix replaces
//! the previous local path), so a changed route (other next hop, communities
//! or local-pref) is re-added in place, without a withdraw in between, and
//! the desired set can hold one route per prefix: when it holds several, the
//! first one in `Route` order wins. In `Marked` mode, announcing a VIP also
//! replaces an unmarked local path for the same prefix.
//!
//! Communities are compared as sets (sorted, without duplicates); the
//! routes [`Announcer::announced`] returns have them sorted.
//!
//! # Errors and restarts
//!
//! A speaker that cannot be connected to, drops the connection or does not
//! answer within the request timeout gives [`AnnounceError::Unreachable`]
//! (and the next call reconnects); any other gRPC error is
//! [`AnnounceError::Refused`]. A `gobgpd` that restarted has lost its
//! API-added neighbors and every path: the next apply adds the configured
//! [`GoBgpConfig::peers`] again (neighbors added with
//! [`GoBgpAnnouncer::add_peer`] alone are not remembered) and re-announces
//! everything; [`GoBgpAnnouncer::watch_peer_events`] tells when sessions come
//! up (and go down, e.g. to re-apply early).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use ipnet::IpNet;
use prost::Message;
use prost_types::Any;
use tonic::transport::{Channel, Endpoint};

use super::{
    fnv1a, AnnounceError, AnnounceResult, Announcer, BoxFuture, PeerLimit, Route, Session,
};

/// The generated client and messages of GoBGP's API subset.
#[allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    rustdoc::all,
    unreachable_pub,
    unused_qualifications
)]
pub mod apipb {
    tonic::include_proto!("apipb");
}

pub use apipb::peer_state::SessionState;
use apipb::{family, gobgp_api_client::GobgpApiClient};

/// Where `gobgpd` serves its API unless told otherwise (`--api-hosts`).
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:50051";

const TYPE_URL_PREFIX: &str = "type.googleapis.com/apipb.";
const ORIGIN_IGP: u32 = 0;

/// Which locally originated paths in GoBGP the announcer owns (see the
/// module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ownership {
    /// Every locally originated IPv4/IPv6 unicast host route.
    #[default]
    LocallyOriginated,
    /// Locally originated host routes carrying this standard community
    /// (ASN, value), which the announcer adds to everything it announces.
    Marked(u16, u16),
}

/// How to reach and use `gobgpd`.
#[derive(Clone, Debug)]
pub struct GoBgpConfig {
    /// The API endpoint, e.g. `http://127.0.0.1:50051`.
    pub endpoint: String,
    pub ownership: Ownership,
    /// Neighbors the announcer keeps configured: every
    /// [`apply`](Announcer::apply) first adds those `gobgpd` does not have
    /// (e.g. after it restarted empty). Neighbors are matched by address
    /// only: a changed setting of an existing neighbor is not pushed, and
    /// other neighbors are left alone.
    pub peers: Vec<PeerConfig>,
    /// Bound on connecting to the API.
    pub connect_timeout: Duration,
    /// Bound on each call, streamed answers included (not on
    /// [`GoBgpAnnouncer::watch_peer_events`]' stream).
    pub request_timeout: Duration,
}

impl Default for GoBgpConfig {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            ownership: Ownership::default(),
            peers: Vec::new(),
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// An address family a BGP session carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddressFamily {
    Ipv4Unicast,
    Ipv6Unicast,
}

impl AddressFamily {
    fn of(addr: &IpAddr) -> Self {
        if addr.is_ipv4() {
            Self::Ipv4Unicast
        } else {
            Self::Ipv6Unicast
        }
    }

    fn to_api(self) -> apipb::Family {
        let afi = match self {
            Self::Ipv4Unicast => family::Afi::Ip,
            Self::Ipv6Unicast => family::Afi::Ip6,
        };
        apipb::Family {
            afi: afi as i32,
            safi: family::Safi::Unicast as i32,
        }
    }
}

/// The connect-retry time the agent gives the neighbours it adds: gobgpd's
/// minimum (it waits at least 5 s between attempts).
pub const AGENT_CONNECT_RETRY: Duration = Duration::from_secs(5);

/// A BGP neighbor to add to `gobgpd` (the local ASN and router id are
/// `gobgpd`'s global settings).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerConfig {
    pub address: IpAddr,
    pub peer_asn: u32,
    /// Proposed hold time; `None` keeps GoBGP's default (90 s).
    pub hold_time: Option<Duration>,
    /// Keepalive interval; `None` keeps GoBGP's default (hold time / 3).
    pub keepalive: Option<Duration>,
    /// TCP MD5 password.
    pub password: Option<String>,
    /// eBGP multihop with this TTL; `None` for a directly connected peer.
    pub multihop_ttl: Option<u8>,
    /// Time between gobgpd's connection attempts after the first (which
    /// gobgpd makes 5-10 s after the neighbor is added, whatever this is);
    /// `None` keeps GoBGP's default of 120 s. A peer that never connects
    /// itself (a route reflector taking its clients as dynamic neighbours)
    /// is reached only by these attempts.
    pub connect_retry: Option<Duration>,
    /// Families to negotiate; empty means GoBGP's default, the family of
    /// the neighbor address. List both to carry IPv6 VIPs over an IPv4
    /// session (or the reverse).
    pub families: Vec<AddressFamily>,
    /// BGP graceful restart (RFC 4724) with this restart time: when
    /// `gobgpd` dies without a NOTIFICATION (SIGKILL; not SIGTERM) the peer
    /// keeps this node's routes for that long, and a `gobgpd` restarted
    /// with `-r` takes them over. `None`: off.
    pub graceful_restart: Option<Duration>,
}

impl PeerConfig {
    /// A peer of the agent's config (or a BGPPeer), as the agent adds it.
    pub fn of(p: &crate::config::BgpPeer) -> Self {
        Self {
            address: p.address,
            peer_asn: p.asn,
            hold_time: Some(p.hold_time),
            keepalive: Some(p.keepalive),
            password: p.password.clone(),
            multihop_ttl: p.multihop_ttl,
            // GoBGP's 120 s would leave a node cut off from a passive peer
            // (a route reflector) for minutes.
            connect_retry: Some(AGENT_CONNECT_RETRY),
            // VIPs of both families ride one session per peer.
            families: vec![AddressFamily::Ipv4Unicast, AddressFamily::Ipv6Unicast],
            graceful_restart: p.graceful_restart,
        }
    }

    /// A directly connected neighbor with GoBGP's defaults.
    pub fn new(address: IpAddr, peer_asn: u32) -> Self {
        Self {
            address,
            peer_asn,
            hold_time: None,
            keepalive: None,
            password: None,
            multihop_ttl: None,
            connect_retry: None,
            families: Vec::new(),
            graceful_restart: None,
        }
    }
}

/// A peer state change reported by [`PeerEvents`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerEvent {
    /// The neighbor address (`None` if GoBGP sent none or an unparsable one).
    pub address: Option<IpAddr>,
    pub state: SessionState,
    /// `true` for the snapshot of existing peers GoBGP may send when the
    /// watch starts, `false` for a change.
    pub initial: bool,
}

/// The stream of peer events from [`GoBgpAnnouncer::watch_peer_events`].
pub struct PeerEvents {
    inner: tonic::Streaming<apipb::WatchEventResponse>,
}

impl PeerEvents {
    /// The next peer event; `Ok(None)` when `gobgpd` ended the stream.
    pub async fn next(&mut self) -> AnnounceResult<Option<PeerEvent>> {
        use apipb::watch_event_response::{peer_event::Type, Event};
        loop {
            let Some(msg) = self.inner.message().await.map_err(status_error)? else {
                return Ok(None);
            };
            let Some(Event::Peer(ev)) = msg.event else {
                continue;
            };
            let kind = Type::try_from(ev.r#type).unwrap_or(Type::Unknown);
            if kind == Type::EndOfInit {
                continue;
            }
            let Some(peer) = ev.peer else {
                continue;
            };
            let (address, state) = peer_address_state(&peer);
            return Ok(Some(PeerEvent {
                address,
                state,
                initial: kind == Type::Init,
            }));
        }
    }
}

/// Drives `gobgpd` through its gRPC API.
pub struct GoBgpAnnouncer {
    config: GoBgpConfig,
    endpoint: Endpoint,
    client: Option<GobgpApiClient<Channel>>,
    /// Neighbors dropped from `config.peers` (a BGPPeer no longer
    /// selecting this node): deleted from `gobgpd` at the next apply.
    removed: BTreeSet<IpAddr>,
    /// The peer limits to keep in `gobgpd`'s export policy.
    limits: Vec<PeerLimit>,
    /// The limits `gobgpd` was last given; `None`: not known (the agent
    /// started, or the last change failed).
    limits_installed: Option<Vec<PeerLimit>>,
}

impl GoBgpAnnouncer {
    /// Checks the endpoint; connects on first use (and again after the
    /// speaker was unreachable).
    pub fn new(config: GoBgpConfig) -> Result<Self, tonic::transport::Error> {
        let endpoint =
            Endpoint::from_shared(config.endpoint.clone())?.connect_timeout(config.connect_timeout);
        Ok(Self {
            config,
            endpoint,
            client: None,
            removed: BTreeSet::new(),
            limits: Vec::new(),
            limits_installed: None,
        })
    }

    /// The default endpoint and ownership.
    pub fn with_defaults() -> Self {
        Self::new(GoBgpConfig::default()).expect("the default endpoint is a valid URI")
    }

    pub fn config(&self) -> &GoBgpConfig {
        &self.config
    }

    fn client(&mut self) -> GobgpApiClient<Channel> {
        self.client
            .get_or_insert_with(|| GobgpApiClient::new(self.endpoint.connect_lazy()))
            .clone()
    }

    /// Runs one call under the request timeout; forgets the connection when
    /// the speaker is unreachable so that the next call reconnects.
    async fn call<T, F>(&mut self, what: &str, fut: F) -> AnnounceResult<T>
    where
        F: std::future::Future<Output = AnnounceResult<T>>,
    {
        let res = match tokio::time::timeout(self.config.request_timeout, fut).await {
            Ok(res) => res,
            Err(_) => Err(AnnounceError::Unreachable(format!(
                "no answer within {:?}",
                self.config.request_timeout
            ))),
        };
        let ctx = |m: String| format!("gobgpd {}: {what}: {m}", self.config.endpoint);
        res.map_err(|e| match e {
            AnnounceError::Unreachable(m) => AnnounceError::Unreachable(ctx(m)),
            AnnounceError::Refused(m) => AnnounceError::Refused(ctx(m)),
        })
        .inspect_err(|e| {
            if matches!(e, AnnounceError::Unreachable(_)) {
                self.client = None;
            }
        })
    }

    /// Adds a BGP neighbor (AddPeer). GoBGP refuses a neighbor it already
    /// has ([`AnnounceError::Refused`]).
    pub async fn add_peer(&mut self, peer: &PeerConfig) -> AnnounceResult<()> {
        let req = apipb::AddPeerRequest {
            peer: Some(peer_to_api(peer)),
        };
        let mut client = self.client();
        self.call("AddPeer", async move {
            client.add_peer(req).await.map_err(status_error)?;
            Ok(())
        })
        .await
    }

    /// Deletes a BGP neighbor (DeletePeer); its session is closed with a
    /// NOTIFICATION, so the peer drops this node's routes at once.
    pub async fn delete_peer(&mut self, address: IpAddr) -> AnnounceResult<()> {
        let req = apipb::DeletePeerRequest {
            address: address.to_string(),
        };
        let mut client = self.client();
        self.call("DeletePeer", async move {
            client.delete_peer(req).await.map_err(status_error)?;
            Ok(())
        })
        .await
    }

    /// Adds the configured [`peers`](GoBgpConfig::peers) that `gobgpd`
    /// does not have and deletes the ones dropped from them; returns how
    /// many were added.
    pub async fn ensure_peers(&mut self) -> AnnounceResult<usize> {
        if self.config.peers.is_empty() && self.removed.is_empty() {
            return Ok(0);
        }
        let mut existing: BTreeSet<IpAddr> = self
            .list_peers()
            .await?
            .into_iter()
            .map(|(addr, _)| addr)
            .collect();
        for address in std::mem::take(&mut self.removed) {
            if existing.remove(&address) {
                tracing::info!(peer = %address, "gobgp: deleting BGP neighbor");
                if let Err(e) = self.delete_peer(address).await {
                    self.removed.insert(address);
                    return Err(e);
                }
            }
        }
        let missing: Vec<PeerConfig> = self
            .config
            .peers
            .iter()
            .filter(|p| !existing.contains(&p.address))
            .cloned()
            .collect();
        for peer in &missing {
            tracing::info!(peer = %peer.address, asn = peer.peer_asn, "gobgp: adding BGP neighbor");
            self.add_peer(peer).await?;
        }
        Ok(missing.len())
    }

    /// Keeps `gobgpd`'s global export policy holding back the routes of
    /// each limited prefix from every neighbor but its peers. When it
    /// changes, our paths in the prefixes whose limits changed are
    /// withdrawn under the old policy and added again under the new one:
    /// gobgpd 3.10 withdraws nothing that a new policy rejects (its soft
    /// reset out only sends what the policy accepts), so a peer that is no
    /// longer allowed a route would keep it. A peer still allowed sees the
    /// route withdrawn and announced again at once.
    async fn keep_limits(&mut self) -> AnnounceResult<()> {
        let desired = self.limits.clone();
        let unchanged = self.limits_installed.as_ref() == Some(&desired);
        if unchanged && desired.is_empty() {
            return Ok(());
        }
        let assigned = self.export_policies().await?;
        let name = limits_policy_name(&desired);
        let ours_assigned: Vec<&String> = assigned
            .iter()
            .filter(|n| n.starts_with(LIMITS_POLICY))
            .collect();
        if ours_assigned == [&name] {
            // In force already (also after the agent restarted).
            self.limits_installed = Some(desired);
            return Ok(());
        }
        // Unknown before (the agent started): every limited prefix.
        let before = self.limits_installed.clone().unwrap_or_default();
        let changed: Vec<IpNet> = before
            .iter()
            .filter(|l| !desired.contains(l))
            .chain(desired.iter().filter(|l| !before.contains(l)))
            .map(|l| l.prefix)
            .collect();
        let affected: Vec<Route> = self
            .list_owned()
            .await?
            .into_values()
            .filter(|r| changed.iter().any(|p| p.contains(&r.prefix)))
            .collect();
        for r in &affected {
            self.delete_path(r).await?;
        }
        self.sync_limits(&assigned).await?;
        for r in &affected {
            self.add_path(r).await?;
        }
        Ok(())
    }

    /// Makes `gobgpd`'s global export policy the one for `self.limits`
    /// (`assigned`: the global export policies now): one statement per
    /// set of peers (prefixes in it, the neighbor not one of them:
    /// reject). The new policy is assigned before the old one goes, so no
    /// route slips out between; then every neighbor gets what the policy
    /// accepts (a soft reset out).
    async fn sync_limits(&mut self, assigned: &[String]) -> AnnounceResult<()> {
        let desired = self.limits.clone();
        let name = limits_policy_name(&desired);
        self.limits_installed = None;
        let ours = |n: &String| n.starts_with(LIMITS_POLICY);
        let adding = !desired.is_empty() && !assigned.contains(&name);
        if adding {
            let (sets, policy) = limits_policy(&desired);
            let mut client = self.client();
            self.call("AddPolicy", async move {
                for set in sets {
                    let name = set.name.clone();
                    // Left by an earlier attempt: replaced.
                    let _ = client
                        .delete_defined_set(apipb::DeleteDefinedSetRequest {
                            defined_set: Some(apipb::DefinedSet {
                                defined_type: set.defined_type,
                                name: name.clone(),
                                ..Default::default()
                            }),
                            all: true,
                        })
                        .await;
                    client
                        .add_defined_set(apipb::AddDefinedSetRequest {
                            defined_set: Some(set),
                        })
                        .await
                        .map_err(status_error)?;
                }
                let _ = client
                    .delete_policy(apipb::DeletePolicyRequest {
                        policy: Some(apipb::Policy {
                            name: policy.name.clone(),
                            statements: Vec::new(),
                        }),
                        preserve_statements: false,
                        all: true,
                    })
                    .await;
                let name = policy.name.clone();
                client
                    .add_policy(apipb::AddPolicyRequest {
                        policy: Some(policy),
                        refer_existing_statements: false,
                    })
                    .await
                    .map_err(status_error)?;
                client
                    .add_policy_assignment(apipb::AddPolicyAssignmentRequest {
                        assignment: Some(global_export(&name)),
                    })
                    .await
                    .map_err(status_error)?;
                Ok(())
            })
            .await?;
        }
        // Then the old ones go: their assignment, policy and sets.
        let old: Vec<String> = assigned
            .iter()
            .filter(|n| ours(n) && **n != name)
            .cloned()
            .collect();
        let mut client = self.client();
        let keep = name.clone();
        let deleted = self
            .call("DeletePolicy", async move {
                let mut deleted = old.len();
                for old in &old {
                    client
                        .delete_policy_assignment(apipb::DeletePolicyAssignmentRequest {
                            assignment: Some(global_export(old)),
                            all: false,
                        })
                        .await
                        .map_err(status_error)?;
                }
                let mut policies = client
                    .list_policy(apipb::ListPolicyRequest::default())
                    .await
                    .map_err(status_error)?
                    .into_inner();
                let mut stale = Vec::new();
                while let Some(msg) = policies.message().await.map_err(status_error)? {
                    if let Some(p) = msg.policy.filter(|p| ours(&p.name) && p.name != keep) {
                        stale.push(p.name);
                    }
                }
                deleted += stale.len();
                for name in stale {
                    client
                        .delete_policy(apipb::DeletePolicyRequest {
                            policy: Some(apipb::Policy {
                                name,
                                statements: Vec::new(),
                            }),
                            preserve_statements: false,
                            all: true,
                        })
                        .await
                        .map_err(status_error)?;
                }
                let keep_sets = format!("{keep}-");
                for defined_type in [apipb::DefinedType::Prefix, apipb::DefinedType::Neighbor] {
                    let mut sets = client
                        .list_defined_set(apipb::ListDefinedSetRequest {
                            defined_type: defined_type as i32,
                            name: String::new(),
                        })
                        .await
                        .map_err(status_error)?
                        .into_inner();
                    let mut stale = Vec::new();
                    while let Some(msg) = sets.message().await.map_err(status_error)? {
                        if let Some(s) = msg.defined_set.filter(|s| {
                            s.name.starts_with(LIMITS_POLICY) && !s.name.starts_with(&keep_sets)
                        }) {
                            stale.push(s.name);
                        }
                    }
                    deleted += stale.len();
                    for name in stale {
                        client
                            .delete_defined_set(apipb::DeleteDefinedSetRequest {
                                defined_set: Some(apipb::DefinedSet {
                                    defined_type: defined_type as i32,
                                    name,
                                    ..Default::default()
                                }),
                                all: true,
                            })
                            .await
                            .map_err(status_error)?;
                    }
                }
                Ok(deleted)
            })
            .await?;
        if !adding && deleted == 0 {
            self.limits_installed = Some(desired);
            return Ok(());
        }
        // Every neighbor's routes again, under the policy now in force.
        let neighbors: Vec<IpAddr> = self
            .list_peers()
            .await?
            .into_iter()
            .map(|(a, _)| a)
            .collect();
        let mut client = self.client();
        self.call("ResetPeer", async move {
            for address in neighbors {
                client
                    .reset_peer(apipb::ResetPeerRequest {
                        address: address.to_string(),
                        communication: String::new(),
                        soft: true,
                        direction: apipb::reset_peer_request::SoftResetDirection::Out as i32,
                    })
                    .await
                    .map_err(status_error)?;
            }
            Ok(())
        })
        .await?;
        tracing::info!(limits = desired.len(), policy = %name, "gobgp: peer limits in the export policy");
        self.limits_installed = Some(desired);
        Ok(())
    }

    /// The policies assigned to the global export policy.
    async fn export_policies(&mut self) -> AnnounceResult<Vec<String>> {
        let mut client = self.client();
        self.call("ListPolicyAssignment", async move {
            let mut stream = client
                .list_policy_assignment(apipb::ListPolicyAssignmentRequest {
                    name: "global".into(),
                    direction: apipb::PolicyDirection::Export as i32,
                })
                .await
                .map_err(status_error)?
                .into_inner();
            let mut names = Vec::new();
            while let Some(msg) = stream.message().await.map_err(status_error)? {
                names.extend(
                    msg.assignment
                        .into_iter()
                        .flat_map(|a| a.policies)
                        .map(|p| p.name),
                );
            }
            Ok(names)
        })
        .await
    }

    /// Every neighbor and its session state (ListPeer).
    pub async fn list_peers(&mut self) -> AnnounceResult<Vec<(IpAddr, SessionState)>> {
        let mut client = self.client();
        self.call("ListPeer", async move {
            let mut stream = client
                .list_peer(apipb::ListPeerRequest::default())
                .await
                .map_err(status_error)?
                .into_inner();
            let mut peers = Vec::new();
            while let Some(msg) = stream.message().await.map_err(status_error)? {
                if let Some(peer) = msg.peer {
                    if let (Some(addr), state) = peer_address_state(&peer) {
                        peers.push((addr, state));
                    }
                }
            }
            Ok(peers)
        })
        .await
    }

    /// Watches peer state changes (WatchEvent with a peer filter), e.g. to
    /// re-add peers and re-apply after `gobgpd` restarted. Only the call is
    /// bounded by the request timeout; the stream lasts until `gobgpd` ends
    /// it or goes away (then [`PeerEvents::next`] fails).
    pub async fn watch_peer_events(&mut self) -> AnnounceResult<PeerEvents> {
        let req = apipb::WatchEventRequest {
            peer: Some(apipb::watch_event_request::Peer {}),
        };
        let mut client = self.client();
        self.call("WatchEvent", async move {
            let inner = client
                .watch_event(req)
                .await
                .map_err(status_error)?
                .into_inner();
            Ok(PeerEvents { inner })
        })
        .await
    }

    /// Our paths in the global RIB (ListPath, IPv4 and IPv6 unicast), by
    /// prefix, with the marker community removed.
    async fn list_owned(&mut self) -> AnnounceResult<BTreeMap<IpNet, Route>> {
        let ownership = self.config.ownership;
        let mut client = self.client();
        self.call("ListPath", async move {
            let mut owned = BTreeMap::new();
            for fam in [AddressFamily::Ipv4Unicast, AddressFamily::Ipv6Unicast] {
                let req = apipb::ListPathRequest {
                    table_type: apipb::TableType::Global as i32,
                    family: Some(fam.to_api()),
                    ..Default::default()
                };
                let mut stream = client
                    .list_path(req)
                    .await
                    .map_err(status_error)?
                    .into_inner();
                while let Some(msg) = stream.message().await.map_err(status_error)? {
                    for path in msg.destination.into_iter().flat_map(|d| d.paths) {
                        if let Some(route) = owned_route(&path, ownership) {
                            owned.insert(route.prefix, route);
                        }
                    }
                }
            }
            Ok(owned)
        })
        .await
    }

    async fn add_path(&mut self, route: &Route) -> AnnounceResult<()> {
        let req = apipb::AddPathRequest {
            table_type: apipb::TableType::Global as i32,
            vrf_id: String::new(),
            path: Some(route_to_path(route, self.config.ownership)),
        };
        let mut client = self.client();
        self.call(&format!("AddPath {route}"), async move {
            client.add_path(req).await.map_err(status_error)?;
            Ok(())
        })
        .await
    }

    async fn delete_path(&mut self, route: &Route) -> AnnounceResult<()> {
        // Always with a path: a DeletePath without path nor uuid withdraws
        // every local path of the family.
        let path = route_to_path(route, self.config.ownership);
        let req = apipb::DeletePathRequest {
            table_type: apipb::TableType::Global as i32,
            vrf_id: String::new(),
            family: path.family,
            path: Some(path),
            uuid: Vec::new(),
        };
        let mut client = self.client();
        self.call(&format!("DeletePath {route}"), async move {
            client.delete_path(req).await.map_err(status_error)?;
            Ok(())
        })
        .await
    }
}

impl Announcer for GoBgpAnnouncer {
    fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<Session>>> {
        Box::pin(async move {
            let mut client = self.client();
            self.call("ListPeer", async move {
                let req = apipb::ListPeerRequest {
                    enable_advertised: true,
                    ..Default::default()
                };
                let mut stream = client
                    .list_peer(req)
                    .await
                    .map_err(status_error)?
                    .into_inner();
                let mut sessions = Vec::new();
                let now = std::time::SystemTime::now();
                while let Some(msg) = stream.message().await.map_err(status_error)? {
                    sessions.extend(msg.peer.as_ref().and_then(|p| session_of(p, now)));
                }
                Ok(sessions)
            })
            .await
        })
    }

    fn name(&self) -> &'static str {
        "gobgp"
    }

    fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>> {
        Box::pin(async move { Ok(self.list_owned().await?.into_values().collect()) })
    }

    /// A peer whose settings changed is deleted and added again (GoBGP
    /// matches neighbors by address only).
    fn set_peers(&mut self, peers: &[crate::config::BgpPeer]) -> Result<(), String> {
        let new: Vec<PeerConfig> = peers.iter().map(PeerConfig::of).collect();
        for old in &self.config.peers {
            if !new.contains(old) {
                self.removed.insert(old.address);
            }
        }
        self.config.peers = new;
        Ok(())
    }

    /// Kept in `gobgpd`'s global export policy, so that every session is
    /// held to them, the agent's and any other.
    fn set_peer_limits(&mut self, limits: &[PeerLimit]) -> Result<(), String> {
        self.limits = limits.to_vec();
        Ok(())
    }

    fn limits_every_session(&self) -> bool {
        true
    }

    fn apply<'a>(
        &'a mut self,
        desired: &'a BTreeSet<Route>,
    ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>> {
        Box::pin(async move {
            // The policy first: a limited route never leaves unfiltered.
            self.keep_limits().await?;
            let desired = desired_by_prefix(desired, self.config.ownership);
            let current = self.list_owned().await?;
            let mut added = 0;
            for (prefix, route) in &desired {
                if current.get(prefix) != Some(route) {
                    // Replaces our previous path for the VIP, if any.
                    self.add_path(route).await?;
                    added += 1;
                }
            }
            let mut withdrawn = 0;
            for (prefix, route) in &current {
                if !desired.contains_key(prefix) {
                    self.delete_path(route).await?;
                    withdrawn += 1;
                }
            }
            // Peers last: a restarted gobgpd then opens its sessions with
            // every path in place, and its first End-of-RIB ends the peers'
            // graceful restart without a withdrawal.
            self.ensure_peers().await?;
            Ok((added, withdrawn))
        })
    }
}

/// The desired routes, one per prefix (the first in `Route` order), with
/// communities normalized and the marker left out.
fn desired_by_prefix(desired: &BTreeSet<Route>, ownership: Ownership) -> BTreeMap<IpNet, Route> {
    let mut by_prefix = BTreeMap::new();
    for route in desired {
        if by_prefix.contains_key(&route.prefix) {
            tracing::warn!(%route, "gobgp: one route per prefix; ignoring this one");
            continue;
        }
        let mut route = route.clone();
        normalize_communities(&mut route.communities, ownership);
        by_prefix.insert(route.prefix, route);
    }
    by_prefix
}

fn normalize_communities(communities: &mut Vec<(u16, u16)>, ownership: Ownership) {
    if let Ownership::Marked(a, v) = ownership {
        communities.retain(|&c| c != (a, v));
    }
    communities.sort_unstable();
    communities.dedup();
}

fn community_to_u32((asn, value): (u16, u16)) -> u32 {
    (u32::from(asn) << 16) | u32::from(value)
}

fn community_from_u32(c: u32) -> (u16, u16) {
    ((c >> 16) as u16, c as u16)
}

fn pack<M: Message>(name: &str, msg: &M) -> Any {
    Any {
        type_url: format!("{TYPE_URL_PREFIX}{name}"),
        value: msg.encode_to_vec(),
    }
}

/// Decodes `any` if it holds the apipb message `name`.
fn unpack<M: Message + Default>(name: &str, any: &Any) -> Option<M> {
    let short = any.type_url.strip_prefix(TYPE_URL_PREFIX)?;
    if short != name {
        return None;
    }
    M::decode(any.value.as_slice()).ok()
}

/// The API path announcing `route`: NLRI, ORIGIN IGP, the next hop
/// (NEXT_HOP for IPv4 over IPv4, else MP_REACH_NLRI as GoBGP expects for
/// IPv6), communities (with the marker) and LOCAL_PREF.
fn route_to_path(route: &Route, ownership: Ownership) -> apipb::Path {
    let fam = AddressFamily::of(&route.prefix.addr()).to_api();
    let nlri = pack(
        "IPAddressPrefix",
        &apipb::IpAddressPrefix {
            prefix_len: u32::from(route.prefix.prefix_len()),
            prefix: route.prefix.addr().to_string(),
        },
    );
    let mut pattrs = vec![pack(
        "OriginAttribute",
        &apipb::OriginAttribute { origin: ORIGIN_IGP },
    )];
    if route.prefix.addr().is_ipv4() && route.next_hop.is_ipv4() {
        pattrs.push(pack(
            "NextHopAttribute",
            &apipb::NextHopAttribute {
                next_hop: route.next_hop.to_string(),
            },
        ));
    } else {
        pattrs.push(pack(
            "MpReachNLRIAttribute",
            &apipb::MpReachNlriAttribute {
                family: Some(fam),
                next_hops: vec![route.next_hop.to_string()],
                nlris: vec![nlri.clone()],
            },
        ));
    }
    let mut communities = route.communities.clone();
    normalize_communities(&mut communities, ownership);
    if let Ownership::Marked(a, v) = ownership {
        communities.push((a, v));
    }
    if !communities.is_empty() {
        pattrs.push(pack(
            "CommunitiesAttribute",
            &apipb::CommunitiesAttribute {
                communities: communities.into_iter().map(community_to_u32).collect(),
            },
        ));
    }
    if !route.large_communities.is_empty() {
        let mut large = route.large_communities.clone();
        large.sort_unstable();
        large.dedup();
        pattrs.push(pack(
            "LargeCommunitiesAttribute",
            &apipb::LargeCommunitiesAttribute {
                communities: large
                    .into_iter()
                    .map(|(g, l1, l2)| apipb::LargeCommunity {
                        global_admin: g,
                        local_data1: l1,
                        local_data2: l2,
                    })
                    .collect(),
            },
        ));
    }
    if let Some(local_pref) = route.local_pref {
        pattrs.push(pack(
            "LocalPrefAttribute",
            &apipb::LocalPrefAttribute { local_pref },
        ));
    }
    apipb::Path {
        nlri: Some(nlri),
        pattrs,
        family: Some(fam),
        ..Default::default()
    }
}

/// The route `path` announces, if it is ours (see the module docs).
fn owned_route(path: &apipb::Path, ownership: Ownership) -> Option<Route> {
    if path.is_withdraw || !is_local(path) {
        return None;
    }
    let prefix: apipb::IpAddressPrefix = unpack("IPAddressPrefix", path.nlri.as_ref()?)?;
    let addr: IpAddr = prefix.prefix.parse().ok()?;
    let prefix = IpNet::new(addr, u8::try_from(prefix.prefix_len).ok()?).ok()?;
    let mut next_hop = None;
    let mut communities = Vec::new();
    let mut large_communities = Vec::new();
    let mut local_pref = None;
    for attr in &path.pattrs {
        if let Some(a) = unpack::<apipb::NextHopAttribute>("NextHopAttribute", attr) {
            next_hop = a.next_hop.parse().ok();
        } else if let Some(a) = unpack::<apipb::MpReachNlriAttribute>("MpReachNLRIAttribute", attr)
        {
            if next_hop.is_none() {
                next_hop = a.next_hops.first().and_then(|n| n.parse().ok());
            }
        } else if let Some(a) = unpack::<apipb::CommunitiesAttribute>("CommunitiesAttribute", attr)
        {
            communities.extend(a.communities.into_iter().map(community_from_u32));
        } else if let Some(a) =
            unpack::<apipb::LargeCommunitiesAttribute>("LargeCommunitiesAttribute", attr)
        {
            large_communities.extend(
                a.communities
                    .into_iter()
                    .map(|c| (c.global_admin, c.local_data1, c.local_data2)),
            );
        } else if let Some(a) = unpack::<apipb::LocalPrefAttribute>("LocalPrefAttribute", attr) {
            local_pref = Some(a.local_pref);
        }
    }
    if let Ownership::Marked(a, v) = ownership {
        if !communities.contains(&(a, v)) {
            return None;
        }
    }
    normalize_communities(&mut communities, ownership);
    Some(
        Route {
            prefix,
            next_hop: next_hop?,
            communities,
            large_communities,
            local_pref,
        }
        .normalized(),
    )
}

/// Locally originated: GoBGP gives no neighbor address for paths that were
/// not learned from a peer ("<nil>" or empty).
fn is_local(path: &apipb::Path) -> bool {
    path.neighbor_ip
        .parse::<IpAddr>()
        .map_or(true, |ip| ip.is_unspecified())
}

fn peer_to_api(p: &PeerConfig) -> apipb::Peer {
    let secs = |d: Option<Duration>| d.map_or(0, |d| d.as_secs());
    // Graceful restart needs the families listed (it is per family).
    let families = match (&p.families[..], p.graceful_restart) {
        ([], Some(_)) => vec![AddressFamily::of(&p.address)],
        _ => p.families.clone(),
    };
    let timers = (p.hold_time.is_some() || p.keepalive.is_some() || p.connect_retry.is_some())
        .then(|| apipb::Timers {
            config: Some(apipb::TimersConfig {
                connect_retry: secs(p.connect_retry),
                hold_time: secs(p.hold_time),
                keepalive_interval: secs(p.keepalive),
                ..Default::default()
            }),
            state: None,
        });
    apipb::Peer {
        conf: Some(apipb::PeerConf {
            neighbor_address: p.address.to_string(),
            peer_asn: p.peer_asn,
            auth_password: p.password.clone().unwrap_or_default(),
            ..Default::default()
        }),
        ebgp_multihop: p.multihop_ttl.map(|ttl| apipb::EbgpMultihop {
            enabled: true,
            multihop_ttl: u32::from(ttl),
        }),
        timers,
        graceful_restart: p.graceful_restart.map(|t| apipb::GracefulRestart {
            enabled: true,
            restart_time: t.as_secs() as u32,
            helper_only: false,
            // A neighbour is added to a gobgpd that has none: it started
            // or restarted, and cannot tell which. Either way the node's
            // data plane kept forwarding (it outlives the agent and the
            // speaker), so the peer may keep what it learned from us until
            // our End-of-RIB; after a first start it has nothing to keep.
            local_restarting: true,
            deferral_time: 1,
        }),
        afi_safis: families
            .iter()
            .map(|f| apipb::AfiSafi {
                // Graceful restart is negotiated per family.
                mp_graceful_restart: p.graceful_restart.map(|_| apipb::MpGracefulRestart {
                    config: Some(apipb::MpGracefulRestartConfig { enabled: true }),
                }),
                config: Some(apipb::AfiSafiConfig {
                    family: Some(f.to_api()),
                    enabled: true,
                }),
                state: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn peer_address_state(peer: &apipb::Peer) -> (Option<IpAddr>, SessionState) {
    let conf_addr = peer.conf.as_ref().map(|c| c.neighbor_address.as_str());
    let state_addr = peer.state.as_ref().map(|s| s.neighbor_address.as_str());
    let address = [conf_addr, state_addr]
        .into_iter()
        .flatten()
        .find_map(|a| a.parse().ok());
    let state = peer
        .state
        .as_ref()
        .and_then(|s| SessionState::try_from(s.session_state).ok())
        .unwrap_or(SessionState::Unknown);
    (address, state)
}

/// The name the agent's export policy starts with; its defined sets start
/// with the policy's name.
const LIMITS_POLICY: &str = "xlb-peer-limits";

/// The policy for `limits`: named after a hash of them, so that a change
/// is a new policy beside the old one.
fn limits_policy_name(limits: &[PeerLimit]) -> String {
    let text: String = limits
        .iter()
        .map(|l| format!("{} {:?};", l.prefix, l.peers))
        .collect();
    format!("{LIMITS_POLICY}-{:08x}", fnv1a(text.as_bytes()))
}

/// The defined sets and the policy for `limits`: per set of peers, a
/// prefix set (each limited prefix and every longer one inside it), a
/// neighbor set (the peers), and a statement rejecting a route of the
/// prefixes to any neighbor not in it (to every neighbor when no peer is
/// allowed).
fn limits_policy(limits: &[PeerLimit]) -> (Vec<apipb::DefinedSet>, apipb::Policy) {
    let name = limits_policy_name(limits);
    let mut by_peers: BTreeMap<&BTreeSet<IpAddr>, Vec<IpNet>> = BTreeMap::new();
    for l in limits {
        by_peers.entry(&l.peers).or_default().push(l.prefix);
    }
    let mut sets = Vec::new();
    let mut statements = Vec::new();
    for (i, (peers, prefixes)) in by_peers.into_iter().enumerate() {
        let prefix_set = format!("{name}-{i}-prefixes");
        sets.push(apipb::DefinedSet {
            defined_type: apipb::DefinedType::Prefix as i32,
            name: prefix_set.clone(),
            list: Vec::new(),
            prefixes: prefixes
                .iter()
                .map(|p| apipb::Prefix {
                    ip_prefix: p.to_string(),
                    mask_length_min: u32::from(p.prefix_len()),
                    mask_length_max: u32::from(p.max_prefix_len()),
                })
                .collect(),
        });
        let neighbor_set = (!peers.is_empty()).then(|| {
            let set = format!("{name}-{i}-peers");
            sets.push(apipb::DefinedSet {
                defined_type: apipb::DefinedType::Neighbor as i32,
                name: set.clone(),
                list: peers.iter().map(|p| IpNet::from(*p).to_string()).collect(),
                prefixes: Vec::new(),
            });
            apipb::MatchSet {
                r#type: apipb::match_set::Type::Invert as i32,
                name: set,
            }
        });
        statements.push(apipb::Statement {
            name: format!("{name}-{i}"),
            conditions: Some(apipb::Conditions {
                prefix_set: Some(apipb::MatchSet {
                    r#type: apipb::match_set::Type::Any as i32,
                    name: prefix_set,
                }),
                neighbor_set,
            }),
            actions: Some(apipb::Actions {
                route_action: apipb::RouteAction::Reject as i32,
            }),
        });
    }
    (sets, apipb::Policy { name, statements })
}

/// The global export assignment of policy `name`; routes no statement
/// rejects are accepted.
fn global_export(name: &str) -> apipb::PolicyAssignment {
    apipb::PolicyAssignment {
        name: "global".into(),
        direction: apipb::PolicyDirection::Export as i32,
        policies: vec![apipb::Policy {
            name: name.into(),
            statements: Vec::new(),
        }],
        default_action: apipb::RouteAction::Accept as i32,
    }
}

/// The session of a ListPeer answer (asked with `enableAdvertised`): its
/// uptime from the time it was established, and the prefixes advertised
/// over all families.
fn session_of(peer: &apipb::Peer, now: std::time::SystemTime) -> Option<Session> {
    let (address, state) = peer_address_state(peer);
    let established = state == SessionState::Established;
    let mut session = Session::new(address?, established);
    if established {
        session.uptime = peer
            .timers
            .as_ref()
            .and_then(|t| t.state.as_ref())
            .and_then(|s| s.uptime)
            .and_then(|t| std::time::SystemTime::try_from(t).ok())
            .map(|since| now.duration_since(since).unwrap_or_default());
        session.prefixes_sent = Some(
            peer.afi_safis
                .iter()
                .filter_map(|a| a.state.as_ref())
                .map(|s| s.advertised)
                .sum(),
        );
    }
    Some(session)
}

/// Connection-level failures (refused, reset, gone away) are Unreachable;
/// an error `gobgpd` answered with is Refused.
fn status_error(status: tonic::Status) -> AnnounceError {
    use tonic::Code;
    let transport = {
        let mut source = std::error::Error::source(&status);
        let mut found = false;
        while let Some(e) = source {
            if e.is::<tonic::transport::Error>() || e.is::<std::io::Error>() {
                found = true;
                break;
            }
            source = e.source();
        }
        found
    };
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded => {
            AnnounceError::Unreachable(status.message().to_string())
        }
        _ if transport => AnnounceError::Unreachable(status.message().to_string()),
        code => AnnounceError::Refused(format!("{code:?}: {}", status.message())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_timers_reach_gobgp() {
        let mut p = PeerConfig::new("10.0.0.254".parse().unwrap(), 65000);
        assert!(peer_to_api(&p).timers.is_none(), "GoBGP's defaults");
        p.connect_retry = Some(AGENT_CONNECT_RETRY);
        p.hold_time = Some(Duration::from_secs(3));
        let t = peer_to_api(&p).timers.unwrap().config.unwrap();
        assert_eq!(
            (t.connect_retry, t.hold_time, t.keepalive_interval),
            (5, 3, 0)
        );
    }

    #[test]
    fn graceful_restart_reaches_gobgp_per_family() {
        let mut p = PeerConfig::new("10.0.0.254".parse().unwrap(), 65000);
        let api = peer_to_api(&p);
        assert!(api.graceful_restart.is_none() && api.afi_safis.is_empty());
        p.graceful_restart = Some(Duration::from_secs(30));
        let api = peer_to_api(&p);
        let gr = api.graceful_restart.unwrap();
        assert!(gr.enabled && gr.local_restarting);
        assert_eq!(gr.restart_time, 30);
        // Negotiated per family: the neighbour's own when none is listed.
        assert_eq!(api.afi_safis.len(), 1);
        assert!(api.afi_safis[0]
            .mp_graceful_restart
            .as_ref()
            .and_then(|m| m.config.as_ref())
            .is_some_and(|c| c.enabled));
        p.families = vec![AddressFamily::Ipv4Unicast, AddressFamily::Ipv6Unicast];
        assert_eq!(peer_to_api(&p).afi_safis.len(), 2);
    }

    fn route(vip: &str, nh: &str, communities: Vec<(u16, u16)>, lp: Option<u32>) -> Route {
        Route {
            prefix: IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: nh.parse().unwrap(),
            communities,
            large_communities: vec![],
            local_pref: lp,
        }
    }

    #[test]
    fn paths_round_trip() {
        for ownership in [Ownership::LocallyOriginated, Ownership::Marked(64512, 1)] {
            for r in [
                route("192.0.2.10", "10.0.0.1", vec![(65000, 100)], Some(200)),
                route("2001:db8::10", "fd00::1", vec![], None),
                route("192.0.2.11", "fd00::1", vec![(1, 2), (0, 1)], None),
                Route {
                    prefix: "192.0.2.0/24".parse().unwrap(),
                    ..route("192.0.2.0", "10.0.0.1", vec![], None)
                },
            ] {
                let path = route_to_path(&r, ownership);
                let mut want = r.clone();
                want.communities.sort();
                assert_eq!(owned_route(&path, ownership), Some(want), "{r}");
            }
        }
    }

    #[test]
    fn ownership_filters_paths() {
        let r = route("192.0.2.10", "10.0.0.1", vec![(65000, 100)], None);
        let unmarked = route_to_path(&r, Ownership::LocallyOriginated);
        assert_eq!(owned_route(&unmarked, Ownership::Marked(64512, 1)), None);
        let mut from_peer = unmarked.clone();
        from_peer.neighbor_ip = "10.0.0.2".into();
        assert_eq!(owned_route(&from_peer, Ownership::LocallyOriginated), None);
        let mut local = unmarked.clone();
        local.neighbor_ip = "<nil>".into();
        assert!(owned_route(&local, Ownership::LocallyOriginated).is_some());
        // The marker is ours, not part of the route.
        let marked = route_to_path(&r, Ownership::Marked(64512, 1));
        let got = owned_route(&marked, Ownership::Marked(64512, 1)).unwrap();
        assert_eq!(got.communities, vec![(65000, 100)]);
    }

    #[test]
    fn a_session_reads_its_uptime_and_advertised_prefixes() {
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let family = |advertised| apipb::AfiSafi {
            state: Some(apipb::AfiSafiState {
                advertised,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut peer = apipb::Peer {
            conf: Some(apipb::PeerConf {
                neighbor_address: "10.0.0.254".into(),
                ..Default::default()
            }),
            state: Some(apipb::PeerState {
                session_state: apipb::peer_state::SessionState::Established as i32,
                ..Default::default()
            }),
            timers: Some(apipb::Timers {
                config: None,
                state: Some(apipb::TimersState {
                    uptime: Some(prost_types::Timestamp {
                        seconds: 1_000_000 - 90,
                        nanos: 0,
                    }),
                    ..Default::default()
                }),
            }),
            afi_safis: vec![family(3), family(1)],
            ..Default::default()
        };
        let s = session_of(&peer, now).unwrap();
        assert_eq!(
            (s.established, s.uptime, s.prefixes_sent),
            (true, Some(Duration::from_secs(90)), Some(4))
        );
        // Down: neither (GoBGP keeps the last uptime and counts).
        peer.state.as_mut().unwrap().session_state = apipb::peer_state::SessionState::Active as i32;
        assert_eq!(
            session_of(&peer, now),
            Some(Session::new("10.0.0.254".parse().unwrap(), false))
        );
    }

    #[test]
    fn communities_pack_asn_high() {
        assert_eq!(community_to_u32((65000, 100)), 0xFDE8_0064);
        assert_eq!(community_from_u32(0xFDE8_0064), (65000, 100));
    }

    #[test]
    fn one_route_per_vip() {
        let desired: BTreeSet<_> = [
            route("192.0.2.10", "10.0.0.2", vec![], None),
            route("192.0.2.10", "10.0.0.1", vec![(2, 2), (1, 1), (2, 2)], None),
        ]
        .into();
        let by_prefix = desired_by_prefix(&desired, Ownership::LocallyOriginated);
        assert_eq!(by_prefix.len(), 1);
        let r = &by_prefix[&"192.0.2.10/32".parse::<IpNet>().unwrap()];
        assert_eq!(r.next_hop.to_string(), "10.0.0.1");
        assert_eq!(r.communities, vec![(1, 1), (2, 2)]);
    }
}
