//! A CPU limit on processes through the kernel's CPU controller: what makes
//! a backend slow for real in the load-aware tests and benchmark. cgroup v1
//! (`cpu.cfs_quota_us` under /sys/fs/cgroup/cpu, this machine) or v2
//! (`cpu.max`), whichever the host has.

use std::{fs, path::PathBuf};

/// The scheduler period the quota is a share of.
const PERIOD_US: u64 = 100_000;

/// A cgroup with a CPU quota; removed (its processes back in the root
/// group) when dropped.
pub struct CpuLimit {
    dir: PathBuf,
    v2: bool,
    root: PathBuf,
}

impl CpuLimit {
    /// A new group `name` allowed `percent` of one CPU.
    pub fn new(name: &str, percent: f64) -> CpuLimit {
        let v1 = PathBuf::from("/sys/fs/cgroup/cpu");
        let (root, v2) = if v1.join("cpu.cfs_quota_us").exists() {
            (v1, false)
        } else {
            (PathBuf::from("/sys/fs/cgroup"), true)
        };
        if v2 {
            // Child groups get the cpu controller only when the root hands it down.
            let _ = fs::write(root.join("cgroup.subtree_control"), "+cpu");
        }
        let dir = root.join(name);
        let _ = fs::create_dir(&dir);
        let limit = CpuLimit { dir, v2, root };
        limit.set(percent);
        limit
    }

    /// Changes the quota: `percent` of one CPU; 100 or more: unlimited.
    pub fn set(&self, percent: f64) {
        let quota = (PERIOD_US as f64 * percent / 100.0).round() as u64;
        let unlimited = percent >= 100.0;
        let (file, value) = match (self.v2, unlimited) {
            (true, true) => ("cpu.max", format!("max {PERIOD_US}")),
            (true, false) => ("cpu.max", format!("{quota} {PERIOD_US}")),
            (false, true) => ("cpu.cfs_quota_us", "-1".to_string()),
            (false, false) => ("cpu.cfs_quota_us", quota.to_string()),
        };
        if !self.v2 {
            fs::write(self.dir.join("cpu.cfs_period_us"), PERIOD_US.to_string())
                .expect("cpu.cfs_period_us");
        }
        fs::write(self.dir.join(file), &value)
            .unwrap_or_else(|e| panic!("{}/{file} = {value}: {e}", self.dir.display()));
    }

    /// Moves process `pid` (all its threads) into the group.
    pub fn add(&self, pid: u32) {
        fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", self.dir.display()));
    }
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        if let Ok(procs) = fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = fs::write(self.root.join("cgroup.procs"), pid);
            }
        }
        let _ = fs::remove_dir(&self.dir);
    }
}
