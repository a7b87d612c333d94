//! JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

use serde_json::{Map, Value};

/// Applies an RFC 7386 merge patch: objects merge key by key, `null`
/// removes a key, anything else (arrays included) replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Applies an RFC 6902 JSON patch (add, remove, replace, move, copy, test).
/// On error the target may be partly changed: callers patch a copy.
pub fn json_patch(target: &mut Value, patch: &Value) -> Result<(), String> {
    let ops = patch
        .as_array()
        .ok_or("a JSON patch must be an array of operations")?;
    for op in ops {
        let field = |name: &str| {
            op.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("JSON patch operation {op} has no string {name:?}"))
        };
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("JSON patch operation {op} has no \"value\""))
        };
        let path = field("path")?;
        match field("op")? {
            "add" => add(target, path, value()?)?,
            "remove" => {
                remove(target, path)?;
            }
            "replace" => {
                remove(target, path)?;
                add(target, path, value()?)?;
            }
            "move" => {
                let from = field("from")?;
                if path.starts_with(&format!("{from}/")) {
                    return Err(format!("cannot move {from} into its own child {path}"));
                }
                let moved = remove(target, from)?;
                add(target, path, moved)?;
            }
            "copy" => {
                let from = field("from")?;
                let copied = target
                    .pointer(from)
                    .cloned()
                    .ok_or_else(|| format!("copy from missing path {from}"))?;
                add(target, path, copied)?;
            }
            "test" => {
                if target.pointer(path) != Some(&value()?) {
                    return Err(format!("test operation failed at {path}"));
                }
            }
            other => return Err(format!("unknown JSON patch operation {other:?}")),
        }
    }
    Ok(())
}

/// Splits a JSON pointer into its parent pointer and unescaped last token.
fn split_pointer(path: &str) -> Result<(&str, String), String> {
    if path.is_empty() {
        return Err("the whole document cannot be patched".into());
    }
    let slash = path
        .rfind('/')
        .filter(|_| path.starts_with('/'))
        .ok_or_else(|| format!("invalid JSON pointer {path:?}"))?;
    let token = path[slash + 1..].replace("~1", "/").replace("~0", "~");
    Ok((&path[..slash], token))
}

fn add(target: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let (parent, token) = split_pointer(path)?;
    match target.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.insert(token, value);
            Ok(())
        }
        Some(Value::Array(items)) => {
            let index = if token == "-" {
                items.len()
            } else {
                token
                    .parse::<usize>()
                    .ok()
                    .filter(|&i| i <= items.len())
                    .ok_or_else(|| format!("invalid array index in {path}"))?
            };
            items.insert(index, value);
            Ok(())
        }
        _ => Err(format!("path {path} does not exist")),
    }
}

fn remove(target: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, token) = split_pointer(path)?;
    let removed = match target.pointer_mut(parent) {
        Some(Value::Object(map)) => map.remove(&token),
        Some(Value::Array(items)) => token
            .parse::<usize>()
            .ok()
            .filter(|&i| i < items.len())
            .map(|i| items.remove(i)),
        _ => None,
    };
    removed.ok_or_else(|| format!("path {path} does not exist"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(
            &mut doc,
            &json!({"a": "z", "c": {"f": null, "h": 1}, "l": [3]}),
        );
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e", "h": 1}, "l": [3]}));
        merge_patch(&mut doc, &json!({"a": {"x": null, "y": 2}}));
        assert_eq!(doc["a"], json!({"y": 2}));
    }

    #[test]
    fn json_patch_operations() {
        let mut doc = json!({"a": [1, 2], "b": {"c/d": 1}});
        json_patch(
            &mut doc,
            &json!([
                {"op": "add", "path": "/a/1", "value": 9},
                {"op": "add", "path": "/a/-", "value": 3},
                {"op": "remove", "path": "/b/c~1d"},
                {"op": "replace", "path": "/b", "value": {"x": 1}},
                {"op": "copy", "from": "/b/x", "path": "/y"},
                {"op": "move", "from": "/y", "path": "/z"},
                {"op": "test", "path": "/z", "value": 1},
            ]),
        )
        .unwrap();
        assert_eq!(doc, json!({"a": [1, 9, 2, 3], "b": {"x": 1}, "z": 1}));
    }

    #[test]
    fn json_patch_errors() {
        let doc = json!({"a": 1});
        for bad in [
            json!([{"op": "test", "path": "/a", "value": 2}]),
            json!([{"op": "remove", "path": "/missing"}]),
            json!([{"op": "replace", "path": "/missing", "value": 1}]),
            json!([{"op": "add", "path": "/x/y", "value": 1}]),
            json!([{"op": "frobnicate", "path": "/a"}]),
            json!({"op": "add"}),
        ] {
            assert!(json_patch(&mut doc.clone(), &bad).is_err(), "{bad}");
        }
    }
}
