//! Weighted Maglev consistent hashing (Eisenbud et al., NSDI 2016, §3.4).
//!
//! A pure function of the backends (identity and weight) and the table size:
//! every node and every process builds the same table from the same inputs,
//! which is what keeps a flow on one backend whichever node ECMP picks.
//! Backends are identified by address and port, never by their slot id, so
//! that two agents that numbered their backends differently still agree.

use std::{vec, vec::Vec};

/// One backend as Maglev sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaglevBackend {
    /// Stable identity: address octets (16; IPv4 in the first 4) and port.
    pub addr: [u8; 16],
    pub port: u16,
    /// Relative weight; 0 keeps the backend out of the table.
    pub weight: u32,
}

/// Why a table cannot be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MaglevError {
    NotPrime(u32),
    TooLarge(u32),
    TooSmall { size: u32, backends: usize },
}

impl core::fmt::Display for MaglevError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            MaglevError::NotPrime(m) => write!(f, "table size {m} is not a prime"),
            MaglevError::TooLarge(m) => {
                write!(f, "table size {m} exceeds {}", crate::MAX_MAGLEV_SIZE)
            }
            MaglevError::TooSmall { size, backends } => write!(
                f,
                "table size {size} is below 100 x {backends} backends; pick a prime above {}",
                100 * backends
            ),
        }
    }
}

impl std::error::Error for MaglevError {}

pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while (d as u64) * (d as u64) <= n as u64 {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// The table size for `backends` backends when the service sets none.
/// Measured (see the tests): removing one backend disturbs under 1% of other
/// flows while M is about 500 x N or more, so large services get the
/// largest size.
pub fn default_table_size(backends: usize) -> u32 {
    if backends <= 32 {
        crate::DEFAULT_MAGLEV_SIZE
    } else {
        crate::MAX_MAGLEV_SIZE
    }
}

/// Checks a table size for a service with `backends` backends.
pub fn check_table_size(size: u32, backends: usize) -> Result<(), MaglevError> {
    if size > crate::MAX_MAGLEV_SIZE {
        return Err(MaglevError::TooLarge(size));
    }
    if !is_prime(size) {
        return Err(MaglevError::NotPrime(size));
    }
    if (size as u64) < 100 * backends as u64 {
        return Err(MaglevError::TooSmall { size, backends });
    }
    Ok(())
}

/// 64-bit FNV-1a followed by a SplitMix64 finaliser, seeded.
fn identity_hash(b: &MaglevBackend, seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for byte in b.addr.iter().chain(b.port.to_be_bytes().iter()) {
        h ^= *byte as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Builds the lookup table: entry i holds an index into `backends`.
/// Returns an empty table when no backend has a weight.
///
/// Weights: in every round each backend claims `weight` entries (each the
/// next free slot of its own permutation), so shares match weights to
/// within one round's worth of entries.
pub fn build_table(backends: &[MaglevBackend], size: u32) -> Result<Vec<u32>, MaglevError> {
    check_table_size(size, backends.len())?;
    let m = size as u64;
    // Sort a view by identity so that input order does not matter.
    let mut order: Vec<usize> = (0..backends.len())
        .filter(|&i| backends[i].weight > 0)
        .collect();
    order.sort_by(|&a, &b| {
        (backends[a].addr, backends[a].port).cmp(&(backends[b].addr, backends[b].port))
    });
    order.dedup_by(|a, b| {
        (backends[*a].addr, backends[*a].port) == (backends[*b].addr, backends[*b].port)
    });
    if order.is_empty() {
        return Ok(Vec::new());
    }
    let perm: Vec<(u64, u64)> = order
        .iter()
        .map(|&i| {
            let offset = identity_hash(&backends[i], 0x6f66_6673_6574) % m;
            let skip = identity_hash(&backends[i], 0x0000_736b_6970) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; order.len()];
    let mut table = vec![u32::MAX; size as usize];
    let mut filled = 0u64;
    'rounds: loop {
        for (slot, &i) in order.iter().enumerate() {
            for _ in 0..backends[i].weight {
                let (offset, skip) = perm[slot];
                let mut c = (offset + next[slot] * skip) % m;
                while table[c as usize] != u32::MAX {
                    next[slot] += 1;
                    c = (offset + next[slot] * skip) % m;
                }
                table[c as usize] = i as u32;
                next[slot] += 1;
                filled += 1;
                if filled == m {
                    break 'rounds;
                }
            }
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{vec, vec::Vec};

    fn backend(n: u8, weight: u32) -> MaglevBackend {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&[10, 2, 0, n]);
        MaglevBackend {
            addr,
            port: 8080,
            weight,
        }
    }

    fn shares(table: &[u32], n: usize) -> Vec<f64> {
        let mut c = vec![0usize; n];
        for &e in table {
            c[e as usize] += 1;
        }
        c.iter().map(|&x| x as f64 / table.len() as f64).collect()
    }

    #[test]
    fn sizes_are_checked() {
        assert!(check_table_size(16381, 3).is_ok());
        assert_eq!(
            check_table_size(16380, 3),
            Err(MaglevError::NotPrime(16380))
        );
        assert_eq!(
            check_table_size(65539, 3),
            Err(MaglevError::TooLarge(65539))
        );
        assert!(matches!(
            check_table_size(101, 3),
            Err(MaglevError::TooSmall { .. })
        ));
        assert!(check_table_size(65537, 655).is_ok());
    }

    #[test]
    fn equal_weights_give_equal_shares_within_one_percent() {
        for n in [1usize, 2, 3, 7, 50, 163] {
            let bs: Vec<_> = (0..n).map(|i| backend(i as u8, 1)).collect();
            let t = build_table(&bs, 16381).unwrap();
            assert!(t.iter().all(|&e| (e as usize) < n));
            for s in shares(&t, n) {
                assert!((s - 1.0 / n as f64).abs() <= 0.01, "n={n} share {s}");
            }
        }
    }

    #[test]
    fn weighted_shares_within_one_percent() {
        let weights = [1u32, 2, 3, 10, 0, 4];
        let bs: Vec<_> = weights
            .iter()
            .enumerate()
            .map(|(i, &w)| backend(i as u8, w))
            .collect();
        let total: u32 = weights.iter().sum();
        for m in [16381u32, 65537] {
            let t = build_table(&bs, m).unwrap();
            let s = shares(&t, bs.len());
            for (i, &w) in weights.iter().enumerate() {
                let want = w as f64 / total as f64;
                assert!(
                    (s[i] - want).abs() <= 0.01,
                    "m={m} backend {i}: {} vs {want}",
                    s[i]
                );
            }
            assert_eq!(s[4], 0.0, "weight 0 must get nothing");
        }
    }

    #[test]
    fn removing_a_backend_moves_little_else() {
        for (n, m) in [
            (3usize, 16381u32),
            (10, 16381),
            (30, 16381),
            (100, 65537),
            (150, 65537),
        ] {
            let bs: Vec<_> = (0..n).map(|i| backend(i as u8, 1)).collect();
            let before = build_table(&bs, m).unwrap();
            let removed = n / 2;
            let mut fewer = bs.clone();
            fewer.remove(removed);
            let after = build_table(&fewer, m).unwrap();
            let moved_elsewhere = before
                .iter()
                .zip(&after)
                .filter(|(&b, &a)| {
                    let b = b as usize;
                    b != removed && bs[b] != fewer[a as usize]
                })
                .count();
            assert!(
                (moved_elsewhere as f64) <= 0.01 * m as f64,
                "n={n} m={m}: {moved_elsewhere} entries of surviving backends moved"
            );
        }
    }

    #[test]
    fn same_inputs_same_table_whatever_the_order() {
        let bs: Vec<_> = (0..5).map(|i| backend(i, 1 + i as u32)).collect();
        let a = build_table(&bs, 16381).unwrap();
        let mut rev = bs.clone();
        rev.reverse();
        let b = build_table(&rev, 16381).unwrap();
        // Same backend identity at every entry.
        assert!(a
            .iter()
            .zip(&b)
            .all(|(&x, &y)| bs[x as usize] == rev[y as usize]));
        assert_eq!(a, build_table(&bs, 16381).unwrap());
        // Pinned first entries: if this changes, nodes on different xlb
        // versions would disagree behind one ECMP group.
        assert_eq!(&a[..8], &GOLDEN_PREFIX);
    }

    const GOLDEN_PREFIX: [u32; 8] = [1, 1, 2, 3, 4, 4, 3, 4];

    #[test]
    fn no_weight_no_table() {
        assert!(build_table(&[backend(1, 0)], 16381).unwrap().is_empty());
        assert!(build_table(&[], 16381).unwrap().is_empty());
    }
}
