//! Per-service admission: `loadBalancerSourceRanges`, checked on every client
//! packet before any flow state is read or written.

use aya_ebpf::btf_maps::lpm_trie::Key;
use lb_common::{RangeKey, ServiceInfo, RANGE_LOOKUP_PREFIX, SERVICE_F_SOURCE_RANGES};

use crate::maps::SOURCE_RANGES;

/// Whether `client` may reach `svc`. A service without ranges is open.
/// Not inlined: the trie key gets its own stack frame.
#[inline(never)]
pub fn source_allowed(svc: &ServiceInfo, client: &[u32; 4]) -> bool {
    if svc.flags & SERVICE_F_SOURCE_RANGES == 0 {
        return true;
    }
    let key = Key::new(
        RANGE_LOOKUP_PREFIX,
        RangeKey {
            scope: svc.range_scope().to_be_bytes(),
            addr: *client,
        },
    );
    SOURCE_RANGES.get(&key).is_some()
}
