//! The real Kubernetes control plane the tests run against: kube-apiserver,
//! kube-controller-manager and kubectl at one pinned release, etcd and
//! etcdctl at another, built from the Go module proxy (no prebuilt binaries
//! are reachable). This is the one place that names the versions.
//!
//! Binaries go to `/opt/xlb-k8s/<version>/` and are linked into
//! `/opt/xlb-k8s/bin/`, which is where the test harness looks
//! (`tests/src/cluster`). Each is built only when missing.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, output, succeeds};

pub const KUBERNETES_VERSION: &str = "v1.37.2";
pub const ETCD_VERSION: &str = "v3.6.16";
const CACHE: &str = "/opt/xlb-k8s";
const KUBE_COMMANDS: &[&str] = &["kube-apiserver", "kube-controller-manager", "kubectl"];

pub fn setup() -> Result<()> {
    let bin = Path::new(CACHE).join("bin");
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;

    let kube_dir = Path::new(CACHE).join(KUBERNETES_VERSION);
    let missing: Vec<&str> = KUBE_COMMANDS
        .iter()
        .copied()
        .filter(|cmd| !built(&kube_dir.join(cmd), KUBERNETES_VERSION))
        .collect();
    for cmd in KUBE_COMMANDS {
        if missing.contains(cmd) {
            println!(
                "installing  {cmd} {KUBERNETES_VERSION} (Go build, ~15 min on a fresh machine)"
            );
        } else {
            println!("ok          {cmd} {KUBERNETES_VERSION}");
        }
    }
    if !missing.is_empty() {
        build_kubernetes(&kube_dir, &missing)?;
    }

    let etcd_dir = Path::new(CACHE).join(format!("etcd-{ETCD_VERSION}"));
    let etcd_version = ETCD_VERSION.trim_start_matches('v');
    if built(&etcd_dir.join("etcd"), etcd_version) && built(&etcd_dir.join("etcdctl"), etcd_version)
    {
        println!("ok          etcd {ETCD_VERSION}");
    } else {
        println!("installing  etcd {ETCD_VERSION} (Go build, ~3 min on a fresh machine)");
        build_etcd(&etcd_dir)?;
    }

    for cmd in KUBE_COMMANDS {
        link(&kube_dir.join(cmd), &bin.join(cmd))?;
    }
    for cmd in ["etcd", "etcdctl"] {
        link(&etcd_dir.join(cmd), &bin.join(cmd))?;
    }
    Ok(())
}

/// A binary counts as built when it runs and reports the pinned version.
fn built(binary: &Path, version: &str) -> bool {
    let args: &[&str] = match binary.file_name().and_then(|n| n.to_str()) {
        Some("kubectl") => &["version", "--client"],
        Some("etcdctl") => &["version"],
        _ => &["--version"],
    };
    output(Command::new(binary).args(args)).is_some_and(|out| out.contains(version))
}

fn go() -> Command {
    let mut cmd = Command::new("go");
    // The module's go.mod is edited below, so go may update go.sum; no
    // workspace file may change what is built.
    cmd.env("GOFLAGS", "-mod=mod").env("GOWORK", "off");
    cmd
}

/// k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces the
/// staging modules with directories the module zip lacks. Copy the module,
/// point each of them at its published release, then build unchanged.
fn build_kubernetes(out: &Path, commands: &[&str]) -> Result<()> {
    let module = format!("k8s.io/kubernetes@{KUBERNETES_VERSION}");
    let json = output(
        go().current_dir("/")
            .args(["mod", "download", "-json", &module]),
    )
    .with_context(|| format!("`go mod download {module}` failed"))?;
    let cached = json_string(&json, "Dir").context("no Dir in `go mod download -json` output")?;

    let src = Path::new(CACHE)
        .join("src")
        .join(format!("kubernetes-{KUBERNETES_VERSION}"));
    if src.exists() {
        fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    }
    fs::create_dir_all(src.parent().unwrap_or(Path::new(CACHE)))?;
    util::run(Command::new("cp").arg("-r").arg(&cached).arg(&src))?;
    util::run(Command::new("chmod").args(["-R", "u+w"]).arg(&src))?;
    for file in ["go.work", "go.work.sum"] {
        let _ = fs::remove_file(src.join(file));
    }

    let go_mod = fs::read_to_string(src.join("go.mod")).context("reading go.mod")?;
    let staging = staging_version(KUBERNETES_VERSION)?;
    let mut edit = go();
    edit.current_dir(&src).args(["mod", "edit"]);
    for module in staging_replacements(&go_mod) {
        edit.arg(format!("-dropreplace={module}"));
        if go_mod
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [module.as_str(), "v0.0.0"])
        {
            edit.arg(format!("-require={module}@{staging}"));
        }
    }
    util::run(&mut edit)?;

    let ldflags = version_ldflags(KUBERNETES_VERSION)?;
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for cmd in commands {
        util::run(
            go().current_dir(&src)
                .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
                .arg(out.join(cmd))
                .arg(format!("./cmd/{cmd}")),
        )?;
        if !built(&out.join(cmd), KUBERNETES_VERSION) {
            bail!("{cmd} was built but does not report {KUBERNETES_VERSION}");
        }
    }
    // The copied source is 300 MB and only needed to build.
    fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    Ok(())
}

/// etcd's server module has replace directives too; a throwaway module that
/// requires it builds it as a dependency, where replaces do not apply.
fn build_etcd(out: &Path) -> Result<()> {
    let module = Path::new(CACHE).join("src/etcdbuild");
    if module.exists() {
        fs::remove_dir_all(&module)?;
    }
    fs::create_dir_all(&module)?;
    fs::write(
        module.join("tools.go"),
        "//go:build tools\n\npackage tools\n\nimport (\n\t_ \"go.etcd.io/etcd/etcdctl/v3\"\n\t_ \"go.etcd.io/etcd/server/v3\"\n)\n",
    )?;
    util::run(go().current_dir(&module).args(["mod", "init", "etcdbuild"]))?;
    util::run(go().current_dir(&module).args([
        "get",
        &format!("go.etcd.io/etcd/server/v3@{ETCD_VERSION}"),
        &format!("go.etcd.io/etcd/etcdctl/v3@{ETCD_VERSION}"),
    ]))?;
    fs::create_dir_all(out)?;
    for (cmd, package) in [
        ("etcd", "go.etcd.io/etcd/server/v3"),
        ("etcdctl", "go.etcd.io/etcd/etcdctl/v3"),
    ] {
        util::run(
            go().current_dir(&module)
                .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
                .arg(out.join(cmd))
                .arg(package),
        )?;
    }
    fs::remove_dir_all(&module)?;
    Ok(())
}

/// The modules in go.mod's `replace ( … )` block that point into staging/.
fn staging_replacements(go_mod: &str) -> Vec<String> {
    go_mod
        .lines()
        .filter_map(|line| {
            let (module, target) = line.trim().split_once("=>")?;
            target
                .trim()
                .starts_with("./staging/")
                .then(|| module.trim().to_string())
        })
        .collect()
}

/// k8s.io/kubernetes v1.N.P publishes its staging modules as v0.N.P.
fn staging_version(kubernetes: &str) -> Result<String> {
    match kubernetes.strip_prefix("v1.") {
        Some(rest) => Ok(format!("v0.{rest}")),
        None => bail!("unexpected Kubernetes version {kubernetes}"),
    }
}

/// Without these the binaries report `v0.0.0-master+$Format:%H$`, which
/// kubectl refuses to parse as a server version.
fn version_ldflags(version: &str) -> Result<String> {
    let mut parts = version.trim_start_matches('v').split('.');
    let (Some(major), Some(minor)) = (parts.next(), parts.next()) else {
        bail!("unexpected Kubernetes version {version}");
    };
    let mut flags = vec!["-s".to_string(), "-w".to_string()];
    for package in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push(format!("-X {package}.gitVersion={version}"));
        flags.push(format!("-X {package}.gitMajor={major}"));
        flags.push(format!("-X {package}.gitMinor={minor}"));
        flags.push(format!("-X {package}.gitTreeState=clean"));
    }
    Ok(flags.join(" "))
}

/// The value of `"key": "value"` in go's indented JSON output.
fn json_string(json: &str, key: &str) -> Option<PathBuf> {
    let needle = format!("\"{key}\": \"");
    let start = json.find(&needle)? + needle.len();
    let end = start + json[start..].find('"')?;
    Some(PathBuf::from(&json[start..end]))
}

fn link(target: &Path, link: &Path) -> Result<()> {
    if fs::read_link(link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    if link.symlink_metadata().is_ok() {
        fs::remove_file(link).with_context(|| format!("removing {}", link.display()))?;
    }
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("linking {} -> {}", link.display(), target.display()))?;
    if !succeeds(Command::new(link).arg("--help")) {
        bail!("{} does not run", link.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_staging_replacements_are_dropped() {
        let go_mod = "module k8s.io/kubernetes\n\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n\tgithub.com/x/y => github.com/x/z v1.0.0\n)\n";
        assert_eq!(
            staging_replacements(go_mod),
            ["k8s.io/api", "k8s.io/client-go"]
        );
    }

    #[test]
    fn staging_modules_are_published_as_v0() {
        assert_eq!(staging_version("v1.37.2").unwrap(), "v0.37.2");
        assert!(staging_version("v2.0.0").is_err());
    }

    #[test]
    fn dir_is_read_from_go_json() {
        let json = "{\n\t\"Path\": \"k8s.io/kubernetes\",\n\t\"Dir\": \"/root/go/pkg/mod/k8s.io/kubernetes@v1.37.2\"\n}";
        assert_eq!(
            json_string(json, "Dir").unwrap(),
            PathBuf::from("/root/go/pkg/mod/k8s.io/kubernetes@v1.37.2")
        );
    }
}
