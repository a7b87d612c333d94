//! The resource types the server knows, and how each behaves.

use serde_json::{json, Value};

/// Resource-specific defaulting done on create, as the real server does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defaulting {
    None,
    Service,
    EndpointSlice,
}

/// A resource type served by [`TestApiServer`](super::TestApiServer).
///
/// The built-in table is [`ResourceType::builtin`]; more can be added with
/// [`ServerOptions::resource`](super::ServerOptions::resource).
#[derive(Clone, Debug)]
pub struct ResourceType {
    /// `""` for the core group.
    pub group: &'static str,
    pub version: &'static str,
    /// Lower-case plural used in paths (`services`).
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `/status` subresource: the main resource ignores `status`
    /// changes and `/status` changes only `status`.
    pub status_subresource: bool,
    /// Status is dropped on create (Services, custom resources); Nodes keep it.
    pub reset_status_on_create: bool,
    /// `metadata.generation` starts at 1 and grows when anything outside
    /// metadata and status changes.
    pub tracks_generation: bool,
    /// PUT to a missing object creates it (Services, Leases, Events).
    pub create_on_update: bool,
    /// PUT without `metadata.resourceVersion` is allowed (not for custom resources).
    pub unconditional_update: bool,
    /// Built-in types have `apiVersion`/`kind` stripped from list items;
    /// custom resources keep them.
    pub builtin: bool,
    /// Field selector paths besides `metadata.name` and `metadata.namespace`.
    pub field_selectors: &'static [&'static str],
    pub(crate) defaulting: Defaulting,
}

impl ResourceType {
    /// A resource with plain behaviour: no status subresource, no
    /// generation, PUT does not create, list items keep apiVersion/kind
    /// (as for custom resources).
    pub fn new(
        group: &'static str,
        version: &'static str,
        plural: &'static str,
        kind: &'static str,
        namespaced: bool,
    ) -> Self {
        Self {
            group,
            version,
            plural,
            kind,
            namespaced,
            status_subresource: false,
            reset_status_on_create: false,
            tracks_generation: false,
            create_on_update: false,
            unconditional_update: true,
            builtin: false,
            field_selectors: &[],
            defaulting: Defaulting::None,
        }
    }

    /// A custom resource: status subresource, status dropped on create,
    /// generation tracked, updates must carry a resourceVersion.
    pub fn custom(
        group: &'static str,
        version: &'static str,
        plural: &'static str,
        kind: &'static str,
        namespaced: bool,
    ) -> Self {
        Self {
            status_subresource: true,
            reset_status_on_create: true,
            tracks_generation: true,
            unconditional_update: false,
            ..Self::new(group, version, plural, kind, namespaced)
        }
    }

    fn builtin_type(
        group: &'static str,
        version: &'static str,
        plural: &'static str,
        kind: &'static str,
        namespaced: bool,
    ) -> Self {
        Self {
            builtin: true,
            ..Self::new(group, version, plural, kind, namespaced)
        }
    }

    /// What the server serves by default.
    pub fn builtin() -> Vec<ResourceType> {
        vec![
            Self {
                status_subresource: true,
                reset_status_on_create: true,
                tracks_generation: true,
                create_on_update: true,
                field_selectors: &["spec.type", "spec.clusterIP"],
                defaulting: Defaulting::Service,
                ..Self::builtin_type("", "v1", "services", "Service", true)
            },
            Self {
                status_subresource: true,
                field_selectors: &["spec.unschedulable"],
                ..Self::builtin_type("", "v1", "nodes", "Node", false)
            },
            Self {
                status_subresource: true,
                ..Self::builtin_type("", "v1", "namespaces", "Namespace", false)
            },
            Self {
                create_on_update: true,
                field_selectors: &[
                    "involvedObject.kind",
                    "involvedObject.namespace",
                    "involvedObject.name",
                    "involvedObject.uid",
                    "reason",
                    "type",
                ],
                ..Self::builtin_type("", "v1", "events", "Event", true)
            },
            Self {
                tracks_generation: true,
                defaulting: Defaulting::EndpointSlice,
                ..Self::builtin_type(
                    "discovery.k8s.io",
                    "v1",
                    "endpointslices",
                    "EndpointSlice",
                    true,
                )
            },
            Self {
                create_on_update: true,
                ..Self::builtin_type("coordination.k8s.io", "v1", "leases", "Lease", true)
            },
            Self {
                create_on_update: true,
                field_selectors: &[
                    "regarding.kind",
                    "regarding.namespace",
                    "regarding.name",
                    "regarding.uid",
                    "reason",
                    "type",
                ],
                ..Self::builtin_type("events.k8s.io", "v1", "events", "Event", true)
            },
            Self::custom(
                "xlb.dev",
                "v1alpha1",
                "loadbalancerpools",
                "LoadBalancerPool",
                false,
            ),
        ]
    }

    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `services` or `leases.coordination.k8s.io`, as messages name it.
    pub fn qualified_name(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The path of the collection in `namespace` (or cluster-wide).
    pub fn collection_path(&self, namespace: Option<&str>) -> String {
        let prefix = if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        };
        match namespace {
            Some(ns) if self.namespaced => format!("{prefix}/namespaces/{ns}/{}", self.plural),
            _ => format!("{prefix}/{}", self.plural),
        }
    }

    /// The status a freshly created object gets when status is reset.
    pub(crate) fn initial_status(&self) -> Option<Value> {
        match self.defaulting {
            Defaulting::Service => Some(json!({"loadBalancer": {}})),
            _ => None,
        }
    }
}

/// Allocates Service cluster IPs and node ports, as the real server does.
#[derive(Debug, Default)]
pub(crate) struct Allocator {
    next_cluster_ip: u32,
    next_node_port: u16,
}

impl Allocator {
    fn cluster_ip(&mut self) -> String {
        // 10.96.0.0/12, skipping .0 and the apiserver's own 10.96.0.1.
        self.next_cluster_ip += 1;
        let host = self.next_cluster_ip + 1;
        format!("10.96.{}.{}", host / 256, host % 256)
    }

    fn node_port(&mut self) -> u16 {
        let port = 30000 + self.next_node_port;
        self.next_node_port = (self.next_node_port + 1) % 2768;
        port
    }
}

fn set_default(object: &mut Value, key: &str, value: Value) {
    if let Some(map) = object.as_object_mut() {
        if map.get(key).is_none_or(Value::is_null) {
            map.insert(key.to_string(), value);
        }
    }
}

/// Fills in what the real server defaults on create.
pub(crate) fn apply_defaults(rt: &ResourceType, object: &mut Value, allocator: &mut Allocator) {
    match rt.defaulting {
        Defaulting::None => {}
        Defaulting::Service => default_service(object, allocator),
        Defaulting::EndpointSlice => {
            if let Some(ports) = object.get_mut("ports").and_then(Value::as_array_mut) {
                for port in ports {
                    set_default(port, "protocol", json!("TCP"));
                }
            }
        }
    }
}

fn default_service(object: &mut Value, allocator: &mut Allocator) {
    set_default(object, "spec", json!({}));
    let spec = &mut object["spec"];
    set_default(spec, "type", json!("ClusterIP"));
    let service_type = spec["type"].as_str().unwrap_or_default().to_string();
    if service_type == "ExternalName" {
        return;
    }
    set_default(spec, "sessionAffinity", json!("None"));
    set_default(spec, "internalTrafficPolicy", json!("Cluster"));
    let external = matches!(service_type.as_str(), "NodePort" | "LoadBalancer");
    if external {
        set_default(spec, "externalTrafficPolicy", json!("Cluster"));
    }
    if service_type == "LoadBalancer" {
        set_default(spec, "allocateLoadBalancerNodePorts", json!(true));
    }
    let wants_node_ports = service_type == "NodePort"
        || (service_type == "LoadBalancer"
            && spec["allocateLoadBalancerNodePorts"] != json!(false));
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for port in ports {
            set_default(port, "protocol", json!("TCP"));
            let number = port.get("port").cloned().unwrap_or(Value::Null);
            set_default(port, "targetPort", number);
            if wants_node_ports {
                let node_port = allocator.node_port();
                set_default(port, "nodePort", json!(node_port));
            }
        }
    }
    if spec.get("clusterIP").is_none_or(Value::is_null) {
        let ip = allocator.cluster_ip();
        spec["clusterIP"] = json!(ip);
    }
    if spec["clusterIP"] != json!("None") {
        let ip = spec["clusterIP"].clone();
        set_default(spec, "clusterIPs", json!([ip]));
        set_default(spec, "ipFamilies", json!(["IPv4"]));
        set_default(spec, "ipFamilyPolicy", json!("SingleStack"));
    }
}
