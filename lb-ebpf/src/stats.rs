//! Per-CPU counters: one reason per packet, traffic per service and backend.

use lb_common::{flow_time_bucket, FLOW_TIME_BUCKETS};

use crate::maps::{
    BACKEND_CLOSED, BACKEND_STATS, FLOW_EVENTS, FLOW_TIMES, REASON_STATS, SERVICE_STATS,
};

#[inline(always)]
pub fn count_reason(reason: u32) {
    if let Some(c) = REASON_STATS.get_ptr_mut(reason) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *c += 1 };
    }
}

#[inline(always)]
pub fn count_flow_event(event: u32) {
    if let Some(c) = FLOW_EVENTS.get_ptr_mut(event) {
        // SAFETY: per-CPU slot, only this CPU writes it while we run.
        unsafe { *c += 1 };
    }
}

/// Counts a packet of `bytes` for a service and a backend; `reply` for the
/// backend -> client direction.
#[inline(always)]
pub fn count_traffic(service_id: u32, backend_id: u32, bytes: u64, new_flow: bool, reply: bool) {
    for s in [
        SERVICE_STATS.get_ptr_mut(service_id),
        BACKEND_STATS.get_ptr_mut(backend_id),
    ]
    .into_iter()
    .flatten()
    {
        // SAFETY: per-CPU slot.
        let s = unsafe { &mut *s };
        if reply {
            s.reply_packets += 1;
            s.reply_bytes += bytes;
        } else {
            s.packets += 1;
            s.bytes += bytes;
            s.new_flows += new_flow as u64;
        }
    }
}

/// Counts a flow of `backend_id` that closed.
#[inline(always)]
pub fn count_closed(backend_id: u32) {
    if let Some(c) = BACKEND_CLOSED.get_ptr_mut(backend_id) {
        // SAFETY: per-CPU slot.
        unsafe { *c += 1 };
    }
}

/// Counts how long a closed flow of `backend_id` was open (`FLOW_TIMES`).
#[inline(always)]
pub fn count_flow_time(backend_id: u32, open_ns: u64) {
    use core::intrinsics::{atomic_xadd, AtomicOrdering};
    // The mask keeps the index provably in bounds for the verifier.
    let b = flow_time_bucket(open_ns) & (FLOW_TIME_BUCKETS - 1);
    if let Some(h) = FLOW_TIMES.get_ptr_mut(backend_id) {
        // SAFETY: a valid, aligned map value; every CPU adds atomically
        // (BPF_ATOMIC_ADD: the result is not used).
        unsafe {
            let c = (h as *mut u32).add(b);
            atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(c, 1);
        }
    }
}
