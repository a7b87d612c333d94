//! CPU load of a backend that runs on this node, from its cgroup: how much
//! of its CPU limit it uses and how much of the time it was held back
//! (throttled by its quota, or waiting for a CPU: pressure, PSI). Only a
//! local process's cgroup can be read, which is why the other signals come
//! first (docs/load-aware.md).
//!
//! Both cgroup versions: v1 keeps CPU time in `cpuacct` and the quota and
//! throttling in `cpu`; v2 keeps all of it in one directory, plus
//! `cpu.pressure`. A hybrid host (v1 controllers, v2 at `unified`) gives
//! pressure from v2 where the group exists there too.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Instant,
};

use crate::service::BackendCgroup;

/// Where the hierarchies are mounted, found below one root (usually
/// /sys/fs/cgroup; in a container, the host's, mounted elsewhere).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hierarchies {
    /// v1 `cpu` controller: quota and throttling.
    cpu: Option<PathBuf>,
    /// v1 `cpuacct` controller: CPU time used.
    cpuacct: Option<PathBuf>,
    /// The v2 hierarchy (the whole of it, or `unified` on a hybrid host).
    v2: Option<PathBuf>,
}

impl Hierarchies {
    pub fn at(root: &Path) -> Hierarchies {
        if root.join("cgroup.controllers").exists() {
            return Hierarchies {
                v2: Some(root.to_path_buf()),
                ..Default::default()
            };
        }
        let first = |names: &[&str], file: &str| {
            names
                .iter()
                .map(|n| root.join(n))
                .find(|d| d.join(file).exists())
        };
        Hierarchies {
            cpu: first(&["cpu,cpuacct", "cpu"], "cpu.cfs_quota_us"),
            cpuacct: first(&["cpu,cpuacct", "cpuacct"], "cpuacct.usage"),
            v2: Some(root.join("unified")).filter(|d| d.join("cgroup.controllers").exists()),
        }
    }

    /// The group's path below the roots: as configured, or where kubelet
    /// puts a Pod (either cgroup driver, any QoS class).
    pub fn locate(&self, group: &BackendCgroup) -> Result<PathBuf, String> {
        let uid = match group {
            BackendCgroup::Path(p) => return Ok(p.clone()),
            BackendCgroup::Pod(uid) => uid,
        };
        let root = self
            .cpu
            .as_ref()
            .or(self.v2.as_ref())
            .ok_or("no cgroup CPU hierarchy is mounted")?;
        let pod = format!("pod{uid}");
        let unit = uid.replace('-', "_");
        let candidates = [
            format!("kubepods/{pod}"),
            format!("kubepods/burstable/{pod}"),
            format!("kubepods/besteffort/{pod}"),
            format!("kubepods.slice/kubepods-pod{unit}.slice"),
            format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{unit}.slice"),
            format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{unit}.slice"),
        ];
        candidates
            .into_iter()
            .map(PathBuf::from)
            .find(|c| root.join(c).is_dir())
            .ok_or_else(|| format!("no cgroup for Pod {uid} under {}", root.display()))
    }

    /// The group's counters now.
    pub fn sample(&self, group: &Path) -> Result<Sample, String> {
        let at = Instant::now();
        let v2 = self
            .v2
            .as_ref()
            .map(|r| r.join(group))
            .filter(|d| d.is_dir());
        let cpu = self.cpu.as_ref().map(|r| r.join(group));
        let cpuacct = self.cpuacct.as_ref().map(|r| r.join(group));
        let v2_stat = v2.as_ref().map(|d| read(&d.join("cpu.stat"))).transpose()?;
        let usage_ns = match (&cpuacct, &v2_stat) {
            (Some(d), _) if d.is_dir() => read(&d.join("cpuacct.usage"))?
                .trim()
                .parse::<u64>()
                .map_err(|e| format!("{}/cpuacct.usage: {e}", d.display()))?,
            (_, Some(stat)) => field(stat, "usage_usec").unwrap_or(0) * 1000,
            _ => {
                return Err(format!(
                    "no cgroup {} to read CPU time from",
                    group.display()
                ))
            }
        };
        let (periods, throttled, limit) = match &cpu {
            Some(d) if d.is_dir() => {
                let stat = read(&d.join("cpu.stat"))?;
                let quota = read(&d.join("cpu.cfs_quota_us"))?;
                let period = read(&d.join("cpu.cfs_period_us"))?;
                (
                    field(&stat, "nr_periods").unwrap_or(0),
                    field(&stat, "nr_throttled").unwrap_or(0),
                    quota_cpus(quota.trim(), period.trim()),
                )
            }
            _ => {
                let stat = v2_stat.as_deref().unwrap_or("");
                let max = v2
                    .as_ref()
                    .and_then(|d| fs::read_to_string(d.join("cpu.max")).ok())
                    .unwrap_or_default();
                let mut it = max.split_whitespace();
                let (q, p) = (it.next().unwrap_or("max"), it.next().unwrap_or("100000"));
                (
                    field(stat, "nr_periods").unwrap_or(0),
                    field(stat, "nr_throttled").unwrap_or(0),
                    quota_cpus(q, p),
                )
            }
        };
        let pressure_us = v2
            .as_ref()
            .and_then(|d| fs::read_to_string(d.join("cpu.pressure")).ok())
            .and_then(|p| some_total(&p));
        Ok(Sample {
            at,
            usage_ns,
            periods,
            throttled,
            pressure_us,
            limit_cpus: limit.unwrap_or_else(online_cpus),
        })
    }
}

/// One reading of a group's counters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub at: Instant,
    /// CPU time used, all CPUs.
    pub usage_ns: u64,
    /// Scheduler periods with a quota, and those in which it ran out.
    pub periods: u64,
    pub throttled: u64,
    /// Time some of its tasks waited for a CPU (PSI `some`), where known.
    pub pressure_us: Option<u64>,
    /// CPUs it may use: its quota, or every online CPU.
    pub limit_cpus: f64,
}

impl Sample {
    /// The load between `earlier` and this sample: the share of its limit
    /// used, plus the share of the time it was held back (the larger of
    /// throttled periods and CPU pressure). 1: all of its CPU; up to 2:
    /// all of it and still wanting more.
    pub fn load_since(&self, earlier: &Sample) -> Option<f64> {
        let secs = self.at.duration_since(earlier.at).as_secs_f64();
        if secs <= 0.0 || self.usage_ns < earlier.usage_ns {
            // No time passed, or the group was made anew: no rate yet.
            return None;
        }
        let used = (self.usage_ns - earlier.usage_ns) as f64 / 1e9 / secs / self.limit_cpus;
        let periods = self.periods.saturating_sub(earlier.periods);
        let throttled = match periods {
            0 => 0.0,
            n => self.throttled.saturating_sub(earlier.throttled) as f64 / n as f64,
        };
        let waiting = match (self.pressure_us, earlier.pressure_us) {
            (Some(now), Some(then)) => now.saturating_sub(then) as f64 / 1e6 / secs,
            _ => 0.0,
        };
        Some(used.min(1.0) + throttled.max(waiting).min(1.0))
    }
}

fn read(path: &Path) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// `name value` lines (cpu.stat).
fn field(stat: &str, name: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// `some avg10=… total=N` (cpu.pressure): N, in µs.
fn some_total(pressure: &str) -> Option<u64> {
    let line = pressure.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

/// A quota and period (µs) as CPUs; `None`: no quota (`-1`, `max`).
fn quota_cpus(quota: &str, period: &str) -> Option<f64> {
    let q: f64 = quota.parse().ok().filter(|q: &f64| *q > 0.0)?;
    let p: f64 = period.parse().ok().filter(|p: &f64| *p > 0.0)?;
    Some(q / p)
}

fn online_cpus() -> f64 {
    crate::sys::online_cpus() as f64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A directory of files standing for a cgroup mount; removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn tree(files: &[(&str, &str)]) -> Tree {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "xlb-cgroup-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        for (path, text) in files {
            let p = dir.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
        Tree(dir)
    }

    #[test]
    fn v1_usage_quota_and_throttling() {
        let d = tree(&[
            ("cpu/cpu.cfs_quota_us", "-1\n"),
            ("cpuacct/cpuacct.usage", "0\n"),
            ("cpu/g/cpu.cfs_quota_us", "50000\n"),
            ("cpu/g/cpu.cfs_period_us", "100000\n"),
            (
                "cpu/g/cpu.stat",
                "nr_periods 10\nnr_throttled 2\nthrottled_time 5\n",
            ),
            ("cpuacct/g/cpuacct.usage", "1000000000\n"),
        ]);
        let h = Hierarchies::at(d.path());
        let s = h.sample(Path::new("g")).unwrap();
        assert_eq!((s.usage_ns, s.periods, s.throttled), (1_000_000_000, 10, 2));
        assert_eq!((s.limit_cpus, s.pressure_us), (0.5, None));
        // A second later: 0.5 s of CPU (all of the quota), throttled in
        // half the periods.
        let later = Sample {
            at: s.at + Duration::from_secs(1),
            usage_ns: 1_500_000_000,
            periods: 20,
            throttled: 7,
            ..s
        };
        assert_eq!(later.load_since(&s), Some(1.5));
        assert_eq!(s.load_since(&later), None, "time runs forward only");
    }

    #[test]
    fn v2_usage_limit_and_pressure() {
        let d = tree(&[
            ("cgroup.controllers", "cpu\n"),
            (
                "g/cpu.stat",
                "usage_usec 2000\nnr_periods 0\nnr_throttled 0\n",
            ),
            ("g/cpu.max", "max 100000\n"),
            (
                "g/cpu.pressure",
                "some avg10=1.00 avg60=0 avg300=0 total=300\nfull avg10=0 total=0\n",
            ),
        ]);
        let h = Hierarchies::at(d.path());
        let s = h.sample(Path::new("g")).unwrap();
        assert_eq!((s.usage_ns, s.pressure_us), (2_000_000, Some(300)));
        assert_eq!(s.limit_cpus, online_cpus());
        let later = Sample {
            at: s.at + Duration::from_secs(2),
            usage_ns: s.usage_ns,
            pressure_us: Some(300 + 500_000),
            ..s
        };
        // Idle, but waiting a quarter of the time.
        assert_eq!(later.load_since(&s), Some(0.25));
        assert!(h.sample(Path::new("missing")).is_err());
    }

    #[test]
    fn pods_are_found_under_either_driver() {
        let uid = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc";
        let cgroupfs = tree(&[
            ("cpu/cpu.cfs_quota_us", "-1\n"),
            (&format!("cpu/kubepods/burstable/pod{uid}/cpu.stat"), ""),
        ]);
        let found = Hierarchies::at(cgroupfs.path()).locate(&BackendCgroup::Pod(uid.into()));
        assert_eq!(
            found,
            Ok(PathBuf::from(format!("kubepods/burstable/pod{uid}")))
        );
        let systemd = tree(&[
            ("cgroup.controllers", "cpu\n"),
            (
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f1e2d3c_aaaa_bbbb_cccc_123456789abc.slice/cpu.stat",
                "",
            ),
        ]);
        let h = Hierarchies::at(systemd.path());
        assert!(h
            .locate(&BackendCgroup::Pod(uid.into()))
            .unwrap()
            .ends_with("kubepods-besteffort-pod0f1e2d3c_aaaa_bbbb_cccc_123456789abc.slice"));
        assert!(h.locate(&BackendCgroup::Pod("other".into())).is_err());
    }
}
