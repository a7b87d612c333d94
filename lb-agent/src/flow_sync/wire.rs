//! The flow exchange's frames, over TCP. Each frame's payload is encrypted
//! with the cluster key (`crate::seal`), its header authenticated with it:
//! the clients' addresses in the flows are not readable on the wire. The
//! header holds the exchange's nonce (a pull's answer must carry the
//! pull's) and the sender's clock, so that a frame recorded once cannot be
//! replayed long after.
//!
//! Frame: magic `XLF\x02`, kind (1 byte), 3 zero bytes, nonce (16), Unix
//! time in ms (8, big-endian), sealed length (4, big-endian), then the
//! sealed payload ([`seal::OVERHEAD`] bytes more than the payload). A
//! `Flows` payload is records of [`RECORD_LEN`] bytes; a `Done` payload is
//! a count (4, big-endian); `Pull` and `Leaving` have none.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use lb_common::net::Protocol;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{
    dataplane::HandedFlow,
    seal::{self, Keyring, Refusal},
};

const MAGIC: &[u8; 4] = b"XLF\x02";
const HEADER_LEN: usize = 4 + 4 + 16 + 8 + 4;
/// One flow: family, protocol, closed, mode (0 snat, 1 nat), idle ms (4),
/// then client, VIP, backend and SNAT address (16 each, IPv4 in the first
/// 4) and port (2 each); a nat flow's SNAT address and port are zeros.
pub const RECORD_LEN: usize = 8 + 4 * 18;
/// Flows per frame: a frame stays under 320 KiB.
pub const FLOWS_PER_FRAME: usize = 4096;
const MAX_PAYLOAD: usize = FLOWS_PER_FRAME * RECORD_LEN;
/// How far a frame's clock may be from the receiver's.
pub const MAX_SKEW: Duration = Duration::from_secs(60);

pub type Nonce = [u8; 16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Asks for the receiver's SNAT flows.
    Pull = 1,
    /// Flows, pushed or answering a pull.
    Flows = 2,
    /// Ends a push (the count sent) or answers one (the count taken), or
    /// ends a pull's answer (the count sent).
    Done = 3,
    /// Begins a push from a node about to leave the routers' ECMP set.
    Leaving = 4,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Pull,
    Flows(Vec<HandedFlow>),
    Done(u32),
    Leaving,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not an xlb flow exchange frame (or another version's)")]
    Malformed,
    #[error("sealed with a key this node does not have (another cluster, or a key not rolled out here yet)")]
    UnknownKey,
    #[error("altered on the way, or sealed with another key")]
    BadKey,
    #[error("the sender's clock is {0:?} away from ours (more than {MAX_SKEW:?}): a replay, or clocks out of sync")]
    Stale(Duration),
    #[error("a frame of another exchange (its nonce is not ours)")]
    WrongNonce,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A frame as bytes, sealed.
pub fn seal(keys: &Keyring, nonce: &Nonce, frame: &Frame) -> Vec<u8> {
    seal_at(keys, nonce, frame, unix_ms())
}

fn seal_at(keys: &Keyring, nonce: &Nonce, frame: &Frame, ms: u64) -> Vec<u8> {
    let (kind, payload) = match frame {
        Frame::Pull => (Kind::Pull, Vec::new()),
        Frame::Flows(flows) => (Kind::Flows, flows.iter().flat_map(encode).collect()),
        Frame::Done(n) => (Kind::Done, n.to_be_bytes().to_vec()),
        Frame::Leaving => (Kind::Leaving, Vec::new()),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + seal::OVERHEAD);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[kind as u8, 0, 0, 0]);
    out.extend_from_slice(nonce);
    out.extend_from_slice(&ms.to_be_bytes());
    out.extend_from_slice(&((payload.len() + seal::OVERHEAD) as u32).to_be_bytes());
    let sealed = keys.seal(&out, &payload);
    out.extend_from_slice(&sealed);
    out
}

/// Writes one frame.
pub async fn write<W: AsyncWrite + Unpin>(
    w: &mut W,
    keys: &Keyring,
    nonce: &Nonce,
    frame: &Frame,
) -> std::io::Result<()> {
    w.write_all(&seal(keys, nonce, frame)).await
}

/// Reads one frame sealed with one of `keys`; with `expect`, only of that
/// exchange.
/// Returns the frame's nonce too (a pull's, to answer with).
pub async fn read<R: AsyncRead + Unpin>(
    r: &mut R,
    keys: &Keyring,
    expect: Option<&Nonce>,
) -> Result<(Nonce, Frame), WireError> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).await?;
    if &header[..4] != MAGIC || header[5..8] != [0, 0, 0] {
        return Err(WireError::Malformed);
    }
    let sealed_len = u32::from_be_bytes(header[32..36].try_into().expect("4 bytes")) as usize;
    if !(seal::OVERHEAD..=MAX_PAYLOAD + seal::OVERHEAD).contains(&sealed_len) {
        return Err(WireError::Malformed);
    }
    let mut sealed = vec![0u8; sealed_len];
    r.read_exact(&mut sealed).await?;
    let payload = keys.open(&header, &sealed).map_err(|e| match e {
        Refusal::Short => WireError::Malformed,
        Refusal::UnknownKey => WireError::UnknownKey,
        Refusal::Forged => WireError::BadKey,
    })?;
    let len = payload.len();
    let nonce: Nonce = header[8..24].try_into().expect("16 bytes");
    if expect.is_some_and(|n| *n != nonce) {
        return Err(WireError::WrongNonce);
    }
    let sent = u64::from_be_bytes(header[24..32].try_into().expect("8 bytes"));
    let skew = Duration::from_millis(unix_ms().abs_diff(sent));
    if skew > MAX_SKEW {
        return Err(WireError::Stale(skew));
    }
    let frame = match header[4] {
        1 if len == 0 => Frame::Pull,
        2 if len.is_multiple_of(RECORD_LEN) => Frame::Flows(
            payload
                .chunks_exact(RECORD_LEN)
                .map(decode)
                .collect::<Option<_>>()
                .ok_or(WireError::Malformed)?,
        ),
        3 if len == 4 => Frame::Done(u32::from_be_bytes(payload[..].try_into().expect("4 bytes"))),
        4 if len == 0 => Frame::Leaving,
        _ => return Err(WireError::Malformed),
    };
    Ok((nonce, frame))
}

fn encode(f: &HandedFlow) -> Vec<u8> {
    let mut out = Vec::with_capacity(RECORD_LEN);
    out.push(if f.client.is_ipv6() { 6 } else { 4 });
    out.push(f.protocol.number());
    out.push(f.closed as u8);
    out.push(f.snat.is_none() as u8);
    out.extend_from_slice(&f.idle_ms.to_be_bytes());
    let none = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0);
    for a in [f.client, f.vip, f.backend, f.snat.unwrap_or(none)] {
        let mut ip = [0u8; 16];
        match a.ip() {
            IpAddr::V4(v4) => ip[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => ip = v6.octets(),
        }
        out.extend_from_slice(&ip);
        out.extend_from_slice(&a.port().to_be_bytes());
    }
    out
}

/// A record, or `None` if it is not one (unknown family or protocol, an
/// address of another family than the flow's).
fn decode(b: &[u8]) -> Option<HandedFlow> {
    let v6 = match b[0] {
        4 => false,
        6 => true,
        _ => return None,
    };
    let protocol = Protocol::from_number(b[1])?;
    let closed = match b[2] {
        0 => false,
        1 => true,
        _ => return None,
    };
    let nat = match b[3] {
        0 => false,
        1 => true,
        _ => return None,
    };
    let idle_ms = u32::from_be_bytes(b[4..8].try_into().ok()?);
    let at = |i: usize| {
        let o = 8 + i * 18;
        let ip: [u8; 16] = b[o..o + 16].try_into().ok()?;
        let port = u16::from_be_bytes(b[o + 16..o + 18].try_into().ok()?);
        let ip = if v6 {
            IpAddr::V6(Ipv6Addr::from(ip))
        } else if ip[4..].iter().all(|&x| x == 0) {
            IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
        } else {
            return None;
        };
        Some(SocketAddr::new(ip, port))
    };
    Some(HandedFlow {
        protocol,
        client: at(0)?,
        vip: at(1)?,
        backend: at(2)?,
        snat: if nat {
            b[8 + 3 * 18..].iter().all(|&x| x == 0).then_some(None)?
        } else {
            Some(at(3)?)
        },
        closed,
        idle_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(secret: &[u8]) -> Keyring {
        Keyring::new(&[secret.to_vec()], seal::Purpose::FlowSync)
    }

    fn key() -> Keyring {
        keys(b"0123456789abcdef0123")
    }

    fn flow(port: u16) -> HandedFlow {
        HandedFlow {
            protocol: Protocol::Tcp,
            client: SocketAddr::from(([192, 0, 2, 7], port)),
            vip: SocketAddr::from(([203, 0, 113, 10], 80)),
            backend: SocketAddr::from(([10, 0, 0, 2], 8080)),
            snat: Some(SocketAddr::from(([10, 0, 0, 254], 20001))),
            closed: port.is_multiple_of(2),
            idle_ms: 1234,
        }
    }

    async fn round_trip(bytes: &[u8], expect: Option<&Nonce>) -> Result<(Nonce, Frame), WireError> {
        let mut r = bytes;
        read(&mut r, &key(), expect).await
    }

    #[tokio::test]
    async fn frames_round_trip_ipv4_and_ipv6() {
        let mut v6 = flow(3);
        v6.client = "[2001:db8::7]:40000".parse().unwrap();
        v6.vip = "[2001:db8::10]:443".parse().unwrap();
        v6.backend = "[fd00::2]:8443".parse().unwrap();
        v6.snat = Some("[fd00::fe]:30000".parse().unwrap());
        v6.protocol = Protocol::Udp;
        let nat = HandedFlow {
            snat: None,
            ..flow(4)
        };
        let n = [7u8; 16];
        for frame in [
            Frame::Flows(vec![flow(1), flow(2), v6, nat]),
            Frame::Pull,
            Frame::Done(42),
            Frame::Leaving,
        ] {
            let sealed = seal(&key(), &n, &frame);
            let client = [192, 0, 2, 7];
            assert!(
                !sealed.windows(4).any(|w| w == client),
                "a client's address is not readable in {frame:?}"
            );
            let got = round_trip(&sealed, Some(&n)).await.unwrap();
            assert_eq!(got, (n, frame));
        }
    }

    #[tokio::test]
    async fn strangers_replays_and_garbage_are_refused() {
        let n = [1u8; 16];
        let good = seal(&key(), &n, &Frame::Flows(vec![flow(1)]));
        let other_key = seal(
            &keys(b"another key, 20 bytes"),
            &n,
            &Frame::Flows(vec![flow(1)]),
        );
        assert!(matches!(
            round_trip(&other_key, None).await,
            Err(WireError::UnknownKey)
        ));
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 20] ^= 1;
        assert!(matches!(
            round_trip(&flipped, None).await,
            Err(WireError::BadKey)
        ));
        assert!(matches!(
            round_trip(&good, Some(&[2u8; 16])).await,
            Err(WireError::WrongNonce)
        ));
        let old = seal_at(&key(), &n, &Frame::Done(1), unix_ms() - 120_000);
        assert!(matches!(
            round_trip(&old, None).await,
            Err(WireError::Stale(_))
        ));
        let mut huge = good.clone();
        huge[32..36].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            round_trip(&huge, None).await,
            Err(WireError::Malformed)
        ));
        assert!(matches!(
            round_trip(b"GET / HTTP/1.1\r\n\r\n01234567890123456789", None).await,
            Err(WireError::Malformed)
        ));
        // The header is authenticated: a changed clock is refused.
        let mut retimed = good.clone();
        retimed[30] ^= 1;
        assert!(matches!(
            round_trip(&retimed, None).await,
            Err(WireError::BadKey)
        ));
        // A sealed record that is not a flow (family 5) is refused whole.
        let mut bad = flow(1);
        bad.idle_ms = 0;
        let mut rec = encode(&bad);
        rec[0] = 5;
        assert_eq!(decode(&rec), None);
        assert!(matches!(
            round_trip(&good[..good.len() - 1], None).await,
            Err(WireError::Io(_))
        ));
    }

    mod generated {
        //! Generated input (`cargo xtask fuzz` runs these long).
        use proptest::{collection::vec, prelude::*, sample::Index};

        use super::*;

        fn any_addr(v6: bool) -> BoxedStrategy<SocketAddr> {
            if v6 {
                (any::<[u8; 16]>(), any::<u16>())
                    .prop_map(|(ip, p)| SocketAddr::from((Ipv6Addr::from(ip), p)))
                    .boxed()
            } else {
                (any::<[u8; 4]>(), any::<u16>())
                    .prop_map(|(ip, p)| SocketAddr::from((Ipv4Addr::from(ip), p)))
                    .boxed()
            }
        }

        fn any_flow() -> impl Strategy<Value = HandedFlow> {
            any::<bool>()
                .prop_flat_map(|v6| {
                    (
                        [any_addr(v6), any_addr(v6), any_addr(v6)],
                        proptest::option::of(any_addr(v6)),
                        any::<(bool, u32, bool)>(),
                    )
                })
                .prop_map(
                    |([client, vip, backend], snat, (closed, idle_ms, udp))| HandedFlow {
                        protocol: if udp { Protocol::Udp } else { Protocol::Tcp },
                        client,
                        vip,
                        backend,
                        snat,
                        closed,
                        idle_ms,
                    },
                )
        }

        fn block_on<F: std::future::Future>(f: F) -> F::Output {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime")
                .block_on(f)
        }

        proptest! {
            #[test]
            fn generated_flows_round_trip(flows in vec(any_flow(), 0..40), nonce in any::<Nonce>()) {
                let sealed = seal(&key(), &nonce, &Frame::Flows(flows.clone()));
                let got = block_on(round_trip(&sealed, Some(&nonce)));
                prop_assert_eq!(got.ok(), Some((nonce, Frame::Flows(flows))));
            }

            #[test]
            fn generated_bytes_are_refused(bytes in vec(any::<u8>(), 0..2048)) {
                prop_assert!(block_on(round_trip(&bytes, None)).is_err());
            }

            /// Any bit flipped anywhere in a frame: refused, never taken.
            #[test]
            fn generated_changes_to_a_frame_are_refused(
                flows in vec(any_flow(), 1..8),
                at in any::<Index>(),
                bit in 0u8..8,
            ) {
                let mut sealed = seal(&key(), &[3; 16], &Frame::Flows(flows));
                let i = at.index(sealed.len());
                sealed[i] ^= 1 << bit;
                prop_assert!(block_on(round_trip(&sealed, None)).is_err());
            }
        }
    }
}
