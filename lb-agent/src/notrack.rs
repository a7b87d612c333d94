//! Keeps the kernel's connection tracking off the packets the data plane
//! translated and hands to the kernel to forward: those to Pods (from the
//! SNAT address), and replies whose next hop has no neighbour entry yet
//! (from a VIP).
//!
//! Why: such a connection's other direction is translated by XDP and never
//! reaches conntrack. A tracked SYN then leaves an entry that never sees
//! its SYN-ACK, so the client's next packets are `INVALID`; a SYN-ACK
//! tracked first is INVALID itself. kube-proxy drops INVALID packets in
//! FORWARD: on flannel's VXLAN every connection to another node's Pod
//! stalled after its handshake, and the first connection after a start
//! timed out while the node had no neighbour entry for the router. (A
//! bridge hides the first: br_netfilter shows the reply to conntrack before
//! XDP on the bridge takes it.) Untracked, they are neither dropped nor
//! masqueraded.
//!
//! The replies to the SNAT address stay tracked: kube-proxy masquerades
//! in-cluster clients of a LoadBalancer IP to the same address (the
//! bridge's) on random ports, and those replies need conntrack. So a reply
//! that br_netfilter tracked before XDP on the bridge translated it, and
//! that XDP then hands to the kernel (no neighbour entry), keeps an
//! INVALID verdict: the agent keeps the uplinks' gateways resolved
//! (`netif::keep_neighbour_resolved`) so that this does not happen.
//!
//! With a flow exchange, a peer's SNAT address (its flows keep it when
//! they are handed here) is untracked both ways: from it (else flannel
//! masquerades the flow as it leaves for the peer's Pods), and to it (this
//! node's Pods answer it through the kernel, and the peer's program
//! translates the answer).
//!
//! How: an nf_tables table `xlb` per family with one chain at the raw
//! priority of prerouting and a rule per address, `ip saddr ADDR notrack`
//! (and `ip daddr PEER notrack`).
//! Only packets that arrive with such a source match: the node's own
//! connections from its addresses leave by output, not prerouting. Written
//! with hand-made netlink messages (nfnetlink), one atomic batch each time.

use std::{io, net::IpAddr};

/// The table's name, in both families.
pub const TABLE: &str = "xlb";
const CHAIN: &str = "snat-notrack";

/// linux/netfilter/nfnetlink.h and nf_tables.h.
const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFTA_DATA_VALUE: u16 = 1;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_REG_1: u32 = 1;
const NFT_CMP_EQ: u32 = 0;
const NF_INET_PRE_ROUTING: u32 = 0;
/// NF_IP_PRI_RAW: before conntrack (-200).
const PRIORITY_RAW: i32 = -300;
const NLA_F_NESTED: u16 = 1 << 15;

/// What a rule matches: packets from an address (`ip saddr`) or to one
/// (`ip daddr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Untracked {
    From(IpAddr),
    To(IpAddr),
}

impl Untracked {
    fn addr(self) -> IpAddr {
        match self {
            Self::From(a) | Self::To(a) => a,
        }
    }
}

/// Makes the tables say exactly `rules`: a family without a rule loses its
/// table. Idempotent.
pub fn set(rules: &[Untracked]) -> io::Result<()> {
    for (family, v4) in [(NFPROTO_IPV4, true), (NFPROTO_IPV6, false)] {
        let of: Vec<Untracked> = rules
            .iter()
            .copied()
            .filter(|r| r.addr().is_ipv4() == v4)
            .collect();
        exchange(&batch(family, &of))?;
    }
    Ok(())
}

/// Removes both tables (an uninstall); absent ones are fine.
pub fn remove() -> io::Result<()> {
    set(&[])
}

/// One batch: make the table (so that deleting it cannot fail), delete it
/// with whatever it held, and when there are addresses make it again with
/// the chain and a rule each.
fn batch(family: u8, rules: &[Untracked]) -> Vec<u8> {
    let mut b = Vec::new();
    let mut seq = 0;
    let mut msg = |b: &mut Vec<u8>, kind: u16, flags: u16, family: u8, attrs: &[u8]| {
        seq += 1;
        message(b, kind, flags, family, seq, attrs);
    };
    let create = (libc::NLM_F_REQUEST | libc::NLM_F_CREATE | libc::NLM_F_ACK) as u16;
    let request = (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    msg(
        &mut b,
        NFNL_MSG_BATCH_BEGIN,
        libc::NLM_F_REQUEST as u16,
        0,
        &[],
    );
    let table = attr(NFTA_TABLE_NAME, &cstr(TABLE));
    msg(&mut b, nft(NFT_MSG_NEWTABLE), create, family, &table);
    msg(&mut b, nft(NFT_MSG_DELTABLE), request, family, &table);
    if !rules.is_empty() {
        msg(&mut b, nft(NFT_MSG_NEWTABLE), create, family, &table);
        let hook = [
            attr(NFTA_HOOK_HOOKNUM, &NF_INET_PRE_ROUTING.to_be_bytes()),
            attr(NFTA_HOOK_PRIORITY, &PRIORITY_RAW.to_be_bytes()),
        ]
        .concat();
        let chain = [
            attr(NFTA_CHAIN_TABLE, &cstr(TABLE)),
            attr(NFTA_CHAIN_NAME, &cstr(CHAIN)),
            attr(NFTA_CHAIN_HOOK | NLA_F_NESTED, &hook),
            attr(NFTA_CHAIN_TYPE, &cstr("filter")),
        ]
        .concat();
        msg(&mut b, nft(NFT_MSG_NEWCHAIN), create, family, &chain);
        for exprs in rules.iter().map(|r| untracked(*r)) {
            let rule = [
                attr(NFTA_RULE_TABLE, &cstr(TABLE)),
                attr(NFTA_RULE_CHAIN, &cstr(CHAIN)),
                attr(NFTA_RULE_EXPRESSIONS | NLA_F_NESTED, &exprs),
            ]
            .concat();
            let append = create | libc::NLM_F_APPEND as u16;
            msg(&mut b, nft(NFT_MSG_NEWRULE), append, family, &rule);
        }
    }
    msg(
        &mut b,
        NFNL_MSG_BATCH_END,
        libc::NLM_F_REQUEST as u16,
        0,
        &[],
    );
    b
}

/// The expressions of `ip saddr ADDR notrack` or `ip daddr ADDR notrack`
/// (`ip6` for IPv6).
fn untracked(rule: Untracked) -> Vec<u8> {
    let addr = rule.addr();
    let offset = match (rule, addr.is_ipv4()) {
        (Untracked::From(_), true) => 12,
        (Untracked::To(_), true) => 16,
        (Untracked::From(_), false) => 8,
        (Untracked::To(_), false) => 24,
    };
    [
        load(NFT_PAYLOAD_NETWORK_HEADER, offset, octets(addr).len()),
        compare(NFT_CMP_EQ, &octets(addr)),
        expression("notrack", None),
    ]
    .concat()
}

fn octets(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// `payload load` of `len` bytes at `offset` of `base` into register 1.
fn load(base: u32, offset: u32, len: usize) -> Vec<u8> {
    let payload = [
        attr(NFTA_PAYLOAD_DREG, &NFT_REG_1.to_be_bytes()),
        attr(NFTA_PAYLOAD_BASE, &base.to_be_bytes()),
        attr(NFTA_PAYLOAD_OFFSET, &offset.to_be_bytes()),
        attr(NFTA_PAYLOAD_LEN, &(len as u32).to_be_bytes()),
    ]
    .concat();
    expression("payload", Some(&payload))
}

/// `cmp` of register 1 with `data`.
fn compare(op: u32, data: &[u8]) -> Vec<u8> {
    let cmp = [
        attr(NFTA_CMP_SREG, &NFT_REG_1.to_be_bytes()),
        attr(NFTA_CMP_OP, &op.to_be_bytes()),
        attr(NFTA_CMP_DATA | NLA_F_NESTED, &attr(NFTA_DATA_VALUE, data)),
    ]
    .concat();
    expression("cmp", Some(&cmp))
}

fn expression(name: &str, data: Option<&[u8]>) -> Vec<u8> {
    let mut e = attr(NFTA_EXPR_NAME, &cstr(name));
    if let Some(d) = data {
        e.extend(attr(NFTA_EXPR_DATA | NLA_F_NESTED, d));
    }
    attr(NFTA_LIST_ELEM | NLA_F_NESTED, &e)
}

fn nft(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// One netlink attribute, padded to 4 bytes.
fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(4 + payload.len() + 3);
    a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    a.extend_from_slice(&kind.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize(a.len().next_multiple_of(4), 0);
    a
}

/// One nfnetlink message: header, `nfgenmsg`, attributes.
fn message(out: &mut Vec<u8>, kind: u16, flags: u16, family: u8, seq: u32, attrs: &[u8]) {
    let len = 16 + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    // struct nfgenmsg: family, version, res_id (big-endian): the batch
    // messages name the subsystem there.
    let res_id = if kind == NFNL_MSG_BATCH_BEGIN || kind == NFNL_MSG_BATCH_END {
        NFNL_SUBSYS_NFTABLES
    } else {
        0
    };
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
}

/// Sends the batch and reads one acknowledgement per acknowledged message;
/// the first error the kernel reports fails the whole (atomic) batch.
fn exchange(batch: &[u8]) -> io::Result<()> {
    use std::os::fd::AsFd;
    let acks = count_acks(batch);
    let fd = crate::netif::netlink_send(NETLINK_NETFILTER, batch)?;
    // Ignored on failure, as it always was: the exchange works without it,
    // only a lost ack would then be waited for without end.
    let _ = crate::sys::set_recv_timeout(fd.as_fd(), std::time::Duration::from_secs(2));
    let mut seen = 0;
    let mut buf = vec![0u8; 16384];
    while seen < acks {
        let n = crate::netif::netlink_recv(&fd, &mut buf)?;
        let mut rest = &buf[..n];
        while rest.len() >= 20 {
            let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            if kind == libc::NLMSG_ERROR as u16 {
                let code = i32::from_ne_bytes(rest[16..20].try_into().unwrap());
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
                seen += 1;
            }
            if len < 16 || len > rest.len() {
                break;
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
    }
    Ok(())
}

/// How many messages of `batch` ask for an acknowledgement.
fn count_acks(mut batch: &[u8]) -> usize {
    let mut n = 0;
    while batch.len() >= 16 {
        let len = u32::from_ne_bytes(batch[0..4].try_into().unwrap()) as usize;
        let flags = u16::from_ne_bytes([batch[6], batch[7]]);
        if flags & libc::NLM_F_ACK as u16 != 0 {
            n += 1;
        }
        batch = &batch[len.max(16).min(batch.len())..];
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_but_the_batch_frame_is_acknowledged() {
        let addrs = [
            Untracked::From("10.244.1.1".parse().unwrap()),
            Untracked::To("192.0.2.10".parse().unwrap()),
        ];
        // new table, delete it, new table, chain, a rule each.
        assert_eq!(count_acks(&batch(NFPROTO_IPV4, &addrs)), 6);
        assert_eq!(count_acks(&batch(NFPROTO_IPV6, &[])), 2);
    }

    #[test]
    fn the_rule_compares_the_source_or_destination_address() {
        let has = |e: &[u8], needle: &[u8]| e.windows(needle.len()).any(|w| w == needle);
        let a = "10.244.1.1".parse().unwrap();
        let e = untracked(Untracked::From(a));
        assert!(has(&e, &[10, 244, 1, 1]));
        assert!(has(&e, b"notrack\0"));
        assert!(has(&e, &12u32.to_be_bytes()));
        assert!(has(&untracked(Untracked::To(a)), &16u32.to_be_bytes()));
        let a6 = "fd00::1".parse().unwrap();
        assert!(has(&untracked(Untracked::From(a6)), &8u32.to_be_bytes()));
        assert!(has(&untracked(Untracked::To(a6)), &24u32.to_be_bytes()));
    }

    /// In a network namespace of its own: the rules as nft reads them back,
    /// written twice (one each stays), changed, then removed.
    #[test]
    fn the_table_follows_the_snat_addresses_needs_root() {
        crate::netif::tests::in_own_netns(|| {
            let nft = |family: &str| {
                let out = std::process::Command::new("nft")
                    .args(["list", "table", family, TABLE])
                    .output()
                    .expect("running nft");
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            };
            let a: IpAddr = "10.244.1.1".parse().unwrap();
            let a6: IpAddr = "fd00:1::1".parse().unwrap();
            let vip: IpAddr = "192.0.2.10".parse().unwrap();
            let peer: IpAddr = "10.244.2.1".parse().unwrap();
            let rules = [
                Untracked::From(a),
                Untracked::From(vip),
                Untracked::From(a6),
                Untracked::From(peer),
                Untracked::To(peer),
            ];
            set(&rules).unwrap();
            set(&rules).unwrap();
            let v4 = nft("ip").expect("table ip xlb");
            assert_eq!(v4.matches("ip saddr 10.244.1.1 notrack").count(), 1, "{v4}");
            assert_eq!(v4.matches("ip saddr 192.0.2.10 notrack").count(), 1, "{v4}");
            assert_eq!(v4.matches("ip daddr 10.244.2.1 notrack").count(), 1, "{v4}");
            assert!(
                !v4.contains("daddr 10.244.1.1"),
                "replies stay tracked: {v4}"
            );
            assert!(v4.contains("hook prerouting priority raw"), "{v4}");
            let v6 = nft("ip6").expect("table ip6 xlb");
            assert!(v6.contains("ip6 saddr fd00:1::1 notrack"), "{v6}");
            set(&[Untracked::From("10.244.1.9".parse().unwrap())]).unwrap();
            let v4 = nft("ip").expect("table ip xlb");
            assert!(
                v4.contains("ip saddr 10.244.1.9 notrack") && !v4.contains("10.244.1.1"),
                "{v4}"
            );
            assert_eq!(nft("ip6"), None, "no IPv6 address, no table");
            remove().unwrap();
            assert_eq!(nft("ip"), None);
        });
    }
}
