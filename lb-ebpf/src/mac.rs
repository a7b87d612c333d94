//! Frames for this node only. A promiscuous interface (a bridge port, a
//! macvlan parent, a running tcpdump) or a switch flooding an unknown
//! destination hands XDP unicast frames addressed to other hosts; the
//! kernel would drop them (PACKET_OTHERHOST), so translating them would
//! make this node answer another node's connection.

use aya_ebpf::programs::XdpContext;
use lb_common::{IfaceMac, IFACE_F_POD, IFACE_SLOTS};

use crate::{
    maps::{IFACE_MACS, IFACE_MACS_SPILL},
    parse::{load16, load8, ptr_at},
};

/// False for a unicast frame to another MAC than the receiving interface's.
/// Group frames (broadcast, multicast: ARP requests, NDP solicitations)
/// and interfaces the agent has not named are taken as before.
#[inline(always)]
pub fn for_us(ctx: &XdpContext) -> bool {
    let Some(eth) = ptr_at(ctx, 0, 6) else {
        // Too short to tell: parsing passes it as truncated.
        return true;
    };
    if load8(eth) & 1 != 0 {
        return true;
    }
    let Some(entry) = entry(ctx) else {
        return true;
    };
    let m = &entry.mac;
    load16(eth) == u16::from_ne_bytes([m[0], m[1]])
        && load16(eth + 2) == u16::from_ne_bytes([m[2], m[3]])
        && load16(eth + 4) == u16::from_ne_bytes([m[4], m[5]])
}

/// The receiving interface's `IFACE_MACS` entry, if the agent wrote one.
#[inline(always)]
fn entry(ctx: &XdpContext) -> Option<&'static IfaceMac> {
    let ifindex = ctx.ingress_ifindex() as u32;
    let slot = IFACE_MACS.get(ifindex & (IFACE_SLOTS - 1))?;
    if slot.ifindex == ifindex {
        Some(slot)
    } else {
        // SAFETY: plain-data value, read at once.
        unsafe { IFACE_MACS_SPILL.get(&ifindex) }
    }
}

/// Whether the receiving interface is pod-side (`IFACE_F_POD`). Read only
/// on a reply's path, so ordinary traffic does not pay for it twice.
#[inline(always)]
pub fn pod_side(ctx: &XdpContext) -> bool {
    entry(ctx).is_some_and(|e| e.flags & IFACE_F_POD != 0)
}
