use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, output, succeeds};

/// Debian packages the tests, demo and benchmarks call out to.
const PACKAGES: &[&str] = &[
    "bpftool",
    "iproute2",
    "ethtool",
    "tcpdump",
    "python3-scapy",
    "nginx",
    "libnginx-mod-stream",
    "wrk",
    "iperf3",
    "socat",
    "netcat-openbsd",
    "iptables",
    "nftables",
    "haproxy",
    "hping3",
    "curl",
    // BGP speakers and a router for the ECMP issue.
    "bird2",
    "exabgp",
    "gobgpd",
    "frr",
    "protobuf-compiler",
    // Container images (cargo xtask image): buildah, musl-gcc for ring's C
    // code in the static build, a static shell for the images.
    "buildah",
    "musl-tools",
    "busybox-static",
    // A venv for kubernetes-validate (cargo xtask chart-check).
    "python3-venv",
    // Real nodes (tests/src/nodes.rs): the OCI runtime and CNI plugins that
    // run Pods under the containerd built by kube.rs, and what kube-proxy calls.
    "runc",
    "containernetworking-plugins",
    "conntrack",
];

/// Kept with the binary: bpf-linker has an rpath to the libLLVM symlinks here.
const LLVM_PREFIX: &str = "/opt/xlb-llvm";
/// The release known to build against the LLVM 22 inside these toolchains;
/// pinned so a newer release cannot break a fresh machine.
const BPF_LINKER_VERSION: &str = "0.13.0";
const BPFFS: &str = "/sys/fs/bpf";
/// machine.md: the release that builds here with `go install`.
const HELM_MODULE: &str = "helm.sh/helm/v3/cmd/helm@v3.16.4";
const HELM_VERSION: &str = "v3.16.4";
/// Pinned: its version is also the newest Kubernetes it ships schemas for.
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

fn ok(item: &str) {
    println!("ok          {item}");
}

fn installing(item: &str) {
    println!("installing  {item}");
}

/// Idempotent: each item is checked first and only installed when missing.
pub fn run() -> Result<()> {
    ensure_root()?;
    debian_packages()?;
    stable_components()?;
    nightly_rust_src()?;
    bpf_linker()?;
    bpffs()?;
    musl_target()?;
    helm()?;
    kubernetes_validate()?;
    Ok(())
}

fn ensure_root() -> Result<()> {
    // Read the effective uid from /proc to avoid a libc dependency for one call.
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .context("no Uid line in /proc/self/status")?;
    if euid != "0" {
        bail!(
            "cargo xtask must run as root (effective uid is {euid}): it installs packages, \
             mounts bpffs and loads XDP programs"
        );
    }
    Ok(())
}

fn debian_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .copied()
        .filter(|pkg| {
            let installed = output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
                .is_some_and(|s| s.contains("install ok installed"));
            if installed {
                ok(pkg);
            } else {
                installing(pkg);
            }
            !installed
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    // The package lists on a fresh machine are empty or stale; refresh only when needed.
    util::run(Command::new("apt-get").arg("update"))?;
    util::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y"])
            .args(&missing),
    )?;
    Ok(())
}

/// rust-toolchain.toml lists rustfmt and clippy, but RUSTUP_AUTO_INSTALL=0
/// stops rustup from adding them by itself.
fn stable_components() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "stable",
    ]))
    .unwrap_or_default();
    for component in ["rustfmt", "clippy"] {
        let item = format!("{component} (stable)");
        if installed.lines().any(|l| l.starts_with(component)) {
            ok(&item);
        } else {
            installing(&item);
            util::run(Command::new("rustup").args([
                "component",
                "add",
                component,
                "--toolchain",
                "stable",
            ]))?;
        }
    }
    Ok(())
}

fn nightly_sysroot() -> Result<PathBuf> {
    let out = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))
        .context("`rustc +nightly --print sysroot` failed; is the nightly toolchain installed?")?;
    Ok(PathBuf::from(out.trim()))
}

/// `-Z build-std=core` for the eBPF crate needs the standard library sources.
fn nightly_rust_src() -> Result<()> {
    let item = "rust-src (nightly)";
    let library = nightly_sysroot()?.join("lib/rustlib/src/rust/library");
    if library.is_dir() {
        ok(item);
        return Ok(());
    }
    installing(item);
    util::run(Command::new("rustup").args([
        "component",
        "add",
        "rust-src",
        "--toolchain",
        "nightly",
    ]))
}

/// No prebuilt bpf-linker is reachable, so build it against the libLLVM that
/// ships inside the nightly toolchain (same LLVM major as rustc emits).
fn bpf_linker() -> Result<()> {
    let item = "bpf-linker";
    // Also catches a binary whose libLLVM symlink went stale after a toolchain update.
    if succeeds(Command::new("bpf-linker").arg("--version")) {
        ok(item);
        return Ok(());
    }
    installing(item);

    let lib_dir = nightly_sysroot()?.join("lib");
    let libllvm = find_libllvm(&lib_dir)?;
    let prefix_lib = Path::new(LLVM_PREFIX).join("lib");
    fs::create_dir_all(&prefix_lib)
        .with_context(|| format!("creating {}", prefix_lib.display()))?;
    let name = libllvm
        .file_name()
        .context("libLLVM path has no file name")?;
    for link in [prefix_lib.join("libLLVM.so"), prefix_lib.join(name)] {
        symlink_force(&libllvm, &link)?;
    }

    // Run from / on stable so the workspace's rust-toolchain.toml plays no part.
    util::run(
        Command::new("cargo")
            .current_dir("/")
            .env("RUSTUP_TOOLCHAIN", "stable")
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--no-default-features",
                "--features",
                "llvm-22",
            ]),
    )?;

    if !succeeds(Command::new("bpf-linker").arg("--version")) {
        bail!(
            "bpf-linker was installed but `bpf-linker --version` fails; is ~/.cargo/bin on PATH?"
        );
    }
    Ok(())
}

fn find_libllvm(lib_dir: &Path) -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = fs::read_dir(lib_dir)
        .with_context(|| format!("reading {}", lib_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .collect();
    candidates.sort();
    candidates
        .into_iter()
        .next()
        .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))
}

/// `ln -sf`: replace whatever is at `link`, including a dangling symlink.
fn symlink_force(target: &Path, link: &Path) -> Result<()> {
    if link.symlink_metadata().is_ok() {
        fs::remove_file(link).with_context(|| format!("removing {}", link.display()))?;
    }
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("linking {} -> {}", link.display(), target.display()))
}

fn bpffs() -> Result<()> {
    let item = "bpffs on /sys/fs/bpf";
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    let mounted = mounts.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&BPFFS) && fields.get(2) == Some(&"bpf")
    });
    if mounted {
        ok(item);
        return Ok(());
    }
    installing(item);
    util::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
}

/// The agent's image holds static binaries built for musl.
fn musl_target() -> Result<()> {
    let target = crate::image::MUSL_TARGET;
    let item = format!("rust target {target} (stable)");
    let installed = output(Command::new("rustup").args([
        "target",
        "list",
        "--installed",
        "--toolchain",
        "stable",
    ]))
    .unwrap_or_default();
    if installed.lines().any(|l| l.trim() == target) {
        ok(&item);
        return Ok(());
    }
    installing(&item);
    util::run(Command::new("rustup").args(["target", "add", target, "--toolchain", "stable"]))
}

/// No helm package is reachable; it builds from the Go module proxy.
fn helm() -> Result<()> {
    let item = format!("helm {HELM_VERSION}");
    let version = output(Command::new("helm").args(["version", "--short"])).unwrap_or_default();
    if version.starts_with(HELM_VERSION) {
        ok(&item);
        return Ok(());
    }
    installing(&item);
    util::run(
        Command::new("go")
            .current_dir("/")
            .env("GOBIN", "/usr/local/bin")
            .args(["install", HELM_MODULE]),
    )
}

/// Debian's pip refuses system-wide installs, so it goes into its own venv.
fn kubernetes_validate() -> Result<()> {
    let venv = Path::new(crate::chart::VENV);
    let item = format!("{KUBERNETES_VALIDATE} in {}", venv.display());
    let wanted = KUBERNETES_VALIDATE.rsplit("==").next().unwrap_or_default();
    let version = output(Command::new(venv.join("bin/kubernetes-validate")).arg("--version"))
        .unwrap_or_default();
    if version.trim() == wanted {
        ok(&item);
        return Ok(());
    }
    installing(&item);
    if !venv.join("bin/python").exists() {
        // Debian's interpreter, not whatever python3 comes first on PATH.
        util::run(
            Command::new("/usr/bin/python3")
                .args(["-m", "venv"])
                .arg(venv),
        )?;
    }
    util::run(Command::new(venv.join("bin/pip")).args(["install", "--quiet", KUBERNETES_VALIDATE]))
}
