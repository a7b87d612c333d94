//! The controller that hands out LoadBalancer addresses.
