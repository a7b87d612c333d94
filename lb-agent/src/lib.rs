//! lb-agent's library: the data-plane driver, the configuration, health
//! checks and metrics, shared by the daemon, lbctl, the tests and the benchmarks.
pub mod agent;
pub mod bgp;
pub mod config;
pub mod dataplane;
pub mod desired;
pub mod flow_sync;
pub mod health;
pub mod http;
pub mod k8s;
pub mod l2;
pub mod load_aware;
pub mod maps;
pub mod metrics;
pub mod netif;
pub mod notrack;
pub mod podnet;
pub mod seal;
pub mod service;
pub mod sys;
