//! Field paths (`services[2].backends[0].ip`) and the line each one is on,
//! found by replaying the YAML with a probing deserializer.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::ConfigError;

// ---------------------------------------------------------------------------
// Field paths and their lines.

#[derive(Clone, Copy, Debug)]
pub(super) enum Seg {
    Key(&'static str),
    Index(usize),
}

/// A dotted path into the document, e.g. `services[1].backends[0].ip`.
#[derive(Clone, Debug, Default)]
pub(super) struct FieldPath(pub(super) Vec<Seg>);

impl FieldPath {
    pub(super) fn key(&self, key: &'static str) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Key(key));
        FieldPath(v)
    }

    pub(super) fn index(&self, i: usize) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        FieldPath(v)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(TOP_LEVEL);
        }
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => f.write_str(k)?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

pub(super) const TOP_LEVEL: &str = "(top level)";

/// The line of the value at `path` in `text` (1-based); for a path that is
/// not in the document, the line of its deepest ancestor that is.
///
/// serde_yaml gives no positions to `Deserialize` impls, only to errors, so
/// this walks the document down `path` and fails on purpose there: the
/// error carries the position of the value it failed on. This re-parses the
/// text, which only happens when there is an error to report.
pub(super) fn locate(text: &str, path: &[Seg]) -> usize {
    match Probe(path).deserialize(serde_yaml::Deserializer::from_str(text)) {
        Err(e) => e.location().map_or(1, |l| l.line()),
        Ok(()) => 1,
    }
}

pub(super) struct Probe<'p>(&'p [Seg]);

pub(super) const PROBE: &str = "(probe)";

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE)
    }

    // Scalars: the default `visit_*` fail, at the scalar: what we want.

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        if let Some((Seg::Key(want), rest)) = self.0.split_first() {
            // The last key fails on itself: `backends:` rather than the
            // first line of its value.
            let seed = KeyProbe {
                want,
                fail: rest.is_empty(),
            };
            while let Some(found) = map.next_key_seed(seed)? {
                if found {
                    return map.next_value_seed(Probe(rest));
                }
                map.next_value::<IgnoredAny>()?;
            }
        }
        Err(de::Error::custom(PROBE))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if let Some((Seg::Index(want), rest)) = self.0.split_first() {
            for _ in 0..*want {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Err(de::Error::custom(PROBE));
                }
            }
            if seq.next_element_seed(Probe(rest))?.is_some() {
                return Ok(());
            }
        }
        Err(de::Error::custom(PROBE))
    }
}

/// A mapping key: is it `want`? With `fail`, finding it is an error (at
/// the key).
#[derive(Clone, Copy)]
pub(super) struct KeyProbe<'w> {
    pub(super) want: &'w str,
    pub(super) fail: bool,
}

impl<'de> DeserializeSeed<'de> for KeyProbe<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyProbe<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE)
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match key == self.want {
            true if self.fail => Err(E::custom(PROBE)),
            found => Ok(found),
        }
    }
}

/// Turns a serde_yaml error (syntax, unknown field, wrong type, missing
/// field) into a `ConfigError` with the line and dotted path.
pub(super) fn yaml_error(text: &str, e: serde_yaml::Error) -> ConfigError {
    let position = |e: &serde_yaml::Error| e.location().map_or((1, 1), |l| (l.line(), l.column()));
    // serde_yaml deserializes what libyaml parsed before a syntax error, so
    // a schema error may come first: look for a syntax error on its own.
    if let Err(e) = serde_yaml::from_str::<IgnoredAny>(text) {
        let (line, column) = position(&e);
        return ConfigError::Syntax {
            line,
            column,
            message: e
                .to_string()
                .replacen(&format!(" at line {line} column {column}"), "", 1),
        };
    }
    let (line, column) = position(&e);
    let full = e.to_string();
    let at = format!(" at line {line} column {column}");
    let msg = full.strip_suffix(&at).unwrap_or(&full);
    // serde_yaml writes "path: message" unless the path is the root.
    let (mut field, msg) = match msg.split_once(": ") {
        Some((p, m)) if !p.is_empty() && !p.contains([' ', '`', '"']) => (p.to_owned(), m),
        _ => (String::new(), msg),
    };
    // Unknown and missing fields are reported on their parent: name them.
    for lead in ["unknown field `", "missing field `", "duplicate field `"] {
        if let Some(name) = msg.strip_prefix(lead).and_then(|r| r.split('`').next()) {
            if !field.is_empty() {
                field.push('.');
            }
            field.push_str(name);
        }
    }
    if field.is_empty() {
        field = TOP_LEVEL.to_owned();
    }
    ConfigError::Invalid {
        line,
        field,
        message: msg.replace("expected i64", "expected an integer"),
    }
}
