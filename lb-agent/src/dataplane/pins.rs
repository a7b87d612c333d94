//! Checks before maps are pinned or adopted: a bpffs to pin on, and pinned
//! maps laid out as this build expects.

use std::path::Path;

use lb_common::{map_names as names, FLOW_EVENT_COUNT, REASON_COUNT};

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
    let fs_type = crate::sys::filesystem_type(&c_path)
        .map_err(|e| DataplaneError::Pin(existing.to_path_buf(), e))?;
    if fs_type != BPF_FS_MAGIC {
        return Err(DataplaneError::NoBpffs(dir.to_path_buf()));
    }
    Ok(())
}

/// Counters: each one's pin is started afresh alone when its layout
/// changed. Everything else is the data plane's state, one whole.
pub(super) const COUNTERS: [&str; 9] = [
    names::SERVICE_STATS,
    names::BACKEND_STATS,
    names::REASON_STATS,
    names::FLOW_EVENTS,
    names::BACKEND_CLOSED,
    names::FLOW_TIMES,
    names::BACKEND_ACTIVE,
    names::BACKEND_LOAD,
    names::SOURCE_RATES,
];

/// A counter array this version has more slots in than its pin's
/// `entries`: how many it wants.
fn grown_counter(name: &str, entries: u32) -> Option<u32> {
    let wanted = match name {
        names::REASON_STATS => REASON_COUNT,
        names::FLOW_EVENTS => FLOW_EVENT_COUNT,
        _ => return None,
    };
    (entries < wanted).then_some(wanted)
}

/// Removes the pins in `dir` that this build cannot read as it lays them
/// out (another xlb version's), so that the load creates them afresh; the
/// program keeps running on the old maps until its links take the new one.
/// A counter is started afresh alone. A state map (services, tables, flows)
/// of another layout starts every pin afresh, counters included: they are
/// indexed by service and backend ids, which are handed out again. Returns
/// the names started afresh; the agent never refuses to start over a
/// layout, so that an upgrade cannot crash-loop.
pub(super) fn start_afresh_where_layout_changed(dir: &Path) -> Result<Vec<&'static str>> {
    let mut changed = Vec::new();
    for name in names::ALL {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path).map_err(map_err(name))?;
        if let Some(why) = crate::maps::layout_mismatch(name, &info) {
            log::warn!("{} has {why}", path.display());
            changed.push(name);
        } else if let Some(wanted) = grown_counter(name, info.max_entries()) {
            // A version with fewer reasons or flow events: the new ones
            // would go uncounted.
            log::info!(
                "{} counts {} kinds, this version {wanted}",
                path.display(),
                info.max_entries()
            );
            changed.push(name);
        }
    }
    let state_changed = changed.iter().any(|n| !COUNTERS.contains(n));
    let afresh: Vec<&'static str> = if state_changed {
        names::ALL
            .into_iter()
            .filter(|n| dir.join(n).exists())
            .collect()
    } else {
        changed
    };
    for name in &afresh {
        let path = dir.join(name);
        std::fs::remove_file(&path).map_err(|e| DataplaneError::Pin(path, e))?;
    }
    if state_changed {
        log::warn!(
            "pinned maps of another xlb version: the data plane starts afresh (services are \
             programmed again; open flows are forgotten: nat flows are picked again by Maglev, \
             onto the same backends while they are unchanged, snat ones are reset unless \
             flow_sync hands them back; counters restart)"
        );
    } else if !afresh.is_empty() {
        log::info!("counters started afresh: {}", afresh.join(", "));
    }
    Ok(afresh)
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
mod tests {
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

    #[test]
    fn counters_with_more_kinds_are_started_afresh() {
        assert_eq!(grown_counter(names::FLOW_EVENTS, 1), Some(FLOW_EVENT_COUNT));
        assert_eq!(grown_counter(names::FLOW_EVENTS, FLOW_EVENT_COUNT), None);
        assert_eq!(
            grown_counter(names::REASON_STATS, REASON_COUNT - 1),
            Some(REASON_COUNT)
        );
        assert_eq!(grown_counter(names::REASON_STATS, REASON_COUNT), None);
        assert_eq!(grown_counter(names::FLOWS, 1), None);
    }
}
