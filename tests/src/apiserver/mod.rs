//! A Kubernetes API server for tests, speaking the real HTTP API.
//!
//! No kube-apiserver can run on the machines that run xlb's tests, so the
//! suite starts this one. It keeps objects in memory and follows the API
//! conventions closely enough that kube-rs clients (`kube::Api`, the
//! `watcher`, `reflector`, the `Controller` runtime) and the agent cannot tell
//! the difference in what they use: resourceVersions, watches that resume
//! from a resourceVersion or answer 410 Expired, bookmarks, paging,
//! selectors, conflicts, the status subresource, finalizers.
//! Its point is fault injection: closing every watch, compacting the
//! history, failing the next requests, taking the whole server down.
//!
//! # Starting it
//!
//! The server always runs on its own tokio runtime in its own thread, so it
//! keeps serving while the test blocks, and works the same from async and
//! sync tests. Dropping the handle stops it.
//!
//! ```no_run
//! # async fn demo() {
//! use xlb_tests::apiserver::TestApiServer;
//! use k8s_openapi::api::core::v1::Service;
//!
//! let server = TestApiServer::start().await;          // or start_blocking() in a #[test]
//! server.write_kubeconfig("/tmp/kubeconfig").unwrap(); // for lb-agent: KUBECONFIG=...
//! let client = server.client();                       // a kube::Client (needs a tokio runtime)
//! let services: kube::Api<Service> = kube::Api::namespaced(client, "default");
//! # }
//! ```
//!
//! # Direct store access
//!
//! [`TestApiServer::create`], [`update`](TestApiServer::update),
//! [`update_status`](TestApiServer::update_status), [`patch`](TestApiServer::patch),
//! [`apply`](TestApiServer::apply), [`delete`](TestApiServer::delete),
//! [`get`](TestApiServer::get) and [`list`](TestApiServer::list) take typed
//! objects (k8s-openapi types, or `#[derive(CustomResource)]` types such as
//! `LoadBalancerPool`); the `*_json` variants take `serde_json::Value`. They
//! go through the same code as HTTP requests (same checks, same
//! resourceVersions, same watch events) but are not logged and not subject
//! to injected faults. They are plain (non-async) functions.
//!
//! # Served resources
//!
//! core/v1 `services` (+status), `nodes` (+status), `namespaces` (+status),
//! `events`; discovery.k8s.io/v1 `endpointslices`; coordination.k8s.io/v1
//! `leases`; events.k8s.io/v1 `events`; xlb.dev/v1alpha1
//! `loadbalancerpools` (cluster-scoped, +status). More with
//! [`ServerOptions::resource`]. Unknown paths get 404 with a `Status`.
//! Paths: `/api/v1/...` and `/apis/GROUP/VERSION/...`, namespaced
//! (`/namespaces/NS/RESOURCE[/NAME[/status]]`), cluster-scoped, and
//! all-namespaces list/watch (`/api/v1/services`). Also `/version`,
//! `/healthz`, `/api`, `/apis` and per-group resource lists (legacy
//! discovery; aggregated discovery is not served).
//!
//! # What behaves as in Kubernetes
//!
//! - One resourceVersion counter for the whole store; each write sets
//!   `metadata.resourceVersion`, and create sets `uid`, `creationTimestamp`
//!   and (Services, EndpointSlices, custom resources) `generation`, which
//!   grows when anything outside metadata and status changes. A write that
//!   changes nothing gets no new resourceVersion and no watch event.
//! - Create: 409 AlreadyExists; `generateName`; 422 for a missing or invalid
//!   name; 500 if the body carries a resourceVersion (as the real server);
//!   status dropped for Services (`{"loadBalancer":{}}`) and custom
//!   resources; Service defaults (type, ports' protocol and targetPort,
//!   clusterIP from 10.96.0.0/12, nodePorts for LoadBalancer/NodePort,
//!   traffic policies) and EndpointSlice port protocol defaults.
//! - Update (PUT): 409 Conflict for a stale `metadata.resourceVersion`;
//!   without one, unconditional (custom resources: 422, they require it);
//!   PUT to a missing object creates it for Services, Leases and Events
//!   only. With a status subresource, PUT/PATCH to the object keep the old
//!   status, and PUT/PATCH to `/status` change only `status` (metadata
//!   changes there are ignored too, as for custom resources).
//! - Patch: `application/merge-patch+json` (RFC 7386),
//!   `application/json-patch+json` (RFC 6902). **Limitations:**
//!   `application/strategic-merge-patch+json` is applied as a merge patch
//!   (lists are replaced, not merged by key; `$patch` directives are not
//!   understood), and `application/apply-patch+yaml` (server-side apply)
//!   is a merge patch of the applied object, creating it when missing: no
//!   managedFields, no field ownership conflicts, fields dropped from the
//!   applied config are not removed. Apply requires `fieldManager` (422).
//!   A `metadata.resourceVersion` in any patch is a precondition (409).
//! - Delete returns the deleted object (200) and emits DELETED carrying the
//!   deletion's resourceVersion. Objects with finalizers get a
//!   `deletionTimestamp` (MODIFIED) and go when the last finalizer is
//!   removed (DELETED); no new finalizers may be added meanwhile (422).
//!   DeleteOptions preconditions (uid, resourceVersion) are checked.
//!   DELETE on a collection deletes what the selectors match.
//! - List: `kind: XList` with `metadata.resourceVersion`; `labelSelector`
//!   (`a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`,
//!   comma = AND), `fieldSelector` (`metadata.name`, `metadata.namespace`,
//!   and per resource e.g. `spec.type`, `involvedObject.name`; others 400),
//!   `limit`/`continue` served from a consistent snapshot at the first
//!   page's resourceVersion (410 Expired once compacted),
//!   `resourceVersion` + `resourceVersionMatch=Exact|NotOlderThan`.
//!   Items of built-in types carry no apiVersion/kind (custom resources do),
//!   as on the real server. `Accept: ...;as=PartialObjectMetadataList` is
//!   answered with metadata only.
//! - Watch (`?watch=true`): newline-delimited `{"type","object"}` events.
//!   From `resourceVersion=N` it replays every change after N from the
//!   history, then streams live ones; with no resourceVersion or `0` it
//!   first sends ADDED for every existing object. An N older than the
//!   history (see [`compact`](TestApiServer::compact) and
//!   [`ServerOptions::history_limit`]) gets HTTP 200 and a single
//!   `ERROR` event with a 410 Expired Status, then the stream ends.
//!   `allowWatchBookmarks=true` adds a BOOKMARK with the current
//!   resourceVersion every [`ServerOptions::bookmark_interval`] and when
//!   `timeoutSeconds` ends the watch. `sendInitialEvents=true` sends the
//!   current objects then a bookmark annotated `k8s.io/initial-events-end`.
//!   Objects moving into or out of a watch's selectors are sent as ADDED /
//!   DELETED.
//! - Requests need `Authorization: Bearer <token>` (401 otherwise); the
//!   kubeconfig and [`client`](TestApiServer::client) carry it.
//! - Not modelled: namespaces need not exist, no admission, no RBAC, no
//!   garbage collection of owned objects, no dryRun, no protobuf, no
//!   field validation of specs beyond the above.
//!
//! # Faults
//!
//! - [`drop_watches`](TestApiServer::drop_watches): closes every connection
//!   and watch stream (an API server restart); clients reconnect.
//! - [`compact`](TestApiServer::compact): forgets the history, so resumed
//!   watches get the 410 ERROR event and continue tokens expire.
//! - [`fail_next`](TestApiServer::fail_next) /
//!   [`inject`](TestApiServer::inject) with a [`Fault`]: the next matching
//!   requests fail with a code and a `Status` body (429 and 503 may carry
//!   `Retry-After`). Note that kube-rs's client retries 429, 503 and 504 by
//!   itself (up to 15 times), so those reach the caller only when they
//!   outlast its retries; 500 and 409 reach it at once.
//! - [`set_down`](TestApiServer::set_down): closes the port (connections
//!   are refused) and drops every connection; `set_down(false)` reopens the
//!   same port with the store intact.
//! - [`requests`](TestApiServer::requests): every HTTP request with its
//!   verb, path, query, content type, status and parsed body, to assert
//!   e.g. that the agent PATCHed a Service's `/status`.
//! - [`wait_for`](TestApiServer::wait_for) /
//!   [`wait_for_blocking`](TestApiServer::wait_for_blocking): poll a
//!   condition on the server (store, log, open watches) until it holds or a
//!   deadline passes, re-checking on every change.

mod error;
mod http;
mod patch;
mod resources;
mod selector;
mod store;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};

pub use error::ApiError;
pub use resources::ResourceType;
pub use store::PatchType;

use http::{lock, Shared};
use store::Store;

/// How to start a [`TestApiServer`].
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// Bearer token clients must send.
    pub token: String,
    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK.
    /// (The real server sends them about once a minute; tests want them sooner.)
    pub bookmark_interval: Duration,
    /// Changes kept for watches to resume from; older ones are compacted.
    pub history_limit: usize,
    pub resources: Vec<ResourceType>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            port: 0,
            token: "xlb-test-token".into(),
            bookmark_interval: Duration::from_secs(1),
            history_limit: 10_000,
            resources: ResourceType::builtin(),
        }
    }
}

impl ServerOptions {
    /// Serves another resource type too.
    pub fn resource(mut self, resource: ResourceType) -> Self {
        self.resources.push(resource);
        self
    }
}

/// A rule that makes matching requests fail:
/// `Fault::new(503).times(2).method("PATCH").path_contains("/status")`,
/// `Fault::new(500).verb("list")`. All set conditions must hold.
#[derive(Clone, Debug)]
pub struct Fault {
    pub code: u16,
    /// How many matching requests fail (then the rule is gone).
    pub times: usize,
    /// Only this HTTP method (`"GET"`, `"PATCH"`, ...).
    pub method: Option<String>,
    /// Only paths containing this (`"/status"`, `"/leases/"`).
    pub path_contains: Option<String>,
    /// Only this Kubernetes verb (`"list"`, `"watch"`, `"patch"`, ...; see
    /// [`RequestRecord::verb`]).
    pub verb: Option<String>,
    /// Only watch requests (`Some(true)`) or only others (`Some(false)`).
    pub watch: Option<bool>,
    /// Sent as `Retry-After` (429 gets 1 second unless set).
    pub retry_after_seconds: Option<u64>,
    /// The Status message; a default names the injected code.
    pub message: Option<String>,
}

impl Fault {
    /// Fails the next request (any) with `code`.
    pub fn new(code: u16) -> Self {
        Self {
            code,
            times: 1,
            method: None,
            path_contains: None,
            verb: None,
            watch: None,
            retry_after_seconds: (code == 429).then_some(1),
            message: None,
        }
    }

    pub fn times(mut self, times: usize) -> Self {
        self.times = times;
        self
    }

    pub fn method(mut self, method: &str) -> Self {
        self.method = Some(method.to_ascii_uppercase());
        self
    }

    pub fn verb(mut self, verb: &str) -> Self {
        self.verb = Some(verb.to_ascii_lowercase());
        self
    }

    pub fn path_contains(mut self, part: &str) -> Self {
        self.path_contains = Some(part.to_string());
        self
    }

    pub fn watches_only(mut self) -> Self {
        self.watch = Some(true);
        self
    }

    pub fn non_watches_only(mut self) -> Self {
        self.watch = Some(false);
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_seconds = Some(seconds);
        self
    }

    pub fn message(mut self, message: &str) -> Self {
        self.message = Some(message.to_string());
        self
    }

    fn matches(&self, method: &str, path: &str, verb: &str, watch: bool) -> bool {
        self.times > 0
            && self.method.as_deref().is_none_or(|m| m == method)
            && self.verb.as_deref().is_none_or(|v| v == verb)
            && self
                .path_contains
                .as_deref()
                .is_none_or(|p| path.contains(p))
            && self.watch.is_none_or(|w| w == watch)
    }
}

/// One HTTP request the server answered.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    /// `GET`, `PATCH`, ...
    pub method: String,
    pub path: String,
    /// The raw query string (see [`param`](Self::param)).
    pub query: String,
    pub content_type: Option<String>,
    /// Kubernetes verb: `get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`, `deletecollection`; empty for other paths and for requests
    /// not naming a resource.
    pub verb: &'static str,
    /// HTTP status of the response (200 for watches, even expired ones).
    pub status: u16,
    /// The body of writes, parsed (JSON or YAML).
    pub body: Option<Value>,
    pub watch: bool,
    /// The code of the ERROR event a watch was answered with (410 when
    /// its resourceVersion was compacted).
    pub watch_error: Option<u16>,
    /// Failed by an injected [`Fault`].
    pub injected: bool,
}

impl RequestRecord {
    /// A decoded query parameter.
    pub fn param(&self, name: &str) -> Option<String> {
        http::parse_query(&self.query)
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }
}

/// Types the typed store methods take: k8s-openapi resources and
/// `#[derive(CustomResource)]` types.
pub trait ApiObject: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned {}

impl<K: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned> ApiObject for K {}

/// A running test API server; dropping it stops the server.
pub struct TestApiServer {
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestApiServer {
    /// Starts a server with default options on 127.0.0.1 and a free port.
    pub async fn start() -> Self {
        Self::start_blocking_with(ServerOptions::default())
    }

    /// [`start`](Self::start) with options.
    pub async fn start_with(options: ServerOptions) -> Self {
        Self::start_blocking_with(options)
    }

    /// Starts a server from synchronous code (no runtime needed).
    pub fn start_blocking() -> Self {
        Self::start_blocking_with(ServerOptions::default())
    }

    /// [`start_blocking`](Self::start_blocking) with options.
    pub fn start_blocking_with(options: ServerOptions) -> Self {
        // Bound here so the address is known (and errors surface) at once.
        let std_listener = std::net::TcpListener::bind(("127.0.0.1", options.port))
            .unwrap_or_else(|e| panic!("test apiserver cannot bind port {}: {e}", options.port));
        let addr = std_listener
            .local_addr()
            .expect("bound socket has an address");
        std_listener
            .set_nonblocking(true)
            .expect("listener can be non-blocking");
        let activity = Arc::new(watch::Sender::new(0u64));
        let store = Store::new(options.resources, options.history_limit, activity.clone());
        let shared = Arc::new(Shared::new(
            store,
            options.token,
            options.bookmark_interval,
            addr,
            activity,
        ));
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let server_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("test-apiserver-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("test-apiserver")
                    .enable_all()
                    .build()
                    .expect("tokio runtime for the test apiserver");
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener)
                        .expect("listener joins the runtime");
                    tokio::spawn(http::serve(server_shared, listener));
                    let _ = shutdown_rx.await;
                });
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .expect("spawn the test apiserver thread");
        let server = Self {
            shared,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        };
        server.wait_listening(true);
        server
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// The bearer token clients must send.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// A kubeconfig (cluster `xlb-test` at [`url`](Self::url), a user with
    /// the token, a current context with namespace `default`).
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: xlb-test\n  cluster:\n    server: {url}\n\
             users:\n- name: xlb-test\n  user:\n    token: {token}\n\
             contexts:\n- name: xlb-test\n  context:\n    cluster: xlb-test\n    user: xlb-test\n    namespace: default\n\
             current-context: xlb-test\npreferences: {{}}\n",
            url = self.url(),
            token = self.shared.token
        )
    }

    /// Writes [`kubeconfig_yaml`](Self::kubeconfig_yaml) to `path`.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
    }

    /// A kube-rs client configuration for this server.
    pub fn client_config(&self) -> kube::Config {
        let url = self.url().parse().expect("server URL parses");
        let mut config = kube::Config::new(url);
        config.default_namespace = "default".into();
        config.auth_info =
            serde_json::from_value(json!({"token": self.shared.token})).expect("token auth info");
        config
    }

    /// A kube-rs client for this server. Call it inside a tokio runtime
    /// (the client spawns a task there).
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.client_config()).expect("kube client for the test apiserver")
    }

    /// The current (latest) resourceVersion of the store.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).resource_version()
    }

    fn resource_of(&self, api_version: &str, kind: &str) -> Result<usize, ApiError> {
        lock(&self.shared.store)
            .find_kind(api_version, kind)
            .ok_or_else(|| {
                ApiError::new(
                    404,
                    format!("no resource {kind} in {api_version} is served"),
                )
            })
    }

    /// The resource type and namespace for a write of `object`
    /// (namespaced objects without a namespace go to `default`).
    fn target(&self, object: &Value) -> Result<(usize, String), ApiError> {
        let api_version = object["apiVersion"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        let rt = self.resource_of(api_version, kind)?;
        let namespaced = lock(&self.shared.store).resources[rt].namespaced;
        let namespace = store::meta_str(object, "namespace").unwrap_or_default();
        let namespace = if namespaced && namespace.is_empty() {
            "default"
        } else {
            namespace
        };
        Ok((rt, namespace.to_string()))
    }

    fn name_of(object: &Value) -> Result<String, ApiError> {
        store::meta_str(object, "name")
            .map(String::from)
            .ok_or_else(|| ApiError::bad_request("the object has no metadata.name"))
    }

    /// Creates an object (apiVersion and kind say which resource).
    pub fn create_json(&self, object: Value) -> Result<Value, ApiError> {
        let (rt, ns) = self.target(&object)?;
        lock(&self.shared.store).create(rt, &ns, object)
    }

    /// Replaces an object (PUT semantics: status kept where there is a
    /// status subresource; a stale resourceVersion is a 409).
    pub fn update_json(&self, object: Value) -> Result<Value, ApiError> {
        self.put(object, false)
    }

    /// Replaces only the status (PUT to `/status`).
    pub fn update_status_json(&self, object: Value) -> Result<Value, ApiError> {
        self.put(object, true)
    }

    fn put(&self, object: Value, status_only: bool) -> Result<Value, ApiError> {
        let (rt, ns) = self.target(&object)?;
        let name = Self::name_of(&object)?;
        lock(&self.shared.store)
            .update(rt, &ns, &name, object, status_only)
            .map(|(o, _)| o)
    }

    /// Creates the object, or merges it into the existing one (like
    /// server-side apply here; see the module docs).
    pub fn apply_json(&self, object: Value) -> Result<Value, ApiError> {
        let (rt, ns) = self.target(&object)?;
        let name = Self::name_of(&object)?;
        lock(&self.shared.store)
            .patch(
                rt,
                &ns,
                &name,
                PatchType::Apply,
                &object,
                false,
                Some("xlb-tests"),
            )
            .map(|(o, _)| o)
    }

    /// Applies a patch to an object, or to its status with `status_only`.
    #[allow(clippy::too_many_arguments)]
    pub fn patch_json(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        patch_type: PatchType,
        patch: &Value,
        status_only: bool,
    ) -> Result<Value, ApiError> {
        let rt = self.resource_of(api_version, kind)?;
        lock(&self.shared.store)
            .patch(
                rt,
                namespace.unwrap_or(""),
                name,
                patch_type,
                patch,
                status_only,
                Some("xlb-tests"),
            )
            .map(|(o, _)| o)
    }

    /// Deletes an object (with finalizers: marks it for deletion).
    pub fn delete_json(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let rt = self.resource_of(api_version, kind)?;
        lock(&self.shared.store).delete(rt, namespace.unwrap_or(""), name, None)
    }

    pub fn get_json(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let rt = self.resource_of(api_version, kind).ok()?;
        lock(&self.shared.store)
            .get(rt, namespace.unwrap_or(""), name)
            .ok()
    }

    /// Objects in `namespace` (`None`: all namespaces), sorted by namespace and name.
    pub fn list_json(&self, api_version: &str, kind: &str, namespace: Option<&str>) -> Vec<Value> {
        let Ok(rt) = self.resource_of(api_version, kind) else {
            return Vec::new();
        };
        let filter = store::Filter {
            namespace: namespace.map(String::from),
            ..Default::default()
        };
        let store = lock(&self.shared.store);
        let list = store
            .list(rt, &filter, &Default::default())
            .unwrap_or_default();
        let (api_version, kind) = (store.resources[rt].api_version(), store.resources[rt].kind);
        let mut items = list["items"].as_array().cloned().unwrap_or_default();
        for item in &mut items {
            item["apiVersion"] = json!(api_version);
            item["kind"] = json!(kind);
        }
        items
    }

    fn to_value<K: ApiObject>(object: &K) -> Result<Value, ApiError> {
        let mut value =
            serde_json::to_value(object).map_err(|e| ApiError::bad_request(e.to_string()))?;
        value["apiVersion"] = json!(K::api_version(&()));
        value["kind"] = json!(K::kind(&()));
        Ok(value)
    }

    fn from_value<K: ApiObject>(value: Value) -> Result<K, ApiError> {
        serde_json::from_value(value)
            .map_err(|e| ApiError::internal(format!("stored object does not deserialize: {e}")))
    }

    pub fn create<K: ApiObject>(&self, object: &K) -> Result<K, ApiError> {
        Self::from_value(self.create_json(Self::to_value(object)?)?)
    }

    pub fn update<K: ApiObject>(&self, object: &K) -> Result<K, ApiError> {
        Self::from_value(self.update_json(Self::to_value(object)?)?)
    }

    pub fn update_status<K: ApiObject>(&self, object: &K) -> Result<K, ApiError> {
        Self::from_value(self.update_status_json(Self::to_value(object)?)?)
    }

    pub fn apply<K: ApiObject>(&self, object: &K) -> Result<K, ApiError> {
        Self::from_value(self.apply_json(Self::to_value(object)?)?)
    }

    /// Merge-patches (RFC 7386) an object.
    pub fn patch<K: ApiObject>(
        &self,
        namespace: Option<&str>,
        name: &str,
        merge_patch: &Value,
    ) -> Result<K, ApiError> {
        self.merge_patch(namespace, name, merge_patch, false)
    }

    /// Merge-patches (RFC 7386) an object's status.
    pub fn patch_status<K: ApiObject>(
        &self,
        namespace: Option<&str>,
        name: &str,
        merge_patch: &Value,
    ) -> Result<K, ApiError> {
        self.merge_patch(namespace, name, merge_patch, true)
    }

    fn merge_patch<K: ApiObject>(
        &self,
        namespace: Option<&str>,
        name: &str,
        merge_patch: &Value,
        status_only: bool,
    ) -> Result<K, ApiError> {
        Self::from_value(self.patch_json(
            &K::api_version(&()),
            &K::kind(&()),
            namespace,
            name,
            PatchType::Merge,
            merge_patch,
            status_only,
        )?)
    }

    /// Deletes an object; returns it as deleted (or as marked for deletion
    /// when it has finalizers).
    pub fn delete<K: ApiObject>(&self, namespace: Option<&str>, name: &str) -> Result<K, ApiError> {
        Self::from_value(self.delete_json(&K::api_version(&()), &K::kind(&()), namespace, name)?)
    }

    pub fn get<K: ApiObject>(&self, namespace: Option<&str>, name: &str) -> Option<K> {
        self.get_json(&K::api_version(&()), &K::kind(&()), namespace, name)
            .and_then(|v| Self::from_value(v).ok())
    }

    /// Objects in `namespace` (`None`: all namespaces or cluster-scoped).
    pub fn list<K: ApiObject>(&self, namespace: Option<&str>) -> Vec<K> {
        self.list_json(&K::api_version(&()), &K::kind(&()), namespace)
            .into_iter()
            .filter_map(|v| Self::from_value(v).ok())
            .collect()
    }

    // ---- faults ----

    /// Closes every open connection and watch stream, as an API server
    /// restart does; the listener stays up. Returns once they are closed.
    pub fn drop_watches(&self) {
        let (connections, watches) = self.shared.abort_connections();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.shared.closed(&connections, &watches) {
            assert!(
                Instant::now() < deadline,
                "test apiserver connections did not close"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Forgets the change history: watches resuming from any earlier
    /// resourceVersion get a 410 Expired ERROR event, continue tokens expire.
    /// Open watches keep streaming (combine with
    /// [`drop_watches`](Self::drop_watches) to force resumes).
    pub fn compact(&self) {
        lock(&self.shared.store).compact();
    }

    /// The next `times` requests fail with `code` and a Status body.
    pub fn fail_next(&self, times: usize, code: u16) {
        self.inject(Fault::new(code).times(times));
    }

    /// Adds a fault rule (rules are tried in the order added).
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared.faults).push(fault);
    }

    /// Removes fault rules not used up yet.
    pub fn clear_faults(&self) {
        lock(&self.shared.faults).clear();
    }

    /// Rules not used up yet.
    pub fn pending_faults(&self) -> Vec<Fault> {
        lock(&self.shared.faults).clone()
    }

    /// `true`: close the port (connections refused) and every connection;
    /// `false`: listen on the same port again. The store is kept. Returns
    /// once the change has happened.
    pub fn set_down(&self, down: bool) {
        self.shared.up.send_replace(!down);
        // Going down, `listening` turns false once every connection is closed.
        self.wait_listening(!down);
    }

    pub fn is_down(&self) -> bool {
        !*self.shared.up.borrow()
    }

    fn wait_listening(&self, listening: bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while *self.shared.listening.borrow() != listening {
            assert!(
                Instant::now() < deadline,
                "test apiserver did not switch listening to {listening}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Watch streams open now.
    pub fn open_watches(&self) -> usize {
        self.shared.open_watches()
    }

    /// Every HTTP request answered so far, oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.log).clear();
    }

    /// Calls `check` now and after every change to the store, the request
    /// log or the open watches, until it returns `Some` or `timeout` passes
    /// (then `None`).
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&Self) -> Option<T>,
    ) -> Option<T> {
        let mut activity = self.shared.activity.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            activity.borrow_and_update();
            if let Some(found) = check(self) {
                return Some(found);
            }
            match tokio::time::timeout_at(deadline, activity.changed()).await {
                Ok(Ok(())) => {}
                _ => return check(self),
            }
        }
    }

    /// [`wait_for`](Self::wait_for) for synchronous code.
    pub fn wait_for_blocking<T>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&Self) -> Option<T>,
    ) -> Option<T> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = check(self) {
                return Some(found);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
