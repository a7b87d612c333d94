//! `cargo xtask image`: the container images the Helm chart points at, built
//! with buildah (no registry is reachable, so both start from scratch):
//!
//! - `localhost/xlb-agent:<version>` (also tagged `xlb-agent:dev`) from
//!   lb-agent/Containerfile: static musl builds of lb-agent and lbctl;
//! - `localhost/xlb-gobgpd:<version>`: Debian's gobgpd and gobgp with the C
//!   library they link against, for the chart's BGP sidecar;
//! - `localhost/xlb-bird:<version>`: Debian's BIRD 2 (bird, birdc) and its
//!   libraries, for the chart's BIRD sidecar (`bgpSpeaker.speaker: bird`);
//! - `localhost/xlb-frr:<version>`: Debian's FRR (zebra, bgpd, bfdd, vtysh)
//!   for the chart's FRR sidecar (`bgpSpeaker.speaker: frr`), with a copy of
//!   vtysh that runs through its own loader, which the sidecar hands to the
//!   agent (whose image has no C library).
//!
//! - `localhost/xlb-pause:<version>` and `localhost/xlb-backend:<version>`
//!   from tests/images: the Pod sandbox and the HTTP/UDP backend the
//!   real-node tests run (tests/src/nodes.rs).
//!
//! Then each image is checked by running its binaries inside it, and saved
//! as an OCI archive in target/image/oci/<name>.tar, which the real-node
//! tests import into each node's containerd.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

use crate::chart::workspace_version;
use crate::util::{cargo, output, repo_root, run as run_cmd};

pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";
/// Debian's busybox-static: a shell for the init container and for debugging.
pub const BUSYBOX: &str = "/bin/busybox";
const GOBGP_BINARIES: &[&str] = &["/usr/bin/gobgpd", "/usr/bin/gobgp"];
const BIRD_BINARIES: &[&str] = &["/usr/sbin/bird", "/usr/sbin/birdc"];
const FRR_BINARIES: &[&str] = &[
    "/usr/lib/frr/zebra",
    "/usr/lib/frr/bgpd",
    "/usr/lib/frr/bfdd",
    "/usr/bin/vtysh",
];
/// Where the FRR image keeps the vtysh it hands to the agent: the binary,
/// every library it loads and the loader, in one directory.
const FRR_AGENT_VTYSH: &str = "opt/xlb-vtysh";

/// buildah with the settings this machine needs: vfs storage (no overlay
/// in a container) and chroot isolation (no user namespaces for runc).
fn buildah() -> Command {
    let mut cmd = Command::new("buildah");
    cmd.args(["--storage-driver", "vfs"]);
    cmd
}

pub fn run() -> Result<()> {
    let version = workspace_version()?;
    let context = repo_root().join("target/image");
    agent_image(&version, &context.join("agent"))?;
    gobgpd_image(&version, &context.join("gobgpd"))?;
    bird_image(&version, &context.join("bird"))?;
    frr_image(&version, &context.join("frr"))?;
    test_images(&version, &context.join("test"))?;
    let archives = context.join("oci");
    fresh_dir(&archives)?;
    for name in IMAGES {
        let image = format!("localhost/{name}:{version}");
        let archive = archives.join(format!("{name}.tar"));
        run_cmd(
            buildah()
                .args(["push", "--quiet", &image])
                .arg(format!("oci-archive:{}:{image}", archive.display())),
        )
        .with_context(|| format!("saving {image} as {}", archive.display()))?;
    }
    println!(
        "images built and checked: {} (tag {version}); OCI archives in {}",
        IMAGES.join(", "),
        archives.display()
    );
    Ok(())
}

/// Every image this command builds, as `localhost/<name>:<version>`.
const IMAGES: &[&str] = &[
    "xlb-agent",
    "xlb-gobgpd",
    "xlb-bird",
    "xlb-frr",
    "xlb-pause",
    "xlb-backend",
];

/// The pause and backend images: one static binary each, FROM scratch.
fn test_images(version: &str, context: &Path) -> Result<()> {
    run_cmd(
        cargo()
            .args([
                "build",
                "--release",
                "-p",
                "xlb-test-images",
                "--bins",
                "--target",
            ])
            .arg(MUSL_TARGET),
    )
    .context("building the test images' programs for musl")?;
    let bin_dir = repo_root().join("target").join(MUSL_TARGET).join("release");
    fresh_dir(context)?;
    for (name, binary) in [("xlb-pause", "pause"), ("xlb-backend", "backend")] {
        let image = format!("localhost/{name}:{version}");
        remove_previous(&[&image]);
        let staged = context.join(binary);
        ensure_static(&bin_dir.join(binary))?;
        copy(&bin_dir.join(binary), &staged)?;
        let container = format!("{name}-build-{}", std::process::id());
        run_cmd(buildah().args(["from", "--name", &container, "scratch"]))?;
        let result = (|| {
            run_cmd(
                buildah()
                    .arg("copy")
                    .arg(&container)
                    .arg(&staged)
                    .arg(format!("/{binary}")),
            )?;
            run_cmd(buildah().args([
                "config",
                "--entrypoint",
                &format!(r#"["/{binary}"]"#),
                "--label",
                &format!("org.opencontainers.image.version={version}"),
                &container,
            ]))?;
            run_cmd(buildah().args(["commit", "--rm", &container, &image]))
        })();
        if result.is_err() {
            let _ = buildah().args(["rm", &container]).status();
        }
        result.with_context(|| format!("building {image}"))?;
    }
    Ok(())
}

fn agent_image(version: &str, context: &Path) -> Result<()> {
    // build.rs also builds the XDP object (nightly, bpfel) and the gRPC stubs
    // (protoc); ring's C and assembly parts are compiled with musl-gcc.
    run_cmd(
        cargo()
            .env(format!("CC_{}", MUSL_TARGET.replace('-', "_")), "musl-gcc")
            .args(["build", "--release", "-p", "lb-agent", "--bins", "--target"])
            .arg(MUSL_TARGET),
    )
    .context("building lb-agent and lbctl for musl")?;
    let bin_dir = repo_root().join("target").join(MUSL_TARGET).join("release");

    fresh_dir(context)?;
    for name in ["lb-agent", "lbctl"] {
        let binary = bin_dir.join(name);
        ensure_static(&binary)?;
        copy(&binary, &context.join(name))?;
    }
    ensure_static(Path::new(BUSYBOX))?;
    copy(Path::new(BUSYBOX), &context.join("busybox"))?;

    let image = format!("localhost/xlb-agent:{version}");
    remove_previous(&[&image, "localhost/xlb-agent:dev"]);
    run_cmd(
        buildah()
            .args(["bud", "--isolation", "chroot", "--layers=false"])
            .arg("--build-arg")
            .arg(format!("VERSION={version}"))
            .arg("-f")
            .arg(repo_root().join("lb-agent/Containerfile"))
            .args(["-t", &image, "-t", "xlb-agent:dev"])
            .arg(context),
    )
    .context("building the agent image")?;

    in_container(&image, |run| {
        let out = run(&["lb-agent", "--version"])?;
        ensure!(
            out.contains(&format!("lb-agent {version}")),
            "`lb-agent --version` in the image printed {out:?}"
        );
        let out = run(&["lbctl", "--help"])?;
        ensure!(out.contains("Usage"), "`lbctl --help` printed {out:?}");
        let out = run(&["lb-agent", "--print-crds"])?;
        ensure!(out.contains("loadbalancerpools.xlb.dev"), "{out}");
        // busybox's shell, for `kubectl exec` into the agent.
        run(&[
            "sh",
            "-c",
            "set -e; for i in \"$@\"; do echo \"$i\"; done",
            "sh",
            "eth0",
        ])?;
        Ok(())
    })
}

/// An image of Debian's `binaries`, the libraries they link against,
/// busybox (a shell, for the chart's start scripts) and the files staged
/// under `root` (at the same paths), FROM scratch.
fn debian_binaries_image(
    image: &str,
    binaries: &[&str],
    root: &Path,
    entrypoint: &str,
    description: &str,
) -> Result<()> {
    remove_previous(&[image]);
    let container = format!("xlb-image-build-{}", std::process::id());
    run_cmd(buildah().args(["from", "--name", &container, "scratch"]))?;
    let result = (|| {
        let mut files: Vec<PathBuf> = binaries.iter().map(PathBuf::from).collect();
        for binary in binaries {
            files.extend(shared_libraries(Path::new(binary))?);
        }
        files.push(PathBuf::from(BUSYBOX));
        files.sort();
        files.dedup();
        for file in &files {
            // The same path inside the image, so the binaries' interpreter
            // path and the loader's search paths hold; the content from the
            // end of any symlink chain (/lib64/ld-linux-x86-64.so.2 is one).
            let source =
                fs::canonicalize(file).with_context(|| format!("resolving {}", file.display()))?;
            run_cmd(buildah().arg("copy").arg(&container).arg(source).arg(file))?;
        }
        if fs::read_dir(root)?.next().is_some() {
            run_cmd(buildah().arg("copy").arg(&container).arg(root).arg("/"))?;
        }
        run_cmd(buildah().args([
            "run",
            "--isolation",
            "chroot",
            &container,
            "--",
            BUSYBOX,
            "--install",
            "-s",
            "/bin",
        ]))?;
        let version = image.rsplit(':').next().unwrap_or_default();
        run_cmd(buildah().args([
            "config",
            "--env",
            "PATH=/usr/sbin:/usr/bin:/bin",
            "--entrypoint",
            &format!(r#"["{entrypoint}"]"#),
            "--label",
            &format!("org.opencontainers.image.version={version}"),
            "--label",
            &format!("org.opencontainers.image.description={description}"),
            &container,
        ]))?;
        run_cmd(buildah().args(["commit", "--rm", &container, image]))
    })();
    if result.is_err() {
        let _ = buildah().args(["rm", &container]).status();
    }
    result.with_context(|| format!("building {image}"))
}

fn bird_image(version: &str, context: &Path) -> Result<()> {
    fresh_dir(context)?;
    let image = format!("localhost/xlb-bird:{version}");
    debian_binaries_image(
        &image,
        BIRD_BINARIES,
        context,
        "/usr/sbin/bird",
        "Debian's BIRD 2 for xlb's BGP sidecar",
    )?;
    in_container(&image, |run| {
        // The sidecar's start (charts/xlb/templates/daemonset.yaml): the
        // agent's files created empty, then a config that includes them
        // parses.
        let out = run(&[
            "sh",
            "-c",
            "set -e; mkdir -p /run/xlb-bird; cd /run/xlb-bird; \
             touch xlb-vips4 xlb-vips6 bird-peers; \
             printf 'router id 192.0.2.7;\nprotocol device {}\n\
             protocol static xlb_vips4 {\n  ipv4;\n  include \"/run/xlb-bird/xlb-vips4\";\n}\n\
             protocol static xlb_vips6 {\n  ipv6;\n  include \"/run/xlb-bird/xlb-vips6\";\n}\n\
             include \"/run/xlb-bird/bird-peers\";\n' > bird.conf; \
             bird -p -c bird.conf && echo parsed; bird --version 2>&1; \
             birdc -s /run/xlb-bird/none show status 2>&1 || true",
        ])?;
        ensure!(
            out.contains("parsed")
                && out.contains("BIRD version 2")
                && out.contains("Unable to connect"),
            "{out}"
        );
        Ok(())
    })
}

/// FRR for the chart's sidecar. Its daemons run as root (the agent, root
/// without CAP_DAC_OVERRIDE, must reach their vty sockets and they must
/// read the frr.conf the agent's vtysh saves), and FRR insists root be in
/// its vty group. The agent's vtysh looks itself up as root too.
fn frr_image(version: &str, context: &Path) -> Result<()> {
    fresh_dir(context)?;
    let etc = context.join("etc");
    fs::create_dir_all(&etc)?;
    fs::write(etc.join("passwd"), "root:x:0:0:root:/:/bin/sh\n")?;
    fs::write(etc.join("group"), "root:x:0:\nfrrvty:x:85:root\n")?;
    // FRR's crash logs; the chart mounts a volume here (read-only root).
    fs::create_dir_all(context.join("var/tmp/frr"))?;
    let vtysh = context.join(FRR_AGENT_VTYSH);
    fs::create_dir_all(&vtysh)?;
    for lib in shared_libraries(Path::new("/usr/bin/vtysh"))? {
        let name = lib.file_name().context("a library without a name")?;
        copy(&fs::canonicalize(&lib)?, &vtysh.join(name))?;
    }
    copy(Path::new("/usr/bin/vtysh"), &vtysh.join("vtysh.bin"))?;
    let wrapper = vtysh.join("vtysh");
    // Run from wherever the directory is copied to.
    fs::write(
        &wrapper,
        "#!/bin/sh\n\
         # FRR's vtysh with its own loader and libraries (the agent's image has no C library).\n\
         d=$(dirname \"$0\")\n\
         exec \"$d/ld-linux-x86-64.so.2\" --library-path \"$d\" \"$d/vtysh.bin\" \"$@\"\n",
    )?;
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755))?;

    let image = format!("localhost/xlb-frr:{version}");
    debian_binaries_image(
        &image,
        FRR_BINARIES,
        context,
        "/usr/lib/frr/bgpd",
        "Debian's FRR (zebra, bgpd, bfdd, vtysh) for xlb's BGP sidecar",
    )?;
    in_container(&image, |run| {
        let out = run(&["/usr/lib/frr/bgpd", "--version"])?;
        ensure!(out.contains("bgpd version"), "{out:?}");
        for daemon in ["zebra", "bfdd"] {
            run(&[&format!("/usr/lib/frr/{daemon}"), "--version"])?;
        }
        // The agent's copy runs from where it is copied to, and finds no
        // daemon there.
        let out = run(&[
            "sh",
            "-c",
            &format!(
                "set -e; mkdir -p /tmp/v /tmp/s; cp -a /{FRR_AGENT_VTYSH}/. /tmp/v/; \
                 printf 'username root nopassword\\n' > /tmp/s/vtysh.conf; \
                 /tmp/v/vtysh --vty_socket /tmp/s --config_dir /tmp/s -c 'show version' 2>&1 || true"
            ),
        ])?;
        ensure!(out.contains("failed to connect to any daemons"), "{out}");
        Ok(())
    })
}

fn gobgpd_image(version: &str, context: &Path) -> Result<()> {
    fresh_dir(context)?;
    let image = format!("localhost/xlb-gobgpd:{version}");
    debian_binaries_image(
        &image,
        GOBGP_BINARIES,
        context,
        "/usr/bin/gobgpd",
        "Debian's gobgpd for xlb's BGP sidecar",
    )?;

    in_container(&image, |run| {
        let out = run(&["gobgpd", "--version"])?;
        ensure!(out.contains("gobgpd version"), "{out:?}");
        run(&["gobgp", "--help"])?;
        // The sidecar's start: the router id substituted with sed, then a
        // config file gobgpd accepts.
        let out = run(&[
            "sh",
            "-c",
            "set -e; mkdir -p /tmp/g; \
             printf '[global.config]\\n  as = 64512\\n  router-id = \"@ROUTER_ID@\"\\n  port = -1\\n' > /tmp/g/in.toml; \
             sed \"s/@ROUTER_ID@/$ROUTER_ID/\" /tmp/g/in.toml > /tmp/g/gobgpd.toml; \
             cat /tmp/g/gobgpd.toml; gobgpd --dry-run --config-type=toml --config-file=/tmp/g/gobgpd.toml",
        ])?;
        ensure!(out.contains("router-id = \"192.0.2.7\""), "{out}");
        Ok(())
    })
}

/// Run checks in a working container of `image`, removed afterwards.
fn in_container(
    image: &str,
    checks: impl FnOnce(&dyn Fn(&[&str]) -> Result<String>) -> Result<()>,
) -> Result<()> {
    let container = format!("xlb-image-check-{}", std::process::id());
    run_cmd(buildah().args(["from", "--name", &container, image]))?;
    let run = |argv: &[&str]| -> Result<String> {
        let mut cmd = buildah();
        cmd.args([
            "run",
            "--isolation",
            "chroot",
            "--env",
            "ROUTER_ID=192.0.2.7",
        ])
        .arg(&container)
        .arg("--")
        .args(argv);
        println!("$ (in {image}) {}", argv.join(" "));
        let out = cmd
            .output()
            .with_context(|| format!("could not start buildah run for {argv:?}"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            bail!("{argv:?} failed in {image} ({}):\n{text}", out.status);
        }
        Ok(text)
    };
    let result = checks(&run);
    run_cmd(buildah().args(["rm", &container]))?;
    result.with_context(|| format!("checking {image}"))?;
    println!("ok  {image} runs its binaries");
    Ok(())
}

/// vfs storage keeps a full copy per image: drop the last build's before
/// tagging a new one, so repeated runs do not pile up untagged images.
/// (Absent images, or ones a container still uses, are left alone.)
fn remove_previous(images: &[&str]) {
    for image in images {
        let _ = crate::util::succeeds(buildah().args(["rmi", image]));
    }
}

fn ensure_static(binary: &Path) -> Result<()> {
    let description = output(Command::new("file").arg("-L").arg(binary))
        .with_context(|| format!("`file {}` failed", binary.display()))?;
    if !(description.contains("statically linked") || description.contains("static-pie linked")) {
        bail!(
            "{} is not statically linked: {description}",
            binary.display()
        );
    }
    Ok(())
}

/// The libraries (and loader) `ldd` says a binary loads.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = output(Command::new("ldd").arg(binary))
        .with_context(|| format!("`ldd {}` failed", binary.display()))?;
    Ok(out
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; linux-vdso has no file.
            let path = line.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

fn fresh_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to)
        .map(|_| ())
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}
