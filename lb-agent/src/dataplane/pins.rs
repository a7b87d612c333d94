//! Checks before maps are pinned or adopted: a bpffs to pin on, and pinned
//! maps laid out as this build expects.

use std::path::Path;

use lb_common::{map_names as names, REASON_COUNT};

use super::{map_err, DataplaneError, Result};

/// `statfs`'s `f_type` of a BPF filesystem (linux/magic.h).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Checks that `dir`, or where it would be created, is on a bpffs: anything
/// else cannot hold pins, and the kernel's error alone (ENOENT, EPERM) does
/// not say why. The agent does not mount one itself: under `ip netns exec`
/// that bpffs would vanish with the agent's mount namespace, taking the
/// pins that let a restart keep the flows.
pub(super) fn check_bpffs(dir: &Path) -> Result<()> {
    let existing = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    let c_path = std::ffi::CString::new(existing.as_os_str().as_encoded_bytes())
        .map_err(|_| DataplaneError::NoBpffs(dir.to_path_buf()))?;
    // SAFETY: a valid NUL-terminated path and a zeroed statfs to fill.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut st) } != 0 {
        return Err(DataplaneError::Pin(
            existing.to_path_buf(),
            std::io::Error::last_os_error(),
        ));
    }
    if st.f_type as i64 != BPF_FS_MAGIC {
        return Err(DataplaneError::NoBpffs(dir.to_path_buf()));
    }
    Ok(())
}

/// Refuses to adopt a pinned map laid out by another xlb version: reusing
/// it would make the program read garbage.
pub(super) fn check_pinned_layout(name: &'static str, path: &Path) -> Result<()> {
    let info = aya::maps::MapInfo::from_pin(path).map_err(map_err(name))?;
    let mismatch = crate::maps::layout_mismatch(name, &info);
    // The agent rewrites this record every load-aware step and the program
    // never reads it: one laid out by another version is replaced.
    if let (Some(why), names::BACKEND_LOAD) = (&mismatch, name) {
        log::info!("{} has {why}: starting it afresh", path.display());
        return std::fs::remove_file(path).map_err(|e| DataplaneError::Pin(path.to_path_buf(), e));
    }
    if let Some(why) = mismatch {
        return Err(DataplaneError::Adopt(format!(
            "{} has {why}",
            path.display()
        )));
    }
    // Counters only: a table from a version with fewer reasons is replaced
    // (the new reasons would go uncounted) rather than refused.
    if name == names::REASON_STATS && info.max_entries() < REASON_COUNT {
        log::info!(
            "{} counts {} reasons, this version {REASON_COUNT}: starting the reason counters afresh",
            path.display(),
            info.max_entries()
        );
        std::fs::remove_file(path).map_err(|e| DataplaneError::Pin(path.to_path_buf(), e))?;
    }
    Ok(())
}

/// The pin of an interface's XDP link: `link_<iface>`, with each `.` as
/// `:`. bpffs refuses names with a dot (it keeps them for itself), and VLAN
/// (`eth0.100`) and tunnel (`flannel.1`) interfaces have one; `:` cannot
/// be in an interface name, so the mapping is reversible.
pub(super) fn link_pin_name(iface: &str) -> String {
    format!("link_{}", iface.replace('.', ":"))
}

/// The interface a link pin was made for, if `name` is a link pin.
pub(super) fn iface_of_link_pin(name: &str) -> Option<String> {
    name.strip_prefix("link_").map(|i| i.replace(':', "."))
}

#[cfg(test)]
mod link_pin_tests {
    use super::*;

    #[test]
    fn interfaces_with_dots_have_pin_names_without_and_come_back() {
        for iface in ["eth0", "eth0.100", "flannel.1", "bond0.12.3"] {
            let pin = link_pin_name(iface);
            assert!(!pin.contains('.'), "{pin}");
            assert_eq!(iface_of_link_pin(&pin).as_deref(), Some(iface));
        }
        assert_eq!(iface_of_link_pin("FLOWS"), None);
    }
}
