//! The coarse monotonic clock, read once per timer tick on each CPU.

use aya_ebpf::{
    btf_maps::PerCpuArray,
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
    macros::btf_map,
};

/// Per CPU: the last clock read and its tick (`now`). A map of its own,
/// not a field of `SCRATCH`: the clock is read while a caller holds the
/// scratch.
#[btf_map]
pub static CLOCK: PerCpuArray<Clock, 1> = PerCpuArray::new();

/// The coarse monotonic clock (ns), as `bpf_ktime_get_coarse_ns` gives it.
/// That clock moves only at the timer tick, so it is read once per tick on
/// each CPU and kept in a per-CPU map (`CLOCK`), keyed by `bpf_jiffies64` (which
/// the verifier turns into a plain load): the helper call cost 20 ns a
/// packet on this project's machine (`xlb-bench`'s "clock read"). A tick's
/// first reader may see the new jiffies before the clock's update and keep
/// the previous tick's time for this one: a lag of one tick at most.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helpers without arguments.
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(c) = CLOCK.get_ptr_mut(0) else {
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    // SAFETY: a per-CPU value, only this program run uses it.
    let c = unsafe { &mut *c };
    if c.jiffies != jiffies || c.ns == 0 {
        c.jiffies = jiffies;
        c.ns = unsafe { bpf_ktime_get_coarse_ns() };
    }
    c.ns
}

/// A CPU's last clock read and the tick it was made in (`now`).
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct Clock {
    jiffies: u64,
    ns: u64,
}
