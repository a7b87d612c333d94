//! Bounds-checked packet access and header parsing.
//!
//! Every header sits at an even offset (Ethernet is 14 bytes, VLAN tags,
//! IPv4 options and IPv6 extension headers are multiples of 4), so 16-bit
//! loads and stores are always aligned; 32-bit fields are read as two halves.

use aya_ebpf::programs::XdpContext;
use lb_common::{FAMILY_V4, FAMILY_V6};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;

/// IPv6 extension headers walked before giving up on finding L4. Each one
/// more multiplies the paths the verifier walks (two: ~690k of its 1M
/// instruction budget; three: ~900k).
const MAX_IPV6_EXT: usize = 2;

/// Pointer to `len` bytes at `off`, or `None` if the packet is shorter.
#[inline(always)]
pub fn ptr_at(ctx: &XdpContext, off: usize, len: usize) -> Option<usize> {
    let start = ctx.data();
    if start + off + len > ctx.data_end() {
        return None;
    }
    Some(start + off)
}

#[inline(always)]
pub fn load16(p: usize) -> u16 {
    // SAFETY: callers got `p` from `ptr_at` with room for the read.
    unsafe { *(p as *const u16) }
}

#[inline(always)]
pub fn store16(p: usize, v: u16) {
    // SAFETY: as for `load16`.
    unsafe { *(p as *mut u16) = v }
}

#[inline(always)]
pub fn load32(p: usize) -> u32 {
    load16(p) as u32 | ((load16(p + 2) as u32) << 16)
}

#[inline(always)]
pub fn store32(p: usize, v: u32) {
    store16(p, v as u16);
    store16(p + 2, (v >> 16) as u16);
}

/// Checked accessors by packet offset. Each access carries its own bounds
/// check of a constant size, so the verifier never has to connect a check
/// of a computed length (`if v6 { 40 } else { 20 }`) with a later access.
#[inline(always)]
pub fn rd16(ctx: &XdpContext, off: usize) -> Option<u16> {
    ptr_at(ctx, off, 2).map(load16)
}

#[inline(always)]
pub fn wr16(ctx: &XdpContext, off: usize, v: u16) -> Option<()> {
    ptr_at(ctx, off, 2).map(|p| store16(p, v))
}

#[inline(always)]
pub fn rd8(ctx: &XdpContext, off: usize) -> Option<u8> {
    ptr_at(ctx, off, 1).map(load8)
}

#[inline(always)]
pub fn wr8(ctx: &XdpContext, off: usize, v: u8) -> Option<()> {
    ptr_at(ctx, off, 1).map(|p| store8(p, v))
}

/// Reads an address (4 bytes for IPv4, 16 for IPv6) at `off`.
#[inline(always)]
pub fn rd_addr(ctx: &XdpContext, off: usize, v6: bool) -> Option<[u32; 4]> {
    if v6 {
        let p = ptr_at(ctx, off, 16)?;
        Some([load32(p), load32(p + 4), load32(p + 8), load32(p + 12)])
    } else {
        let p = ptr_at(ctx, off, 4)?;
        Some([load32(p), 0, 0, 0])
    }
}

/// Writes an address (4 bytes for IPv4, 16 for IPv6) at `off`.
#[inline(always)]
pub fn wr_addr(ctx: &XdpContext, off: usize, addr: &[u32; 4], v6: bool) -> Option<()> {
    if v6 {
        let p = ptr_at(ctx, off, 16)?;
        store32(p, addr[0]);
        store32(p + 4, addr[1]);
        store32(p + 8, addr[2]);
        store32(p + 12, addr[3]);
    } else {
        let p = ptr_at(ctx, off, 4)?;
        store32(p, addr[0]);
    }
    Some(())
}

/// Offsets of the source and destination address within the IP header.
#[inline(always)]
pub fn addr_offsets(v6: bool) -> (usize, usize) {
    if v6 {
        (8, 24)
    } else {
        (12, 16)
    }
}

#[inline(always)]
pub fn load8(p: usize) -> u8 {
    // SAFETY: as for `load16`.
    unsafe { *(p as *const u8) }
}

#[inline(always)]
pub fn store8(p: usize, v: u8) {
    // SAFETY: as for `load16`.
    unsafe { *(p as *mut u8) = v }
}

/// What the program needs to know of a packet's L2-L4 headers.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Headers {
    /// Offset of the IP header.
    pub l3: usize,
    /// Offset of the L4 header (valid unless `fragment` is a non-first fragment).
    pub l4: usize,
    pub family: u8,
    pub proto: u8,
    pub vlan: bool,
    /// Any IPv4 fragment, or an IPv6 packet with a non-atomic fragment header.
    pub fragment: bool,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

impl Headers {
    #[inline(always)]
    pub fn v6(&self) -> bool {
        self.family == FAMILY_V6
    }
}

pub enum ParseError {
    NotIp,
    Truncated,
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Headers, ParseError> {
    let eth = ptr_at(ctx, 0, ETH_HLEN).ok_or(ParseError::Truncated)?;
    let mut ethertype = u16::from_be(load16(eth + 12));
    let mut l3 = ETH_HLEN;
    let mut vlan = false;
    if ethertype == ETH_P_8021Q {
        let tag = ptr_at(ctx, ETH_HLEN, 4).ok_or(ParseError::Truncated)?;
        ethertype = u16::from_be(load16(tag + 2));
        l3 += 4;
        vlan = true;
    }
    match ethertype {
        ETH_P_IP => parse_ipv4(ctx, l3, vlan),
        ETH_P_IPV6 => parse_ipv6(ctx, l3, vlan),
        _ => Err(ParseError::NotIp),
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, l3: usize, vlan: bool) -> Result<Headers, ParseError> {
    let ip = ptr_at(ctx, l3, 20).ok_or(ParseError::Truncated)?;
    let vihl = load8(ip);
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if vihl >> 4 != 4 || ihl < 20 {
        return Err(ParseError::Truncated);
    }
    // Options must be present in full even though we skip them.
    ptr_at(ctx, l3, ihl).ok_or(ParseError::Truncated)?;
    let frag = u16::from_be(load16(ip + 6)) & 0x3fff; // MF flag + offset
    Ok(Headers {
        l3,
        l4: l3 + ihl,
        family: FAMILY_V4,
        proto: load8(ip + 9),
        vlan,
        fragment: frag != 0,
        src: [load32(ip + 12), 0, 0, 0],
        dst: [load32(ip + 16), 0, 0, 0],
    })
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, l3: usize, vlan: bool) -> Result<Headers, ParseError> {
    let ip = ptr_at(ctx, l3, 40).ok_or(ParseError::Truncated)?;
    let mut next = load8(ip + 6);
    let mut off = l3 + 40;
    let mut fragment = false;
    for _ in 0..MAX_IPV6_EXT {
        match next {
            // Hop-by-hop, routing, destination options: length in 8-byte units after the first 8.
            0 | 43 | 60 => {
                let ext = ptr_at(ctx, off, 8).ok_or(ParseError::Truncated)?;
                next = load8(ext);
                off += (load8(ext + 1) as usize + 1) * 8;
            }
            // Fragment header: fixed 8 bytes. Offset 0 without M is an atomic fragment.
            44 => {
                let ext = ptr_at(ctx, off, 8).ok_or(ParseError::Truncated)?;
                next = load8(ext);
                fragment = u16::from_be(load16(ext + 2)) & 0xfff9 != 0;
                off += 8;
            }
            _ => break,
        }
    }
    Ok(Headers {
        l3,
        l4: off,
        family: FAMILY_V6,
        proto: next,
        vlan,
        fragment,
        src: [
            load32(ip + 8),
            load32(ip + 12),
            load32(ip + 16),
            load32(ip + 20),
        ],
        dst: [
            load32(ip + 24),
            load32(ip + 28),
            load32(ip + 32),
            load32(ip + 36),
        ],
    })
}

/// Source and destination port (network order) of a TCP or UDP header.
#[inline(always)]
pub fn ports(ctx: &XdpContext, h: &Headers) -> Option<(u16, u16)> {
    let l4 = ptr_at(ctx, h.l4, 4)?;
    Some((load16(l4), load16(l4 + 2)))
}
