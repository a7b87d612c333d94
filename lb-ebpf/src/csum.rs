//! Incremental Internet checksum updates (RFC 1624, eq. 3: HC' = ~(~HC + ~m + m')).
//!
//! Values are 16-bit words exactly as loaded from the packet (network order
//! kept in a native integer). One's-complement sums commute with byte
//! swapping, so no conversion is needed as long as every word is treated the same.

/// Accumulates the words a rewrite removes and adds, then patches a checksum once.
#[derive(Clone, Copy, Default)]
pub struct Delta(u64);

impl Delta {
    #[inline(always)]
    pub fn replace16(&mut self, old: u16, new: u16) {
        self.0 += (!old) as u64 + new as u64;
    }

    #[inline(always)]
    pub fn replace32(&mut self, old: u32, new: u32) {
        let o = !old;
        self.0 +=
            (o & 0xffff) as u64 + (o >> 16) as u64 + (new & 0xffff) as u64 + (new >> 16) as u64;
    }

    #[inline(always)]
    pub fn replace_addr(&mut self, old: &[u32; 4], new: &[u32; 4], v6: bool) {
        self.replace32(old[0], new[0]);
        if v6 {
            self.replace32(old[1], new[1]);
            self.replace32(old[2], new[2]);
            self.replace32(old[3], new[3]);
        }
    }

    #[inline(always)]
    pub fn add(&mut self, other: Delta) {
        self.0 += other.0;
    }

    /// The checksum `check` becomes after the recorded replacements.
    #[inline(always)]
    pub fn apply(self, check: u16) -> u16 {
        !fold((!check) as u64 + self.0)
    }
}

/// The folded pseudo-header sum (addresses, protocol, transport length):
/// what an unfinished (CHECKSUM_PARTIAL) transport checksum holds, the
/// rest being left to the NIC. Words as loaded from the packet.
#[inline(always)]
pub fn pseudo_header(src: &[u32; 4], dst: &[u32; 4], v6: bool, proto: u8, l4_len: u16) -> u16 {
    let w = |a: u32| (a & 0xffff) as u64 + (a >> 16) as u64;
    let mut s = w(src[0]) + w(dst[0]);
    if v6 {
        s += w(src[1]) + w(src[2]) + w(src[3]) + w(dst[1]) + w(dst[2]) + w(dst[3]);
    }
    s += u16::from_ne_bytes([0, proto]) as u64;
    s += u16::from_ne_bytes(l4_len.to_be_bytes()) as u64;
    fold(s)
}

#[inline(always)]
fn fold(mut s: u64) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}
