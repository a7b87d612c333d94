//! Per-CPU counters: one reason per packet, traffic per service and backend.

use crate::maps::{BACKEND_CLOSED, BACKEND_STATS, FLOW_EVENTS, REASON_STATS, SERVICE_STATS};

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

/// Counts a flow of `backend_id` that the client closed.
#[inline(always)]
pub fn count_closed(backend_id: u32) {
    if let Some(c) = BACKEND_CLOSED.get_ptr_mut(backend_id) {
        // SAFETY: per-CPU slot.
        unsafe { *c += 1 };
    }
}
