//! Per-service limit on new flows per source prefix (`new_flow_limit`),
//! checked before a new flow takes any state. GCRA: each prefix has a
//! theoretical arrival time (TAT) that every admitted flow pushes one
//! period further; a flow that would put it more than the burst ahead of
//! now is dropped and pushes nothing.

use lb_common::{ServiceInfo, FAMILY_V4};

use crate::{
    clock::now,
    maps::{FLOW_LIMITS, SOURCE_RATES},
    scratch::Scratch,
};

/// `bits` leading one bits of a 32-bit word, in network order.
#[inline(always)]
fn mask(bits: u32) -> u32 {
    if bits == 0 {
        0
    } else if bits >= 32 {
        u32::MAX
    } else {
        (u32::MAX << (32 - bits)).to_be()
    }
}

/// Whether a new flow from `s.key.src` to `svc` may start now. Not
/// inlined: only new flows of limited services pay for it.
#[inline(never)]
pub fn admit(svc: &ServiceInfo, s: &mut Scratch) -> bool {
    let Some(lim) = FLOW_LIMITS.get(svc.id) else {
        return true;
    };
    let prefix = if s.key.family == FAMILY_V4 {
        lim.prefix_v4
    } else {
        lim.prefix_v6
    } as u32;
    let k = &mut s.source_key;
    for i in 0..4 {
        let bits = prefix.saturating_sub(32 * i as u32);
        k.addr[i] = s.key.src[i] & mask(bits);
    }
    k.service_id = svc.id;
    k.family = s.key.family;
    k._pad = [0; 3];
    let t = now();
    match SOURCE_RATES.get_ptr_mut(&*k) {
        Some(tat) => {
            // SAFETY: shared entry; a racing CPU may overwrite our push.
            let tat = unsafe { &mut *tat };
            let due = if *tat > t { *tat } else { t };
            if due - t > lim.burst_ns {
                return false;
            }
            *tat = due + lim.period_ns;
            true
        }
        None => {
            // A full LRU evicts its oldest prefix: that prefix starts afresh.
            let _ = SOURCE_RATES.insert(&*k, &(t + lim.period_ns), 0);
            true
        }
    }
}
