//! Sending a rewritten packet on: FIB lookup, MACs, TTL, XDP_TX or redirect.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup as FibParams, xdp_action, BPF_FIB_LKUP_RET_FRAG_NEEDED,
        BPF_FIB_LKUP_RET_NOT_FWDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
    },
    helpers::{bpf_fib_lookup, bpf_redirect},
    programs::XdpContext,
    EbpfContext,
};
use core::mem::MaybeUninit;

use lb_common::{FibCache, Reason};

/// Age after which a cached FIB answer is looked up again: route and
/// neighbour changes reach established flows within this time.
const FIB_REFRESH_NS: u64 = 1_000_000_000;

use crate::{
    clock::now,
    csum::Delta,
    maps::TX_PORTS,
    parse::{load16, load8, ptr_at, store16, store32, store8, Headers},
    Verdict,
};

/// TTL / hop limit of the packet; forwarding needs it above 1.
#[inline(always)]
pub fn ttl(ctx: &XdpContext, h: &Headers) -> u8 {
    let off = if h.v6() { 7 } else { 8 };
    ptr_at(ctx, h.l3 + off, 1).map(load8).unwrap_or(0)
}

/// Routes the (already rewritten) packet to `dst`, using `cache` when it
/// holds a FIB answer younger than a second and refreshing it otherwise.
/// Returns the action and its reason.
#[inline(never)]
pub fn forward(
    ctx: &XdpContext,
    h: &Headers,
    src: &[u32; 4],
    dst: &[u32; 4],
    cache: &mut FibCache,
) -> Verdict {
    let ingress = ctx.ingress_ifindex() as u32;
    let t = now();
    if cache.ifindex == 0 || t.saturating_sub(cache.checked_ns) > FIB_REFRESH_NS {
        let mut p = MaybeUninit::<FibParams>::uninit();
        let p = zeroed(&mut p);
        let rc = fib_lookup(ctx, h, src, dst, p);
        if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
            cache.ifindex = 0;
            return Verdict::new(xdp_action::XDP_PASS, Reason::PassNoNeigh);
        }
        if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
            cache.ifindex = 0;
            return Verdict::new(xdp_action::XDP_PASS, Reason::PassFibFailed);
        }
        // Only interfaces the agent listed take redirects (the ingress one
        // always does): anything else goes through the kernel.
        if p.ifindex != ingress && TX_PORTS.get_ifindex(p.ifindex).is_none() {
            cache.ifindex = 0;
            return Verdict::new(xdp_action::XDP_PASS, Reason::PassFibFailed);
        }
        cache.ifindex = p.ifindex;
        cache.dmac = p.dmac;
        cache.smac = p.smac;
        cache.checked_ns = t;
    }
    let (action, reason) = if cache.ifindex == ingress {
        (xdp_action::XDP_TX, Reason::Tx)
    } else if h.vlan {
        // We cannot know the egress VLAN; the kernel's VLAN device does.
        return Verdict::new(xdp_action::XDP_PASS, Reason::PassFibFailed);
    } else {
        // Checked against TX_PORTS when cached; no map lookup per packet.
        // SAFETY: plain helper call.
        let a = unsafe { bpf_redirect(cache.ifindex, 0) } as u32;
        (a, Reason::Redirect)
    };
    let Some(eth) = ptr_at(ctx, 0, 12) else {
        return Verdict::new(xdp_action::XDP_ABORTED, Reason::DropMalformed);
    };
    write_mac(eth, &cache.dmac);
    write_mac(eth + 6, &cache.smac);
    decrement_ttl(ctx, h);
    Verdict::new(action, reason)
}

/// `bpf_fib_lookup` of `src -> dst` from the ingress interface; the
/// helper's return code, the answer in `p`.
#[inline(always)]
fn fib_lookup(
    ctx: &XdpContext,
    h: &Headers,
    src: &[u32; 4],
    dst: &[u32; 4],
    p: &mut FibParams,
) -> i64 {
    let len = (ctx.data_end() - ctx.data()).saturating_sub(h.l3) as u16;
    fib_lookup_len(ctx, h, src, dst, p, len)
}

/// As [`fib_lookup`] with the IP length given: 0 skips the MTU check.
#[inline(always)]
fn fib_lookup_len(
    ctx: &XdpContext,
    h: &Headers,
    src: &[u32; 4],
    dst: &[u32; 4],
    p: &mut FibParams,
    len: u16,
) -> i64 {
    p.family = h.family;
    p.l4_protocol = h.proto;
    p.ifindex = ctx.ingress_ifindex() as u32;
    p.__bindgen_anon_1.tot_len = len;
    if h.v6() {
        p.__bindgen_anon_3.ipv6_src = *src;
        p.__bindgen_anon_4.ipv6_dst = *dst;
    } else {
        p.__bindgen_anon_3.ipv4_src = src[0];
        p.__bindgen_anon_4.ipv4_dst = dst[0];
    }
    // SAFETY: `p` is a valid, fully initialised parameter block of the size given.
    unsafe { bpf_fib_lookup(ctx.as_ptr(), p, core::mem::size_of::<FibParams>() as i32, 0) }
}

/// Whether `dst` is an address of this node (the kernel would deliver a
/// packet to it rather than forward it). Not inlined: only a reply's first
/// packet asks.
#[inline(never)]
pub fn is_local(ctx: &XdpContext, h: &Headers, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    let mut p = MaybeUninit::<FibParams>::uninit();
    fib_lookup(ctx, h, src, dst, zeroed(&mut p)) == BPF_FIB_LKUP_RET_NOT_FWDED as i64
}

/// Whether the route from `src` to `dst` leaves by an interface that takes
/// redirects (`TX_PORTS`: the attached uplinks). A reply seen on a pod-side
/// interface is translated by `BACKEND_REVERSE` only then: one to another
/// node's Pod (through a tunnel) is in-cluster traffic to the backend's own
/// address, not a reply to a client of the VIP. No MTU check (`tot_len` 0):
/// only the route matters.
#[inline(never)]
pub fn leaves_by_uplink(ctx: &XdpContext, h: &Headers, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    let mut p = MaybeUninit::<FibParams>::uninit();
    let p = zeroed(&mut p);
    let rc = fib_lookup_len(ctx, h, src, dst, p, 0);
    (rc == BPF_FIB_LKUP_RET_SUCCESS as i64 || rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64)
        && TX_PORTS.get_ifindex(p.ifindex).is_some()
}

/// Whether the packet is larger than the route's MTU allows: generic XDP
/// hands over a Pod's segmentation-offload packets whole (up to 64 KiB),
/// which a redirect would drop where the kernel segments them. Packets up
/// to 1280 bytes (IPv6's minimum MTU) fit any route and skip the lookup.
#[inline(never)]
pub fn too_big(ctx: &XdpContext, h: &Headers, src: &[u32; 4], dst: &[u32; 4]) -> bool {
    if (ctx.data_end() - ctx.data()).saturating_sub(h.l3) <= 1280 {
        return false;
    }
    let mut p = MaybeUninit::<FibParams>::uninit();
    fib_lookup(ctx, h, src, dst, zeroed(&mut p)) == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64
}

/// Zeroes the FIB lookup's parameter block four bytes at a time (its
/// alignment). `mem::zeroed` becomes a call to a byte-by-byte `memset` (the
/// BPF backend does not inline it: over 300 instructions); volatile stores
/// cannot be merged back into one.
#[inline(always)]
pub(crate) fn zeroed(p: &mut MaybeUninit<FibParams>) -> &mut FibParams {
    const WORDS: usize = core::mem::size_of::<FibParams>() / 4;
    const _: () = assert!(core::mem::size_of::<FibParams>().is_multiple_of(4));
    const _: () = assert!(core::mem::align_of::<FibParams>() >= 4);
    let w = p.as_mut_ptr() as *mut u32;
    for i in 0..WORDS {
        // SAFETY: within the block, at its alignment (asserted above).
        unsafe { w.add(i).write_volatile(0) };
    }
    // SAFETY: every byte is now zero, a valid value of this plain-data struct.
    unsafe { p.assume_init_mut() }
}

#[inline(always)]
pub(crate) fn write_mac(p: usize, mac: &[u8; 6]) {
    store16(p, u16::from_ne_bytes([mac[0], mac[1]]));
    store32(p + 2, u32::from_ne_bytes([mac[2], mac[3], mac[4], mac[5]]));
}

#[inline(always)]
fn decrement_ttl(ctx: &XdpContext, h: &Headers) {
    if h.v6() {
        if let Some(p) = ptr_at(ctx, h.l3 + 7, 1) {
            store8(p, load8(p).wrapping_sub(1));
        }
    } else if let Some(ip) = ptr_at(ctx, h.l3, 20) {
        // TTL shares a checksummed 16-bit word with the protocol byte.
        let old = load16(ip + 8);
        store8(ip + 8, load8(ip + 8).wrapping_sub(1));
        let mut d = Delta::default();
        d.replace16(old, load16(ip + 8));
        store16(ip + 10, d.apply(load16(ip + 10)));
    }
}
