//! Label and field selectors, as the `labelSelector` and `fieldSelector`
//! query parameters spell them.

use serde_json::Value;

/// One label requirement; a selector is the AND of several.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed `labelSelector` (`a=b`, `a==b`, `a!=b`, `a`, `!a`,
/// `a in (x,y)`, `a notin (x,y)`; commas AND them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<LabelRequirement>,
}

impl LabelSelector {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for term in split_top_level(text)? {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            requirements.push(parse_label_term(term)?);
        }
        Ok(Self { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        let labels = object
            .pointer("/metadata/labels")
            .and_then(Value::as_object);
        let label = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.requirements.iter().all(|req| match req {
            LabelRequirement::Equals(k, v) => label(k) == Some(v.as_str()),
            // As in Kubernetes, `a!=b` also matches objects without label `a`.
            LabelRequirement::NotEquals(k, v) => label(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::NotIn(k, vs) => !label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::Exists(k) => label(k).is_some(),
            LabelRequirement::DoesNotExist(k) => label(k).is_none(),
        })
    }
}

/// Splits at commas that are not inside `( )`.
fn split_top_level(text: &str) -> Result<Vec<&str>, String> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unbalanced ')' in selector {text:?}"))?
            }
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '(' in selector {text:?}"));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn parse_label_term(term: &str) -> Result<LabelRequirement, String> {
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelRequirement::DoesNotExist(label_key(key)?));
    }
    if let Some((key, value)) = term.split_once("!=") {
        return Ok(LabelRequirement::NotEquals(
            label_key(key)?,
            label_value(value)?,
        ));
    }
    if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelRequirement::Equals(
            label_key(key)?,
            label_value(value)?,
        ));
    }
    // Set-based: `key in (a,b)` / `key notin (a,b)`.
    if let Some(open) = term.find('(') {
        let close = term
            .rfind(')')
            .filter(|&c| c == term.len() - 1)
            .ok_or_else(|| format!("invalid selector term {term:?}: missing ')'"))?;
        let mut head = term[..open].split_whitespace();
        let (Some(key), Some(op), None) = (head.next(), head.next(), head.next()) else {
            return Err(format!("invalid selector term {term:?}"));
        };
        let values = term[open + 1..close]
            .split(',')
            .map(label_value)
            .collect::<Result<Vec<_>, _>>()?;
        return match op {
            "in" => Ok(LabelRequirement::In(label_key(key)?, values)),
            "notin" => Ok(LabelRequirement::NotIn(label_key(key)?, values)),
            _ => Err(format!("invalid selector operator {op:?} in {term:?}")),
        };
    }
    if term.contains(['<', '>']) {
        return Err(format!("unsupported selector operator in {term:?}"));
    }
    Ok(LabelRequirement::Exists(label_key(term)?))
}

fn label_key(key: &str) -> Result<String, String> {
    let key = key.trim();
    let valid = !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if valid {
        Ok(key.to_string())
    } else {
        Err(format!("invalid label key {key:?}"))
    }
}

fn label_value(value: &str) -> Result<String, String> {
    let value = value.trim();
    let valid = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(value.to_string())
    } else {
        Err(format!("invalid label value {value:?}"))
    }
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value`,
/// comma-separated (AND). Which paths are allowed depends on the resource.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSelector {
    // (dotted path, expected value, true for equality)
    requirements: Vec<(String, String, bool)>,
}

impl FieldSelector {
    /// `allowed` lists the paths besides `metadata.name` and
    /// `metadata.namespace` this resource supports.
    pub fn parse(text: &str, allowed: &[&str]) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for term in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (path, value, equal) = if let Some((p, v)) = term.split_once("!=") {
                (p, v, false)
            } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (p, v, true)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            let path = path.trim();
            if !matches!(path, "metadata.name" | "metadata.namespace") && !allowed.contains(&path) {
                return Err(format!("field label not supported: {path}"));
            }
            requirements.push((path.to_string(), value.trim().to_string(), equal));
        }
        Ok(Self { requirements })
    }

    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.requirements.iter().all(|(path, expected, equal)| {
            let mut current = Some(object);
            for part in path.split('.') {
                current = current.and_then(|v| v.get(part));
            }
            // A missing field compares as the empty string, as in Kubernetes.
            let actual = match current {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (actual == *expected) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_operators() {
        let o = obj(json!({"app": "web", "tier": "front"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app=web,tier=back"));
        assert!(m("app!=db"));
        assert!(m("missing!=x"));
        assert!(!m("app!=web"));
        assert!(m("!missing"));
        assert!(!m("!app"));
        assert!(m("tier in (back, front)"));
        assert!(!m("tier notin (back,front)"));
        assert!(m("missing notin (x)"));
        assert!(m(""));
    }

    #[test]
    fn bad_label_selectors_are_errors() {
        for bad in ["a in (x", "a>1", "a=b c", "in (x,y) z"] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn field_selectors() {
        let o = obj(json!({}));
        let s = FieldSelector::parse("metadata.name=a,metadata.namespace!=other", &[]).unwrap();
        assert!(s.matches(&o));
        let s = FieldSelector::parse("metadata.name==b", &[]).unwrap();
        assert!(!s.matches(&o));
        assert!(FieldSelector::parse("spec.type=x", &[]).is_err());
        let s = FieldSelector::parse("spec.type=", &["spec.type"]).unwrap();
        assert!(s.matches(&o));
    }
}
