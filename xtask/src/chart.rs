//! `cargo xtask chart-check`: the Helm chart in charts/xlb lints, renders
//! for every values file in charts/xlb/ci/, every rendered object passes a
//! strict schema check, the agent accepts the config the chart renders, bad
//! values are refused, and the CRD file is what `lb-agent --print-crds`
//! prints now.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, ensure, Context, Result};

use crate::util::{cargo, describe, repo_root, run as run_cmd};

/// The Python environment setup installs kubernetes-validate into (Debian's
/// own pip refuses to install outside a venv).
pub const VENV: &str = "/opt/xlb-venv";
/// The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion: native
/// sidecars) and the newest kubernetes-validate has schemas for; rendered
/// objects must be valid for both.
const KUBE_VERSIONS: &[&str] = &["1.29.0", "1.37.0"];
const NAMESPACE: &str = "xlb-system";
/// Kinds kubernetes-validate has no schema for, checked by
/// charts/xlb/ci/validate-custom-kinds.py instead.
const CUSTOM_KINDS: &[&str] = &["LoadBalancerPool", "ServiceMonitor", "PrometheusRule"];
const CRD_FILE: &str = "crds/xlb.dev.yaml";

fn chart_dir() -> PathBuf {
    repo_root().join("charts/xlb")
}

pub fn run() -> Result<()> {
    let chart = chart_dir();
    let out = repo_root().join("target/chart-check");
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let agent = build_agent()?;
    crds_match_the_binary(&chart, &agent)?;
    versions_match_the_workspace(&chart)?;

    let values = values_files(&chart.join("ci"), "-values.yaml")?;
    ensure!(!values.is_empty(), "no values files in charts/xlb/ci");
    run_cmd(helm().arg("lint").arg(&chart)).context("helm lint")?;
    for file in &values {
        run_cmd(
            helm()
                .args(["lint", "--strict"])
                .arg(&chart)
                .arg("-f")
                .arg(file),
        )
        .context("helm lint --strict")?;
    }

    for file in &values {
        let name = file_stem(file);
        println!("--- {name}");
        let rendered = render(&chart, file)?;
        let all = out.join(format!("{name}.yaml"));
        fs::write(&all, &rendered).with_context(|| format!("writing {}", all.display()))?;

        let (custom, builtin) = split_custom_kinds(&rendered);
        let builtin_file = out.join(format!("{name}.builtin.yaml"));
        fs::write(&builtin_file, builtin)?;
        for version in KUBE_VERSIONS {
            kubernetes_validate(&builtin_file, version)?;
        }
        if !custom.is_empty() {
            let custom_file = out.join(format!("{name}.custom.yaml"));
            fs::write(&custom_file, custom)?;
            run_cmd(
                Command::new(venv_bin("python"))
                    .arg(chart.join("ci/validate-custom-kinds.py"))
                    .arg(chart.join(CRD_FILE))
                    .arg(&custom_file),
            )
            .with_context(|| format!("custom kinds rendered from {}", file.display()))?;
        }
        agent_accepts_config(&agent, &all, &out.join(format!("{name}.config.yaml")))?;
        gobgpd_accepts_config(&all, &out.join(format!("{name}.gobgpd.toml")))?;
        frr_accepts_config(&rendered, &out.join(format!("{name}.frr.conf")))?;
        alert_metrics_exist(&rendered)?;
    }

    bad_values_are_refused(&chart)?;
    println!("chart-check passed ({} values files)", values.len());
    Ok(())
}

fn helm() -> Command {
    Command::new("helm")
}

fn venv_bin(name: &str) -> PathBuf {
    Path::new(VENV).join("bin").join(name)
}

fn file_stem(path: &Path) -> String {
    path.file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.trim_end_matches(".yaml").to_string())
        .unwrap_or_default()
}

fn values_files(dir: &Path, suffix: &str) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(suffix))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Run a command, capture stdout and stderr, fail with both if it fails.
fn capture(cmd: &mut Command) -> Result<(String, String)> {
    println!("$ {}", describe(cmd));
    capture_quietly(cmd)
}

fn capture_quietly(cmd: &mut Command) -> Result<(String, String)> {
    let shown = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not start `{shown}`"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("`{shown}` failed ({}):\n{stdout}{stderr}", out.status);
    }
    Ok((stdout, stderr))
}

/// The host build of lb-agent (debug: the tests build it anyway).
fn build_agent() -> Result<PathBuf> {
    run_cmd(cargo().args(["build", "--quiet", "-p", "lb-agent", "--bin", "lb-agent"]))
        .context("building lb-agent")?;
    Ok(repo_root().join("target/debug/lb-agent"))
}

fn crds_match_the_binary(chart: &Path, agent: &Path) -> Result<()> {
    let (printed, _) = capture(Command::new(agent).arg("--print-crds"))?;
    let file = chart.join(CRD_FILE);
    let shipped =
        fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    if printed != shipped {
        bail!(
            "{} differs from what `lb-agent --print-crds` prints; regenerate it with\n  \
             cargo run -p lb-agent --bin lb-agent -- --print-crds > charts/xlb/{CRD_FILE}",
            file.display()
        );
    }
    println!("ok  {CRD_FILE} is what lb-agent --print-crds prints");
    Ok(())
}

/// The chart's version and appVersion (the image tag) follow the workspace's.
fn versions_match_the_workspace(chart: &Path) -> Result<()> {
    let workspace = workspace_version()?;
    let chart_yaml = fs::read_to_string(chart.join("Chart.yaml")).context("reading Chart.yaml")?;
    for key in ["version", "appVersion"] {
        let value = chart_yaml
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .map(|v| v.trim().trim_matches('"').to_string())
            .with_context(|| format!("no {key} in Chart.yaml"))?;
        ensure!(
            value == workspace,
            "Chart.yaml {key} is {value} but the workspace version is {workspace}"
        );
    }
    println!("ok  Chart.yaml version and appVersion are {workspace}");
    Ok(())
}

pub fn workspace_version() -> Result<String> {
    let manifest =
        fs::read_to_string(repo_root().join("Cargo.toml")).context("reading Cargo.toml")?;
    let section = manifest
        .split("[workspace.package]")
        .nth(1)
        .context("no [workspace.package] in Cargo.toml")?;
    section
        .lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.trim().strip_prefix("version"))
        .and_then(|rest| rest.trim().strip_prefix('='))
        .map(|v| v.trim().trim_matches('"').to_string())
        .context("no version in [workspace.package]")
}

fn render(chart: &Path, values: &Path) -> Result<String> {
    let (stdout, _) = capture(
        helm()
            .args(["template", "xlb"])
            .arg(chart)
            .args(["--namespace", NAMESPACE, "--include-crds"])
            .args(["--kube-version", KUBE_VERSIONS[0]])
            .arg("-f")
            .arg(values),
    )?;
    Ok(stdout)
}

/// Split a multi-document stream into (custom kinds, everything else).
fn split_custom_kinds(rendered: &str) -> (String, String) {
    let mut custom = String::new();
    let mut builtin = String::new();
    for doc in documents(rendered) {
        let kind = top_level(doc, "kind").unwrap_or_default();
        let target = if CUSTOM_KINDS.contains(&kind) {
            &mut custom
        } else {
            &mut builtin
        };
        target.push_str("---\n");
        target.push_str(doc);
        target.push('\n');
    }
    (custom, builtin)
}

fn documents(rendered: &str) -> impl Iterator<Item = &str> {
    rendered
        .split("\n---")
        .map(|d| d.trim_start_matches("---").trim_matches('\n'))
        .filter(|d| top_level(d, "kind").is_some())
}

fn top_level<'a>(doc: &'a str, key: &str) -> Option<&'a str> {
    doc.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// Strict: unknown fields are errors. It only warns about kinds it has no
/// schema for, so those warnings are checked here: only custom kinds may be
/// unknown to it, and they must not reach it.
fn kubernetes_validate(file: &Path, version: &str) -> Result<()> {
    let (stdout, stderr) = capture(
        Command::new(venv_bin("kubernetes-validate"))
            .args(["--strict", "--quiet", "-k", version])
            .arg(file),
    )?;
    let output = format!("{stdout}{stderr}");
    if let Some(line) = output
        .lines()
        .find(|l| l.contains("Couldn't find schema") || l.contains("ERROR"))
    {
        bail!("kubernetes-validate {version}: {line}");
    }
    println!("ok  {} valid for Kubernetes {version}", file.display());
    Ok(())
}

/// What a Python one-liner prints from the rendered objects (PyYAML parses
/// the stream the way the API server would).
fn extract(rendered: &Path, script: &str) -> Result<String> {
    let (stdout, _) = capture_quietly(
        Command::new(venv_bin("python"))
            .args(["-c", script])
            .arg(rendered),
    )?;
    Ok(stdout)
}

fn config_map_entry(rendered: &Path, key: &str) -> Result<String> {
    extract(
        rendered,
        &format!(
            "import sys, yaml\n\
             for d in yaml.safe_load_all(open(sys.argv[1])):\n    \
                 if d and d['kind'] == 'ConfigMap' and {key:?} in d.get('data', {{}}):\n        \
                     sys.stdout.write(d['data'][{key:?}])\n"
        ),
    )
}

/// The rendered agent config passes the agent's own parser (`--check`).
fn agent_accepts_config(agent: &Path, rendered: &Path, out: &Path) -> Result<()> {
    let config = config_map_entry(rendered, "config.yaml")?;
    ensure!(
        !config.is_empty(),
        "no config.yaml in the rendered ConfigMaps"
    );
    fs::write(out, config)?;
    capture(Command::new(agent).arg("--check").arg(out))
        .context("lb-agent refuses the config the chart renders")?;
    println!("ok  lb-agent --check {}", out.display());
    Ok(())
}

/// gobgpd parses its rendered file (after the sidecar's router-id substitution).
fn gobgpd_accepts_config(rendered: &Path, out: &Path) -> Result<()> {
    let config = config_map_entry(rendered, "gobgpd.toml")?;
    if config.is_empty() {
        return Ok(());
    }
    ensure!(
        config.contains("@ROUTER_ID@"),
        "gobgpd.toml has no @ROUTER_ID@ for the sidecar to replace"
    );
    fs::write(out, config.replace("@ROUTER_ID@", "192.0.2.1"))?;
    capture(
        Command::new("gobgpd")
            .args(["--dry-run", "--config-type=toml", "--config-file"])
            .arg(out),
    )
    .context("gobgpd refuses the file the chart renders")?;
    println!("ok  gobgpd --dry-run {}", out.display());
    Ok(())
}

/// FRR's bgpd parses the first frr.conf the FRR sidecar writes (the
/// here-document in its start script, after the router-id substitution).
/// `bgpd --dryrun` exits 0 either way, so its complaints are what fail.
fn frr_accepts_config(rendered: &str, out: &Path) -> Result<()> {
    let mut lines = rendered.lines();
    if !lines.any(|l| l.contains("> frr.conf <<'EOF'")) {
        return Ok(());
    }
    let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "EOF").collect();
    let indent = body
        .iter()
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    let config: String = body.iter().map(|l| format!("{}\n", &l[indent..])).collect();
    ensure!(
        config.contains("@ROUTER_ID@"),
        "the FRR sidecar's frr.conf has no @ROUTER_ID@ for it to replace"
    );
    fs::write(out, config.replace("@ROUTER_ID@", "192.0.2.1"))?;
    let scratch = out.with_extension("vty");
    fs::create_dir_all(&scratch)?;
    let (stdout, stderr) = capture(
        Command::new("/usr/lib/frr/bgpd")
            .args(["--dryrun", "--skip_runas", "--vty_socket"])
            .arg(&scratch)
            .arg("-f")
            .arg(out),
    )
    .context("bgpd --dryrun")?;
    let said = format!("{stdout}{stderr}");
    ensure!(
        !said.contains("[EC "),
        "bgpd refuses the frr.conf the chart renders ({}):\n{said}",
        out.display()
    );
    println!("ok  bgpd --dryrun {}", out.display());
    Ok(())
}

/// Every xlb_* series an alert uses is one the agent exports (a renamed
/// metric would otherwise silence its alert).
fn alert_metrics_exist(rendered: &str) -> Result<()> {
    let Some(rule) = documents(rendered).find(|d| top_level(d, "kind") == Some("PrometheusRule"))
    else {
        return Ok(());
    };
    let used: BTreeSet<&str> = rule
        .lines()
        .filter(|l| l.trim_start().starts_with("expr:"))
        .flat_map(|l| {
            l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("xlb_"))
        })
        .collect();
    let sources = agent_sources()?;
    for metric in &used {
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| metric.strip_suffix(s))
            .unwrap_or(metric);
        ensure!(
            sources.contains(&format!("\"{family}\"")),
            "the PrometheusRule uses {metric}, which lb-agent/src does not define"
        );
    }
    println!("ok  alerts use metrics the agent exports: {used:?}");
    Ok(())
}

fn agent_sources() -> Result<String> {
    let mut text = String::new();
    let mut dirs = vec![repo_root().join("lb-agent/src")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                text += &fs::read_to_string(&path)?;
            }
        }
    }
    Ok(text)
}

/// Each file in ci/invalid/ starts with `# expect: TEXT`; helm must refuse
/// it with an error containing TEXT (the schema's or the templates' message).
fn bad_values_are_refused(chart: &Path) -> Result<()> {
    let files = values_files(&chart.join("ci/invalid"), ".yaml")?;
    ensure!(!files.is_empty(), "no files in charts/xlb/ci/invalid");
    for file in &files {
        let text = fs::read_to_string(file)?;
        let expected = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect:"))
            .map(str::trim)
            .with_context(|| format!("{} does not start with `# expect: TEXT`", file.display()))?;
        let mut cmd = helm();
        cmd.args(["template", "xlb"])
            .arg(chart)
            .args(["--namespace", NAMESPACE, "--kube-version", KUBE_VERSIONS[0]])
            .arg("-f")
            .arg(file);
        let shown = describe(&cmd);
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("could not start `{shown}`"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success(),
            "`{shown}` accepted values it must refuse"
        );
        ensure!(
            stderr.contains(expected),
            "`{shown}` refused the values, but not with {expected:?}:\n{stderr}"
        );
        println!("ok  refused {}: {expected}", file.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const RENDERED: &str = "---\n# Source: a.yaml\napiVersion: v1\nkind: ConfigMap\n\
        metadata:\n  name: a\n---\n# Source: b.yaml\napiVersion: xlb.dev/v1alpha1\n\
        kind: LoadBalancerPool\nmetadata:\n  name: p\nspec:\n  addresses: [\"192.0.2.0/24\"]\n\
        ---\n# Source: empty.yaml\n";

    #[test]
    fn custom_kinds_are_split_from_builtin_ones() {
        let (custom, builtin) = split_custom_kinds(RENDERED);
        assert!(custom.contains("kind: LoadBalancerPool") && !custom.contains("ConfigMap"));
        assert!(builtin.contains("kind: ConfigMap") && !builtin.contains("LoadBalancerPool"));
        // The empty document (a template that rendered nothing) is dropped.
        assert_eq!(documents(RENDERED).count(), 2);
    }

    #[test]
    fn nested_kind_keys_do_not_count_as_the_objects_kind() {
        let doc = "apiVersion: v1\nkind: ConfigMap\ndata:\n  kind: LoadBalancerPool\n";
        assert_eq!(top_level(doc, "kind"), Some("ConfigMap"));
    }

    #[test]
    fn workspace_version_is_read() {
        let version = workspace_version().unwrap();
        assert!(version.split('.').count() == 3, "{version}");
    }
}
