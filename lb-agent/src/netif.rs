//! Network interfaces: their index, address and driver, and per-interface
//! settings. IPv4 settings go through rtnetlink, which needs only
//! CAP_NET_ADMIN: `/proc/sys` is read-only in an unprivileged container, so
//! writing `net.ipv4.conf.<if>.accept_local` there would need a privileged
//! one. The kernel takes the same setting as an `IFLA_INET_CONF` attribute
//! of an RTM_NEWLINK request.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsFd, OwnedFd},
};

use ipnet::IpNet;

use crate::sys::{self, IfAddress};

/// Index of a network interface in the caller's network namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    sys::if_nametoindex(&std::ffi::CString::new(name).ok()?)
}

/// The first address of `family` (v4 when `v4`) on interface `iface`:
/// the default next hop. IPv6 link-local addresses are skipped.
pub fn interface_address(iface: &str, v4: bool) -> Option<IpAddr> {
    interface_networks(iface)
        .into_iter()
        .map(|n| n.addr())
        .find(|a| a.is_ipv4() == v4 && !is_link_local(*a))
}

/// The address this node is known by on `iface`: its first IPv4 address,
/// or on an IPv6-only interface its first global IPv6 address.
pub fn node_address(iface: &str) -> Option<IpAddr> {
    interface_address(iface, true).or_else(|| interface_address(iface, false))
}

fn is_link_local(a: IpAddr) -> bool {
    matches!(a, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

/// The addresses on `iface` with their prefixes, in the kernel's order.
pub fn interface_networks(iface: &str) -> Vec<IpNet> {
    networks(Some(iface))
}

/// Every address of this node (all interfaces).
pub fn local_addresses() -> Vec<IpAddr> {
    networks(None).into_iter().map(|n| n.addr()).collect()
}

/// The addresses on `iface`, or on every interface, with their prefixes.
fn networks(iface: Option<&str>) -> Vec<IpNet> {
    addresses_of(iface)
        .filter_map(|a| match a {
            IfAddress::Ip(ip, len) => IpNet::new(ip, len).ok(),
            IfAddress::Mac(_) => None,
        })
        .collect()
}

/// The hardware (MAC) address of `iface`.
pub fn interface_mac(iface: &str) -> Option<[u8; 6]> {
    addresses_of(Some(iface)).find_map(|a| match a {
        IfAddress::Mac(mac) => Some(mac),
        IfAddress::Ip(..) => None,
    })
}

/// The addresses of `iface` (of all interfaces with `None`).
fn addresses_of(iface: Option<&str>) -> impl Iterator<Item = IfAddress> + use<'_> {
    sys::interface_addresses()
        .into_iter()
        .filter(move |e| iface.is_none_or(|i| e.interface.as_bytes() == i.as_bytes()))
        .map(|e| e.address)
}

/// linux/neighbour.h: a neighbour's address, its extended flags, and the
/// one that has the kernel keep it resolved (`managed`, Linux 5.16).
const NDA_DST: u16 = 1;
const NDA_FLAGS_EXT: u16 = 15;
const NTF_EXT_MANAGED: u32 = 1;

/// Has the kernel resolve `addr` on `ifindex` and keep it resolved (a
/// managed neighbour entry, `ip neigh replace ADDR dev IF managed`): the
/// data plane forwards only to next hops with a neighbour entry, and it
/// takes the packets that would make the kernel resolve them.
pub fn keep_neighbour_resolved(ifindex: u32, addr: IpAddr) -> io::Result<()> {
    rtnetlink_request(&managed_neighbour_request(ifindex, addr))
}

fn managed_neighbour_request(ifindex: u32, addr: IpAddr) -> Vec<u8> {
    let (family, octets) = match addr {
        IpAddr::V4(a) => (libc::AF_INET, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6, a.octets().to_vec()),
    };
    let mut body = Vec::new();
    // struct ndmsg: family, pad, pad, ifindex, state (NUD_NONE: the kernel
    // resolves it), flags, type.
    body.extend_from_slice(&[family as u8, 0]);
    body.extend_from_slice(&0u16.to_ne_bytes());
    body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    body.extend_from_slice(&0u16.to_ne_bytes());
    body.extend_from_slice(&[0, 0]);
    attr(&mut body, NDA_DST, &octets);
    attr(&mut body, NDA_FLAGS_EXT, &NTF_EXT_MANAGED.to_ne_bytes());
    let flags = libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_REPLACE;
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&libc::RTM_NEWNEIGH.to_ne_bytes());
    msg.extend_from_slice(&(flags as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&body);
    msg
}

/// `IPV4_DEVCONF_ACCEPT_LOCAL` in linux/ip.h (the sysctl's index, 1-based).
const IPV4_DEVCONF_ACCEPT_LOCAL: u16 = 23;
/// linux/if_link.h: `IFLA_AF_SPEC`, and `IFLA_INET_CONF` inside its AF_INET part.
const IFLA_AF_SPEC: u16 = 26;
const IFLA_INET_CONF: u16 = 1;
const NLA_F_NESTED: u16 = 1 << 15;

/// Sets `accept_local` on `ifindex` in the caller's network namespace.
pub fn set_accept_local(ifindex: u32, on: bool) -> io::Result<()> {
    let request = accept_local_request(ifindex, on);
    rtnetlink_request(&request)
}

/// Appends one netlink attribute (header, payload, padding to 4 bytes).
fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// RTM_NEWLINK { ifinfomsg, IFLA_AF_SPEC { AF_INET { IFLA_INET_CONF { ACCEPT_LOCAL = on } } } }.
fn accept_local_request(ifindex: u32, on: bool) -> Vec<u8> {
    let mut conf = Vec::new();
    attr(
        &mut conf,
        IPV4_DEVCONF_ACCEPT_LOCAL,
        &u32::from(on).to_ne_bytes(),
    );
    let mut inet = Vec::new();
    attr(&mut inet, IFLA_INET_CONF | NLA_F_NESTED, &conf);
    let mut af_spec = Vec::new();
    attr(&mut af_spec, libc::AF_INET as u16 | NLA_F_NESTED, &inet);

    let mut body = Vec::new();
    // struct ifinfomsg: family, pad, type, index, flags, change.
    body.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]);
    body.extend_from_slice(&0u16.to_ne_bytes());
    body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    body.extend_from_slice(&0u32.to_ne_bytes());
    body.extend_from_slice(&0u32.to_ne_bytes());
    attr(&mut body, IFLA_AF_SPEC | NLA_F_NESTED, &af_spec);

    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&libc::RTM_NEWLINK.to_ne_bytes());
    msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    msg.extend_from_slice(&body);
    msg
}

/// How XDP is attached to an interface, as `IFLA_XDP_ATTACHED` says
/// (linux/if_link.h `XDP_ATTACHED_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttached {
    None,
    /// Driver (native) mode.
    Driver,
    /// Generic (skb) mode.
    Generic,
    /// Offloaded to the NIC, or more than one mode at once.
    Other,
}

/// linux/if_link.h: `IFLA_XDP` and `IFLA_XDP_ATTACHED` inside it.
const IFLA_XDP: u16 = 43;
const IFLA_XDP_ATTACHED: u16 = 2;

/// How XDP is attached to `ifindex` in the caller's network namespace.
pub fn xdp_attached(ifindex: u32) -> io::Result<XdpAttached> {
    let mut msg = Vec::with_capacity(32);
    msg.extend_from_slice(&32u32.to_ne_bytes());
    msg.extend_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    msg.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    // struct ifinfomsg
    msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]);
    msg.extend_from_slice(&0u16.to_ne_bytes());
    msg.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    let reply = rtnetlink_exchange(&msg)?;
    parse_xdp_attached(&reply)
}

/// Name of the interface with index `ifindex` in the caller's network namespace.
pub fn ifname(ifindex: u32) -> Option<String> {
    String::from_utf8(sys::if_indextoname(ifindex)?).ok()
}

/// A unicast route of the main table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MainRoute {
    pub dst: IpNet,
    /// The interface, when the destination is directly on it: no gateway,
    /// one next hop (`ip route` shows `DST dev IF` with no `via`).
    pub direct: Option<u32>,
    /// The interface of a route through one gateway (`DST via GW dev IF`,
    /// flannel's `10.244.2.0/24 via 10.244.2.0 dev flannel.1 onlink`).
    pub gateway: Option<u32>,
    /// That gateway's address.
    pub via: Option<IpAddr>,
}

/// linux/rtnetlink.h: attributes of a route, its table and type.
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
const RTA_VIA: u16 = 18;
const RT_TABLE_MAIN: u32 = 254;
const RTN_UNICAST: u8 = 1;

/// The unicast routes of the main table (IPv4 and IPv6). On a node, this
/// node's Pods are reached directly, behind a bridge (`10.244.1.0/24 dev
/// cni0`) or a per-Pod veth (`10.244.1.5 dev cali1234`); other nodes'
/// Pods and the rest of the world through a gateway.
pub fn main_routes() -> io::Result<Vec<MainRoute>> {
    let mut out = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        let mut msg = Vec::with_capacity(28);
        msg.extend_from_slice(&28u32.to_ne_bytes());
        msg.extend_from_slice(&libc::RTM_GETROUTE.to_ne_bytes());
        msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        msg.extend_from_slice(&1u32.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        // struct rtmsg: family, dst_len, src_len, tos, table, protocol,
        // scope, type, flags.
        msg.extend_from_slice(&[family as u8, 0, 0, 0, 0, 0, 0, 0]);
        msg.extend_from_slice(&0u32.to_ne_bytes());
        for reply in rtnetlink_dump(&msg)? {
            out.extend(parse_main_route(&reply));
        }
    }
    Ok(out)
}

/// One RTM_NEWROUTE message (header included), if it is a unicast route
/// of the main table.
fn parse_main_route(m: &[u8]) -> Option<MainRoute> {
    if m.len() < 28 || u16::from_ne_bytes([m[4], m[5]]) != libc::RTM_NEWROUTE {
        return None;
    }
    let (family, dst_len, rtm_table, rtm_type) = (m[16], m[17], m[20], m[23]);
    if rtm_type != RTN_UNICAST {
        return None;
    }
    let mut table = u32::from(rtm_table);
    let (mut dst, mut oif, mut via, mut multipath) = (None, None, false, false);
    let mut gateway_addr = None;
    for (kind, payload) in attrs(&m[28..]) {
        match kind {
            RTA_DST => dst = Some(payload),
            RTA_OIF => oif = payload.try_into().ok().map(u32::from_ne_bytes),
            RTA_TABLE => table = payload.try_into().ok().map(u32::from_ne_bytes)?,
            RTA_GATEWAY => {
                via = true;
                gateway_addr = match payload.len() {
                    4 => <[u8; 4]>::try_from(payload).ok().map(IpAddr::from),
                    16 => <[u8; 16]>::try_from(payload).ok().map(IpAddr::from),
                    _ => None,
                };
            }
            RTA_VIA => via = true,
            RTA_MULTIPATH => multipath = true,
            _ => {}
        }
    }
    if table != RT_TABLE_MAIN {
        return None;
    }
    let addr: IpAddr = match (i32::from(family), dst) {
        (libc::AF_INET, Some(d)) => <[u8; 4]>::try_from(d).ok()?.into(),
        (libc::AF_INET6, Some(d)) => <[u8; 16]>::try_from(d).ok()?.into(),
        (libc::AF_INET, None) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        (libc::AF_INET6, None) => std::net::Ipv6Addr::UNSPECIFIED.into(),
        _ => return None,
    };
    Some(MainRoute {
        dst: IpNet::new(addr, dst_len).ok()?,
        direct: oif.filter(|_| !via && !multipath),
        gateway: oif.filter(|_| via && !multipath),
        via: gateway_addr.filter(|_| !multipath),
    })
}

/// Sends a dump request on a fresh NETLINK_ROUTE socket; every message of
/// the answer up to NLMSG_DONE.
fn rtnetlink_dump(request: &[u8]) -> io::Result<Vec<Vec<u8>>> {
    let fd = netlink_send(libc::NETLINK_ROUTE, request)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = netlink_recv(&fd, &mut buf)?;
        let mut rest = &buf[..n];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if len < 16 || len > rest.len() {
                return Err(io::Error::other("malformed netlink message"));
            }
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if kind == libc::NLMSG_DONE as u16 {
                return Ok(out);
            }
            if kind == libc::NLMSG_ERROR as u16 {
                parse_ack(&rest[..len])?;
            } else {
                out.push(rest[..len].to_vec());
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
    }
}

/// A fresh netlink socket of `protocol` (`NETLINK_ROUTE`,
/// `NETLINK_NETFILTER`) with `request` sent to the kernel; closed when
/// dropped.
pub(crate) fn netlink_send(protocol: i32, request: &[u8]) -> io::Result<OwnedFd> {
    let fd = sys::netlink_socket(protocol)?;
    sys::send_to_kernel(fd.as_fd(), request)?;
    Ok(fd)
}

/// One datagram of `fd` into `buf`; its length.
pub(crate) fn netlink_recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    sys::recv(fd.as_fd(), buf)
}

/// Attributes (kind without flag bits, payload) of a netlink attribute list.
fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

/// The RTM_NEWLINK reply's `IFLA_XDP { IFLA_XDP_ATTACHED }`.
fn parse_xdp_attached(reply: &[u8]) -> io::Result<XdpAttached> {
    if reply.len() >= 16 && u16::from_ne_bytes([reply[4], reply[5]]) == libc::NLMSG_ERROR as u16 {
        parse_ack(reply)?;
    }
    if reply.len() < 32 || u16::from_ne_bytes([reply[4], reply[5]]) != libc::RTM_NEWLINK {
        return Err(io::Error::other("unexpected reply to RTM_GETLINK"));
    }
    let len =
        (u32::from_ne_bytes([reply[0], reply[1], reply[2], reply[3]]) as usize).min(reply.len());
    let Some((_, xdp)) = attrs(&reply[32..len]).find(|(k, _)| *k == IFLA_XDP) else {
        return Ok(XdpAttached::None);
    };
    Ok(match attrs(xdp).find(|(k, _)| *k == IFLA_XDP_ATTACHED) {
        Some((_, [0, ..])) | None => XdpAttached::None,
        Some((_, [1, ..])) => XdpAttached::Driver,
        Some((_, [2, ..])) => XdpAttached::Generic,
        Some(_) => XdpAttached::Other,
    })
}

/// Sends one request on a fresh NETLINK_ROUTE socket and reads the ack.
fn rtnetlink_request(request: &[u8]) -> io::Result<()> {
    parse_ack(&rtnetlink_exchange(request)?)
}

/// Sends one request on a fresh NETLINK_ROUTE socket; the first reply.
fn rtnetlink_exchange(request: &[u8]) -> io::Result<Vec<u8>> {
    let fd = netlink_send(libc::NETLINK_ROUTE, request)?;
    // A link's attributes (statistics, per-family settings) take a few KiB.
    let mut reply = vec![0u8; 64 * 1024];
    let n = netlink_recv(&fd, &mut reply)?;
    reply.truncate(n);
    Ok(reply)
}

/// An NLMSG_ERROR reply carries 0 for success, else a negated errno.
fn parse_ack(reply: &[u8]) -> io::Result<()> {
    if reply.len() < 20 {
        return Err(io::Error::other("short netlink reply"));
    }
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    if kind != libc::NLMSG_ERROR as u16 {
        return Err(io::Error::other(format!(
            "unexpected netlink reply type {kind}"
        )));
    }
    let errno = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
    match errno {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

/// The driver of `iface` in the caller's network namespace (`veth`,
/// `virtio_net`, ...), as `ethtool -i` reports it.
pub fn driver(iface: &str) -> io::Result<String> {
    sys::ethtool_driver(iface)
}

#[cfg(test)]
pub(crate) mod tests {
    /// Runs `f` on a thread of its own in a new network namespace (root).
    pub(crate) fn in_own_netns(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(|| {
            crate::sys::unshare_network_namespace().expect("unshare (root needed)");
            f()
        })
        .join()
        .expect("test thread");
    }

    #[test]
    fn loopback_has_an_index_and_an_ipv4_address() {
        assert!(super::ifindex("lo").is_some());
        assert_eq!(super::ifindex("no-such-if"), None);
        assert_eq!(
            super::interface_address("lo", true),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(super::interface_address("no-such-if", true), None);
        assert!(super::driver("no-such-if").is_err());
        assert!(super::interface_networks("lo").contains(&"127.0.0.1/8".parse().unwrap()));
        assert_eq!(super::interface_mac("lo"), Some([0; 6]));
        assert_eq!(super::interface_mac("no-such-if"), None);
    }

    use super::*;

    /// An RTM_NEWLINK reply: header, ifinfomsg, IFLA_MTU, then `IFLA_XDP
    /// { IFLA_XDP_ATTACHED = attached }` if given.
    fn newlink(attached: Option<u8>) -> Vec<u8> {
        let mut body = vec![0u8; 16];
        attr(&mut body, 4, &1500u32.to_ne_bytes());
        if let Some(a) = attached {
            let mut xdp = Vec::new();
            attr(&mut xdp, IFLA_XDP_ATTACHED, &[a]);
            attr(&mut xdp, 4, &42u32.to_ne_bytes());
            attr(&mut body, IFLA_XDP | NLA_F_NESTED, &xdp);
        }
        let mut msg = Vec::new();
        msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&libc::RTM_NEWLINK.to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&body);
        msg
    }

    /// The kernel resolves a managed neighbour entry by itself, and
    /// asking twice is fine. (Root: a network namespace of its own.)
    #[test]
    fn a_managed_neighbour_is_resolved_and_kept_needs_root() {
        in_own_netns(|| {
            let sh = |cmd: &str| {
                let out = std::process::Command::new("sh")
                    .args(["-c", cmd])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{cmd}: {out:?}");
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            // The gateway answers ARP from a namespace of its own.
            sh("ip link add v0 type veth peer name v1 && ip addr add 10.9.0.1/24 dev v0 && \
                ip link set v0 up && ip netns add xlb-neigh-gw && ip link set v1 netns xlb-neigh-gw && \
                ip netns exec xlb-neigh-gw sh -c 'ip addr add 10.9.0.2/24 dev v1 && ip link set v1 up'");
            let index = ifindex("v0").unwrap();
            let gw: IpAddr = "10.9.0.2".parse().unwrap();
            keep_neighbour_resolved(index, gw).unwrap();
            keep_neighbour_resolved(index, gw).unwrap();
            let resolved = (0..100).any(|_| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                let n = sh("ip -d neigh show 10.9.0.2 dev v0");
                n.contains("lladdr") && n.contains("managed")
            });
            let shown = sh("ip -d neigh show dev v0");
            sh("ip netns del xlb-neigh-gw");
            assert!(resolved, "not resolved and managed: {shown}");
        });
    }

    /// An IPv6-only interface: L2 membership and the flow exchange take
    /// its global IPv6 address; with an IPv4 address too, the IPv4 one.
    /// (Root: a network namespace of the test thread's own.)
    #[test]
    fn an_ipv6_only_interface_is_known_by_its_ipv6_address() {
        in_own_netns(|| {
            let sh = |cmd: &str| {
                let ok = std::process::Command::new("sh")
                    .args(["-c", cmd])
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "{cmd}");
            };
            sh(
                "ip link add v0 type veth peer name v1 && ip addr add fe80::5/64 dev v0 && \
                ip addr add fd00::5/64 dev v0 nodad && ip link set v0 up",
            );
            assert_eq!(node_address("v0"), Some("fd00::5".parse().unwrap()));
            sh("ip addr add 10.0.0.5/24 dev v0");
            assert_eq!(node_address("v0"), Some("10.0.0.5".parse().unwrap()));
            assert_eq!(node_address("v1"), None, "no address at all");
        });
    }

    #[test]
    fn reads_the_xdp_mode_of_a_link() {
        for (attached, want) in [
            (None, XdpAttached::None),
            (Some(0), XdpAttached::None),
            (Some(1), XdpAttached::Driver),
            (Some(2), XdpAttached::Generic),
            (Some(4), XdpAttached::Other),
        ] {
            assert_eq!(parse_xdp_attached(&newlink(attached)).unwrap(), want);
        }
        // The kernel's answer for loopback, which has no XDP program.
        assert_eq!(
            xdp_attached(ifindex("lo").unwrap()).unwrap(),
            XdpAttached::None
        );
        assert!(xdp_attached(u32::MAX).is_err());
    }

    #[test]
    fn the_request_nests_the_setting_as_the_kernel_expects() {
        let msg = accept_local_request(7, true);
        assert_eq!(
            msg.len() as u32,
            u32::from_ne_bytes(msg[0..4].try_into().unwrap())
        );
        // ifindex in ifinfomsg.
        assert_eq!(i32::from_ne_bytes(msg[20..24].try_into().unwrap()), 7);
        // AF_SPEC(nested) > AF_INET(nested) > INET_CONF(nested) > [23] = 1.
        let attrs = &msg[32..];
        assert_eq!(
            u16::from_ne_bytes([attrs[2], attrs[3]]),
            IFLA_AF_SPEC | NLA_F_NESTED
        );
        assert_eq!(u16::from_ne_bytes([attrs[6], attrs[7]]), 2 | NLA_F_NESTED);
        assert_eq!(
            u16::from_ne_bytes([attrs[10], attrs[11]]),
            IFLA_INET_CONF | NLA_F_NESTED
        );
        assert_eq!(
            u16::from_ne_bytes([attrs[14], attrs[15]]),
            IPV4_DEVCONF_ACCEPT_LOCAL
        );
        assert_eq!(u32::from_ne_bytes(attrs[16..20].try_into().unwrap()), 1);
        assert_eq!(attrs.len(), 20);
    }

    #[test]
    fn acks_and_errors_are_told_apart() {
        let mut ack = vec![0u8; 36];
        ack[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        assert!(parse_ack(&ack).is_ok());
        ack[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert_eq!(
            parse_ack(&ack).unwrap_err().raw_os_error(),
            Some(libc::EPERM)
        );
    }
}
