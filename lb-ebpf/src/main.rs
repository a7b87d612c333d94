//! xlb's XDP data plane. The entry point reads like a packet's path:
//! parse, find the service (or the flow a reply belongs to), pick or recall
//! the backend, rewrite, forward. Every packet is counted under one reason.
#![no_std]
#![no_main]
// `core::intrinsics::atomic_xadd`: shared counters (conntrack::count_active).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// Map keys and values are passed by reference on purpose: by value they are
// copied to the stack (the verifier limits it to 512 bytes across calls).
#![allow(clippy::needless_borrows_for_generic_args)]

mod bench;
mod clock;
mod conntrack;
mod csum;
mod flood;
mod forward;
mod icmp;
mod l2;
mod limit;
mod mac;
mod maps;
mod nat;
mod parse;
mod policy;
mod scratch;
mod stats;
mod steps;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb_common::{
    Reason, ServiceKey, PORT_F_BACKEND, PORT_F_SERVICE, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP,
    PROTO_UDP, SERVICE_F_SNAT,
};

use crate::{
    forward::{forward, ttl},
    maps::{BACKENDS, FLOWS, PORT_FLAGS, SERVICES},
    nat::{checksum_unfinished, l4_min_len, leave_unfinished, rewrite},
    parse::{load8, parse, ports, ptr_at, Headers, ParseError},
    scratch::SCRATCH,
};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

#[xdp]
pub fn xlb(ctx: XdpContext) -> u32 {
    let v = process(&ctx);
    let reason = v.reason();
    stats::count_reason(reason);
    if reason == Reason::DropTableError as u32 || reason == Reason::DropSnatExhausted as u32 {
        // Rare, and a sign of a full table or an agent bug: worth a log line.
        aya_log_ebpf::warn!(&ctx, "xlb: dropped a packet, reason {}", reason);
    }
    v.action()
}

/// An XDP action and the reason it is counted under, packed in one register
/// so that non-inlined functions can return it (BPF has no struct returns).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Verdict(u64);

impl Verdict {
    /// "Not handled here": the caller decides.
    pub const NONE: Verdict = Verdict(u64::MAX);

    #[inline(always)]
    pub fn new(action: u32, reason: Reason) -> Self {
        Self::new_raw(action, reason as u32)
    }

    #[inline(always)]
    pub fn new_raw(action: u32, reason: u32) -> Self {
        Verdict(((reason as u64) << 32) | action as u64)
    }

    #[inline(always)]
    pub fn is_none(self) -> bool {
        self.0 == u64::MAX
    }

    #[inline(always)]
    pub fn action(self) -> u32 {
        self.0 as u32
    }

    #[inline(always)]
    pub fn reason(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

#[inline(always)]
fn pass(reason: Reason) -> Verdict {
    Verdict::new(xdp_action::XDP_PASS, reason)
}

#[inline(always)]
fn drop(reason: Reason) -> Verdict {
    Verdict::new(xdp_action::XDP_DROP, reason)
}

#[inline(always)]
fn process(ctx: &XdpContext) -> Verdict {
    // Before anything reads the frame as ours: ARP, NDP, ICMP and VLAN
    // frames included.
    if !mac::for_us(ctx) {
        return pass(Reason::PassForeignMac);
    }
    let h = match parse(ctx) {
        Ok(h) => h,
        Err(ParseError::NotIp) => {
            let v = l2::arp(ctx);
            return if v.is_none() {
                pass(Reason::PassNotIp)
            } else {
                v
            };
        }
        Err(ParseError::Truncated) => return pass(Reason::PassTruncated),
    };
    if h.fragment {
        // Policy (docs/datapath.md): fragments carry no ports after the
        // first, so fragments to a VIP are dropped; PMTU discovery, which
        // we translate, keeps TCP and well-behaved UDP unfragmented.
        return if icmp::is_vip(&h.dst, h.family) {
            drop(Reason::DropFragment)
        } else {
            pass(Reason::PassFragment)
        };
    }
    match h.proto {
        PROTO_TCP | PROTO_UDP => transport(ctx, &h),
        PROTO_ICMP | PROTO_ICMPV6 => {
            let v = icmp::handle(ctx, &h);
            if v.is_none() {
                pass(Reason::PassNoService)
            } else {
                v
            }
        }
        _ => pass(Reason::PassNoService),
    }
}

#[inline(always)]
fn port_flags(port_be: u16) -> u8 {
    PORT_FLAGS
        .get(u16::from_be(port_be) as u32)
        .copied()
        .unwrap_or(0)
}

#[inline(always)]
fn transport(ctx: &XdpContext, h: &Headers) -> Verdict {
    let Some((sport, dport)) = ports(ctx, h) else {
        return if icmp::is_vip(&h.dst, h.family) {
            drop(Reason::DropMalformed)
        } else {
            pass(Reason::PassTruncated)
        };
    };
    if port_flags(dport) & PORT_F_SERVICE != 0 {
        let key = ServiceKey {
            addr: h.dst,
            port: dport,
            proto: h.proto,
            family: h.family,
        };
        if let Some(svc) = SERVICES.get_ptr(&key) {
            // SAFETY: SERVICES is not preallocated: an update replaces the
            // element and frees the old one only after this program run.
            return to_backend(ctx, h, unsafe { &*svc });
        }
    }
    if port_flags(sport) & PORT_F_BACKEND != 0 || is_snat_port(dport) {
        let v = from_backend(ctx, h);
        if !v.is_none() {
            return v;
        }
    }
    pass(Reason::PassNoService)
}

#[inline(always)]
fn is_snat_port(port_be: u16) -> bool {
    let cfg = conntrack::config();
    let p = u16::from_be(port_be);
    p >= cfg.snat_port_min && p <= cfg.snat_port_max
}

/// TCP flags byte, or 0 for UDP. Needs the transport header checked present.
#[inline(always)]
fn tcp_flags(ctx: &XdpContext, h: &Headers) -> u8 {
    if h.proto != PROTO_TCP {
        return 0;
    }
    ptr_at(ctx, h.l4 + 13, 1).map(load8).unwrap_or(0)
}

/// A client packet to a VIP service. Not inlined: each path gets its own
/// stack frame, keeping every frame under the verifier's 512 bytes.
#[inline(never)]
fn to_backend(ctx: &XdpContext, h: &Headers, svc: &lb_common::ServiceInfo) -> Verdict {
    // Before any flow state: a refused client creates none, and an
    // established flow from a range since removed is cut here.
    if !policy::source_allowed(svc, &h.src) {
        return drop(Reason::DropSourceRange);
    }
    if ptr_at(ctx, h.l4, l4_min_len(h.proto)).is_none() {
        return drop(Reason::DropMalformed);
    }
    let Some((sport, dport)) = ports(ctx, h) else {
        return drop(Reason::DropMalformed);
    };
    if ttl(ctx, h) <= 1 {
        return pass(Reason::PassTtlExpired);
    }
    let flags = tcp_flags(ctx, h);
    let closing = flags & (TCP_FIN | TCP_RST) != 0;
    let syn = flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return drop(Reason::DropTableError);
    };
    // SAFETY: per-CPU scratch, only this program run uses it.
    let scratch = unsafe { &mut *scratch };
    conntrack::copy_addr(&mut scratch.key.src, &h.src);
    conntrack::copy_addr(&mut scratch.key.dst, &h.dst);
    scratch.key.sport = sport;
    scratch.key.dport = dport;
    scratch.key.proto = h.proto;
    scratch.key.family = h.family;
    let now = clock::now();
    let found = conntrack::lookup_or_create(svc, closing, syn, now, scratch);
    if found != conntrack::FOUND {
        return Verdict::new_raw(xdp_action::XDP_DROP, found);
    }
    // Every new flow counts toward this CPU's rate; above the threshold a
    // stateless one goes untracked (`flood`). The verdict stays in the
    // scratch, not in registers: live booleans multiplied the paths the
    // verifier walks through the rest of this function.
    if scratch.target.new_flow != 0
        && flood::over_threshold(now)
        && scratch.target.new_flow == scratch::NEW_FLOW_STATELESS
    {
        scratch.target.new_flow = scratch::UNTRACKED;
    }
    let t = &scratch.target;
    let snat = svc.flags & SERVICE_F_SNAT != 0;
    let src = if snat {
        Some((&scratch.flow.snat_addr, t.snat_port))
    } else {
        None
    };
    if rewrite(ctx, h, src, Some((&t.backend.addr, t.backend.port))).is_none() {
        return drop(Reason::DropMalformed);
    }
    let bytes = (ctx.data_end() - ctx.data()) as u64;
    // An untracked flow's later packets are picked afresh: only its SYN
    // counts as a new flow.
    let new_flow = t.new_flow;
    let counted = new_flow == scratch::NEW_FLOW
        || new_flow == scratch::NEW_FLOW_STATELESS
        || (new_flow == scratch::UNTRACKED && syn);
    stats::count_traffic(svc.id, t.backend_id, bytes, counted, false);
    if new_flow == scratch::UNTRACKED {
        stats::count_flow_event(lb_common::FLOW_EVENT_UNTRACKED);
    }
    // The route to a backend is cached in its BACKENDS entry, shared by
    // all its flows. A flow whose backend id has since been given to another
    // backend (it left the service, its flows stay) looks its route up itself.
    let cache = match BACKENDS.get_ptr_mut(t.backend_id) {
        // SAFETY: array value; racing CPUs write the same answer.
        Some(e)
            if unsafe {
                (*e).backend.addr == t.backend.addr && (*e).backend.port == t.backend.port
            } =>
        unsafe { &mut (*e).fib },
        _ => {
            // An interface index of 0 is "not cached": looked up afresh.
            scratch.fib.ifindex = 0;
            &mut scratch.fib
        }
    };
    let v = forward(
        ctx,
        h,
        if snat {
            &scratch.flow.snat_addr
        } else {
            &h.src
        },
        &scratch.target.backend.addr,
        cache,
    );
    let new_flow = scratch.target.new_flow;
    if new_flow == scratch::NEW_FLOW || new_flow == scratch::NEW_FLOW_STATELESS {
        // A full LRU evicts its oldest entry; failure only costs a re-pick later.
        let _ = FLOWS.insert(&scratch.key, &scratch.flow, 0);
    }
    v
}

/// A packet that may be a backend's reply; `Verdict::NONE` if it is not.
#[inline(never)]
fn from_backend(ctx: &XdpContext, h: &Headers) -> Verdict {
    from_backend_inner(ctx, h).unwrap_or(Verdict::NONE)
}

#[inline(always)]
fn from_backend_inner(ctx: &XdpContext, h: &Headers) -> Option<Verdict> {
    ptr_at(ctx, h.l4, l4_min_len(h.proto))?;
    let (sport, dport) = ports(ctx, h)?;
    let flags = tcp_flags(ctx, h);
    // SAFETY: per-CPU scratch, only this program run uses it.
    let s = unsafe { &mut *SCRATCH.get_ptr_mut(0)? };
    conntrack::copy_addr(&mut s.key.src, &h.src);
    conntrack::copy_addr(&mut s.key.dst, &h.dst);
    s.key.sport = sport;
    s.key.dport = dport;
    s.key.proto = h.proto;
    s.key.family = h.family;
    let closing = flags & (TCP_FIN | TCP_RST) != 0;
    let r = match conntrack::reply_lookup(&s.key, closing, clock::now()) {
        Some(r) => r,
        None => conntrack::reply_from_reverse(ctx, h, s, closing)?,
    };
    if flags & TCP_RST != 0 {
        conntrack::close_from_backend(r, &mut s.reply_key, h.proto, h.family);
    }
    if ttl(ctx, h) <= 1 {
        return Some(pass(Reason::PassTtlExpired));
    }
    // In NAT mode the destination already is the client; skip the no-op.
    let dst = if r.client != h.dst || r.cport != dport {
        Some((&r.client, r.cport))
    } else {
        None
    };
    // Only on a pod-side interface (generic XDP, the skb kept): there a
    // local Pod's unfinished checksum reaches the NIC as such.
    let pod_side = mac::pod_side(ctx);
    let unfinished = pod_side && checksum_unfinished(ctx, h);
    rewrite(ctx, h, Some((&r.vip, r.vport)), dst)?;
    if unfinished {
        leave_unfinished(ctx, h, &r.vip, &r.client)?;
    }
    let bytes = (ctx.data_end() - ctx.data()) as u64;
    stats::count_traffic(r.service_id, r.backend_id, bytes, false, true);
    // A Pod's segmentation-offload packet is larger than the uplink's MTU:
    // a redirect would drop it, the kernel segments it on the way out.
    if pod_side && forward::too_big(ctx, h, &r.vip, &r.client) {
        return Some(pass(Reason::PassFibFailed));
    }
    // The cache lives in the shared entry: any CPU may refresh it.
    Some(forward(ctx, h, &r.vip, &r.client, &mut r.fib))
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// The measurement floor of `cargo xtask bench`: an XDP program that only
/// returns XDP_PASS. The agent never attaches it.
#[xdp]
pub fn xlb_floor(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}
