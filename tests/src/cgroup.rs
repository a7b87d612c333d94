//! A CPU limit on processes through the kernel's CPU controller: what makes
//! a backend slow for real in the load-aware tests and benchmark. cgroup v1
//! (`cpu.cfs_quota_us` under /sys/fs/cgroup/cpu, this machine) or v2
//! (`cpu.max`), whichever the host has. On a v1 host the group is made in
//! `cpuacct` (CPU time) and the v2 `unified` tree (pressure) as well, as
//! systemd and kubelet do, so that the agent can read its load.

use std::{fs, path::PathBuf};

/// The scheduler period the quota is a share of.
const PERIOD_US: u64 = 100_000;

/// A cgroup with a CPU quota; removed (its processes back in the root
/// group) when dropped.
pub struct CpuLimit {
    name: String,
    dir: PathBuf,
    v2: bool,
    root: PathBuf,
    /// The same group in the other hierarchies (v1 host): (root, group).
    others: Vec<(PathBuf, PathBuf)>,
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
        let _ = fs::create_dir_all(&dir);
        let others = ["cpuacct", "unified"]
            .into_iter()
            .map(|h| PathBuf::from("/sys/fs/cgroup").join(h))
            .filter(|r| !v2 && r.join("cgroup.procs").exists() && *r != root)
            .map(|r| {
                let d = r.join(name);
                let _ = fs::create_dir_all(&d);
                (r, d)
            })
            .collect();
        let limit = CpuLimit {
            name: name.to_string(),
            dir,
            v2,
            root,
            others,
        };
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
        let dirs = std::iter::once(&self.dir).chain(self.others.iter().map(|(_, d)| d));
        for dir in dirs {
            fs::write(dir.join("cgroup.procs"), pid.to_string())
                .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", dir.display()));
        }
    }

    /// The group's path below the hierarchies' root (what the agent's
    /// `cgroup:` names).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        let groups =
            std::iter::once((&self.root, &self.dir)).chain(self.others.iter().map(|(r, d)| (r, d)));
        for (root, dir) in groups {
            if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in procs.lines() {
                    let _ = fs::write(root.join("cgroup.procs"), pid);
                }
            }
            // With its parents made for it, while empty (kubepods/…).
            for d in dir
                .ancestors()
                .take_while(|d| d.starts_with(root) && *d != root)
            {
                if fs::remove_dir(d).is_err() {
                    break;
                }
            }
        }
    }
}

/// A process that burns all the CPU its cgroup allows; killed when dropped.
pub struct Burner(std::process::Child);

impl Burner {
    pub fn start_in(group: &CpuLimit) -> Burner {
        let child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        group.add(child.id());
        Burner(child)
    }
}

impl Drop for Burner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
