//! Programs for the benchmarks; the agent never attaches them (it loads
//! only `xlb`). They are tiny on purpose: the forwarding benchmark's
//! traffic source, its limit and its receivers, and the throughput
//! benchmark's plain XDP router, not part of the data path.

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, xdp_action, BPF_FIB_LKUP_RET_SUCCESS},
    btf_maps::{Array, PerCpuArray},
    helpers::{bpf_fib_lookup, bpf_redirect},
    macros::{btf_map, xdp},
    programs::XdpContext,
    EbpfContext,
};
use core::mem::MaybeUninit;

use crate::{
    csum::Delta,
    forward::{write_mac, zeroed},
    parse::{load16, load32, load8, ptr_at, store16, store8},
};

/// Offsets in the generator's frame: Ethernet, then IPv4 without options.
const IP_PROTO: usize = 14 + 9;
const L4: usize = 14 + 20;
const TCP_CHECK: usize = L4 + 16;
const UDP_CHECK: usize = L4 + 6;
const PROTO_TCP: u8 = 6;
/// The frame's first 54 bytes: Ethernet, IPv4 and TCP (or UDP and 12 bytes
/// of payload), as 16-bit words in packet order.
pub const TEMPLATE_WORDS: usize = 27;
/// Source ports the generator cycles through: 1024..=65535.
const FIRST_PORT: u32 = 1024;
const PORTS: u32 = 65536 - FIRST_PORT;

/// Frames generated so far, per CPU: picks each frame's source port.
#[btf_map]
pub static GEN_FRAMES: PerCpuArray<u32, 1> = PerCpuArray::new();

/// `[0]`: the headers every generated frame starts from, written by the
/// benchmark. Live frames are recycled as the receivers left them (xlb's
/// DNAT rewrites them in place), so each run writes the headers afresh.
#[btf_map]
pub static GEN_TEMPLATE: Array<[u16; TEMPLATE_WORDS], 1> = Array::new();

/// `[0]`: the interface `xlb_redirect_only` sends every frame to.
#[btf_map]
pub static REDIRECT_TO: Array<u32, 1> = Array::new();

/// The traffic source, run by BPF_PROG_RUN with live frames, which sends
/// each frame it returns XDP_TX for out of the ingress interface with no
/// skb: the template's headers with the next source port, so every frame
/// is a new flow until the ports wrap.
#[xdp]
pub fn xlb_trafficgen(ctx: XdpContext) -> u32 {
    generate(&ctx).unwrap_or(xdp_action::XDP_ABORTED)
}

#[inline(always)]
fn generate(ctx: &XdpContext) -> Option<u32> {
    let template = GEN_TEMPLATE.get(0)?;
    let frame = ptr_at(ctx, 0, TEMPLATE_WORDS * 2)?;
    for (i, word) in template.iter().enumerate() {
        store16(frame + 2 * i, *word);
    }
    let count = GEN_FRAMES.get_ptr_mut(0)?;
    // SAFETY: a per-CPU slot only this CPU's runs touch.
    let n = unsafe { *count };
    unsafe { *count = n.wrapping_add(1) };
    let new = ((FIRST_PORT + n % PORTS) as u16).to_be();
    store16(frame + L4, new);
    let check = if load8(frame + IP_PROTO) == PROTO_TCP {
        TCP_CHECK
    } else {
        UDP_CHECK
    };
    let sum = load16(frame + check);
    // A UDP checksum of 0 means "none" and stays so.
    if sum != 0 || check == TCP_CHECK {
        let mut d = Delta::default();
        d.replace16(template[L4 / 2], new);
        store16(frame + check, d.apply(sum));
    }
    Some(xdp_action::XDP_TX)
}

/// The limit the forwarding benchmark compares with: every frame redirected
/// to one interface, untouched, without a look at it.
#[xdp]
pub fn xlb_redirect_only(_ctx: XdpContext) -> u32 {
    match REDIRECT_TO.get(0) {
        // SAFETY: a helper call with a plain interface index.
        Some(&ifindex) => unsafe { bpf_redirect(ifindex, 0) as u32 },
        None => xdp_action::XDP_ABORTED,
    }
}

/// The benchmark's receivers: drops every frame. The interface still counts
/// it in rx_packets, and the receiving namespace's stack does no work that
/// would share the CPU with what is measured.
#[xdp]
pub fn xlb_sink(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// What any XDP forwarder pays on these interfaces, without balancing:
/// every IPv4 frame routed as the kernel would route it (FIB lookup, MACs,
/// TTL) and redirected, or sent back out with XDP_TX; anything else, and
/// anything the FIB cannot answer, goes to the kernel. The throughput
/// benchmark runs it where xlb runs, to tell xlb's cost from XDP's.
#[xdp]
pub fn xlb_route_only(ctx: XdpContext) -> u32 {
    route(&ctx).unwrap_or(xdp_action::XDP_PASS)
}

#[inline(always)]
fn route(ctx: &XdpContext) -> Option<u32> {
    const ETH_P_IP: u16 = 0x0800;
    const AF_INET: u8 = 2;
    let eth = ptr_at(ctx, 0, 14 + 20)?;
    let ip = eth + 14;
    if u16::from_be(load16(eth + 12)) != ETH_P_IP || load8(ip + 8) <= 1 {
        return None;
    }
    let mut p = MaybeUninit::<FibParams>::uninit();
    let p = zeroed(&mut p);
    p.family = AF_INET;
    p.l4_protocol = load8(ip + 9);
    p.ifindex = ctx.ingress_ifindex() as u32;
    p.__bindgen_anon_1.tot_len = u16::from_be(load16(ip + 2));
    p.__bindgen_anon_3.ipv4_src = load32(ip + 12);
    p.__bindgen_anon_4.ipv4_dst = load32(ip + 16);
    // SAFETY: a valid, fully initialised parameter block of the size given.
    let rc =
        unsafe { bpf_fib_lookup(ctx.as_ptr(), p, core::mem::size_of::<FibParams>() as i32, 0) };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return None;
    }
    write_mac(eth, &p.dmac);
    write_mac(eth + 6, &p.smac);
    // TTL shares a checksummed 16-bit word with the protocol byte.
    let old = load16(ip + 8);
    store8(ip + 8, load8(ip + 8) - 1);
    let mut d = Delta::default();
    d.replace16(old, load16(ip + 8));
    store16(ip + 10, d.apply(load16(ip + 10)));
    Some(if p.ifindex == ctx.ingress_ifindex() as u32 {
        xdp_action::XDP_TX
    } else {
        // SAFETY: a helper call with a plain interface index.
        unsafe { bpf_redirect(p.ifindex, 0) as u32 }
    })
}
