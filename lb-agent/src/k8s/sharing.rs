//! When two Services may hold one address (`xlb.dev/allow-shared-ip`).
//!
//! Both must carry the annotation with the same key, their ports must not
//! clash (the same port and protocol), and if either has
//! `externalTrafficPolicy: Local` both must, with the same Pod selector:
//! a node announces a Local Service's address only while it has local
//! endpoints, so two Local Services on one address must have the same ones,
//! and a Cluster Service would make nodes without them attract the Local
//! Service's traffic too.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;

use super::SHARED_IP_ANNOTATION;

/// What decides whether a Service may share its address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sharing {
    /// The `xlb.dev/allow-shared-ip` key; `None`: the address is its own.
    pub key: Option<String>,
    /// (port, protocol) of every port.
    pub ports: BTreeSet<(i32, String)>,
    /// `externalTrafficPolicy: Local`.
    pub local: bool,
    pub selector: BTreeMap<String, String>,
}

impl Sharing {
    pub fn from_service(svc: &Service) -> Sharing {
        let spec = svc.spec.as_ref();
        Sharing {
            key: svc
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SHARED_IP_ANNOTATION))
                .map(|k| k.trim().to_string())
                .filter(|k| !k.is_empty()),
            ports: spec
                .and_then(|s| s.ports.as_ref())
                .into_iter()
                .flatten()
                .map(|p| (p.port, p.protocol.clone().unwrap_or_else(|| "TCP".into())))
                .collect(),
            local: spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local"),
            selector: spec.and_then(|s| s.selector.clone()).unwrap_or_default(),
        }
    }

    /// Whether a Service with `self` may join `other` (named `other_name`)
    /// on one address; `Err` says why not, naming the other Service.
    pub fn compatible(&self, other: &Sharing, other_name: &str) -> Result<(), String> {
        match (&self.key, &other.key) {
            (Some(a), Some(b)) if a == b => {}
            (_, None) => {
                return Err(format!(
                    "it is used by Service {other_name}, which does not allow sharing \
                     (annotation {SHARED_IP_ANNOTATION})"
                ))
            }
            (None, Some(b)) => {
                return Err(format!(
                    "it is used by Service {other_name}, which shares it only with \
                     {SHARED_IP_ANNOTATION}: {b:?}"
                ))
            }
            (Some(_), Some(b)) => {
                return Err(format!(
                    "it is used by Service {other_name}, which shares it under the key {b:?}"
                ))
            }
        }
        if let Some((port, proto)) = self.ports.intersection(&other.ports).next() {
            return Err(format!(
                "port {port}/{proto} is also a port of Service {other_name}, which uses it"
            ));
        }
        if (self.local || other.local)
            && !(self.local && other.local && self.selector == other.selector)
        {
            return Err(format!(
                "it is used by Service {other_name}; with externalTrafficPolicy: Local, \
                 Services share an address only when both are Local with the same selector"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sharing(key: Option<&str>, ports: &[(i32, &str)], local: bool, app: &str) -> Sharing {
        Sharing {
            key: key.map(str::to_string),
            ports: ports.iter().map(|(p, s)| (*p, s.to_string())).collect(),
            local,
            selector: [("app".to_string(), app.to_string())].into(),
        }
    }

    #[test]
    fn dns_on_tcp_and_udp_shares() {
        let tcp = sharing(Some("dns"), &[(53, "TCP")], false, "dns");
        let udp = sharing(Some("dns"), &[(53, "UDP")], false, "dns");
        assert_eq!(tcp.compatible(&udp, "ns/udp"), Ok(()));
        assert_eq!(udp.compatible(&tcp, "ns/tcp"), Ok(()));
    }

    #[test]
    fn every_refusal_names_the_other_service_and_why() {
        let a = sharing(Some("k"), &[(53, "TCP")], false, "dns");
        let cases = [
            (
                sharing(None, &[(80, "TCP")], false, "x"),
                "does not allow sharing",
            ),
            (
                sharing(Some("other"), &[(80, "TCP")], false, "x"),
                "under the key \"other\"",
            ),
            (
                sharing(Some("k"), &[(53, "TCP")], false, "x"),
                "port 53/TCP",
            ),
            (
                sharing(Some("k"), &[(54, "TCP")], true, "dns"),
                "externalTrafficPolicy: Local",
            ),
        ];
        for (b, why) in cases {
            let e = a.compatible(&b, "ns/b").unwrap_err();
            assert!(e.contains("ns/b") && e.contains(why), "{e}");
        }
        let none = sharing(None, &[(80, "TCP")], false, "x");
        let e = none.compatible(&a, "ns/a").unwrap_err();
        assert!(e.contains("shares it only with"), "{e}");
        // Local with Local and the same selector is fine; another selector is not.
        let l1 = sharing(Some("k"), &[(53, "TCP")], true, "dns");
        let l2 = sharing(Some("k"), &[(53, "UDP")], true, "dns");
        assert_eq!(l1.compatible(&l2, "ns/l2"), Ok(()));
        let l3 = sharing(Some("k"), &[(54, "UDP")], true, "web");
        assert!(l1.compatible(&l3, "ns/l3").is_err());
    }
}
