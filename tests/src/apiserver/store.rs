//! The object store: objects, the change history watches replay from, and
//! the write semantics (preconditions, status subresource, generation,
//! finalizers) shared by HTTP requests and the test's direct calls.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};

use super::error::ApiError;
use super::patch::{json_patch, merge_patch};
use super::resources::{apply_defaults, Allocator, ResourceType};
use super::selector::{FieldSelector, LabelSelector};

/// What happened to an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One committed change, as kept in the history and sent to watches.
#[derive(Debug)]
pub(crate) struct Change {
    pub rv: u64,
    pub resource: usize,
    pub kind: ChangeKind,
    /// The new state; for deletions the last state with the deletion's
    /// resourceVersion, as Kubernetes sends it.
    pub object: Value,
    /// The state before, used to undo changes for consistent paged lists
    /// and to see objects move in or out of a watch's selector.
    pub prev: Option<Value>,
}

/// Patch formats, by Content-Type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchType {
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/json-patch+json` (RFC 6902).
    Json,
    /// `application/strategic-merge-patch+json`, applied as a merge patch.
    Strategic,
    /// `application/apply-patch+yaml`, applied as a merge of the applied
    /// object (creating it when missing).
    Apply,
}

/// Which objects a list, watch or delete-collection covers.
#[derive(Clone, Debug, Default)]
pub(crate) struct Filter {
    /// `None`: all namespaces (or a cluster-scoped resource).
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| meta_str(object, "namespace") == Some(ns))
            && self.labels.matches(object)
            && self.fields.matches(object)
    }
}

/// Query parameters of a list.
#[derive(Clone, Debug, Default)]
pub(crate) struct ListOptions {
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
}

/// Where a watch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WatchFrom {
    /// No resourceVersion or "0": ADDED events for what exists, then live.
    Now,
    /// Every change after this resourceVersion, then live.
    After(u64),
}

struct WatcherSlot {
    resource: usize,
    tx: mpsc::UnboundedSender<Arc<Change>>,
}

/// (namespace, or "" for cluster-scoped; name)
type Key = (String, String);

pub(crate) struct Store {
    pub resources: Vec<ResourceType>,
    objects: Vec<BTreeMap<Key, Value>>,
    rv: u64,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    /// Watches may resume from this resourceVersion or later: every change
    /// after it is still in `history`.
    compacted: u64,
    watchers: Vec<WatcherSlot>,
    allocator: Allocator,
    random: u64,
    activity: Arc<watch::Sender<u64>>,
}

pub(crate) fn meta_str<'a>(object: &'a Value, key: &str) -> Option<&'a str> {
    object.get("metadata")?.get(key)?.as_str()
}

fn meta_mut(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    object["metadata"]
        .as_object_mut()
        .expect("metadata was made an object")
}

fn finalizers(object: &Value) -> Vec<&str> {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The object without metadata and status: what a generation counts.
fn spec_part(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        map.remove("metadata");
        map.remove("status");
    }
    copy
}

/// RFC 3339 in UTC with seconds, as `metav1.Time` serializes.
pub(crate) fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn is_dns_label(name: &str, first_must_be_letter: bool) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0] != b'-'
        && (!first_must_be_letter || bytes[0].is_ascii_lowercase())
        && bytes[bytes.len() - 1] != b'-'
}

/// Checks a name the way the resource's validation does; the problem text if invalid.
fn name_problem(rt: &ResourceType, name: &str) -> Option<String> {
    let valid = match rt.plural {
        "services" => is_dns_label(name, true),
        "namespaces" => is_dns_label(name, false),
        _ => name.len() <= 253 && name.split('.').all(|part| is_dns_label(part, false)),
    };
    (!valid).then(|| {
        format!(
            "Invalid value: {name:?}: must be a lower-case DNS name (letters, digits, '-'{})",
            if rt.plural == "services" {
                ", starting with a letter, at most 63 characters"
            } else {
                ", '.'"
            }
        )
    })
}

fn encode_continue(rv: u64, key: &Key) -> String {
    let text = json!({"rv": rv, "ns": key.0, "name": key.1}).to_string();
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<(u64, Key)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let value: Value = serde_json::from_slice(&bytes).ok()?;
    Some((
        value["rv"].as_u64()?,
        (
            value["ns"].as_str()?.to_string(),
            value["name"].as_str()?.to_string(),
        ),
    ))
}

impl Store {
    pub fn new(
        resources: Vec<ResourceType>,
        history_limit: usize,
        activity: Arc<watch::Sender<u64>>,
    ) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9);
        Self {
            objects: resources.iter().map(|_| BTreeMap::new()).collect(),
            resources,
            rv: 1,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted: 1,
            watchers: Vec::new(),
            allocator: Allocator::default(),
            random: seed,
            activity,
        }
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<usize> {
        self.resources
            .iter()
            .position(|r| r.group == group && r.version == version && r.plural == plural)
    }

    pub fn find_kind(&self, api_version: &str, kind: &str) -> Option<usize> {
        self.resources
            .iter()
            .position(|r| r.api_version() == api_version && r.kind == kind)
    }

    /// SplitMix64: uids and generated names need to differ, not be secret.
    fn next_random(&mut self) -> u64 {
        self.random = self.random.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.random;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn new_uid(&mut self) -> String {
        let (a, b) = (self.next_random(), self.next_random());
        let b = (b & 0x3fff_ffff_ffff_ffff) | 0x8000_0000_0000_0000;
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            b >> 48,
            b & 0xffff_ffff_ffff
        )
    }

    fn key(&self, rt: usize, namespace: &str, name: &str) -> Key {
        let ns = if self.resources[rt].namespaced {
            namespace
        } else {
            ""
        };
        (ns.to_string(), name.to_string())
    }

    pub fn get(&self, rt: usize, namespace: &str, name: &str) -> Result<Value, ApiError> {
        self.objects[rt]
            .get(&self.key(rt, namespace, name))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&self.resources[rt], name))
    }

    /// The objects of `rt` as they were at `rv` (undoing later changes).
    fn snapshot(&self, rt: usize, rv: u64) -> Result<BTreeMap<Key, Value>, ApiError> {
        if rv >= self.rv {
            return Ok(self.objects[rt].clone());
        }
        if rv < self.compacted {
            return Err(ApiError::expired(format!(
                "too old resource version: {rv} ({})",
                self.compacted + 1
            )));
        }
        let mut objects = self.objects[rt].clone();
        for change in self.history.iter().rev() {
            if change.rv <= rv {
                break;
            }
            if change.resource != rt {
                continue;
            }
            let key = (
                meta_str(&change.object, "namespace")
                    .unwrap_or_default()
                    .to_string(),
                meta_str(&change.object, "name")
                    .unwrap_or_default()
                    .to_string(),
            );
            match &change.prev {
                Some(prev) => objects.insert(key, prev.clone()),
                None => objects.remove(&key),
            };
        }
        Ok(objects)
    }

    /// A `XList` object, paged and filtered.
    pub fn list(
        &self,
        rt: usize,
        filter: &Filter,
        options: &ListOptions,
    ) -> Result<Value, ApiError> {
        let rtype = &self.resources[rt];
        let requested_rv = options
            .resource_version
            .as_deref()
            .filter(|rv| !rv.is_empty());
        let (snapshot_rv, start_after) = match options.continue_token.as_deref() {
            Some(token) => {
                if requested_rv.is_some_and(|rv| rv != "0") {
                    return Err(ApiError::bad_request(
                        "specifying resource version is not allowed when using continue",
                    ));
                }
                let (rv, key) = decode_continue(token)
                    .ok_or_else(|| ApiError::bad_request("continue key is not valid"))?;
                if rv < self.compacted {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                (rv, Some(key))
            }
            None => {
                let rv = match requested_rv {
                    None | Some("0") => self.rv,
                    Some(text) => {
                        let rv: u64 = text.parse().map_err(|_| {
                            ApiError::bad_request(format!("invalid resource version {text:?}"))
                        })?;
                        if rv > self.rv {
                            let mut err = ApiError::new(
                                504,
                                format!("Too large resource version: {rv}, current resource version: {}", self.rv),
                            );
                            err.retry_after_seconds = Some(1);
                            return Err(err);
                        }
                        if options.resource_version_match.as_deref() == Some("Exact") {
                            rv
                        } else {
                            self.rv
                        }
                    }
                };
                (rv, None)
            }
        };
        let objects = self.snapshot(rt, snapshot_rv)?;
        let matching: Vec<(&Key, &Value)> = objects
            .iter()
            .filter(|(key, _)| start_after.as_ref().is_none_or(|after| *key > after))
            .filter(|(_, object)| filter.matches(object))
            .collect();
        let limit = options.limit.filter(|&l| l > 0).unwrap_or(usize::MAX);
        let mut metadata = json!({"resourceVersion": snapshot_rv.to_string()});
        if matching.len() > limit {
            metadata["continue"] = json!(encode_continue(snapshot_rv, matching[limit - 1].0));
            // Only known without selectors, as on the real server.
            if filter.labels.is_empty() && filter.fields.is_empty() {
                metadata["remainingItemCount"] = json!(matching.len() - limit);
            }
        }
        let items: Vec<Value> = matching
            .into_iter()
            .take(limit)
            .map(|(_, object)| {
                let mut item = object.clone();
                if rtype.builtin {
                    if let Some(map) = item.as_object_mut() {
                        map.remove("apiVersion");
                        map.remove("kind");
                    }
                }
                item
            })
            .collect();
        Ok(json!({
            "kind": format!("{}List", rtype.kind),
            "apiVersion": rtype.api_version(),
            "metadata": metadata,
            "items": items,
        }))
    }

    /// Checks (and fills in) apiVersion and kind of a request body.
    fn check_type(&self, rt: usize, object: &mut Value) -> Result<(), ApiError> {
        let rtype = &self.resources[rt];
        let Some(map) = object.as_object_mut() else {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        };
        let expected = rtype.api_version();
        match map.get("apiVersion").and_then(Value::as_str) {
            Some(av) if av != expected => {
                return Err(ApiError::bad_request(format!(
                    "the API version in the data ({av}) does not match the expected API version ({expected})"
                )))
            }
            _ => map.insert("apiVersion".into(), json!(expected)),
        };
        match map.get("kind").and_then(Value::as_str) {
            Some(kind) if kind != rtype.kind => {
                return Err(ApiError::bad_request(format!(
                    "the kind in the data ({kind}) does not match the expected kind ({})",
                    rtype.kind
                )))
            }
            _ => map.insert("kind".into(), json!(rtype.kind)),
        };
        if map.get("metadata").is_some_and(|m| !m.is_object()) {
            return Err(ApiError::bad_request("metadata must be an object"));
        }
        Ok(())
    }

    /// Makes the body's namespace agree with the request's.
    fn check_namespace(
        &self,
        rt: usize,
        namespace: &str,
        object: &mut Value,
    ) -> Result<(), ApiError> {
        let namespaced = self.resources[rt].namespaced;
        let meta = meta_mut(object);
        if !namespaced {
            meta.remove("namespace");
            return Ok(());
        }
        match meta.get("namespace").and_then(Value::as_str) {
            Some(ns) if !ns.is_empty() && ns != namespace => Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            )),
            _ => {
                meta.insert("namespace".into(), json!(namespace));
                Ok(())
            }
        }
    }

    fn commit(
        &mut self,
        rt: usize,
        kind: ChangeKind,
        mut object: Value,
        prev: Option<Value>,
    ) -> Value {
        self.rv += 1;
        meta_mut(&mut object).insert("resourceVersion".into(), json!(self.rv.to_string()));
        let key = (
            meta_str(&object, "namespace")
                .unwrap_or_default()
                .to_string(),
            meta_str(&object, "name").unwrap_or_default().to_string(),
        );
        match kind {
            ChangeKind::Deleted => {
                self.objects[rt].remove(&key);
            }
            _ => {
                self.objects[rt].insert(key, object.clone());
            }
        }
        let change = Arc::new(Change {
            rv: self.rv,
            resource: rt,
            kind,
            object: object.clone(),
            prev,
        });
        self.history.push_back(change.clone());
        while self.history.len() > self.history_limit {
            if let Some(oldest) = self.history.pop_front() {
                self.compacted = oldest.rv;
            }
        }
        self.watchers
            .retain(|w| w.resource != rt || w.tx.send(change.clone()).is_ok());
        self.activity.send_modify(|n| *n += 1);
        object
    }

    pub fn create(
        &mut self,
        rt: usize,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        self.check_type(rt, &mut object)?;
        self.check_namespace(rt, namespace, &mut object)?;
        let rtype = self.resources[rt].clone();
        let meta = meta_mut(&mut object);
        let name = match meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            Some(name) => name.to_string(),
            None => {
                let Some(prefix) = meta
                    .get("generateName")
                    .and_then(Value::as_str)
                    .map(String::from)
                else {
                    return Err(ApiError::invalid(
                        &rtype,
                        "",
                        "metadata.name",
                        "Required value: name or generateName is required",
                    ));
                };
                self.generate_name(rt, namespace, &prefix)
            }
        };
        if let Some(problem) = name_problem(&rtype, &name) {
            return Err(ApiError::invalid(&rtype, &name, "metadata.name", &problem));
        }
        if meta_str(&object, "resourceVersion").is_some_and(|rv| !rv.is_empty()) {
            return Err(ApiError::internal(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        if self.objects[rt].contains_key(&self.key(rt, namespace, &name)) {
            return Err(ApiError::already_exists(&rtype, &name));
        }
        let uid = self.new_uid();
        let meta = meta_mut(&mut object);
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(uid));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        if rtype.tracks_generation {
            meta.insert("generation".into(), json!(1));
        } else {
            meta.remove("generation");
        }
        if rtype.reset_status_on_create {
            let map = object.as_object_mut().expect("checked to be an object");
            map.remove("status");
            if let Some(status) = rtype.initial_status() {
                map.insert("status".into(), status);
            }
        }
        apply_defaults(&rtype, &mut object, &mut self.allocator);
        Ok(self.commit(rt, ChangeKind::Added, object, None))
    }

    fn generate_name(&mut self, rt: usize, namespace: &str, prefix: &str) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        loop {
            let mut r = self.next_random();
            let suffix: String = (0..5)
                .map(|_| {
                    let c = ALPHABET[(r % ALPHABET.len() as u64) as usize] as char;
                    r /= ALPHABET.len() as u64;
                    c
                })
                .collect();
            let name = format!("{prefix}{suffix}");
            if !self.objects[rt].contains_key(&self.key(rt, namespace, &name)) {
                return name;
            }
        }
    }

    /// PUT: replaces the object (or only its status when `status_only`).
    /// Returns the stored object and whether it was created.
    pub fn update(
        &mut self,
        rt: usize,
        namespace: &str,
        name: &str,
        mut object: Value,
        status_only: bool,
    ) -> Result<(Value, bool), ApiError> {
        self.check_type(rt, &mut object)?;
        let body_name = meta_str(&object, "name").unwrap_or_default();
        if body_name != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        self.check_namespace(rt, namespace, &mut object)?;
        let key = self.key(rt, namespace, name);
        let Some(old) = self.objects[rt].get(&key).cloned() else {
            let rtype = &self.resources[rt];
            let has_rv = meta_str(&object, "resourceVersion").is_some_and(|rv| !rv.is_empty());
            if rtype.create_on_update && !status_only && !has_rv {
                return self.create(rt, namespace, object).map(|o| (o, true));
            }
            return Err(ApiError::not_found(rtype, name));
        };
        self.replace(rt, old, object, status_only, true)
            .map(|o| (o, false))
    }

    /// The shared part of update and patch: `new` is the complete proposed object.
    fn replace(
        &mut self,
        rt: usize,
        old: Value,
        mut new: Value,
        status_only: bool,
        require_rv: bool,
    ) -> Result<Value, ApiError> {
        let rtype = self.resources[rt].clone();
        let name = meta_str(&old, "name").unwrap_or_default().to_string();
        let old_rv = meta_str(&old, "resourceVersion")
            .unwrap_or_default()
            .to_string();
        match meta_str(&new, "resourceVersion").filter(|rv| !rv.is_empty()) {
            Some(rv) if rv != old_rv => return Err(ApiError::stale(&rtype, &name)),
            Some(_) => {}
            None if require_rv && !rtype.unconditional_update => {
                return Err(ApiError::invalid(
                    &rtype,
                    &name,
                    "metadata.resourceVersion",
                    "Invalid value: 0x0: must be specified for an update",
                ))
            }
            None => {}
        }
        if let (Some(new_uid), Some(old_uid)) = (meta_str(&new, "uid"), meta_str(&old, "uid")) {
            if !new_uid.is_empty() && new_uid != old_uid {
                return Err(ApiError::conflict(
                    &rtype,
                    &name,
                    &format!("Precondition failed: UID in precondition: {new_uid}, UID in object meta: {old_uid}"),
                ));
            }
        }
        if meta_str(&new, "name").is_some_and(|n| n != name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name of the stored object ({name})",
                meta_str(&new, "name").unwrap_or_default()
            )));
        }
        let mut candidate = if status_only {
            // Only status changes through /status (as for custom resources).
            let mut candidate = old.clone();
            let map = candidate
                .as_object_mut()
                .expect("stored objects are objects");
            match new.get("status") {
                Some(status) => map.insert("status".into(), status.clone()),
                None => map.remove("status"),
            };
            candidate
        } else {
            if rtype.status_subresource {
                let map = new.as_object_mut().expect("checked to be an object");
                match old.get("status") {
                    Some(status) => map.insert("status".into(), status.clone()),
                    None => map.remove("status"),
                };
            }
            new
        };
        // Fields only the server sets.
        let old_meta = old["metadata"].as_object().cloned().unwrap_or_default();
        let meta = meta_mut(&mut candidate);
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            match old_meta.get(field) {
                Some(value) => meta.insert(field.into(), value.clone()),
                None => meta.remove(field),
            };
        }
        meta.insert("resourceVersion".into(), json!(old_rv));
        if old_meta.contains_key("deletionTimestamp") {
            let old_finalizers = finalizers(&old);
            if finalizers(&candidate)
                .iter()
                .any(|f| !old_finalizers.contains(f))
            {
                return Err(ApiError::invalid(
                    &rtype,
                    &name,
                    "metadata.finalizers",
                    "Forbidden: no new finalizers can be added if the object is being deleted",
                ));
            }
        }
        if rtype.tracks_generation && spec_part(&candidate) != spec_part(&old) {
            let generation = old_meta
                .get("generation")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut candidate).insert("generation".into(), json!(generation + 1));
        }
        if candidate == old {
            // A no-op write changes nothing: no new resourceVersion, no event.
            return Ok(old);
        }
        if old_meta.contains_key("deletionTimestamp") && finalizers(&candidate).is_empty() {
            return Ok(self.commit(rt, ChangeKind::Deleted, candidate, Some(old)));
        }
        Ok(self.commit(rt, ChangeKind::Modified, candidate, Some(old)))
    }

    /// PATCH. Returns the stored object and whether it was created (apply).
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &mut self,
        rt: usize,
        namespace: &str,
        name: &str,
        patch_type: PatchType,
        patch: &Value,
        status_only: bool,
        field_manager: Option<&str>,
    ) -> Result<(Value, bool), ApiError> {
        let rtype = self.resources[rt].clone();
        if patch_type == PatchType::Apply {
            if field_manager.is_none_or(str::is_empty) {
                return Err(ApiError::new(
                    422,
                    "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                ));
            }
            let mut applied = patch.clone();
            self.check_type(rt, &mut applied)?;
            for field in ["apiVersion", "kind"] {
                if patch.get(field).is_none() {
                    return Err(ApiError::bad_request(format!(
                        "{field} must be set in an apply patch"
                    )));
                }
            }
            if meta_str(patch, "name").is_some_and(|n| n != name) {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    meta_str(patch, "name").unwrap_or_default()
                )));
            }
        } else if matches!(patch_type, PatchType::Merge | PatchType::Strategic)
            && !patch.is_object()
        {
            return Err(ApiError::bad_request("a merge patch must be a JSON object"));
        }
        let key = self.key(rt, namespace, name);
        let Some(old) = self.objects[rt].get(&key).cloned() else {
            if patch_type == PatchType::Apply && !status_only {
                let mut object = patch.clone();
                meta_mut(&mut object).insert("name".into(), json!(name));
                return self.create(rt, namespace, object).map(|o| (o, true));
            }
            return Err(ApiError::not_found(&rtype, name));
        };
        let mut target = old.clone();
        match patch_type {
            PatchType::Merge | PatchType::Strategic | PatchType::Apply => {
                merge_patch(&mut target, patch)
            }
            PatchType::Json => json_patch(&mut target, patch).map_err(|problem| {
                ApiError::new(
                    422,
                    format!(
                        "the server rejected our request due to an error in our request: {problem}"
                    ),
                )
            })?,
        }
        if !target.is_object() {
            return Err(ApiError::bad_request("the patch did not produce an object"));
        }
        self.check_type(rt, &mut target)?;
        if meta_str(&target, "namespace").unwrap_or_default()
            != meta_str(&old, "namespace").unwrap_or_default()
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        self.replace(rt, old, target, status_only, false)
            .map(|o| (o, false))
    }

    /// DELETE. `options` is a DeleteOptions object (preconditions are checked).
    pub fn delete(
        &mut self,
        rt: usize,
        namespace: &str,
        name: &str,
        options: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let rtype = self.resources[rt].clone();
        let old = self.get(rt, namespace, name)?;
        let preconditions = options.and_then(|o| o.get("preconditions"));
        for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            let wanted = preconditions
                .and_then(|p| p.get(field))
                .and_then(Value::as_str);
            let actual = meta_str(&old, field).unwrap_or_default();
            if let Some(wanted) = wanted.filter(|w| *w != actual) {
                return Err(ApiError::conflict(
                    &rtype,
                    name,
                    &format!("Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}"),
                ));
            }
        }
        if meta_str(&old, "deletionTimestamp").is_some() {
            return Ok(old);
        }
        if !finalizers(&old).is_empty() {
            // Finalizers hold the object until they are removed.
            let mut marked = old.clone();
            let meta = meta_mut(&mut marked);
            meta.insert("deletionTimestamp".into(), json!(now_rfc3339()));
            meta.insert("deletionGracePeriodSeconds".into(), json!(0));
            return Ok(self.commit(rt, ChangeKind::Modified, marked, Some(old)));
        }
        Ok(self.commit(rt, ChangeKind::Deleted, old.clone(), Some(old)))
    }

    /// Deletes every object the filter matches; returns them as a list.
    pub fn delete_collection(&mut self, rt: usize, filter: &Filter) -> Result<Value, ApiError> {
        let keys: Vec<Key> = self.objects[rt]
            .iter()
            .filter(|(_, o)| filter.matches(o))
            .map(|(k, _)| k.clone())
            .collect();
        let mut items = Vec::new();
        for (ns, name) in keys {
            items.push(self.delete(rt, &ns, &name, None)?);
        }
        let rtype = &self.resources[rt];
        Ok(json!({
            "kind": format!("{}List", rtype.kind),
            "apiVersion": rtype.api_version(),
            "metadata": {"resourceVersion": self.rv.to_string()},
            "items": items,
        }))
    }

    /// Registers a watch. Returns the events to send first, the current
    /// resourceVersion and the receiver of later changes; or 410 Expired
    /// when `from` is older than the history holds.
    #[allow(clippy::type_complexity)]
    pub fn watch(
        &mut self,
        rt: usize,
        from: WatchFrom,
    ) -> Result<(Vec<Arc<Change>>, u64, mpsc::UnboundedReceiver<Arc<Change>>), ApiError> {
        let initial: Vec<Arc<Change>> = match from {
            WatchFrom::Now => self.objects[rt]
                .values()
                .map(|object| {
                    Arc::new(Change {
                        rv: meta_str(object, "resourceVersion")
                            .and_then(|rv| rv.parse().ok())
                            .unwrap_or(0),
                        resource: rt,
                        kind: ChangeKind::Added,
                        object: object.clone(),
                        prev: None,
                    })
                })
                .collect(),
            WatchFrom::After(rv) if rv < self.compacted => {
                return Err(ApiError::expired(format!(
                    "too old resource version: {rv} ({})",
                    self.compacted + 1
                )));
            }
            WatchFrom::After(rv) => self
                .history
                .iter()
                .filter(|c| c.rv > rv && c.resource == rt)
                .cloned()
                .collect(),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        self.watchers.push(WatcherSlot { resource: rt, tx });
        Ok((initial, self.rv, rx))
    }

    /// Forgets the history: watches from any earlier resourceVersion (and
    /// continue tokens) now get 410 Expired.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        let ts = now_rfc3339();
        assert_eq!(ts.len(), 20, "{ts}");
        assert!(
            ts.starts_with("20") && ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
            "{ts}"
        );
    }

    #[test]
    fn continue_tokens_round_trip() {
        let key = ("ns".to_string(), "name".to_string());
        assert_eq!(decode_continue(&encode_continue(42, &key)), Some((42, key)));
        assert_eq!(decode_continue("zz"), None);
        assert_eq!(decode_continue("abc"), None);
    }

    #[test]
    fn names_are_validated() {
        let svc = &ResourceType::builtin()[0];
        assert!(name_problem(svc, "web-1").is_none());
        assert!(name_problem(svc, "1web").is_some());
        assert!(name_problem(svc, "Web").is_some());
        let lease = ResourceType::new("coordination.k8s.io", "v1", "leases", "Lease", true);
        assert!(name_problem(&lease, "a.b-c").is_none());
        assert!(name_problem(&lease, "a..b").is_some());
        assert!(name_problem(&lease, "").is_some());
    }
}
