//! `new_flow_limit` as the agent holds it and as the program reads it.

use lb_common::FlowLimit;

/// A limit on new flows from one source prefix: `per_second` on average,
/// up to `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewFlowLimit {
    pub per_second: u32,
    pub burst: u32,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
}

impl NewFlowLimit {
    /// The highest `per_second` and `burst` accepted (a new flow a nanosecond).
    pub const MAX_PER_SECOND: u32 = 1_000_000_000;

    /// As the program reads it (GCRA's period and burst tolerance).
    pub fn to_map(self) -> FlowLimit {
        let period_ns = 1_000_000_000 / u64::from(self.per_second.max(1));
        FlowLimit {
            period_ns,
            burst_ns: u64::from(self.burst.max(1) - 1) * period_ns,
            per_second: self.per_second,
            burst: self.burst,
            prefix_v4: self.ipv4_prefix,
            prefix_v6: self.ipv6_prefix,
            _pad: [0; 6],
        }
    }

    pub fn from_map(l: &FlowLimit) -> Self {
        Self {
            per_second: l.per_second,
            burst: l.burst,
            ipv4_prefix: l.prefix_v4,
            ipv6_prefix: l.prefix_v6,
        }
    }
}
