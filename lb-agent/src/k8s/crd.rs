//! The `LoadBalancerPool` custom resource: the addresses xlb may hand out.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A cluster-wide pool of LoadBalancer addresses.
///
/// ```yaml
/// apiVersion: xlb.dev/v1alpha1
/// kind: LoadBalancerPool
/// metadata: { name: public }
/// spec:
///   addresses: ["192.0.2.0/24", "198.51.100.10-198.51.100.20", "2001:db8::/120"]
///   avoidBuggyIPs: true
///   serviceAllocation:          # optional: whom the pool serves, in which order
///     priority: 10
///     namespaces: [team-a]
///     namespaceSelectors: [{ matchLabels: { team: a } }]
///     serviceSelectors: [{ matchLabels: { exposure: public } }]
/// ```
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "xlb.dev",
    version = "v1alpha1",
    kind = "LoadBalancerPool",
    plural = "loadbalancerpools",
    shortname = "lbpool",
    status = "LoadBalancerPoolStatus",
    printcolumn = r#"{"name":"Addresses","type":"string","jsonPath":".spec.addresses"}"#,
    printcolumn = r#"{"name":"In use","type":"integer","jsonPath":".status.inUse"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.size"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerPoolSpec {
    /// CIDRs (`192.0.2.0/24`, `2001:db8::/120`) or inclusive ranges
    /// (`192.0.2.10-192.0.2.20`), IPv4 and IPv6 mixed as needed. The first
    /// and last address of an IPv4 CIDR of /30 or shorter (its network and
    /// broadcast address) are not handed out; a range is taken as written.
    pub addresses: Vec<String>,
    /// Skip IPv4 addresses ending in .0 or .255, which some clients and
    /// routers mishandle.
    #[serde(default, rename = "avoidBuggyIPs")]
    pub avoid_buggy_ips: bool,
    /// Hand out addresses from this pool to Services that name no pool
    /// (annotation `xlb.dev/pool`). Default true.
    #[serde(default = "default_true")]
    pub auto_assign: bool,
    /// Limits the pool to some Services and orders it among pools. Without
    /// it the pool serves every Service, after the pools with a priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_allocation: Option<ServiceAllocation>,
}

/// Which Services a pool serves, and its place in the order pools are tried.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAllocation {
    /// Pools are tried lowest priority number first; pools without one come
    /// after every pool with one (so a catch-all pool is used last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Namespaces whose Services the pool serves. With `namespaceSelectors`,
    /// a Service's namespace must be listed or match a selector; with
    /// neither, every namespace is served.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespace_selectors: Vec<LabelSelector>,
    /// If set, a Service's labels must match one of these too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_selectors: Vec<LabelSelector>,
}

fn default_true() -> bool {
    true
}

/// What the allocating agent last counted.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerPoolStatus {
    /// Addresses the pool can hand out (capped at 2^32 for large IPv6 ranges).
    // schemars says `uint64`, a format Kubernetes does not know (helm
    // warns); int64 with schemars' `minimum: 0` is what it validates.
    #[schemars(extend("format" = "int64"))]
    pub size: u64,
    /// Addresses Services hold now.
    #[schemars(extend("format" = "int64"))]
    pub in_use: u64,
    /// Why the spec is unusable, when it is (e.g. a malformed CIDR).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::*;

    #[test]
    fn crd_is_cluster_scoped_with_status() {
        let crd = LoadBalancerPool::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("loadbalancerpools.xlb.dev")
        );
        let v = &crd.spec.versions[0];
        assert!(v.subresources.as_ref().unwrap().status.is_some());
    }

    /// The formats kube-apiserver validates (apiextensions-apiserver's
    /// `pkg/apiserver/validation/formats.go`); any other is warned about.
    const KNOWN_FORMATS: &[&str] = &[
        "bsonobjectid",
        "uri",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "cidr",
        "mac",
        "uuid",
        "uuid3",
        "uuid4",
        "uuid5",
        "isbn",
        "isbn10",
        "isbn13",
        "creditcard",
        "ssn",
        "hexcolor",
        "rgbcolor",
        "byte",
        "password",
        "date",
        "duration",
        "datetime",
        "date-time",
        "int32",
        "int64",
        "float",
        "double",
    ];

    fn formats(v: &serde_json::Value, at: String, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("format", serde_json::Value::String(f)) => {
                            out.push((at.clone(), f.clone()))
                        }
                        _ => formats(v, format!("{at}.{k}"), out),
                    }
                }
            }
            serde_json::Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    formats(v, format!("{at}[{i}]"), out);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_crd_uses_only_formats_kubernetes_knows() {
        let crd = serde_json::to_value(LoadBalancerPool::crd()).unwrap();
        let mut found = Vec::new();
        formats(&crd, String::new(), &mut found);
        let unknown: Vec<_> = found
            .iter()
            .filter(|(_, f)| !KNOWN_FORMATS.contains(&f.as_str()))
            .collect();
        assert!(unknown.is_empty(), "unknown formats: {unknown:?}");
        let status = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
            ["status"]["properties"];
        for field in ["size", "inUse"] {
            assert_eq!(status[field]["format"], "int64", "{field}");
            assert_eq!(status[field]["minimum"].as_f64(), Some(0.0), "{field}");
        }
    }

    #[test]
    fn defaults_apply() {
        let s: LoadBalancerPoolSpec =
            serde_json::from_str(r#"{"addresses":["192.0.2.0/24"]}"#).unwrap();
        assert!(s.auto_assign);
        assert!(!s.avoid_buggy_ips);
        let s: LoadBalancerPoolSpec =
            serde_json::from_str(r#"{"addresses":[],"avoidBuggyIPs":true,"autoAssign":false}"#)
                .unwrap();
        assert!(!s.auto_assign && s.avoid_buggy_ips);
    }
}
