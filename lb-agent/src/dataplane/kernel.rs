//! Whether the running kernel can take the program, checked before loading
//! it: on an older kernel the verifier's refusal is a long log that names
//! an unknown helper, not the kernel version to get.

use std::fmt;

/// `major.minor` of a kernel release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The oldest kernel the program loads on: it calls `bpf_loop` (5.17).
/// Everything else it needs is older: bpf_ktime_get_coarse_ns (5.11), XDP
/// through bpf_link (5.9), CAP_BPF and CAP_PERFMON (5.8), map batch
/// lookups (5.6), bpf_jiffies64 and mmapable arrays (5.5), the hash devmap
/// (5.4), BTF-defined maps and the LRU flag `BPF_F_NO_COMMON_LRU` (older).
pub const MINIMUM: KernelVersion = KernelVersion {
    major: 5,
    minor: 17,
};

/// The `major.minor` a release string (`uname -r`) starts with:
/// "6.18.0-foo", "5.15.0-91-generic", "4.18.0-513.el8.x86_64", "6.1".
pub fn parse_release(release: &str) -> Option<KernelVersion> {
    let mut parts = release.trim().splitn(3, '.');
    let number = |s: Option<&str>| -> Option<u32> {
        let s = s?;
        let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        s[..end].parse().ok()
    };
    let major = number(parts.next())?;
    // "5.17-rc1" has no patch level: the minor ends at the first non-digit.
    let minor = number(parts.next())?;
    Some(KernelVersion { major, minor })
}

/// What to make of the running kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// New enough by its version.
    Fits,
    /// Older by its version, but it has `bpf_loop` (a distribution kernel
    /// with backports): loading goes ahead.
    Backported(KernelVersion),
    /// The release does not parse: loading goes ahead and the verifier
    /// has the last word.
    Unknown,
    /// Too old: refused.
    TooOld(KernelVersion),
}

/// Decides from the release string; `has_bpf_loop` probes the kernel and
/// is called only for a release older than [`MINIMUM`].
pub fn decide(release: &str, has_bpf_loop: impl FnOnce() -> bool) -> Verdict {
    match parse_release(release) {
        None => Verdict::Unknown,
        Some(v) if v >= MINIMUM => Verdict::Fits,
        Some(v) if has_bpf_loop() => Verdict::Backported(v),
        Some(v) => Verdict::TooOld(v),
    }
}

/// The running kernel's release (`uname -r`).
pub fn running_release() -> String {
    crate::sys::kernel_release()
}

/// Whether the kernel lets an XDP program call `bpf_loop`.
pub fn has_bpf_loop() -> bool {
    use aya::{
        programs::ProgramType,
        sys::{is_helper_supported, BpfHelper},
    };
    is_helper_supported(ProgramType::Xdp, BpfHelper::BPF_FUNC_loop).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32) -> KernelVersion {
        KernelVersion { major, minor }
    }

    #[test]
    fn parses_the_releases_distributions_report() {
        for (release, want) in [
            ("6.18.0-foo", Some(v(6, 18))),
            ("5.15.0-91-generic", Some(v(5, 15))),
            ("4.18.0-513.el8.x86_64", Some(v(4, 18))),
            ("5.17.0", Some(v(5, 17))),
            ("5.17-rc1", Some(v(5, 17))),
            ("6.1", Some(v(6, 1))),
            ("6.10.14-linuxkit", Some(v(6, 10))),
            (" 5.4.0-150-generic\n", Some(v(5, 4))),
            ("6", None),
            ("", None),
            ("linux", None),
            ("x.y.z", None),
        ] {
            assert_eq!(parse_release(release), want, "{release:?}");
        }
        // 6.2 is newer than 5.17, and 5.17 newer than 5.9 (not by string).
        assert!(v(6, 2) > MINIMUM && v(5, 9) < MINIMUM && v(5, 17) == MINIMUM);
    }

    #[test]
    fn refuses_an_older_kernel_unless_it_has_bpf_loop() {
        let never = || -> bool { panic!("probed a kernel new enough by its version") };
        assert_eq!(decide("6.18.0-foo", never), Verdict::Fits);
        assert_eq!(decide("5.17.0-1-amd64", never), Verdict::Fits);
        assert_eq!(
            decide("5.15.0-91-generic", || false),
            Verdict::TooOld(v(5, 15))
        );
        assert_eq!(decide("5.8.0", || false), Verdict::TooOld(v(5, 8)));
        assert_eq!(
            decide("5.14.0-362.el9.x86_64", || true),
            Verdict::Backported(v(5, 14))
        );
        assert_eq!(decide("weird", never), Verdict::Unknown);
    }

    #[test]
    fn the_refusal_names_the_minimum_and_the_running_kernel() {
        let e = super::super::DataplaneError::KernelTooOld {
            release: "5.15.0-91-generic".into(),
            running: v(5, 15),
        };
        assert_eq!(
            e.to_string(),
            "this kernel is Linux 5.15.0-91-generic (5.15); xlb needs Linux 5.17 or newer: \
             its XDP program calls bpf_loop, which this kernel does not have"
        );
    }
}
