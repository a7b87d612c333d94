//! Address and port rewriting with incremental checksum updates.

use aya_ebpf::programs::XdpContext;
use lb_common::{PROTO_TCP, PROTO_UDP};

use crate::{
    csum::{pseudo_header, Delta},
    parse::{addr_offsets, rd16, wr16, wr_addr, Headers},
};

/// Bytes of transport header the rewrite touches (TCP checksum is at 16).
#[inline(always)]
pub fn l4_min_len(proto: u8) -> usize {
    if proto == PROTO_TCP {
        20
    } else {
        8
    }
}

/// Rewrites source and/or destination of a TCP or UDP packet, patching
/// the IPv4 header and transport checksums.
#[inline(always)]
/// `src`/`dst`: the new address and port (network order), or `None` to keep.
pub fn rewrite(
    ctx: &XdpContext,
    h: &Headers,
    src: Option<(&[u32; 4], u16)>,
    dst: Option<(&[u32; 4], u16)>,
) -> Option<()> {
    let v6 = h.v6();
    let (src_off, dst_off) = addr_offsets(v6);
    let mut addrs = Delta::default();
    let mut ports = Delta::default();
    if let Some((addr, port)) = src {
        addrs.replace_addr(&h.src, addr, v6);
        ports.replace16(rd16(ctx, h.l4)?, port);
        wr_addr(ctx, h.l3 + src_off, addr, v6)?;
        wr16(ctx, h.l4, port)?;
    }
    if let Some((addr, port)) = dst {
        addrs.replace_addr(&h.dst, addr, v6);
        ports.replace16(rd16(ctx, h.l4 + 2)?, port);
        wr_addr(ctx, h.l3 + dst_off, addr, v6)?;
        wr16(ctx, h.l4 + 2, port)?;
    }
    if !v6 {
        let c = h.l3 + 10;
        wr16(ctx, c, addrs.apply(rd16(ctx, c)?))?;
    }
    // The transport checksum covers the addresses through the pseudo-header.
    let mut l4_delta = addrs;
    l4_delta.add(ports);
    if h.proto == PROTO_UDP {
        let c = h.l4 + 6;
        let check = rd16(ctx, c)?;
        // Over IPv4 a zero UDP checksum means "none" and stays so.
        if check != 0 || v6 {
            let new = l4_delta.apply(check);
            wr16(ctx, c, if new == 0 { 0xffff } else { new })?;
        }
    } else {
        let c = h.l4 + 16;
        wr16(ctx, c, l4_delta.apply(rd16(ctx, c)?))?;
    }
    Some(())
}

/// Offset of the transport checksum.
#[inline(always)]
fn l4_check_offset(h: &Headers) -> usize {
    if h.proto == PROTO_TCP {
        h.l4 + 16
    } else {
        h.l4 + 6
    }
}

/// The transport length (header and payload) the IP header gives.
#[inline(always)]
fn l4_len(ctx: &XdpContext, h: &Headers) -> Option<u16> {
    let ext = (h.l4 - h.l3) as u16;
    if h.v6() {
        Some(
            u16::from_be(rd16(ctx, h.l3 + 4)?)
                .wrapping_add(40)
                .wrapping_sub(ext),
        )
    } else {
        Some(u16::from_be(rd16(ctx, h.l3 + 2)?).wrapping_sub(ext))
    }
}

/// Whether the transport checksum is unfinished: a Pod's veth hands over
/// TCP and UDP with only the pseudo-header sum in it (CHECKSUM_PARTIAL,
/// TX checksum offload), for the egress NIC to finish. A finished
/// checksum equals that sum only by chance (1 in 65536).
#[inline(always)]
pub fn checksum_unfinished(ctx: &XdpContext, h: &Headers) -> bool {
    let (Some(len), Some(check)) = (l4_len(ctx, h), rd16(ctx, l4_check_offset(h))) else {
        return false;
    };
    check == pseudo_header(&h.src, &h.dst, h.v6(), h.proto, len)
}

/// After [`rewrite`] of a packet whose checksum was unfinished: the field
/// must again hold the pseudo-header sum, now of the new addresses (the
/// incremental update is right for a finished checksum only; the skb,
/// kept by generic XDP, still says the NIC finishes it).
#[inline(always)]
pub fn leave_unfinished(
    ctx: &XdpContext,
    h: &Headers,
    src: &[u32; 4],
    dst: &[u32; 4],
) -> Option<()> {
    let len = l4_len(ctx, h)?;
    wr16(
        ctx,
        l4_check_offset(h),
        pseudo_header(src, dst, h.v6(), h.proto, len),
    )
}
