//! One step of the data path each, for `xlb-bench`'s account of where a
//! packet's time goes: the step alone, on the program's own maps, so that
//! its cost above the floor (`xlb_floor`) is the step's. The agent never
//! attaches them. Frames as the benchmark sends them: Ethernet, IPv4
//! without options, then TCP or UDP.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb_common::{ServiceKey, FAMILY_V4};

use crate::{
    clock::now,
    maps::{FLOWS, SERVICES},
    parse::{load16, load32, load8, ptr_at},
    scratch::Scratch,
    scratch::SCRATCH,
};

const IP: usize = 14;
const L4: usize = 14 + 20;

/// The clock read, as the data path reads it (`clock::now`).
#[xdp]
pub fn xlb_step_clock(_ctx: XdpContext) -> u32 {
    if now() == 0 {
        xdp_action::XDP_ABORTED
    } else {
        xdp_action::XDP_PASS
    }
}

/// The check that a frame is addressed to the receiving interface
/// (`mac::for_us`): XDP_PASS when it is, XDP_DROP when not.
#[xdp]
pub fn xlb_step_mac_check(ctx: XdpContext) -> u32 {
    verdict(crate::mac::for_us(&ctx))
}

/// The service lookup (`SERVICES`) of the frame's destination: XDP_PASS
/// when found, XDP_DROP when not.
#[xdp]
pub fn xlb_step_service_lookup(ctx: XdpContext) -> u32 {
    let Some(ip) = ptr_at(&ctx, IP, 24) else {
        return xdp_action::XDP_ABORTED;
    };
    let key = ServiceKey {
        addr: [load32(ip + 16), 0, 0, 0],
        port: load16(ip + 22),
        proto: load8(ip + 9),
        family: FAMILY_V4,
    };
    verdict(SERVICES.get_ptr(&key).is_some())
}

/// The flow lookup (`FLOWS`) of the frame's flow: XDP_PASS when found,
/// XDP_DROP when not.
#[xdp]
pub fn xlb_step_flow_lookup(ctx: XdpContext) -> u32 {
    let Some(s) = flow_key(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    verdict(FLOWS.get_ptr(&s.key).is_some())
}

/// The flow insert (`FLOWS`) of the frame's flow, with the CPU's scratch
/// flow as its value; on a full table it evicts, as a new flow does.
#[xdp]
pub fn xlb_step_flow_insert(ctx: XdpContext) -> u32 {
    let Some(s) = flow_key(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    verdict(FLOWS.insert(&s.key, &s.flow, 0).is_ok())
}

/// XDP_PASS when the step succeeded, XDP_DROP when not: the bench checks
/// that each step did what it measures.
#[inline(always)]
fn verdict(ok: bool) -> u32 {
    if ok {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// The frame's flow key, written to the CPU's scratch as the data path does.
#[inline(always)]
fn flow_key(ctx: &XdpContext) -> Option<&'static mut Scratch> {
    let ip = ptr_at(ctx, IP, 20)?;
    let l4 = ptr_at(ctx, L4, 4)?;
    // SAFETY: per-CPU scratch, only this program run uses it.
    let s = unsafe { &mut *SCRATCH.get_ptr_mut(0)? };
    s.key.src = [load32(ip + 12), 0, 0, 0];
    s.key.dst = [load32(ip + 16), 0, 0, 0];
    s.key.sport = load16(l4);
    s.key.dport = load16(l4 + 2);
    s.key.proto = load8(ip + 9);
    s.key.family = FAMILY_V4;
    s.key._pad = [0; 2];
    Some(s)
}
