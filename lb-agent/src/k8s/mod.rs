//! Kubernetes as a source of desired state: LoadBalancer Services and their
//! EndpointSlices become data-plane services; one elected agent hands out
//! LoadBalancer addresses from `LoadBalancerPool`s.
//!
//! - [`desired`]: pure conversion of API objects into `ServiceConfig`s.
//! - [`watch`]: reflectors over Services, EndpointSlices and this Node that
//!   publish the desired state.
//! - [`ipam`]: pure address-pool arithmetic and allocation decisions.
//! - [`leader`]: Lease-based leader election.
//! - [`allocator`]: the controller that writes `status.loadBalancer`.

pub mod crd;

/// Annotation naming the pool a Service's address comes from.
pub const POOL_ANNOTATION: &str = "xlb.dev/pool";
/// Annotation requesting specific addresses (comma-separated, one per family).
pub const IP_ANNOTATION: &str = "xlb.dev/ip";
/// Annotation choosing `nat` or `snat` forwarding for one Service.
pub const MODE_ANNOTATION: &str = "xlb.dev/mode";
/// The Service status condition the allocator maintains.
pub const ALLOCATED_CONDITION: &str = "xlb.dev/AddressAllocated";
/// Node label that keeps a node out of load balancing (Kubernetes' own).
pub const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// EndpointSlice label naming the owning Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The field manager / event reporter name.
pub const CONTROLLER_NAME: &str = "xlb.dev/lb-agent";
