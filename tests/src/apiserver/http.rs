//! The HTTP side: accepting connections (and refusing them while down),
//! routing Kubernetes API paths, watch streams, injected faults and the
//! request log.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::error::ApiError;
use super::selector::{FieldSelector, LabelSelector};
use super::store::{Change, ChangeKind, Filter, ListOptions, PatchType, Store, WatchFrom};
use super::{Fault, RequestRecord};

type Body = BoxBody<Bytes, Infallible>;

/// Everything the server tasks and the test's handle share.
pub(crate) struct Shared {
    pub store: Mutex<Store>,
    pub faults: Mutex<Vec<Fault>>,
    pub log: Mutex<Vec<RequestRecord>>,
    pub token: String,
    pub bookmark_interval: Duration,
    pub addr: SocketAddr,
    /// Bumped on every committed change and logged request (wakes `wait_for`).
    pub activity: Arc<watch::Sender<u64>>,
    /// `false` while the test has the server down.
    pub up: watch::Sender<bool>,
    /// Whether the listener is bound right now.
    pub listening: watch::Sender<bool>,
    connections: Mutex<HashMap<u64, AbortHandle>>,
    next_connection: AtomicU64,
    /// Ids of the watch streams open now.
    watches: Mutex<HashSet<u64>>,
    next_watch: AtomicU64,
}

/// Poisoning only follows a panic elsewhere; the data is still usable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    pub fn new(
        store: Store,
        token: String,
        bookmark_interval: Duration,
        addr: SocketAddr,
        activity: Arc<watch::Sender<u64>>,
    ) -> Self {
        Self {
            store: Mutex::new(store),
            faults: Mutex::new(Vec::new()),
            log: Mutex::new(Vec::new()),
            token,
            bookmark_interval,
            addr,
            activity,
            up: watch::Sender::new(true),
            listening: watch::Sender::new(false),
            connections: Mutex::new(HashMap::new()),
            next_connection: AtomicU64::new(0),
            watches: Mutex::new(HashSet::new()),
            next_watch: AtomicU64::new(0),
        }
    }

    /// Closes every connection (and with them every watch stream).
    /// Returns what was open, to wait for with [`Self::closed`].
    pub fn abort_connections(&self) -> (Vec<u64>, Vec<u64>) {
        // Watches first: any watch open now runs on a connection aborted below.
        let watches: Vec<u64> = lock(&self.watches).iter().copied().collect();
        let connections = lock(&self.connections);
        for handle in connections.values() {
            handle.abort();
        }
        (connections.keys().copied().collect(), watches)
    }

    /// Whether these connections and watches have all ended.
    pub fn closed(&self, connections: &[u64], watches: &[u64]) -> bool {
        let open_connections = lock(&self.connections);
        let open_watches = lock(&self.watches);
        connections
            .iter()
            .all(|c| !open_connections.contains_key(c))
            && watches.iter().all(|w| !open_watches.contains(w))
    }

    pub fn open_watches(&self) -> usize {
        lock(&self.watches).len()
    }
}

/// Binds `addr` with SO_REUSEADDR, so the port can be taken again after an outage.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Accepts connections while up; while down the port is closed, so
/// clients get "connection refused".
pub(crate) async fn serve(shared: Arc<Shared>, first: TcpListener) {
    let mut up = shared.up.subscribe();
    let mut listener = Some(first);
    loop {
        let current = match listener.take() {
            Some(l) => l,
            None => {
                // Down: wait to come back up, then take the same port again.
                while !*up.borrow_and_update() {
                    if up.changed().await.is_err() {
                        return;
                    }
                }
                let mut attempt = 0;
                loop {
                    match bind(shared.addr) {
                        Ok(l) => break l,
                        Err(err) if attempt < 200 => {
                            attempt += 1;
                            eprintln!("test apiserver: rebinding {}: {err}", shared.addr);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Err(err) => panic!("test apiserver cannot rebind {}: {err}", shared.addr),
                    }
                }
            }
        };
        shared.listening.send_replace(true);
        loop {
            tokio::select! {
                accepted = current.accept() => {
                    if let Ok((stream, _)) = accepted {
                        // As the real server: a watch event goes out at once
                        // (Nagle would hold small ones for the peer's ACK).
                        let _ = stream.set_nodelay(true);
                        spawn_connection(&shared, stream);
                    }
                }
                changed = up.changed() => {
                    if changed.is_err() || !*up.borrow_and_update() {
                        break;
                    }
                }
            }
        }
        drop(current);
        let (connections, watches) = shared.abort_connections();
        while !shared.closed(&connections, &watches) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        shared.listening.send_replace(false);
    }
}

/// Removes the connection from the registry when its task ends or is aborted.
struct ConnectionGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        lock(&self.shared.connections).remove(&self.id);
    }
}

fn spawn_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
    let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let guard = ConnectionGuard {
        shared: shared.clone(),
        id,
    };
    let service_shared = shared.clone();
    // Held across spawn and insert, so a fast task cannot remove itself first.
    let mut connections = lock(&shared.connections);
    let task = tokio::spawn(async move {
        let _guard = guard;
        let service = hyper::service::service_fn(move |req| handle(service_shared.clone(), req));
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    });
    connections.insert(id, task.abort_handle());
}

fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    let mut response = Response::new(full(body.to_string()));
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_response(err: &ApiError) -> Response<Body> {
    let mut response = json_response(err.code, &err.to_status());
    if let Some(secs) = err.retry_after_seconds {
        response
            .headers_mut()
            .insert("Retry-After", HeaderValue::from(secs));
    }
    response
}

fn percent_decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'+', _, _) => out.push(b' '),
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 2;
            }
            (b, _, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Query parameters, decoded.
pub(crate) fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(pair), String::new()),
        })
        .collect()
}

/// A parsed resource path.
struct Route {
    rt: usize,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

enum Target {
    Resource(Route),
    /// Discovery and health paths, answered as they are.
    Fixed(Value),
    Text(&'static str),
}

fn not_found_path() -> ApiError {
    ApiError::new(404, "the server could not find the requested resource")
}

fn route(shared: &Shared, path: &str) -> Result<Target, ApiError> {
    let segments: Vec<&str> = path
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let store = lock(&shared.store);
    let (group, version, rest) = match segments.as_slice() {
        ["healthz" | "livez" | "readyz"] => return Ok(Target::Text("ok")),
        ["version"] => {
            return Ok(Target::Fixed(json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-xlb-test",
                "platform": "linux/amd64",
            })))
        }
        ["api"] => {
            return Ok(Target::Fixed(json!({
                "kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": shared.addr.to_string()}],
            })))
        }
        ["apis"] => return Ok(Target::Fixed(group_list(&store))),
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(not_found_path()),
    };
    if rest.is_empty() {
        return resource_list(&store, group, version)
            .map(Target::Fixed)
            .ok_or_else(not_found_path);
    }
    let namespaced_path = rest.len() >= 3
        && rest[0] == "namespaces"
        && store
            .find(group, version, rest[2])
            .is_some_and(|rt| store.resources[rt].namespaced);
    let (namespace, rest) = if namespaced_path {
        (Some(rest[1].to_string()), &rest[2..])
    } else {
        (None, rest)
    };
    let rt = store
        .find(group, version, rest[0])
        .ok_or_else(not_found_path)?;
    let rtype = &store.resources[rt];
    let name = rest.get(1).map(|s| s.to_string());
    let status = match rest.get(2) {
        None => false,
        Some(&"status") if rtype.status_subresource => true,
        Some(_) => return Err(not_found_path()),
    };
    if rest.len() > 3
        || (namespace.is_some() && !rtype.namespaced)
        || (namespace.is_none() && rtype.namespaced && name.is_some())
    {
        return Err(not_found_path());
    }
    Ok(Target::Resource(Route {
        rt,
        namespace,
        name,
        status,
    }))
}

fn group_list(store: &Store) -> Value {
    let mut groups: Vec<(&str, &str)> = store
        .resources
        .iter()
        .filter(|r| !r.group.is_empty())
        .map(|r| (r.group, r.version))
        .collect();
    groups.dedup();
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|(group, version)| {
            let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
            json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(store: &Store, group: &str, version: &str) -> Option<Value> {
    let mut resources = Vec::new();
    for r in store
        .resources
        .iter()
        .filter(|r| r.group == group && r.version == version)
    {
        resources.push(json!({
            "name": r.plural, "singularName": r.kind.to_lowercase(), "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        }));
        if r.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", r.plural), "singularName": "", "namespaced": r.namespaced,
                "kind": r.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    (!resources.is_empty()).then(|| {
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": api_version, "resources": resources})
    })
}

/// Finds and consumes the first injected fault that matches.
fn take_fault(
    shared: &Shared,
    method: &Method,
    path: &str,
    verb: &str,
    watch: bool,
) -> Option<ApiError> {
    let mut faults = lock(&shared.faults);
    let index = faults
        .iter()
        .position(|f| f.matches(method.as_str(), path, verb, watch))?;
    let fault = &mut faults[index];
    fault.times -= 1;
    let mut err = ApiError::new(
        fault.code,
        fault
            .message
            .clone()
            .unwrap_or_else(|| format!("injected failure ({})", fault.code)),
    );
    err.retry_after_seconds = fault.retry_after_seconds;
    if fault.times == 0 {
        faults.remove(index);
    }
    Some(err)
}

/// The Kubernetes verb for a request, as audit logs name it.
fn verb(method: &Method, has_name: bool, watch: bool) -> &'static str {
    match (method.as_str(), has_name) {
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("GET", true) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "",
    }
}

fn parse_body(content_type: &str, bytes: &[u8]) -> Result<Option<Value>, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value = if content_type.ends_with("yaml") {
        serde_yaml::from_slice::<Value>(bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid YAML body: {e}")))?
    } else {
        serde_json::from_slice::<Value>(bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
    };
    Ok(Some(value))
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    let query_text = parts.uri.query().unwrap_or_default().to_string();
    let query = parse_query(&query_text);
    let param = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let watch = matches!(param("watch"), Some("1" | "true"));
    let header = |name| {
        parts
            .headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .map(String::from)
    };
    let content_type = header("content-type");
    let media_type = content_type
        .as_deref()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut record = RequestRecord {
        method: parts.method.to_string(),
        path: path.clone(),
        query: query_text.clone(),
        content_type: content_type.clone(),
        verb: "",
        status: 0,
        body: None,
        watch,
        watch_error: None,
        injected: false,
    };
    let response = respond(
        &shared,
        &parts,
        &path,
        &query,
        &media_type,
        &bytes,
        &mut record,
    )
    .await;
    record.status = response.status().as_u16();
    lock(&shared.log).push(record);
    shared.activity.send_modify(|n| *n += 1);
    Ok(response)
}

async fn respond(
    shared: &Arc<Shared>,
    parts: &hyper::http::request::Parts,
    path: &str,
    query: &[(String, String)],
    media_type: &str,
    bytes: &[u8],
    record: &mut RequestRecord,
) -> Response<Body> {
    let param = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let routed = route(shared, path);
    if let Ok(Target::Resource(route)) = &routed {
        record.verb = verb(&parts.method, route.name.is_some(), record.watch);
    }
    if let Some(err) = take_fault(shared, &parts.method, path, record.verb, record.watch) {
        record.injected = true;
        return error_response(&err);
    }
    let authorized = parts
        .headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Bearer {}", shared.token));
    if !authorized {
        return error_response(&ApiError::new(401, "Unauthorized"));
    }
    let route = match routed {
        Ok(Target::Resource(route)) => route,
        Ok(Target::Fixed(value)) => return json_response(200, &value),
        Ok(Target::Text(text)) => return Response::new(full(text)),
        Err(err) => return error_response(&err),
    };
    if matches!(
        parts.method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    ) {
        match parse_body(media_type, bytes) {
            Ok(body) => record.body = body,
            Err(err) => return error_response(&err),
        }
    }
    let metadata_only = parts
        .headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=PartialObjectMetadata"));
    let namespace = route.namespace.clone().unwrap_or_default();
    let rt = route.rt;
    let result: Result<(u16, Value), ApiError> = match (&parts.method, route.name.as_deref()) {
        (&Method::GET, None) => {
            let filter = match make_filter(
                shared,
                &route,
                param("labelSelector"),
                param("fieldSelector"),
            ) {
                Ok(f) => f,
                Err(err) => return error_response(&err),
            };
            if record.watch {
                return start_watch(shared, rt, filter, param, metadata_only, record);
            }
            let options = ListOptions {
                limit: param("limit").and_then(|l| l.parse().ok()),
                continue_token: param("continue")
                    .filter(|c| !c.is_empty())
                    .map(String::from),
                resource_version: param("resourceVersion").map(String::from),
                resource_version_match: param("resourceVersionMatch").map(String::from),
            };
            lock(&shared.store)
                .list(rt, &filter, &options)
                .map(|list| (200, list))
        }
        (&Method::GET, Some(name)) => lock(&shared.store)
            .get(rt, &namespace, name)
            .map(|o| (200, o)),
        (&Method::POST, None)
            if route.namespace.is_some() || !lock(&shared.store).resources[rt].namespaced =>
        {
            match record.body.clone() {
                Some(body)
                    if matches!(media_type, "" | "application/json" | "application/yaml") =>
                {
                    lock(&shared.store)
                        .create(rt, &namespace, body)
                        .map(|o| (201, o))
                }
                Some(_) => Err(unsupported_media_type(media_type)),
                None => Err(ApiError::bad_request("the request body is empty")),
            }
        }
        (&Method::PUT, Some(name)) => match record.body.clone() {
            Some(body) if matches!(media_type, "" | "application/json" | "application/yaml") => {
                lock(&shared.store)
                    .update(rt, &namespace, name, body, route.status)
                    .map(|(o, created)| (if created { 201 } else { 200 }, o))
            }
            Some(_) => Err(unsupported_media_type(media_type)),
            None => Err(ApiError::bad_request("the request body is empty")),
        },
        (&Method::PATCH, Some(name)) => {
            let patch_type = match media_type {
                "application/merge-patch+json" => PatchType::Merge,
                "application/json-patch+json" => PatchType::Json,
                "application/strategic-merge-patch+json" => PatchType::Strategic,
                "application/apply-patch+yaml" => PatchType::Apply,
                other => return error_response(&unsupported_media_type(other)),
            };
            match record.body.clone() {
                Some(body) => lock(&shared.store)
                    .patch(
                        rt,
                        &namespace,
                        name,
                        patch_type,
                        &body,
                        route.status,
                        param("fieldManager"),
                    )
                    .map(|(o, created)| (if created { 201 } else { 200 }, o)),
                None => Err(ApiError::bad_request("the request body is empty")),
            }
        }
        (&Method::DELETE, Some(name)) if !route.status => lock(&shared.store)
            .delete(rt, &namespace, name, record.body.as_ref())
            .map(|o| (200, o)),
        (&Method::DELETE, None) => match make_filter(
            shared,
            &route,
            param("labelSelector"),
            param("fieldSelector"),
        ) {
            Ok(filter) => lock(&shared.store)
                .delete_collection(rt, &filter)
                .map(|l| (200, l)),
            Err(err) => Err(err),
        },
        _ => Err(ApiError::new(
            405,
            "the server does not allow this method on the requested resource",
        )),
    };
    match result {
        Ok((code, object)) if metadata_only => json_response(code, &partial_metadata(&object)),
        Ok((code, object)) => json_response(code, &object),
        Err(err) => error_response(&err),
    }
}

fn unsupported_media_type(media_type: &str) -> ApiError {
    ApiError::new(415, format!("the body of the request was in an unknown format - accepted media types include: application/json, application/yaml; got {media_type:?}"))
}

fn make_filter(
    shared: &Shared,
    route: &Route,
    labels: Option<&str>,
    fields: Option<&str>,
) -> Result<Filter, ApiError> {
    let allowed = lock(&shared.store).resources[route.rt].field_selectors;
    Ok(Filter {
        namespace: route.namespace.clone(),
        labels: LabelSelector::parse(labels.unwrap_or("")).map_err(ApiError::bad_request)?,
        fields: FieldSelector::parse(fields.unwrap_or(""), allowed)
            .map_err(ApiError::bad_request)?,
    })
}

/// The `PartialObjectMetadata(List)` form asked for with
/// `Accept: ...;as=PartialObjectMetadata(List);g=meta.k8s.io;v=v1`.
fn partial_metadata(object: &Value) -> Value {
    let one = |o: &Value| json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": o["metadata"].clone()});
    match object.get("items").and_then(Value::as_array) {
        Some(items) => json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadataList",
            "metadata": object["metadata"].clone(),
            "items": items.iter().map(one).collect::<Vec<_>>(),
        }),
        None => one(object),
    }
}

/// Counts an open watch stream for as long as its producer runs.
struct WatchGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl WatchGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        let id = shared.next_watch.fetch_add(1, Ordering::Relaxed);
        lock(&shared.watches).insert(id);
        shared.activity.send_modify(|n| *n += 1);
        Self {
            shared: shared.clone(),
            id,
        }
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        lock(&self.shared.watches).remove(&self.id);
        self.shared.activity.send_modify(|n| *n += 1);
    }
}

fn start_watch<'a>(
    shared: &Arc<Shared>,
    rt: usize,
    filter: Filter,
    param: impl Fn(&str) -> Option<&'a str>,
    metadata_only: bool,
    record: &mut RequestRecord,
) -> Response<Body> {
    let from = match param("resourceVersion") {
        None | Some("" | "0") => WatchFrom::Now,
        Some(text) => match text.parse() {
            Ok(rv) => WatchFrom::After(rv),
            Err(_) => {
                return error_response(&ApiError::bad_request(format!(
                    "invalid resource version {text:?}"
                )))
            }
        },
    };
    let send_initial_events = param("sendInitialEvents") == Some("true");
    let from = if send_initial_events {
        WatchFrom::Now
    } else {
        from
    };
    let bookmarks = param("allowWatchBookmarks") == Some("true");
    let timeout = param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|&t| t > 0)
        .map(Duration::from_secs);
    let (api_version, kind) = {
        let store = lock(&shared.store);
        (store.resources[rt].api_version(), store.resources[rt].kind)
    };
    let registered = lock(&shared.store).watch(rt, from);
    let (initial, start_rv, mut changes) = match registered {
        Ok(started) => started,
        Err(err) => {
            // Like the real server: 200, then one ERROR event, then the end.
            record.watch_error = Some(err.code);
            let line = json!({"type": "ERROR", "object": err.to_status()}).to_string() + "\n";
            return json_response_raw(line);
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let guard = WatchGuard::new(shared);
    let shared = shared.clone();
    let bookmark = move |rv: u64, initial_end: bool| {
        let (av, k) = if metadata_only {
            ("meta.k8s.io/v1".to_string(), "PartialObjectMetadata")
        } else {
            (api_version.clone(), kind)
        };
        let mut object =
            json!({"kind": k, "apiVersion": av, "metadata": {"resourceVersion": rv.to_string()}});
        if initial_end {
            object["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        Bytes::from(json!({"type": "BOOKMARK", "object": object}).to_string() + "\n")
    };
    tokio::spawn(async move {
        let _guard = guard;
        let mut last_rv = 0u64;
        let render = |change: &Change, last_rv: &mut u64| -> Option<Bytes> {
            *last_rv = (*last_rv).max(change.rv);
            // A watch from a resourceVersion not reached yet starts there.
            if matches!(from, WatchFrom::After(n) if change.rv <= n) {
                return None;
            }
            let event_type = event_type(change, &filter)?;
            let object = if metadata_only {
                partial_metadata(&change.object)
            } else {
                change.object.clone()
            };
            Some(Bytes::from(
                json!({"type": event_type, "object": object}).to_string() + "\n",
            ))
        };
        for change in &initial {
            if let Some(line) = render(change, &mut last_rv) {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        }
        last_rv = last_rv.max(start_rv);
        if send_initial_events && tx.send(bookmark(start_rv, true)).await.is_err() {
            return;
        }
        let mut ticker = tokio::time::interval(shared.bookmark_interval);
        ticker.tick().await;
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let sleep_until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep_until_deadline);
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                change = changes.recv() => {
                    let Some(change) = change else { return };
                    if let Some(line) = render(&change, &mut last_rv) {
                        if tx.send(line).await.is_err() {
                            return;
                        }
                    }
                }
                _ = ticker.tick(), if bookmarks => {
                    // Everything up to `current` is already queued: send it, then the bookmark.
                    let current = lock(&shared.store).resource_version();
                    while let Ok(change) = changes.try_recv() {
                        if let Some(line) = render(&change, &mut last_rv) {
                            if tx.send(line).await.is_err() {
                                return;
                            }
                        }
                    }
                    if tx.send(bookmark(current.max(last_rv), false)).await.is_err() {
                        return;
                    }
                }
                _ = &mut sleep_until_deadline => {
                    if bookmarks {
                        let current = lock(&shared.store).resource_version();
                        while let Ok(change) = changes.try_recv() {
                            if let Some(line) = render(&change, &mut last_rv) {
                                let _ = tx.send(line).await;
                            }
                        }
                        let _ = tx.send(bookmark(current.max(last_rv), false)).await;
                    }
                    return;
                }
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|line| (Ok::<_, Infallible>(Frame::data(line)), rx))
    });
    let mut response = Response::new(StreamBody::new(stream).boxed());
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn json_response_raw(text: String) -> Response<Body> {
    let mut response = Response::new(full(text));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// What a watch with `filter` sees of a change: objects entering the
/// selection are ADDED, objects leaving it DELETED, as the real server does.
fn event_type(change: &Change, filter: &Filter) -> Option<&'static str> {
    let now = filter.matches(&change.object);
    match change.kind {
        ChangeKind::Added => now.then_some("ADDED"),
        ChangeKind::Deleted => now.then_some("DELETED"),
        ChangeKind::Modified => {
            let before = change.prev.as_ref().is_some_and(|p| filter.matches(p));
            match (before, now) {
                (true, true) => Some("MODIFIED"),
                (false, true) => Some("ADDED"),
                (true, false) => Some("DELETED"),
                (false, false) => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query("labelSelector=app%3Dweb%2Ctier&watch=true&x=a+b&flag");
        assert_eq!(q[0], ("labelSelector".into(), "app=web,tier".into()));
        assert_eq!(q[1], ("watch".into(), "true".into()));
        assert_eq!(q[2], ("x".into(), "a b".into()));
        assert_eq!(q[3], ("flag".into(), String::new()));
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
