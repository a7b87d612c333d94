//! L2 mode: ARP requests and IPv6 Neighbor Solicitations for the VIPs this
//! node owns are answered here, in place, with the receiving interface's
//! MAC (XDP_TX). The agent decides ownership (`L2_VIPS`) and vouches for it
//! with a deadline (`L2_IFACES`): past it, the program stays silent, so a
//! crashed or frozen agent's node stops claiming its VIPs by itself.

use aya_ebpf::{bindings::xdp_action, helpers::bpf_ktime_get_ns, programs::XdpContext};
use lb_common::{L2VipKey, Reason, FAMILY_V4, FAMILY_V6};

use crate::{
    maps::{L2_IFACES, L2_VIPS},
    parse::{load16, load32, load8, ptr_at, store16, store32, store8, Headers, ETH_HLEN},
    Verdict,
};

const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ARP_LEN: usize = 28;
const ARPOP_REQUEST: u16 = 1;
const ARPOP_REPLY: u16 = 2;
const ICMPV6_NEIGHBOR_ADVERT: u8 = 136;
/// An advertisement with the target link-layer address option: 8 bytes of
/// header, the target, and one 8-byte option.
const NA_LEN: usize = 32;

/// The MAC to answer `vip` with on the receiving interface, if this node
/// owns it there and the agent's deadline has not passed.
#[inline(always)]
fn owner_mac(ctx: &XdpContext, addr: [u32; 4], family: u8) -> Option<[u8; 6]> {
    let key = L2VipKey {
        addr,
        family,
        _pad: [0; 3],
    };
    // SAFETY: plain-data map values, read once.
    let vip = unsafe { L2_VIPS.get(&key)? };
    let ifindex = ctx.ingress_ifindex() as u32;
    if vip.ifindex != ifindex {
        return None;
    }
    // SAFETY: as above.
    let iface = unsafe { L2_IFACES.get(&ifindex)? };
    // SAFETY: a helper without arguments.
    if unsafe { bpf_ktime_get_ns() } >= iface.valid_until_ns {
        return None;
    }
    Some(iface.mac)
}

/// Ethernet: destination := source, source := `mac`.
#[inline(always)]
fn reply_eth(eth: usize, mac: &[u8; 6]) {
    store16(eth, load16(eth + 6));
    store16(eth + 2, load16(eth + 8));
    store16(eth + 4, load16(eth + 10));
    write_mac(eth + 6, mac);
}

#[inline(always)]
fn write_mac(p: usize, mac: &[u8; 6]) {
    for (i, b) in mac.iter().enumerate() {
        store8(p + i, *b);
    }
}

/// An ARP request for an owned VIP, answered; `Verdict::NONE` otherwise.
#[inline(never)]
pub fn arp(ctx: &XdpContext) -> Verdict {
    arp_inner(ctx).unwrap_or(Verdict::NONE)
}

#[inline(always)]
fn arp_inner(ctx: &XdpContext) -> Option<Verdict> {
    let eth = ptr_at(ctx, 0, ETH_HLEN)?;
    let mut l3 = ETH_HLEN;
    let mut ethertype = u16::from_be(load16(eth + 12));
    if ethertype == ETH_P_8021Q {
        ethertype = u16::from_be(load16(ptr_at(ctx, ETH_HLEN, 4)? + 2));
        l3 += 4;
    }
    if ethertype != ETH_P_ARP {
        return None;
    }
    let arp = ptr_at(ctx, l3, ARP_LEN)?;
    // Ethernet/IPv4 requests only: htype 1, ptype 0x0800, lengths 6 and 4.
    if u16::from_be(load16(arp)) != 1
        || u16::from_be(load16(arp + 2)) != 0x0800
        || load8(arp + 4) != 6
        || load8(arp + 5) != 4
        || u16::from_be(load16(arp + 6)) != ARPOP_REQUEST
    {
        return None;
    }
    let spa = load32(arp + 14);
    let tpa = load32(arp + 24);
    // A gratuitous request (another node announcing the VIP) is news, not a question.
    if spa == tpa {
        return None;
    }
    let mac = owner_mac(ctx, [tpa, 0, 0, 0], FAMILY_V4)?;
    let eth = ptr_at(ctx, 0, 12)?;
    let arp = ptr_at(ctx, l3, ARP_LEN)?;
    reply_eth(eth, &mac);
    store16(arp + 6, ARPOP_REPLY.to_be());
    // Target := the asker (its hardware and protocol address).
    store16(arp + 18, load16(arp + 8));
    store16(arp + 20, load16(arp + 10));
    store16(arp + 22, load16(arp + 12));
    store32(arp + 24, spa);
    // Sender := this node's MAC and the VIP.
    write_mac(arp + 8, &mac);
    store32(arp + 14, tpa);
    Some(Verdict::new(xdp_action::XDP_TX, Reason::ArpReply))
}

/// A Neighbor Solicitation (ICMPv6 type 135) for an owned VIP, answered
/// with a solicited Neighbor Advertisement; `Verdict::NONE` otherwise.
#[inline(never)]
pub fn neighbor_solicit(ctx: &XdpContext, h: &Headers) -> Verdict {
    neighbor_solicit_inner(ctx, h).unwrap_or(Verdict::NONE)
}

#[inline(always)]
fn neighbor_solicit_inner(ctx: &XdpContext, h: &Headers) -> Option<Verdict> {
    // No extension headers (a solicitation carries none), hop limit 255
    // (RFC 4861 7.1.1: it was not forwarded), and not duplicate address
    // detection (source ::), which is answered to all nodes, not here.
    if h.family != FAMILY_V6 || h.l4 != h.l3 + 40 || h.src == [0; 4] {
        return None;
    }
    let ns = ptr_at(ctx, h.l4, 24)?;
    if load8(ns + 1) != 0 || load8(ptr_at(ctx, h.l3 + 7, 1)?) != 255 {
        return None;
    }
    let target = [
        load32(ns + 8),
        load32(ns + 12),
        load32(ns + 16),
        load32(ns + 20),
    ];
    let mac = owner_mac(ctx, target, FAMILY_V6)?;
    // The advertisement is 32 bytes; the solicitation 24 plus options.
    let len = ctx.data_end() - ctx.data();
    let want = h.l4 + NA_LEN;
    if len != want {
        let delta = want as i32 - len as i32;
        // SAFETY: the helper checks the new length against the buffer.
        if unsafe { aya_ebpf::helpers::bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
            return None;
        }
    }
    let eth = ptr_at(ctx, 0, 12)?;
    reply_eth(eth, &mac);
    let ip = ptr_at(ctx, h.l3, 40 + NA_LEN)?;
    store16(ip + 4, (NA_LEN as u16).to_be());
    store8(ip + 7, 255);
    // Destination := the asker; source := the VIP.
    for (i, (asker, vip)) in h.src.iter().zip(&target).enumerate() {
        store32(ip + 24 + i * 4, *asker);
        store32(ip + 8 + i * 4, *vip);
    }
    let na = ip + 40;
    store8(na, ICMPV6_NEIGHBOR_ADVERT);
    store8(na + 1, 0);
    store16(na + 2, 0);
    // Flags: solicited and override (not a router).
    store32(na + 4, 0x6000_0000u32.to_be());
    // The target stays; one option: target link-layer address (type 2, 8 bytes).
    store8(na + 24, 2);
    store8(na + 25, 1);
    write_mac(na + 26, &mac);
    // Checksum over the pseudo-header (addresses, length, next header) and the message.
    let mut sum: u32 = (NA_LEN as u16).to_be() as u32 + 58u16.to_be() as u32;
    for i in 0..16 {
        sum += load16(ip + 8 + i * 2) as u32;
    }
    for i in 0..NA_LEN / 2 {
        sum += load16(na + i * 2) as u32;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    store16(na + 2, !(sum as u16));
    Some(Verdict::new(xdp_action::XDP_TX, Reason::NdpAdvert))
}
