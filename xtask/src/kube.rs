//! The real Kubernetes the tests run against, built from the Go module proxy
//! (no prebuilt binaries are reachable). This is the one place that names
//! the versions:
//! - the control plane: kube-apiserver, kube-controller-manager,
//!   kube-scheduler and kubectl, etcd and etcdctl;
//! - the node side: kubelet and kube-proxy, containerd (with its runc shim
//!   and ctr), flanneld and crictl. runc and the CNI plugins come from
//!   Debian (setup.rs): their releases there run Pods here.
//!
//! Binaries go to `/opt/xlb-k8s/<name>-<version>/` and are linked into
//! `/opt/xlb-k8s/bin/`, which is where the test harness looks
//! (`tests/src/cluster`, `tests/src/nodes`). Each is built only when missing.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, output};

pub const KUBERNETES_VERSION: &str = "v1.37.2";
pub const ETCD_VERSION: &str = "v3.6.16";
/// Kubernetes 1.36 and newer need containerd 2.
const CONTAINERD_VERSION: &str = "v2.4.2";
const FLANNEL_VERSION: &str = "v0.28.10";
const CRI_TOOLS_VERSION: &str = "v1.37.0";
const CACHE: &str = "/opt/xlb-k8s";
const KUBE_COMMANDS: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "kube-proxy",
];

/// A tool built as a dependency of a throwaway module (its own go.mod has
/// replace directives, so `go install` refuses it).
struct GoTools {
    name: &'static str,
    version: &'static str,
    /// Modules required at `version`.
    modules: &'static [&'static str],
    /// (binary, package, what `binary ARGS` prints when built, ARGS)
    binaries: &'static [(&'static str, &'static str, &'static [&'static str])],
    /// -X flags that set the reported version, `{v}` replaced by it.
    version_flags: &'static [&'static str],
    /// Blank imports dropped from the module's own source, which is then
    /// built in a copy of the module instead (a backend whose dependency
    /// the proxy does not serve).
    drop_imports: &'static [(&'static str, &'static str)],
    /// Built with cgo (flannel's UDP backend has C); else static, as
    /// containerd's releases are (the shim outlives containerd).
    cgo: bool,
    minutes: u32,
}

const GO_TOOLS: &[GoTools] = &[
    GoTools {
        name: "etcd",
        version: ETCD_VERSION,
        modules: &["go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/etcdctl/v3"],
        binaries: &[
            ("etcd", "go.etcd.io/etcd/server/v3", &["--version"]),
            ("etcdctl", "go.etcd.io/etcd/etcdctl/v3", &["version"]),
        ],
        version_flags: &[],
        drop_imports: &[],
        cgo: false,
        minutes: 3,
    },
    GoTools {
        name: "containerd",
        version: CONTAINERD_VERSION,
        modules: &["github.com/containerd/containerd/v2"],
        binaries: &[
            (
                "containerd",
                "github.com/containerd/containerd/v2/cmd/containerd",
                &["--version"],
            ),
            (
                "containerd-shim-runc-v2",
                "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
                &["-v"],
            ),
            (
                "ctr",
                "github.com/containerd/containerd/v2/cmd/ctr",
                &["--version"],
            ),
        ],
        version_flags: &["github.com/containerd/containerd/v2/version.Version={v}"],
        drop_imports: &[],
        cgo: false,
        minutes: 4,
    },
    GoTools {
        name: "flannel",
        version: FLANNEL_VERSION,
        modules: &["github.com/flannel-io/flannel"],
        binaries: &[("flanneld", "github.com/flannel-io/flannel", &["--version"])],
        version_flags: &["github.com/flannel-io/flannel/pkg/version.Version={v}"],
        // Tencent Cloud's SDK module is not served; the tests use VXLAN and host-gw.
        drop_imports: &[(
            "main.go",
            "_ \"github.com/flannel-io/flannel/pkg/backend/tencentvpc\"",
        )],
        cgo: true,
        minutes: 3,
    },
    GoTools {
        name: "crictl",
        version: CRI_TOOLS_VERSION,
        modules: &["sigs.k8s.io/cri-tools"],
        binaries: &[("crictl", "sigs.k8s.io/cri-tools/cmd/crictl", &["--version"])],
        version_flags: &["sigs.k8s.io/cri-tools/pkg/version.Version={v}"],
        drop_imports: &[],
        cgo: false,
        minutes: 2,
    },
];

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

    for cmd in KUBE_COMMANDS {
        link(&kube_dir.join(cmd), &bin.join(cmd))?;
    }
    for tools in GO_TOOLS {
        let dir = Path::new(CACHE).join(format!("{}-{}", tools.name, tools.version));
        let wanted = tools.version.trim_start_matches('v');
        let all_built = tools
            .binaries
            .iter()
            .all(|(binary, _, args)| reports(&dir.join(binary), args, wanted));
        if all_built {
            println!("ok          {} {}", tools.name, tools.version);
        } else {
            println!(
                "installing  {} {} (Go build, ~{} min on a fresh machine)",
                tools.name, tools.version, tools.minutes
            );
            build_go_tools(tools, &dir)?;
        }
        for (binary, _, _) in tools.binaries {
            link(&dir.join(binary), &bin.join(binary))?;
        }
    }
    Ok(())
}

/// A binary counts as built when it runs and reports the pinned version.
fn built(binary: &Path, version: &str) -> bool {
    let args: &[&str] = match binary.file_name().and_then(|n| n.to_str()) {
        Some("kubectl") => &["version", "--client"],
        _ => &["--version"],
    };
    reports(binary, args, version)
}

/// Whether `binary ARGS` succeeds and prints `version` (on stdout or, as
/// flanneld does, stderr).
fn reports(binary: &Path, args: &[&str], version: &str) -> bool {
    Command::new(binary)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && (String::from_utf8_lossy(&out.stdout).contains(version)
                    || String::from_utf8_lossy(&out.stderr).contains(version))
        })
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
    let src = Path::new(CACHE)
        .join("src")
        .join(format!("kubernetes-{KUBERNETES_VERSION}"));
    copy_module(&format!("k8s.io/kubernetes@{KUBERNETES_VERSION}"), &src)?;

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

/// Builds `tools` into `out` from a throwaway module that requires them:
/// replace directives apply only in the main module, so there they do not.
fn build_go_tools(tools: &GoTools, out: &Path) -> Result<()> {
    let module = Path::new(CACHE)
        .join("src")
        .join(format!("{}-build", tools.name));
    if module.exists() {
        fs::remove_dir_all(&module)?;
    }
    if tools.drop_imports.is_empty() {
        fs::create_dir_all(&module)?;
        let imports: String = tools
            .binaries
            .iter()
            .map(|(_, package, _)| format!("\t_ \"{package}\"\n"))
            .collect();
        fs::write(
            module.join("tools.go"),
            format!("//go:build tools\n\npackage tools\n\nimport (\n{imports})\n"),
        )?;
        util::run(go().current_dir(&module).args([
            "mod",
            "init",
            &format!("{}build", tools.name),
        ]))?;
        let mut get = go();
        get.current_dir(&module).arg("get");
        for m in tools.modules {
            get.arg(format!("{m}@{}", tools.version));
        }
        util::run(&mut get)?;
    } else {
        let [main_module] = tools.modules else {
            bail!("{}: dropping imports needs exactly one module", tools.name);
        };
        copy_module(&format!("{main_module}@{}", tools.version), &module)?;
        for (file, import) in tools.drop_imports {
            let path = module.join(file);
            let text =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            if !text.contains(import) {
                bail!("{} has no import {import}", path.display());
            }
            fs::write(&path, text.replace(import, ""))?;
        }
    }
    let mut ldflags = vec!["-s".to_string(), "-w".to_string()];
    for flag in tools.version_flags {
        ldflags.push(format!("-X {}", flag.replace("{v}", tools.version)));
    }
    fs::create_dir_all(out)?;
    for (binary, package, args) in tools.binaries {
        util::run(
            go().current_dir(&module)
                .env("CGO_ENABLED", if tools.cgo { "1" } else { "0" })
                .args(["build", "-trimpath", "-ldflags", &ldflags.join(" "), "-o"])
                .arg(out.join(binary))
                .arg(package_in(tools, package)),
        )?;
        if !reports(
            &out.join(binary),
            args,
            tools.version.trim_start_matches('v'),
        ) {
            bail!("{binary} was built but does not report {}", tools.version);
        }
    }
    fs::remove_dir_all(&module)?;
    Ok(())
}

/// A writable copy of `module@version` from the module cache at `dest`,
/// without workspace files.
fn copy_module(module: &str, dest: &Path) -> Result<()> {
    let json = output(
        go().current_dir("/")
            .args(["mod", "download", "-json", module]),
    )
    .with_context(|| format!("`go mod download {module}` failed"))?;
    let cached = json_string(&json, "Dir").context("no Dir in `go mod download -json` output")?;
    if dest.exists() {
        fs::remove_dir_all(dest).with_context(|| format!("removing {}", dest.display()))?;
    }
    fs::create_dir_all(dest.parent().unwrap_or(Path::new(CACHE)))?;
    util::run(Command::new("cp").arg("-r").arg(&cached).arg(dest))?;
    util::run(Command::new("chmod").args(["-R", "u+w"]).arg(dest))?;
    for file in ["go.work", "go.work.sum"] {
        let _ = fs::remove_file(dest.join(file));
    }
    Ok(())
}

/// A package of `tools` as `go build` names it where it builds: inside a
/// copy of the module, relative to it.
fn package_in(tools: &GoTools, package: &str) -> String {
    match tools.modules {
        [module] if !tools.drop_imports.is_empty() => match package.strip_prefix(module) {
            Some(rest) => format!(".{rest}"),
            None => package.to_string(),
        },
        _ => package.to_string(),
    }
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
        .with_context(|| format!("linking {} -> {}", link.display(), target.display()))
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
