//! ICMP for VIPs: echo requests are answered; "fragmentation needed" and
//! "packet too big" about a VIP flow go to that flow's backend, translated,
//! so that path MTU discovery works through the load balancer.

use aya_ebpf::{bindings::xdp_action, programs::XdpContext};
use lb_common::{Reason, ServiceKey, PROTO_ICMP, PROTO_ICMPV6, SERVICE_F_SNAT};

use crate::{
    conntrack,
    csum::Delta,
    forward::forward,
    maps::SERVICES,
    parse::{
        addr_offsets, load16, load8, ptr_at, rd16, rd8, rd_addr, store16, wr16, wr8, wr_addr,
        Headers,
    },
    scratch::SCRATCH,
    Verdict,
};

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_ECHO: u8 = 8;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_ECHO: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
const ICMPV6_NEIGHBOR_SOLICIT: u8 = 135;

/// True if `addr` is a VIP (the agent adds an echo marker for every VIP).
#[inline(always)]
pub fn is_vip(addr: &[u32; 4], family: u8) -> bool {
    let proto = if family == lb_common::FAMILY_V6 {
        PROTO_ICMPV6
    } else {
        PROTO_ICMP
    };
    let key = ServiceKey {
        addr: *addr,
        port: 0,
        proto,
        family,
    };
    SERVICES.get_ptr(&key).is_some()
}

/// Handles an ICMP/ICMPv6 packet; `Verdict::NONE` means "not ours, pass it".
#[inline(never)]
pub fn handle(ctx: &XdpContext, h: &Headers) -> Verdict {
    handle_inner(ctx, h).unwrap_or(Verdict::NONE)
}

#[inline(always)]
fn handle_inner(ctx: &XdpContext, h: &Headers) -> Option<Verdict> {
    let icmp = ptr_at(ctx, h.l4, 8)?;
    let (ty, code) = (load8(icmp), load8(icmp + 1));
    let v6 = h.v6();
    if v6 && ty == ICMPV6_NEIGHBOR_SOLICIT {
        let v = crate::l2::neighbor_solicit(ctx, h);
        return (!v.is_none()).then_some(v);
    }
    if (!v6 && ty == ICMP_ECHO) || (v6 && ty == ICMPV6_ECHO) {
        if !is_vip(&h.dst, h.family) {
            return None;
        }
        return Some(
            echo_reply(ctx, h).unwrap_or(Verdict::new(xdp_action::XDP_DROP, Reason::DropMalformed)),
        );
    }
    if (!v6 && ty == ICMP_DEST_UNREACH && code == ICMP_FRAG_NEEDED)
        || (v6 && ty == ICMPV6_PKT_TOOBIG)
    {
        if !is_vip(&h.dst, h.family) {
            return None;
        }
        return Some(
            too_big_to_backend(ctx, h)
                .unwrap_or(Verdict::new(xdp_action::XDP_DROP, Reason::DropIcmpNoFlow)),
        );
    }
    None
}

#[inline(always)]
fn echo_reply(ctx: &XdpContext, h: &Headers) -> Option<Verdict> {
    let v6 = h.v6();
    // Swap MACs.
    let eth = ptr_at(ctx, 0, 12)?;
    let (d0, d1, d2) = (load16(eth), load16(eth + 2), load16(eth + 4));
    store16(eth, load16(eth + 6));
    store16(eth + 2, load16(eth + 8));
    store16(eth + 4, load16(eth + 10));
    store16(eth + 6, d0);
    store16(eth + 8, d1);
    store16(eth + 10, d2);
    // Swap addresses: no checksum changes with a swap.
    let (src_off, dst_off) = addr_offsets(v6);
    wr_addr(ctx, h.l3 + src_off, &h.dst, v6)?;
    wr_addr(ctx, h.l3 + dst_off, &h.src, v6)?;
    let old_type = rd16(ctx, h.l4)?;
    wr8(
        ctx,
        h.l4,
        if v6 {
            ICMPV6_ECHO_REPLY
        } else {
            ICMP_ECHO_REPLY
        },
    )?;
    let mut d = Delta::default();
    d.replace16(old_type, rd16(ctx, h.l4)?);
    wr16(ctx, h.l4 + 2, d.apply(rd16(ctx, h.l4 + 2)?))?;
    if v6 {
        wr8(ctx, h.l3 + 7, 64)?;
    } else {
        // TTL shares a checksummed word with the protocol byte.
        let old = rd16(ctx, h.l3 + 8)?;
        wr8(ctx, h.l3 + 8, 64)?;
        let mut t = Delta::default();
        t.replace16(old, rd16(ctx, h.l3 + 8)?);
        wr16(ctx, h.l3 + 10, t.apply(rd16(ctx, h.l3 + 10)?))?;
    }
    Some(Verdict::new(xdp_action::XDP_TX, Reason::EchoReply))
}

/// The quoted packet is one the client received: `vip:vport -> client:cport`
/// (our translated reply). Its backend sent it as `backend:bport -> client`
/// (NAT) or `-> snat:sport` (SNAT); we restore that view and send the error there.
#[inline(always)]
fn too_big_to_backend(ctx: &XdpContext, h: &Headers) -> Option<Verdict> {
    let v6 = h.v6();
    let inner = h.l4 + 8;
    let (src_off, dst_off) = addr_offsets(v6);
    let (ihl, proto) = if v6 {
        (40usize, rd8(ctx, inner + 6)?)
    } else {
        let ihl = ((rd8(ctx, inner)? & 0x0f) as usize) * 4;
        if ihl < 20 {
            return None;
        }
        (ihl, rd8(ctx, inner + 9)?)
    };
    // SAFETY: per-CPU scratch, only this program run uses it.
    let s = unsafe { &mut *SCRATCH.get_ptr_mut(0)? };
    // The client's flow is the quoted packet reversed.
    s.key.dst = rd_addr(ctx, inner + src_off, v6)?;
    s.key.src = rd_addr(ctx, inner + dst_off, v6)?;
    let il4 = inner + ihl;
    s.key.dport = rd16(ctx, il4)?;
    s.key.sport = rd16(ctx, il4 + 2)?;
    s.key.proto = proto;
    s.key.family = h.family;
    let svc_key = ServiceKey {
        addr: s.key.dst,
        port: s.key.dport,
        proto,
        family: h.family,
    };
    // SAFETY: SERVICES is not preallocated: the element outlives this run.
    let svc = unsafe { &*SERVICES.get_ptr(&svc_key)? };
    if !crate::policy::source_allowed(svc, &s.key.src) {
        return None;
    }
    conntrack::find(svc, s)?;
    let (isrc, idst, isport, idport) = (&s.key.dst, &s.key.src, s.key.dport, s.key.sport);
    let t = &s.target;
    let snat = svc.flags & SERVICE_F_SNAT != 0;

    // Inner header: source becomes the backend, destination the SNAT address.
    let mut inner_d = Delta::default();
    inner_d.replace_addr(isrc, &t.backend.addr, v6);
    wr_addr(ctx, inner + src_off, &t.backend.addr, v6)?;
    inner_d.replace16(isport, t.backend.port);
    wr16(ctx, il4, t.backend.port)?;
    if snat {
        inner_d.replace_addr(idst, &s.flow.snat_addr, v6);
        wr_addr(ctx, inner + dst_off, &s.flow.snat_addr, v6)?;
        inner_d.replace16(idport, t.snat_port);
        wr16(ctx, il4 + 2, t.snat_port)?;
    }
    let mut icmp_d = inner_d;
    if !v6 {
        // The inner IPv4 header checksum covers its addresses, not the ports.
        let mut hdr = Delta::default();
        hdr.replace_addr(isrc, &t.backend.addr, false);
        if snat {
            hdr.replace_addr(idst, &s.flow.snat_addr, false);
        }
        let old = rd16(ctx, inner + 10)?;
        let new = hdr.apply(old);
        wr16(ctx, inner + 10, new)?;
        icmp_d.replace16(old, new);
    }
    // Outer destination becomes the backend.
    let mut outer = Delta::default();
    outer.replace_addr(&h.dst, &t.backend.addr, v6);
    wr_addr(ctx, h.l3 + dst_off, &t.backend.addr, v6)?;
    if v6 {
        // ICMPv6 checksums the pseudo-header too.
        icmp_d.add(outer);
    } else {
        wr16(ctx, h.l3 + 10, outer.apply(rd16(ctx, h.l3 + 10)?))?;
    }
    wr16(ctx, h.l4 + 2, icmp_d.apply(rd16(ctx, h.l4 + 2)?))?;
    // ICMP errors are rare: no cache, a fresh FIB lookup each time.
    s.fib.ifindex = 0;
    let v = forward(ctx, h, &h.src, &s.target.backend.addr, &mut s.fib);
    if v.action() == xdp_action::XDP_PASS {
        return Some(v);
    }
    Some(Verdict::new(v.action(), Reason::IcmpToBackend))
}
