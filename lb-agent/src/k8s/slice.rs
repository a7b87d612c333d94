//! EndpointSlices as the watch cache keeps them: only what the desired
//! state reads. The cache holds every slice of the cluster, and the typed
//! object carries per endpoint a list of address strings, a Pod reference
//! of seven optional strings, hints, a zone and more; with 100,000
//! endpoints that was most of the agent's memory. Each slice is converted
//! as it arrives, so the typed one lives only while its page is decoded.

use std::{borrow::Cow, collections::HashMap, net::IpAddr, sync::Arc};

use k8s_openapi::{
    api::discovery::v1::{EndpointPort, EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    NamespaceResourceScope, Resource as _,
};

/// An EndpointSlice, compact.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slice {
    /// Its name, namespace, labels and resourceVersion; nothing else.
    pub metadata: ObjectMeta,
    /// `IPv4` or `IPv6` (or `FQDN`, which nothing reads).
    pub address_type: String,
    pub ports: Vec<EndpointPort>,
    pub endpoints: Vec<Endpoint>,
}

/// One endpoint of a [`Slice`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Endpoint {
    /// The first address, the one consumers use (the rest are fungible);
    /// `None` when there is none or it does not parse.
    pub ip: Option<IpAddr>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// `nodeName`; one allocation per name and slice.
    pub node: Option<Arc<str>>,
    /// `None` when there are none (most endpoints: one pointer, not two
    /// lists, per endpoint).
    pub hints: Option<Box<Hints>>,
    /// The UID of its Pod (`targetRef` of kind Pod): finds a local Pod's
    /// cgroup for load-aware balancing.
    pub pod_uid: Option<Box<str>>,
}

/// An endpoint's topology hints.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hints {
    /// `hints.forNodes`; `None` when there are none.
    pub for_nodes: Option<Box<[Arc<str>]>>,
    /// `hints.forZones`; `None` when there are none.
    pub for_zones: Option<Box<[Arc<str>]>>,
}

impl Endpoint {
    pub fn for_nodes(&self) -> Option<&[Arc<str>]> {
        self.hints.as_ref()?.for_nodes.as_deref()
    }

    pub fn for_zones(&self) -> Option<&[Arc<str>]> {
        self.hints.as_ref()?.for_zones.as_deref()
    }
}

impl From<EndpointSlice> for Slice {
    fn from(s: EndpointSlice) -> Slice {
        // Node and zone names repeat across a slice's endpoints.
        let mut names: HashMap<String, Arc<str>> = HashMap::new();
        let mut intern = |n: String| -> Arc<str> {
            names
                .entry(n)
                .or_insert_with_key(|n| Arc::from(n.as_str()))
                .clone()
        };
        let endpoints = s
            .endpoints
            .into_iter()
            .map(|e| {
                let conditions = e.conditions.unwrap_or_default();
                let hints = e.hints.unwrap_or_default();
                let for_nodes: Box<[Arc<str>]> = hints
                    .for_nodes
                    .into_iter()
                    .flatten()
                    .map(|n| intern(n.name))
                    .collect();
                let for_zones: Box<[Arc<str>]> = hints
                    .for_zones
                    .into_iter()
                    .flatten()
                    .map(|z| intern(z.name))
                    .collect();
                Endpoint {
                    ip: e.addresses.first().and_then(|a| a.parse().ok()),
                    ready: conditions.ready,
                    serving: conditions.serving,
                    terminating: conditions.terminating,
                    node: e.node_name.map(&mut intern),
                    hints: (!for_nodes.is_empty() || !for_zones.is_empty()).then(|| {
                        Box::new(Hints {
                            for_nodes: (!for_nodes.is_empty()).then_some(for_nodes),
                            for_zones: (!for_zones.is_empty()).then_some(for_zones),
                        })
                    }),
                    pod_uid: e
                        .target_ref
                        .filter(|r| r.kind.as_deref() == Some("Pod"))
                        .and_then(|r| r.uid)
                        .map(String::into_boxed_str),
                }
            })
            .collect();
        let m = s.metadata;
        Slice {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                labels: m.labels,
                resource_version: m.resource_version,
                ..Default::default()
            },
            address_type: s.address_type,
            ports: s.ports.unwrap_or_default(),
            endpoints,
        }
    }
}

/// What the watch cache needs to keep slices: the API type's names, and
/// the metadata kept.
impl kube::Resource for Slice {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        EndpointSlice::KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        EndpointSlice::GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        EndpointSlice::VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        EndpointSlice::URL_PATH_SEGMENT.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_keeps_what_the_desired_state_reads_and_drops_the_rest() {
        let typed: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-x", "namespace": "shop", "resourceVersion": "42",
                "labels": {"kubernetes.io/service-name": "web"},
                "annotations": {"big": "x"},
                "managedFields": [{"manager": "kube-controller-manager"}],
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.244.1.12", "10.244.1.13"],
                 "conditions": {"ready": false, "serving": true, "terminating": true},
                 "nodeName": "worker-1", "zone": "a", "hostname": "web-0",
                 "hints": {"forNodes": [{"name": "worker-1"}], "forZones": []},
                 "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "shop",
                               "uid": "0b7f6c0c-8a1e-4b8b-9d55-3a0b0d7c1a01"}},
                {"addresses": ["not-an-ip"], "nodeName": "worker-1",
                 "targetRef": {"kind": "Node", "uid": "n1"}},
            ],
        }))
        .unwrap();
        let s = Slice::from(typed);
        assert_eq!(s.metadata.name.as_deref(), Some("web-x"));
        assert_eq!(s.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(s.metadata.labels.as_ref().unwrap().len(), 1);
        assert_eq!(s.metadata.annotations, None);
        assert_eq!(s.metadata.managed_fields, None);
        assert_eq!((s.address_type.as_str(), s.ports.len()), ("IPv4", 1));
        let e = &s.endpoints[0];
        assert_eq!(e.ip, Some("10.244.1.12".parse().unwrap()));
        assert_eq!(
            (e.ready, e.serving, e.terminating),
            (Some(false), Some(true), Some(true))
        );
        assert_eq!(e.node.as_deref(), Some("worker-1"));
        assert_eq!(e.for_nodes().map(<[_]>::len), Some(1));
        assert_eq!(e.for_zones(), None, "empty hints are no hints");
        assert_eq!(
            e.pod_uid.as_deref(),
            Some("0b7f6c0c-8a1e-4b8b-9d55-3a0b0d7c1a01")
        );
        let other = &s.endpoints[1];
        assert_eq!((other.ip, other.pod_uid.as_deref()), (None, None));
        assert!(
            Arc::ptr_eq(e.node.as_ref().unwrap(), other.node.as_ref().unwrap()),
            "one node name a slice"
        );
    }
}
