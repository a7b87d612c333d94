//! The agents' topology (`topology`) with a real cluster (`cluster`): the
//! agent in the LB namespace reaches kube-apiserver as the chart's
//! ServiceAccount, the backends' nginx processes are the Pods of the
//! Service `shop/web`, and the EndpointSlice controller writes its slices.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use k8s_openapi::api::core::v1::Service;
use serde_json::{json, Value};

use crate::{
    cluster::{Cluster, Pod, API_HOST},
    topology::{allowed_cpus, backend_ip, AgentHandle, Topology, BACKEND_PORT, VIP},
    traffic::{count, requests_on, wait_until},
};

pub const NODE: &str = "node-1";
pub const NS: &str = "shop";
pub const SERVICE: &str = "web";

pub struct K8sTopology {
    pub t: Topology,
    pub cluster: Cluster,
}

impl K8sTopology {
    /// The topology with `backends` nginx backends, a cluster the LB
    /// namespace can reach with the chart's identity installed, this node,
    /// the namespace `shop`, and a pool `edge` holding just the topology's VIP.
    pub fn new(prefix: &str, backends: usize) -> K8sTopology {
        let t = Topology::new(prefix, backends);
        let mut cluster = Cluster::start(prefix);
        cluster.reach_from(&t.lb);
        cluster.install_chart_identity();
        cluster.add_node(NODE, "zone-a");
        cluster.create_namespace(NS);
        cluster.create(&json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
            "metadata": {"name": "edge"},
            "spec": {"addresses": [format!("{VIP}/32")]},
        }));
        K8sTopology { t, cluster }
    }

    /// The agent's config: the topology's interfaces and the cluster, as
    /// the chart's ServiceAccount. `extra` is added to the kubernetes section.
    pub fn agent_config(&mut self, extra: &str) -> String {
        let kubeconfig = self.t.dir.join("kubeconfig");
        self.cluster.write_agent_kubeconfig(&kubeconfig, API_HOST);
        let ifaces = self.t.lb_interfaces().join(", ");
        format!(
            "interfaces: [{ifaces}]\n\
             kubernetes:\n  kubeconfig: {}\n  node_name: {NODE}\n  mode: nat\n  lease_duration: 4s\n{extra}",
            kubeconfig.display()
        )
    }

    pub fn start_agent(&mut self) -> AgentHandle {
        let config = self.agent_config("");
        self.t.start_agent(&config)
    }

    /// The Pod backed by backend `n`'s nginx: `shop/web-n`, label `app=web`.
    pub fn pod(&self, n: usize, ready: bool) -> Pod {
        Pod {
            namespace: NS.into(),
            name: format!("web-{n}"),
            labels: json!({"app": "web"}),
            node: NODE.into(),
            ip: backend_ip(n).into(),
            port: BACKEND_PORT,
            ready,
        }
    }

    /// `shop/web`: port 80 to the Pods' named port `http`, class xlb.
    pub fn create_service(&self, name: &str, extra_spec: Value) {
        let mut svc = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "type": "LoadBalancer",
                "loadBalancerClass": "xlb.dev/xlb",
                "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
            },
        });
        for (k, v) in extra_spec.as_object().into_iter().flatten() {
            svc["spec"][k] = v.clone();
        }
        self.cluster.create(&svc);
    }

    /// Waits until the controller's slices for `shop/web` hold exactly
    /// these ready backends (by number).
    pub fn wait_slices_ready(&self, backends: &[usize]) {
        let want: Vec<String> = backends
            .iter()
            .map(|&n| backend_ip(n).to_string())
            .collect();
        wait_until(
            &format!("the controller's slices list {want:?} as ready"),
            Duration::from_secs(60),
            || (self.cluster.ready_addresses(NS, SERVICE) == want).then_some(()),
        );
    }

    /// The address the allocator wrote into the Service's status.
    pub fn ingress_ip(&self, name: &str) -> Option<IpAddr> {
        let v = self.cluster.get("service", Some(NS), name)?;
        let svc: Service = serde_json::from_value(v).ok()?;
        lb_agent::k8s::ingress(&svc)
            .first()?
            .ip
            .as_deref()?
            .parse()
            .ok()
    }

    /// Backends that answered `n` new connections to the VIP (from both CPUs).
    pub fn answered_by(&self, n: usize) -> BTreeMap<String, usize> {
        let vip = SocketAddr::from((VIP, 80));
        let cpus = allowed_cpus().len().max(1);
        let mut all = requests_on(&self.t, vip, n / 2, Some(0));
        all.extend(requests_on(&self.t, vip, n - n / 2, Some(1 % cpus)));
        count(&all)
    }

    /// Waits until new connections reach exactly these backends (names `bN`).
    pub fn wait_answered_by(&self, what: &str, names: &[&str], timeout: Duration) {
        wait_until(what, timeout, || {
            let m = self.answered_by(40);
            (m.keys().map(String::as_str).collect::<Vec<_>>() == names).then_some(())
        });
    }

    /// Waits until the data plane has `n` services.
    pub fn wait_programmed(&self, n: usize) {
        wait_until(
            "the data plane has the VIP",
            Duration::from_secs(20),
            || {
                let v = self.t.lbctl_json(&["services"]);
                (v["services"].as_array().map_or(0, Vec::len) == n).then_some(())
            },
        );
    }
}
