//! The docs are a contract: every config field, annotation, Helm value,
//! metric and command line (lbctl's subcommands and flags, lb-agent's
//! flags) that README.md, docs/ or the chart's own files name exists.
//! Config fields are checked with the agent's parser (which refuses
//! unknown fields), Helm values against values.yaml and the templates,
//! commands against their `--help`, metrics and annotations against the
//! agent's source.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use lb_agent::config::AgentConfig;
use xlb_tests::topology::{agent_bin, lbctl_bin, workspace_root};

/// A text that names things, by its path from the workspace root.
struct Doc {
    path: String,
    text: String,
}

impl Doc {
    /// Inline code spans (`like this`) outside fenced blocks, and every
    /// line of a fenced block, with their line numbers.
    fn code(&self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        let mut fenced = false;
        for (i, line) in self.text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if fenced {
                out.push((i + 1, line.to_string()));
                continue;
            }
            let mut parts = line.split('`');
            parts.next();
            while let (Some(span), Some(_)) = (parts.next(), parts.next()) {
                out.push((i + 1, span.to_string()));
            }
        }
        out
    }

    fn at(&self, line: usize) -> String {
        format!("{}:{line}", self.path)
    }
}

/// README.md, docs/*.md and the chart's values.yaml, templates and CRDs.
fn docs() -> Vec<Doc> {
    let root = workspace_root();
    let mut paths = vec![root.join("README.md"), root.join("charts/xlb/values.yaml")];
    for dir in ["docs", "charts/xlb/templates", "charts/xlb/crds"] {
        let mut found: Vec<PathBuf> = fs::read_dir(root.join(dir))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("md" | "yaml" | "tpl" | "json")
                )
            })
            .collect();
        found.sort();
        paths.extend(found);
    }
    paths
        .into_iter()
        .map(|p| Doc {
            path: p.strip_prefix(&root).unwrap().display().to_string(),
            text: fs::read_to_string(&p).unwrap(),
        })
        .collect()
}

/// The text of every `.rs` file under `dir`.
fn source(dir: &Path) -> String {
    let mut text = String::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            text.push_str(&source(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            text.push_str(&fs::read_to_string(&p).unwrap());
        }
    }
    text
}

/// The words of `text` made of `[a-z0-9_]` after `prefix` (`xlb_` finds
/// `xlb_service_packets_total`), with the first line each is on.
fn words_after(text: &str, prefix: &str, more: &[char]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            let before = rest[..at].chars().last();
            let tail = &rest[at + prefix.len()..];
            let len = tail
                .find(|c: char| {
                    !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || more.contains(&c))
                })
                .unwrap_or(tail.len());
            let word = tail[..len].trim_end_matches(['.', '-']);
            if !word.is_empty() && !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                out.entry(format!("{prefix}{word}")).or_insert(i + 1);
            }
            rest = &tail[len..];
        }
    }
    out
}

/// Where the docs are wrong: one line per claim.
#[derive(Default)]
struct Findings(Vec<String>);

impl Findings {
    fn add(&mut self, s: String) {
        self.0.push(s);
    }

    fn assert_none(self, what: &str) {
        assert!(
            self.0.is_empty(),
            "{} {what} named in the docs do not exist:\n{}",
            self.0.len(),
            self.0.join("\n")
        );
    }
}

// ---- config fields ----

/// The config file's sections in docs/config.md, by heading: the path their
/// field tables' rows are under. A heading with a field table must be here.
const CONFIG_SECTIONS: &[(&str, &str)] = &[
    ("## Top level", ""),
    ("### `timeouts`", "timeouts"),
    ("## Load-aware balancing", "load_aware"),
    ("## Services", "services[]"),
    ("### Backends", "services[].backends[]"),
    ("### `health_check`", "services[].health_check"),
    ("## `bgp`", "bgp"),
    ("## `l2`", "l2"),
    ("## `flow_sync`", "flow_sync"),
    ("## `kubernetes`", "kubernetes"),
];

/// Whether the agent's parser knows the field at `path` (`bgp.peers[].asn`):
/// a file setting it is refused for anything but an unknown field.
fn config_knows(path: &str) -> Result<(), String> {
    let mut yaml = String::from("\"x\"");
    for seg in path.rsplit('.') {
        yaml = match seg.strip_suffix("[]") {
            Some(name) => format!("{{\"{name}\": [{yaml}]}}"),
            None => format!("{{\"{seg}\": {yaml}}}"),
        };
    }
    // Wrapped so that the field is checked before anything is missing.
    let text = format!("interfaces: [eth0]\n{}\n", &yaml[1..yaml.len() - 1]);
    match AgentConfig::parse(&text) {
        Err(e) if e.to_string().contains("unknown field") => Err(e.to_string()),
        _ => Ok(()),
    }
}

/// Field paths from docs/config.md's tables (`| \`name\` |` rows).
fn config_table_fields(doc: &Doc) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut section: Option<&str> = None;
    let mut heading = String::new();
    for (i, line) in doc.text.lines().enumerate() {
        if line.starts_with('#') {
            heading = line.trim().to_string();
            section = CONFIG_SECTIONS
                .iter()
                .find(|(h, _)| *h == heading)
                .map(|(_, p)| *p);
            continue;
        }
        let Some(name) = line
            .strip_prefix("| `")
            .and_then(|r| r.split_once('`'))
            .map(|(n, _)| n)
        else {
            continue;
        };
        let prefix = section.unwrap_or_else(|| {
            panic!(
                "{}: a field table under {heading:?}, which CONFIG_SECTIONS does not map to a path",
                doc.at(i + 1)
            )
        });
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        };
        out.push((path, i + 1));
    }
    out
}

/// A span that reads as a config path under one of `tops`
/// (`l2.share_flows`, `bgp.peers[]`), without a value or file suffix.
fn as_config_path(span: &str, tops: &BTreeSet<String>) -> Option<String> {
    let path = span.split(['=', ':', ' ']).next()?;
    let (top, rest) = path.split_once('.')?;
    let top = top.trim_end_matches("[]");
    let ok = tops.contains(top)
        && !rest.is_empty()
        && !matches!(rest, "md" | "rs" | "yaml" | "json" | "conf")
        && rest
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.[]".contains(c));
    ok.then(|| path.to_string())
}

#[test]
fn every_config_field_the_docs_name_exists() {
    let docs = docs();
    let config_md = docs.iter().find(|d| d.path == "docs/config.md").unwrap();
    let fields = config_table_fields(config_md);
    assert!(
        fields.len() > 60,
        "only {} fields found in docs/config.md",
        fields.len()
    );
    let mut bad = Findings::default();
    for (path, line) in &fields {
        if let Err(e) = config_knows(path) {
            bad.add(format!("{}: `{path}`: {e}", config_md.at(*line)));
        }
    }
    // Paths named anywhere (`l2.share_flows`, or `config.l2.share_flows`
    // as a Helm value), under a section the tables have.
    let tops: BTreeSet<String> = fields
        .iter()
        .map(|(p, _)| p.split(['.', '[']).next().unwrap().to_string())
        .collect();
    let mut named = 0;
    for doc in &docs {
        for (line, span) in doc.code() {
            let span = span.trim().strip_prefix("config.").unwrap_or(span.trim());
            if let Some(path) = as_config_path(span, &tops) {
                named += 1;
                if let Err(e) = config_knows(&path) {
                    bad.add(format!("{}: `{path}`: {e}", doc.at(line)));
                }
            }
        }
    }
    assert!(
        named > 20,
        "only {named} config paths named outside the tables"
    );
    bad.assert_none("config fields");
}

#[test]
fn the_config_check_refuses_a_field_that_does_not_exist() {
    assert!(config_knows("l2.share_flows").is_ok());
    assert!(config_knows("services[].backends[].cgroup").is_ok());
    assert!(config_knows("bgp.peers[].graceful_restart").is_ok());
    assert!(config_knows("l2.share_flow").is_err());
    assert!(config_knows("services[].backends[].group").is_err());
    assert!(config_knows("bgp.peers[].restart").is_err());
    assert!(config_knows("timeout").is_err());
}

// ---- Helm values ----

fn values() -> serde_yaml::Value {
    serde_yaml::from_str(
        &fs::read_to_string(workspace_root().join("charts/xlb/values.yaml")).unwrap(),
    )
    .unwrap()
}

/// Whether `path` (`bgpSpeaker.peers[]`, `image.tag`) is a value of the
/// chart: in values.yaml, or read by a template (`.Values.a.b`), or under
/// `config.` a field the agent's parser knows.
fn helm_knows(path: &str, values: &serde_yaml::Value, templates: &str) -> bool {
    if let Some(field) = path.strip_prefix("config.") {
        return config_knows(field).is_ok();
    }
    let mut v = values;
    let mut found = true;
    for seg in path.split('.') {
        let (name, list) = match seg.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (seg, false),
        };
        match v.get(name) {
            Some(next) if !list => v = next,
            Some(next) => match next.get(0) {
                Some(first) => v = first,
                None => {
                    // An empty list in values.yaml: its items' fields are
                    // whatever the templates read.
                    found = next.is_sequence();
                    break;
                }
            },
            None => {
                found = false;
                break;
            }
        }
    }
    found || templates.contains(&format!(".Values.{}", path.replace("[]", "")))
}

#[test]
fn every_helm_value_the_docs_name_exists() {
    let values = values();
    let tops: BTreeSet<String> = values
        .as_mapping()
        .unwrap()
        .keys()
        .filter_map(|k| k.as_str().map(str::to_string))
        .collect();
    let root = workspace_root();
    let templates: String = fs::read_dir(root.join("charts/xlb/templates"))
        .unwrap()
        .flatten()
        .map(|e| fs::read_to_string(e.path()).unwrap())
        .collect();
    let mut bad = Findings::default();
    let mut named = 0;
    for doc in docs().iter().filter(|d| d.path.ends_with(".md")) {
        for (line, span) in doc.code() {
            let span = span.trim();
            let path = span
                .split(['=', ' ', ':', ','])
                .next()
                .unwrap()
                .trim_end_matches(['.', ')']);
            let top = path.split(['.', '[']).next().unwrap();
            // A bare top-level word (`config`, `pools`) is too common in
            // prose to be a claim; a path or an assignment is.
            let claim = tops.contains(top) && (path.contains('.') || span.contains('='));
            if !claim
                || !path
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.[]".contains(c))
            {
                continue;
            }
            named += 1;
            if !helm_knows(path, &values, &templates) {
                bad.add(format!("{}: `{path}`", doc.at(line)));
            }
        }
    }
    assert!(named > 30, "only {named} Helm values named in the docs");
    bad.assert_none("Helm values");
}

// ---- metrics and annotations ----

/// Names the docs use with this prefix that are not metrics or annotations
/// of xlb, with why.
const NOT_OURS: &[&str] = &[
    // BIRD protocol names in docs/bgp.md's example router configuration,
    // and those of the sessions the agent writes (`xlb_peer1`, `xlb_bfd`).
    "xlb_vips6",
    "xlb_peer",
    "xlb_peer1",
    "xlb_bfd",
    // The API group of the LoadBalancerPool CRD and its version.
    "xlb.dev/v1alpha1",
    // The test crate's name in Rust paths (`xlb_tests::cluster`).
    "xlb_tests",
];

#[test]
fn every_metric_and_annotation_the_docs_name_exists() {
    let root = workspace_root();
    let code = source(&root.join("lb-agent/src"));
    // XDP programs (the benches' `xlb_sink`) are named too.
    let programs = source(&root.join("lb-ebpf/src"));
    let chart_code: String = ["charts/xlb/templates", "charts/xlb/crds"]
        .iter()
        .flat_map(|d| fs::read_dir(root.join(d)).unwrap().flatten())
        .map(|e| fs::read_to_string(e.path()).unwrap())
        .collect();
    let mut bad = Findings::default();
    let mut metrics = 0;
    let mut annotations = 0;
    for doc in docs() {
        for (name, line) in words_after(&doc.text, "xlb_", &[]) {
            if NOT_OURS.contains(&name.as_str()) {
                continue;
            }
            metrics += 1;
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| code.contains(&format!("\"{b}\"")))
                .unwrap_or(&name);
            let exists = if base.ends_with('_') {
                // A family of series named by their prefix (`xlb_l2_`).
                code.contains(&format!("\"{base}"))
            } else {
                code.contains(&format!("\"{base}\"")) || programs.contains(&format!("fn {base}("))
            };
            if !exists {
                bad.add(format!("{}: metric `{name}`", doc.at(line)));
            }
        }
        for (name, line) in words_after(&doc.text, "xlb.dev/", &['-', '.']) {
            if NOT_OURS.contains(&name.as_str()) {
                continue;
            }
            annotations += 1;
            let quoted = format!("\"{name}\"");
            if !code.contains(&quoted) && !chart_code.contains(&name) {
                bad.add(format!("{}: `{name}`", doc.at(line)));
            }
        }
    }
    assert!(
        metrics > 40 && annotations > 10,
        "{metrics} metrics, {annotations} annotations named"
    );
    bad.assert_none("metrics and annotations");
}

/// The metric families the agent registers: the names given to prometheus'
/// constructors (`Opts::new("xlb_...", ...)`, `IntGauge::new(...)`) and to
/// the data plane's family table (`counter("xlb_...", ...)`).
fn registered_metrics(code: &str) -> BTreeSet<String> {
    let makers = [
        "Opts::new(",
        "IntGauge::new(",
        "Gauge::new(",
        "counter(",
        "gauge(",
    ];
    let mut out = BTreeSet::new();
    for m in makers {
        for (at, _) in code.match_indices(m) {
            let after = code[at + m.len()..].trim_start();
            if let Some(name) = after.strip_prefix("\"xlb_") {
                let end = name.find('"').unwrap();
                out.insert(format!("xlb_{}", &name[..end]));
            }
        }
    }
    out
}

#[test]
fn every_metric_the_agent_exports_is_in_docs_metrics_md() {
    let root = workspace_root();
    let exported = registered_metrics(&source(&root.join("lb-agent/src")));
    assert!(
        exported.len() > 40,
        "only {} metric families found: {exported:?}",
        exported.len()
    );
    let doc = fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let missing: Vec<&String> = exported
        .iter()
        .filter(|m| !doc.contains(&format!("| `{m}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "exported but not in docs/metrics.md's tables: {missing:?}"
    );
    // And the reverse: a row there names a family the agent registers.
    let listed = words_after(&doc, "| `xlb_", &[]);
    let stale: Vec<String> = listed
        .keys()
        .map(|k| k.trim_start_matches("| `").to_string())
        .filter(|m| !exported.contains(m))
        .collect();
    assert!(
        stale.is_empty(),
        "docs/metrics.md lists families the agent does not export: {stale:?}"
    );
}

/// The process families the Prometheus client library adds.
const PROCESS_METRICS: &[&str] = &[
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
    "process_threads",
];

/// Every query of the chart's Grafana dashboard names a family the agent
/// exports, and only such families.
#[test]
fn every_dashboard_query_names_metrics_the_agent_exports() {
    let root = workspace_root();
    let exported = registered_metrics(&source(&root.join("lb-agent/src")));
    let text = fs::read_to_string(root.join("charts/xlb/dashboards/xlb.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            queries += 1;
            let named: Vec<String> = words_after(expr, "xlb_", &[])
                .into_keys()
                .chain(words_after(expr, "process_", &[]).into_keys())
                .collect();
            assert!(
                !named.is_empty(),
                "{:?}: {expr} names no metric",
                panel["title"]
            );
            for m in named {
                assert!(
                    exported.contains(&m) || PROCESS_METRICS.contains(&m.as_str()),
                    "{:?}: {expr}: the agent exports no {m}",
                    panel["title"]
                );
            }
        }
    }
    assert!(queries >= 15, "{queries} queries");
}

// ---- command lines ----

/// `PROGRAM ARGS... --help`'s output, if it succeeds.
fn help(bin: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(bin).args(args).arg("--help").output().unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Each `lbctl ...` / `lb-agent ...` command line in the docs: its
/// subcommand (lbctl) exists, and each `--flag` on it is in that
/// subcommand's or the program's help.
#[test]
fn every_command_line_the_docs_show_exists() {
    let programs = [
        ("lbctl", lbctl_bin(), true),
        ("lb-agent", agent_bin(), false),
    ];
    let mut bad = Findings::default();
    let mut lines = 0;
    let mut helps: BTreeMap<(String, String), Option<String>> = BTreeMap::new();
    for doc in docs().iter().filter(|d| d.path.ends_with(".md")) {
        for (line, code) in doc.code() {
            for (name, bin, has_subcommands) in &programs {
                let Some(at) = code.find(&format!("{name} ")) else {
                    continue;
                };
                // `cargo build -p lb-agent` names the package, not the program.
                if at > 0 && !code[..at].ends_with([' ', '$', '(', '|'])
                    || code[..at].ends_with("-p ")
                {
                    continue;
                }
                let words: Vec<&str> = code[at + name.len()..]
                    .split_whitespace()
                    .take_while(|w| !["|", ";", "&&", ">", "#"].contains(w))
                    .collect();
                // The subcommand: the first word that is not a flag or a
                // flag's value.
                let mut sub = String::new();
                if *has_subcommands {
                    let mut prev_flag_takes_value = false;
                    for w in &words {
                        if w.starts_with('-') {
                            prev_flag_takes_value = !w.contains('=') && *w == "--pin-dir";
                        } else if prev_flag_takes_value {
                            prev_flag_takes_value = false;
                        } else {
                            sub = w.to_string();
                            break;
                        }
                    }
                    if !sub.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                        continue;
                    }
                }
                lines += 1;
                let args: Vec<&str> = if sub.is_empty() {
                    vec![]
                } else {
                    vec![sub.as_str()]
                };
                let text = helps
                    .entry((name.to_string(), sub.clone()))
                    .or_insert_with(|| help(bin, &args))
                    .clone();
                let top = helps
                    .entry((name.to_string(), String::new()))
                    .or_insert_with(|| help(bin, &[]))
                    .clone()
                    .unwrap_or_default();
                let Some(text) = text else {
                    bad.add(format!(
                        "{}: `{name} {sub}`: no such subcommand",
                        doc.at(line)
                    ));
                    continue;
                };
                for flag in words.iter().filter(|w| w.starts_with("--")) {
                    let flag = flag
                        .split('=')
                        .next()
                        .unwrap()
                        .trim_end_matches([',', ')', '.']);
                    let listed = |h: &str| {
                        h.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
                            .any(|w| w == flag)
                    };
                    if !listed(&text) && !listed(&top) {
                        bad.add(format!(
                            "{}: `{name} {sub} {flag}`: no such flag",
                            doc.at(line)
                        ));
                    }
                }
            }
        }
    }
    assert!(lines > 20, "only {lines} command lines found in the docs");
    bad.assert_none("commands");
}
