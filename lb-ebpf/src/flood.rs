//! Flood mode: above a rate of new flows on a CPU, flows that Maglev alone
//! re-derives are forwarded without a flow-table entry, so that a flood of
//! SYNs neither pays for the insert (most of a new flow's cost) nor evicts
//! the established flows. Their later packets miss the table and are picked
//! again by Maglev, onto the same backend while the backend set is
//! unchanged; once the rate falls, the next one is inserted.

use crate::maps::FLOOD;

const WINDOW_NS: u64 = 1_000_000_000;

/// Whether this CPU is in flood mode now (its window's count above the
/// threshold), without counting anything.
#[inline(always)]
pub fn engaged(t: u64) -> bool {
    match FLOOD.get(0) {
        Some(w) => {
            w.threshold != 0 && w.new_flows > w.threshold && t.wrapping_sub(w.start_ns) <= WINDOW_NS
        }
        None => false,
    }
}

/// Counts a new flow on this CPU; true when this second's count is above
/// the agent's threshold (0: flood mode off).
#[inline(always)]
pub fn over_threshold(t: u64) -> bool {
    let Some(w) = FLOOD.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU slot, only this CPU writes it while we run (the agent
    // writes the threshold; a racing write only restarts the window).
    let w = unsafe { &mut *w };
    if w.threshold == 0 {
        return false;
    }
    if t.wrapping_sub(w.start_ns) > WINDOW_NS {
        w.start_ns = t;
        w.new_flows = 0;
    }
    w.new_flows = w.new_flows.wrapping_add(1);
    w.new_flows > w.threshold
}
