//! lb-agent's library: the data-plane driver shared by the daemon, lbctl,
//! the tests and the benchmarks.
pub mod dataplane;
