//! Test support for xlb: packet fixtures, checkers and helpers shared by the integration tests.

pub mod bgp_lab;
pub mod cgroup;
pub mod chaos;
pub mod cluster;
pub mod ecmp;
pub mod k8s_topology;
pub mod l2_lab;
pub mod netns;
pub mod nodes;
pub mod packet;
pub mod podnet_lab;
pub mod topology;
pub mod traffic;
pub mod xdp;
