//! Lease-based leader election.
