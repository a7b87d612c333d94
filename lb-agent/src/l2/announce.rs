//! Telling the segment who answers for a VIP now: gratuitous ARP (a request
//! for the VIP from the VIP) and unsolicited Neighbor Advertisements (to all
//! nodes, override set). Hosts with an entry for the VIP update it to the
//! new MAC; switches learn the MAC's port. Sent through an AF_PACKET socket.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket},
    os::fd::{AsFd, OwnedFd},
};

use crate::sys;

const BROADCAST: [u8; 6] = [0xff; 6];
/// 33:33 + the low 32 bits of ff02::1.
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];

/// The frame announcing `vip` at `mac`.
pub fn frame(vip: IpAddr, mac: [u8; 6]) -> ([u8; 6], Vec<u8>) {
    match vip {
        IpAddr::V4(v4) => (BROADCAST, garp(v4, mac)),
        IpAddr::V6(v6) => (ALL_NODES_MAC, unsolicited_na(v6, mac)),
    }
}

fn garp(vip: Ipv4Addr, mac: [u8; 6]) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&BROADCAST);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&0x0806u16.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]); // Ethernet/IPv4, request
    f.extend_from_slice(&mac);
    f.extend_from_slice(&vip.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&vip.octets());
    f
}

fn unsolicited_na(vip: Ipv6Addr, mac: [u8; 6]) -> Vec<u8> {
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    let mut icmp = Vec::with_capacity(32);
    icmp.extend_from_slice(&[136, 0, 0, 0]); // type, code, checksum
    icmp.extend_from_slice(&0x2000_0000u32.to_be_bytes()); // override; not solicited
    icmp.extend_from_slice(&vip.octets());
    icmp.extend_from_slice(&[2, 1]); // target link-layer address, 8 bytes
    icmp.extend_from_slice(&mac);
    let sum = icmpv6_checksum(vip, all_nodes, &icmp);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut f = Vec::with_capacity(14 + 40 + icmp.len());
    f.extend_from_slice(&ALL_NODES_MAC);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&0x86ddu16.to_be_bytes());
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    f.extend_from_slice(&[58, 255]);
    f.extend_from_slice(&vip.octets());
    f.extend_from_slice(&all_nodes.octets());
    f.extend_from_slice(&icmp);
    f
}

/// RFC 4443 2.3: over the pseudo-header and the message.
pub fn icmpv6_checksum(src: Ipv6Addr, dst: Ipv6Addr, msg: &[u8]) -> u16 {
    let mut sum: u64 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            sum += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u64;
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&(msg.len() as u32).to_be_bytes());
    add(&[0, 0, 0, 58]);
    add(msg);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An AF_PACKET socket that only sends.
pub struct Sender {
    fd: OwnedFd,
}

impl Sender {
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            fd: sys::packet_socket()?,
        })
    }

    pub fn send(&self, ifindex: u32, dst: [u8; 6], frame: &[u8]) -> io::Result<()> {
        sys::send_frame(self.fd.as_fd(), ifindex, dst, frame)
    }
}

/// The solicited-node multicast group of `vip` (RFC 4291 2.7.1).
pub fn solicited_node(vip: Ipv6Addr) -> Ipv6Addr {
    let o = vip.octets();
    Ipv6Addr::new(
        0xff02,
        0,
        0,
        0,
        0,
        1,
        0xff00 | o[13] as u16,
        u16::from_be_bytes([o[14], o[15]]),
    )
}

/// Memberships of solicited-node groups, so that a NIC's multicast filter
/// (and an MLD-snooping switch) lets the VIPs' solicitations through to
/// the program. Joined for every L2 VIP on every interface, owned or not,
/// so that a takeover waits for no MLD report.
pub struct Groups {
    socket: Option<UdpSocket>,
    joined: std::collections::BTreeSet<(Ipv6Addr, u32)>,
}

impl Default for Groups {
    fn default() -> Self {
        Self {
            socket: UdpSocket::bind("[::]:0").ok(),
            joined: Default::default(),
        }
    }
}

impl Groups {
    /// Joins and leaves so that exactly `want` are joined; errors are
    /// returned per group and the rest still applied.
    pub fn set(
        &mut self,
        want: std::collections::BTreeSet<(Ipv6Addr, u32)>,
    ) -> Vec<(Ipv6Addr, io::Error)> {
        let mut errors = Vec::new();
        let Some(sock) = &self.socket else {
            return errors;
        };
        for (g, ifindex) in self.joined.difference(&want) {
            let _ = sock.leave_multicast_v6(g, *ifindex);
        }
        for (g, ifindex) in want.difference(&self.joined) {
            if let Err(e) = sock.join_multicast_v6(g, *ifindex) {
                if e.raw_os_error() != Some(libc::EADDRINUSE) {
                    errors.push((*g, e));
                }
            }
        }
        self.joined = want;
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gratuitous_arp_asks_for_the_vip_from_the_vip() {
        let mac = [2, 0, 0, 0, 0, 9];
        let (dst, f) = frame("10.9.0.50".parse().unwrap(), mac);
        assert_eq!(dst, BROADCAST);
        assert_eq!(f.len(), 42);
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[20..22], &[0, 1]); // request
        assert_eq!(&f[28..32], &[10, 9, 0, 50]); // sender
        assert_eq!(&f[38..42], &[10, 9, 0, 50]); // target
    }

    #[test]
    fn the_advertisement_checksums_to_zero() {
        let vip: Ipv6Addr = "fd00:9::50".parse().unwrap();
        let (dst, f) = frame(IpAddr::V6(vip), [2, 0, 0, 0, 0, 9]);
        assert_eq!(dst, ALL_NODES_MAC);
        let icmp = &f[54..];
        assert_eq!(icmp.len(), 32);
        // Summing a message with its checksum in place gives 0 (complemented).
        let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
        assert_eq!(icmpv6_checksum(vip, all_nodes, icmp), 0);
    }

    #[test]
    fn solicited_node_group_takes_the_low_24_bits() {
        let g = solicited_node("fd00:9::12:3456".parse().unwrap());
        assert_eq!(g, "ff02::1:ff12:3456".parse::<Ipv6Addr>().unwrap());
    }
}
