//! Addresses, families and protocols as user space names them, converted to
//! and from the words the maps hold. One definition for the agent, lbctl and
//! the tests.

use core::{fmt, str::FromStr};
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    string::String,
};

use crate::{
    addr_from_v4, addr_from_v6, addr_octets, ServiceKey, FAMILY_V4, FAMILY_V6, PROTO_ICMP,
    PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};

/// An IP address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn other(self) -> Family {
        match self {
            Family::V4 => Family::V6,
            Family::V6 => Family::V4,
        }
    }

    /// Bits in an address: the longest prefix.
    pub fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// As keys store it (`AF_INET` / `AF_INET6`).
    pub fn number(self) -> u8 {
        match self {
            Family::V4 => FAMILY_V4,
            Family::V6 => FAMILY_V6,
        }
    }
}

/// `IPv4` / `IPv6`, as Kubernetes' `ipFamilies` spells them too.
impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// A protocol a service can carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// The IP protocol number, as keys store it.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => PROTO_TCP,
            Protocol::Udp => PROTO_UDP,
        }
    }

    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            PROTO_TCP => Some(Protocol::Tcp),
            PROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Protocol {
    type Err = String;

    /// `tcp` or `udp`, in any case.
    fn from_str(s: &str) -> Result<Protocol, String> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Protocol::Tcp),
            "udp" => Ok(Protocol::Udp),
            _ => Err(std::format!("unknown protocol {s:?} (tcp or udp)")),
        }
    }
}

/// The name of a protocol number a key may hold (services, echo markers).
pub fn protocol_name(proto: u8) -> String {
    match proto {
        PROTO_ICMP => "icmp".into(),
        PROTO_ICMPV6 => "icmpv6".into(),
        n => match Protocol::from_number(n) {
            Some(p) => p.name().into(),
            None => std::format!("proto-{n}"),
        },
    }
}

/// An address as keys and values store it.
pub fn ip_words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(a) => addr_from_v4(a.octets()),
        IpAddr::V6(a) => addr_from_v6(a.octets()),
    }
}

/// A stored address read back, as an address of `family` (a key's number).
pub fn words_ip(words: &[u32; 4], family: u8) -> IpAddr {
    let o = addr_octets(words);
    if family == FAMILY_V6 {
        IpAddr::V6(Ipv6Addr::from(o))
    } else {
        IpAddr::V4(Ipv4Addr::new(o[0], o[1], o[2], o[3]))
    }
}

/// A stored address and network-order port, read back.
pub fn words_socket(words: &[u32; 4], port_be: u16, family: u8) -> SocketAddr {
    SocketAddr::new(words_ip(words, family), u16::from_be(port_be))
}

/// The `SERVICES` key of a VIP, port and protocol number.
pub fn service_key(vip: IpAddr, port: u16, proto: u8) -> ServiceKey {
    ServiceKey {
        addr: ip_words(vip),
        port: port.to_be(),
        proto,
        family: Family::of(vip).number(),
    }
}

impl ServiceKey {
    /// `true` for the entries that only mark a VIP whose echo requests are
    /// answered (ICMP/ICMPv6, port 0): not services.
    pub fn is_echo_marker(&self) -> bool {
        self.port == 0 && (self.proto == PROTO_ICMP || self.proto == PROTO_ICMPV6)
    }

    pub fn vip(&self) -> IpAddr {
        words_ip(&self.addr, self.family)
    }

    /// The port in host order.
    pub fn port(&self) -> u16 {
        u16::from_be(self.port)
    }

    /// `vip:port/proto`, as lbctl and the logs name a service.
    pub fn display(&self) -> String {
        std::format!(
            "{}/{}",
            SocketAddr::new(self.vip(), self.port()),
            protocol_name(self.proto)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::string::ToString;

    #[test]
    fn addresses_survive_the_round_trip_through_words() {
        for ip in ["192.0.2.7", "2001:db8::7", "0.0.0.0", "::"] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(words_ip(&ip_words(ip), Family::of(ip).number()), ip);
        }
        let key = service_key("2001:db8::1".parse().unwrap(), 8443, PROTO_UDP);
        assert_eq!(key.display(), "[2001:db8::1]:8443/udp");
        assert_eq!(key.port(), 8443);
        let words = addr_from_v4([10, 0, 0, 1]);
        assert_eq!(
            words_socket(&words, 8080u16.to_be(), FAMILY_V4).to_string(),
            "10.0.0.1:8080"
        );
    }

    #[test]
    fn echo_markers_are_not_services() {
        let ip: IpAddr = "192.0.2.10".parse().unwrap();
        assert!(service_key(ip, 0, PROTO_ICMP).is_echo_marker());
        assert!(!service_key(ip, 80, PROTO_TCP).is_echo_marker());
        let ip6: IpAddr = "2001:db8::1".parse().unwrap();
        assert!(service_key(ip6, 0, PROTO_ICMPV6).is_echo_marker());
    }

    #[test]
    fn protocols_parse_in_any_case_and_name_unknown_numbers() {
        assert_eq!("TCP".parse::<Protocol>(), Ok(Protocol::Tcp));
        assert!("sctp".parse::<Protocol>().is_err());
        assert_eq!(protocol_name(132), "proto-132");
        assert_eq!(protocol_name(PROTO_ICMPV6), "icmpv6");
    }
}
