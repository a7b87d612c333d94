//! A real Kubernetes control plane for tests: etcd, kube-apiserver (RBAC,
//! serving certificate, service-account keys) and kube-controller-manager
//! running the EndpointSlice and ServiceAccount controllers, started per
//! test on free ports and stopped (by PID) when the handle drops.
//!
//! The binaries are built by `cargo xtask setup` into `/opt/xlb-k8s/bin`
//! (`$XLB_K8S_BIN` overrides). Nothing here imitates the API: the helpers
//! only do what a kubelet or a user with kubectl would do.
//!
//! # Reaching it from a network namespace
//!
//! kube-apiserver listens on every host address. [`Cluster::reach_from`]
//! adds a veth from the host into a namespace; the host end carries
//! [`API_HOST`] (the same address on every such link) and the namespace end
//! an address of its own, so an agent in the namespace talks to
//! `https://10.255.255.1:PORT`, which the serving certificate names.
//!
//! # Pods without a kubelet
//!
//! [`Cluster::add_node`] creates the Node, [`Cluster::run_pod`] creates a
//! Pod bound to it and patches its status the way a kubelet would (Running,
//! its IP, Ready), so the real EndpointSlice controller writes the slices.
//! [`Cluster::set_pod_ready`] flips readiness, [`Cluster::terminate_pod`]
//! deletes it gracefully (it stays terminating: no kubelet finishes it) and
//! [`Cluster::remove_pod`] deletes it for good.

use std::{
    fs,
    io::Write,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        OnceLock,
    },
    time::Duration,
};

use serde_json::{json, Value};

use crate::{netns::Netns, traffic::poll_until};

/// The API server's address as seen from namespaces joined with [`Cluster::reach_from`].
pub const API_HOST: Ipv4Addr = Ipv4Addr::new(10, 255, 255, 1);
/// The chart's release as the tests install it.
pub const AGENT_NAMESPACE: &str = "xlb-system";
pub const AGENT_SERVICE_ACCOUNT: &str = "xlb";
/// What kubelet-run workloads need beyond the EndpointSlice and
/// ServiceAccount controllers every test cluster runs.
const REAL_NODE_CONTROLLERS: &[&str] = &[
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "node-lifecycle-controller",
    "node-ipam-controller",
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-token-controller",
];
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Where `cargo xtask setup` puts kube-apiserver, kube-controller-manager,
/// kubectl, etcd and etcdctl.
pub fn k8s_bin(name: &str) -> PathBuf {
    let dir = std::env::var_os("XLB_K8S_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/xlb-k8s/bin"));
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask setup` (it builds the Kubernetes control plane)",
        path.display()
    );
    path
}

/// A port nobody listens on right now, on any address.
pub fn free_port() -> u16 {
    // Below the kernel's ephemeral range (32768-60999): a free ephemeral
    // port can be taken by some process's outgoing connection between this
    // check and the server's bind ("address already in use", seen in CI).
    // Each test process starts at its own place in 20000-29999.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id() % 400 * 25;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20000 + ((start + n) % 10000) as u16;
        if TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok() {
            return port;
        }
    }
}

/// Certificates and keys, made once per test process with openssl.
struct Pki {
    dir: PathBuf,
}

/// The PKI directories of test processes that have ended: a static has
/// no drop, so each process clears those its predecessors left.
fn remove_stale_pki() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("xlb-k8s-pki-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

impl Pki {
    fn get() -> &'static Pki {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("xlb-k8s-pki-{}", std::process::id()));
            remove_stale_pki();
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            let pki = Pki { dir };
            pki.make();
            pki
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn openssl(&self, args: &[&str]) {
        checked(
            Command::new("openssl").current_dir(&self.dir).args(args),
            &format!("openssl {args:?}"),
        );
    }

    fn make(&self) {
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        self.openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-keyout", "ca.key", "-out", "ca.crt", "-days", "3650"],
                &["-subj", "/CN=xlb-test-ca"],
            ]
            .concat(),
        );
        let sans = format!(
            "subjectAltName=IP:127.0.0.1,IP:{API_HOST},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
        );
        self.signed("apiserver", "/CN=kube-apiserver", &sans, "serverAuth");
        self.signed(
            "admin",
            "/O=system:masters/CN=xlb-test-admin",
            "subjectAltName=DNS:xlb-test-admin",
            "clientAuth",
        );
        self.signed(
            "controller-manager",
            "/CN=system:kube-controller-manager",
            "subjectAltName=DNS:kube-controller-manager",
            "clientAuth",
        );
        self.signed(
            "scheduler",
            "/CN=system:kube-scheduler",
            "subjectAltName=DNS:kube-scheduler",
            "clientAuth",
        );
        // The API server's client certificate towards kubelets (logs, exec).
        self.signed(
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            "subjectAltName=DNS:kube-apiserver-kubelet-client",
            "clientAuth",
        );
        self.openssl(&[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "sa.key",
        ]);
        self.openssl(&["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
    }

    fn signed(&self, name: &str, subject: &str, sans: &str, usage: &str) {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let crt = format!("{name}.crt");
        self.openssl(&[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
            "-addext",
            sans,
            "-addext",
            &format!("extendedKeyUsage={usage}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "3650",
            "-copy_extensions",
            "copy",
        ]);
    }
}

/// Runs a command to completion and returns its stdout; panics with its
/// stderr if it cannot start or fails.
fn checked(cmd: &mut Command, what: &str) -> Vec<u8> {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A kubeconfig with a client certificate (admin, controller-manager).
fn cert_kubeconfig(server: &str, ca: &Path, cert: &Path, key: &Path) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: user\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n\
         contexts:\n- name: test\n  context: {{cluster: test, user: user}}\ncurrent-context: test\n",
        ca = ca.display(),
        cert = cert.display(),
        key = key.display(),
    )
}

/// A kubeconfig with a bearer token (a ServiceAccount's).
pub fn token_kubeconfig(server: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n- name: user\n  user:\n    token: {token}\n\
         contexts:\n- name: test\n  context: {{cluster: test, user: user}}\ncurrent-context: test\n",
        ca = ca.display(),
    )
}

fn spawn_logged(program: &Path, args: &[String], log: &Path) -> Child {
    let log = fs::File::create(log).expect("create log");
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", program.display()))
}

fn stop(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        // SAFETY: kill(2) on a child we own; SIGTERM lets it close cleanly.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let exited = poll_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || match c.try_wait() {
                Ok(Some(_)) => Ok(()),
                _ => Err(()),
            },
        );
        if exited.is_err() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub struct Cluster {
    /// Logs, etcd's data, kubeconfigs.
    pub dir: PathBuf,
    pub api_port: u16,
    etcd_port: u16,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    controllers: Option<Child>,
    /// Controllers beyond the EndpointSlice and ServiceAccount ones.
    extra_controllers: Vec<String>,
    admin_kubeconfig: PathBuf,
    apiserver_starts: usize,
    chart_installed: bool,
    /// Runs kubelets (tests/src/nodes.rs): the API server publishes its
    /// own endpoint and the controllers a real cluster needs run too.
    real_nodes: bool,
    scheduler: Option<Child>,
}

impl Cluster {
    /// etcd, kube-apiserver and the controllers, each waited for through
    /// its own health endpoint. `name` names the working directory.
    pub fn start(name: &str) -> Cluster {
        Self::start_with(name, false, &[])
    }

    /// [`start`](Self::start), kube-controller-manager also running these
    /// controllers (e.g. `garbage-collector-controller`).
    pub fn start_with_controllers(name: &str, extra: &[&str]) -> Cluster {
        Self::start_with(name, false, extra)
    }

    /// The control plane for real nodes: also kube-scheduler, and the
    /// controllers kubelet-run workloads need (DaemonSets, Deployments,
    /// ReplicaSets, node lifecycle, Pod CIDRs for flannel, the root CA
    /// ConfigMap for projected tokens, garbage collection for uninstall).
    pub fn start_for_nodes(name: &str) -> Cluster {
        Self::start_with(name, true, &[])
    }

    fn start_with(name: &str, real_nodes: bool, extra: &[&str]) -> Cluster {
        let pki = Pki::get();
        let dir = std::env::temp_dir().join(format!("xlb-k8s-{name}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let api_port = free_port();
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        fs::write(
            &admin_kubeconfig,
            cert_kubeconfig(
                &format!("https://127.0.0.1:{api_port}"),
                &pki.path("ca.crt"),
                &pki.path("admin.crt"),
                &pki.path("admin.key"),
            ),
        )
        .unwrap();
        let mut cluster = Cluster {
            dir,
            api_port,
            etcd_port: free_port(),
            etcd: None,
            apiserver: None,
            controllers: None,
            extra_controllers: extra.iter().map(|c| c.to_string()).collect(),
            admin_kubeconfig,
            apiserver_starts: 0,
            chart_installed: false,
            real_nodes,
            scheduler: None,
        };
        cluster.start_etcd();
        cluster.start_apiserver();
        cluster.start_controllers();
        if real_nodes {
            cluster.start_scheduler();
        }
        cluster
    }

    fn start_etcd(&mut self) {
        let peer = free_port();
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let args: Vec<String> = [
            "--name=test",
            &format!("--data-dir={}", self.dir.join("etcd").display()),
            &format!("--listen-client-urls={client}"),
            &format!("--advertise-client-urls={client}"),
            &format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
            &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
            &format!("--initial-cluster=test=http://127.0.0.1:{peer}"),
            &format!("--listen-metrics-urls=http://127.0.0.1:{}", free_port()),
            "--log-level=warn",
        ]
        .map(String::from)
        .to_vec();
        self.etcd = Some(spawn_logged(
            &k8s_bin("etcd"),
            &args,
            &self.dir.join("etcd.log"),
        ));
        poll_until(READY_TIMEOUT, Duration::from_millis(100), || {
            self.etcdctl(&["endpoint", "health"])
                .status
                .success()
                .then_some(())
                .ok_or(())
        })
        .unwrap_or_else(|()| panic!("etcd not healthy; log:\n{}", self.log("etcd.log")));
    }

    /// Runs etcdctl against this cluster's etcd.
    pub fn etcdctl(&self, args: &[&str]) -> Output {
        Command::new(k8s_bin("etcdctl"))
            .arg(format!("--endpoints=http://127.0.0.1:{}", self.etcd_port))
            .args(args)
            .output()
            .expect("run etcdctl")
    }

    /// Starts kube-apiserver (again, after [`stop_apiserver`](Self::stop_apiserver))
    /// on the same port and etcd, and waits for `/readyz`.
    pub fn start_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "kube-apiserver already runs");
        let pki = Pki::get();
        let p = |n: &str| pki.path(n).display().to_string();
        let args: Vec<String> = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_port),
            "--bind-address=0.0.0.0".into(),
            format!("--secure-port={}", self.api_port),
            // Not loopback (refused). With real nodes the `kubernetes`
            // Service's endpoint is this address, which node namespaces
            // reach (`reach_from`), so Pods reach the API through kube-proxy.
            format!("--advertise-address={API_HOST}"),
            format!(
                "--endpoint-reconciler-type={}",
                if self.real_nodes { "lease" } else { "none" }
            ),
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            format!(
                "--kubelet-client-certificate={}",
                p("apiserver-kubelet-client.crt")
            ),
            format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
            format!("--tls-cert-file={}", p("apiserver.crt")),
            format!("--tls-private-key-file={}", p("apiserver.key")),
            format!("--client-ca-file={}", p("ca.crt")),
            format!("--requestheader-client-ca-file={}", p("ca.crt")),
            "--requestheader-allowed-names=front-proxy-client".into(),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            // Both families, so dual-stack Services can be made.
            "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112".into(),
            "--authorization-mode=Node,RBAC".into(),
            // What a hardened cluster has: the chart must not need more.
            "--allow-privileged=false".into(),
        ];
        self.apiserver_starts += 1;
        let log = self
            .dir
            .join(format!("kube-apiserver-{}.log", self.apiserver_starts));
        self.apiserver = Some(spawn_logged(&k8s_bin("kube-apiserver"), &args, &log));
        let name = log.file_name().unwrap().to_string_lossy().into_owned();
        poll_until(READY_TIMEOUT, Duration::from_millis(100), || {
            if let Some(st) = self
                .apiserver
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("kube-apiserver exited ({st}); log:\n{}", self.log(&name));
            }
            let out = self.kubectl(&["get", "--raw", "/readyz"]);
            (out.status.success() && out.stdout == b"ok")
                .then_some(())
                .ok_or(())
        })
        .unwrap_or_else(|()| panic!("kube-apiserver not ready; log:\n{}", self.log(&name)));
    }

    /// Stops kube-apiserver (SIGTERM); etcd and its data stay.
    pub fn stop_apiserver(&mut self) {
        stop(&mut self.apiserver);
    }

    /// Restarts kube-controller-manager, as a control-plane restart or
    /// upgrade does. After an API server outage its work queues back off
    /// failed syncs for minutes (found here: a slice written >90 s late);
    /// a fresh one syncs every Service at once.
    pub fn restart_controllers(&mut self) {
        stop(&mut self.controllers);
        self.start_controllers();
    }

    fn start_controllers(&mut self) {
        let pki = Pki::get();
        let kubeconfig = self.dir.join("controller-manager.kubeconfig");
        fs::write(
            &kubeconfig,
            cert_kubeconfig(
                &format!("https://127.0.0.1:{}", self.api_port),
                &pki.path("ca.crt"),
                &pki.path("controller-manager.crt"),
                &pki.path("controller-manager.key"),
            ),
        )
        .unwrap();
        let k = kubeconfig.display().to_string();
        let args: Vec<String> = vec![
            format!("--kubeconfig={k}"),
            format!("--authentication-kubeconfig={k}"),
            format!("--authorization-kubeconfig={k}"),
            format!("--client-ca-file={}", pki.path("ca.crt").display()),
            format!(
                "--requestheader-client-ca-file={}",
                pki.path("ca.crt").display()
            ),
            format!(
                "--controllers={}",
                ["endpointslice-controller", "serviceaccount-controller"]
                    .iter()
                    .chain(if self.real_nodes {
                        REAL_NODE_CONTROLLERS
                    } else {
                        &[]
                    })
                    .map(|c| c.to_string())
                    .chain(self.extra_controllers.iter().cloned())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            format!("--root-ca-file={}", pki.path("ca.crt").display()),
            format!(
                "--service-account-private-key-file={}",
                pki.path("sa.key").display()
            ),
            // Pod CIDRs per node, which flannel's kube subnet manager uses.
            "--allocate-node-cidrs".into(),
            // Dual-stack, as the API server's Service ranges.
            "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56".into(),
            "--node-cidr-mask-size-ipv4=24".into(),
            "--node-cidr-mask-size-ipv6=64".into(),
            "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112".into(),
            "--use-service-account-credentials".into(),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()),
        ];
        self.controllers = Some(spawn_logged(
            &k8s_bin("kube-controller-manager"),
            &args,
            &self.dir.join("kube-controller-manager.log"),
        ));
        // The serviceaccount controller at work: namespace default has its SA.
        self.wait_for_default_service_account("default");
    }

    fn start_scheduler(&mut self) {
        let pki = Pki::get();
        let kubeconfig = self.dir.join("scheduler.kubeconfig");
        fs::write(
            &kubeconfig,
            cert_kubeconfig(
                &format!("https://127.0.0.1:{}", self.api_port),
                &pki.path("ca.crt"),
                &pki.path("scheduler.crt"),
                &pki.path("scheduler.key"),
            ),
        )
        .unwrap();
        let k = kubeconfig.display().to_string();
        let args: Vec<String> = vec![
            format!("--kubeconfig={k}"),
            format!("--authentication-kubeconfig={k}"),
            format!("--authorization-kubeconfig={k}"),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()),
        ];
        self.scheduler = Some(spawn_logged(
            &k8s_bin("kube-scheduler"),
            &args,
            &self.dir.join("kube-scheduler.log"),
        ));
    }

    /// A kubeconfig whose client certificate is signed by the cluster's CA
    /// for `subject` (e.g. `/O=system:nodes/CN=system:node:NAME`), naming the
    /// API server at `host`.
    pub fn cert_kubeconfig_for(&self, name: &str, subject: &str, host: Ipv4Addr) -> PathBuf {
        let pki = Pki::get();
        if !pki.path(&format!("{name}.crt")).exists() {
            pki.signed(
                name,
                subject,
                &format!("subjectAltName=DNS:{name}"),
                "clientAuth",
            );
        }
        let path = self.dir.join(format!("{name}.kubeconfig"));
        fs::write(
            &path,
            cert_kubeconfig(
                &format!("https://{}", SocketAddr::from((host, self.api_port))),
                &pki.path("ca.crt"),
                &pki.path(&format!("{name}.crt")),
                &pki.path(&format!("{name}.key")),
            ),
        )
        .unwrap();
        path
    }

    /// The service-account admission plugin refuses Pods until the
    /// namespace's `default` ServiceAccount exists.
    fn wait_for_default_service_account(&self, namespace: &str) {
        poll_until(READY_TIMEOUT, Duration::from_millis(100), || {
            self.get("serviceaccount", Some(namespace), "default")
                .ok_or(())
        })
        .unwrap_or_else(|()| {
            panic!(
                "no ServiceAccount {namespace}/default; controller-manager log:\n{}",
                self.log("kube-controller-manager.log")
            )
        });
    }

    pub fn log(&self, name: &str) -> String {
        fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    pub fn ca_file(&self) -> PathBuf {
        Pki::get().path("ca.crt")
    }

    /// kubectl as the cluster's administrator.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_with_input(args, None)
    }

    pub fn kubectl_with_input(&self, args: &[&str], input: Option<&[u8]>) -> Output {
        let mut child = Command::new(k8s_bin("kubectl"))
            .arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()))
            .args(args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run kubectl");
        if let Some(input) = input {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(input)
                .expect("kubectl stdin");
        }
        child.wait_with_output().expect("wait for kubectl")
    }

    /// kubectl that must succeed; returns its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Creates the object (a JSON manifest); panics if the API refuses it.
    pub fn create(&self, object: &Value) {
        self.try_create(object)
            .unwrap_or_else(|e| panic!("create {}: {e}", object["metadata"]["name"]));
    }

    /// Creates the object; the API server's refusal as text.
    pub fn try_create(&self, object: &Value) -> Result<(), String> {
        let out =
            self.kubectl_with_input(&["create", "-f", "-"], Some(object.to_string().as_bytes()));
        out.status
            .success()
            .then_some(())
            .ok_or_else(|| String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// Server-side apply of the object (creates or updates it).
    pub fn apply(&self, object: &Value) {
        let out = self.kubectl_with_input(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=xlb-tests",
                "-f",
                "-",
            ],
            Some(object.to_string().as_bytes()),
        );
        assert!(
            out.status.success(),
            "apply {}: {}",
            object["metadata"]["name"],
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The object as JSON, or None if it does not exist.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let mut args = vec!["get", resource, name, "-o", "json"];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        let out = self.kubectl(&args);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("NotFound") || err.contains("not found"),
                "kubectl get: {err}"
            );
            return None;
        }
        Some(serde_json::from_slice(&out.stdout).expect("kubectl -o json"))
    }

    /// Every object of a kind in a namespace.
    pub fn list(&self, resource: &str, namespace: &str) -> Vec<Value> {
        let out = self.kubectl_ok(&["get", resource, "-n", namespace, "-o", "json"]);
        let v: Value = serde_json::from_str(&out).expect("kubectl -o json");
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// Merge-patches an object (`status: true`: its status subresource).
    pub fn patch(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        patch: &Value,
        status: bool,
    ) {
        let patch = patch.to_string();
        let mut args = vec!["patch", resource, name, "--type=merge", "-p", &patch];
        if status {
            args.push("--subresource=status");
        }
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        self.kubectl_ok(&args);
    }

    pub fn delete(&self, resource: &str, namespace: Option<&str>, name: &str) {
        let mut args = vec!["delete", resource, name, "--wait=false"];
        if let Some(ns) = namespace {
            args.extend(["-n", ns]);
        }
        self.kubectl_ok(&args);
    }

    /// Creates a namespace and waits until Pods may be created in it.
    pub fn create_namespace(&self, name: &str) {
        self.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}));
        self.wait_for_default_service_account(name);
    }

    /// A Node object as a kubelet registers it (no kubelet runs).
    pub fn add_node(&self, name: &str, zone: &str) {
        self.create(&json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name,
                "topology.kubernetes.io/zone": zone,
            }},
        }));
    }

    /// A Pod on `node` with container port `http` = `port`, then its status
    /// as the kubelet would report it: Running at `ip`, ready or not.
    pub fn run_pod(&self, pod: &Pod) {
        self.create(&json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
            "spec": {
                "nodeName": pod.node,
                "containers": [{
                    "name": "app", "image": "registry.invalid/app:1",
                    "ports": [{"name": "http", "containerPort": pod.port, "protocol": "TCP"}],
                }],
            },
        }));
        self.set_pod_ready(pod, pod.ready);
    }

    /// Patches the Pod's status: Running at its IP, condition Ready as given.
    pub fn set_pod_ready(&self, pod: &Pod, ready: bool) {
        let status = if ready { "True" } else { "False" };
        self.patch(
            "pod",
            Some(&pod.namespace),
            &pod.name,
            &json!({"status": {
                "phase": "Running",
                "podIP": pod.ip.to_string(),
                "podIPs": [{"ip": pod.ip.to_string()}],
                "hostIP": "10.255.0.1",
                "conditions": [
                    {"type": "Ready", "status": status},
                    {"type": "ContainersReady", "status": status},
                ],
            }}),
            true,
        );
    }

    /// Deletes the Pod with its grace period: it keeps running and stays
    /// terminating, since no kubelet confirms it stopped.
    pub fn terminate_pod(&self, pod: &Pod) {
        self.delete_pod(pod, &[]);
    }

    /// Removes the Pod at once (what the kubelet does once it has stopped).
    pub fn remove_pod(&self, pod: &Pod) {
        self.delete_pod(pod, &["--grace-period=0", "--force"]);
    }

    fn delete_pod(&self, pod: &Pod, options: &[&str]) {
        let mut args = vec![
            "delete",
            "pod",
            &pod.name,
            "-n",
            &pod.namespace,
            "--wait=false",
        ];
        args.extend_from_slice(options);
        self.kubectl_ok(&args);
    }

    /// The EndpointSlices the controller wrote for a Service.
    pub fn slices(&self, namespace: &str, service: &str) -> Vec<Value> {
        let out = self.kubectl_ok(&[
            "get",
            "endpointslices",
            "-n",
            namespace,
            "-l",
            &format!("kubernetes.io/service-name={service}"),
            "-o",
            "json",
        ]);
        let v: Value = serde_json::from_str(&out).expect("kubectl -o json");
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// The ready addresses in a Service's slices, sorted.
    pub fn ready_addresses(&self, namespace: &str, service: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .slices(namespace, service)
            .iter()
            .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["conditions"]["ready"] != false)
            .flat_map(|e| e["addresses"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a.as_str().map(String::from))
            .collect();
        v.sort();
        v
    }

    /// Installs what the Helm chart installs for the agent's identity: the
    /// namespace, ServiceAccount, RBAC and the CRD (rendered by `helm
    /// template` from charts/xlb with default values, applied for real).
    pub fn install_chart_identity(&mut self) {
        self.install_chart_identity_with(&[]);
    }

    /// The same, rendered with extra `helm template` arguments (values that
    /// change the RBAC, e.g. `--set config.l2...`); the first call wins.
    pub fn install_chart_identity_with(&mut self, values: &[&str]) {
        if self.chart_installed {
            return;
        }
        let mut args = vec!["--include-crds"];
        args.extend_from_slice(values);
        let rendered = self.helm_template(&args);
        self.create_namespace(AGENT_NAMESPACE);
        let keep = [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "CustomResourceDefinition",
        ];
        let docs: Vec<&str> = rendered
            .split("\n---")
            .filter(|d| {
                d.lines().any(|l| {
                    l.strip_prefix("kind: ")
                        .is_some_and(|k| keep.contains(&k.trim()))
                })
            })
            .collect();
        assert!(
            docs.len() >= 6,
            "helm template rendered too few identity objects:\n{rendered}"
        );
        let manifest = docs.join("\n---\n");
        let out = self.kubectl_with_input(&["apply", "-f", "-"], Some(manifest.as_bytes()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "applying the chart's identity: {stderr}"
        );
        // The API server's warnings (e.g. a CRD format it does not know)
        // are what `helm install` shows users.
        assert!(
            !stderr.contains("Warning:"),
            "the API server warned about the chart's identity objects:\n{stderr}"
        );
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/loadbalancerpools.xlb.dev",
            "crd/bgppeers.xlb.dev",
            "crd/bgpadvertisements.xlb.dev",
        ]);
        self.chart_installed = true;
    }

    /// The server's version, as kubectl reports it (`v1.37.2`).
    pub fn server_version(&self) -> String {
        let out = self.kubectl_ok(&["version", "-o", "json"]);
        let v: Value = serde_json::from_str(&out).expect("kubectl version -o json");
        v["serverVersion"]["gitVersion"]
            .as_str()
            .expect("a server version")
            .to_string()
    }

    /// `helm template xlb charts/xlb -n xlb-system` for this server's
    /// version, with extra arguments.
    pub fn helm_template(&self, extra: &[&str]) -> String {
        let chart = crate::topology::workspace_root().join("charts/xlb");
        let version = self.server_version();
        let out = checked(
            Command::new("helm")
                .args(["template", "xlb"])
                .arg(&chart)
                .args(["-n", AGENT_NAMESPACE, "--kube-version", &version])
                .args(extra),
            "helm template (cargo xtask setup installs helm)",
        );
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `helm install xlb charts/xlb -n xlb-system` for real, with extra
    /// arguments: every object of the chart is created (no kubelet runs
    /// the DaemonSet's Pods). The chart's identity is then Helm's, not
    /// [`install_chart_identity`](Self::install_chart_identity)'s.
    pub fn helm_install(&mut self, extra: &[&str]) {
        assert!(
            !self.chart_installed,
            "the chart's identity is already installed"
        );
        let chart = crate::topology::workspace_root().join("charts/xlb");
        checked(
            Command::new("helm")
                .args(["install", "xlb"])
                .arg(&chart)
                .args(["-n", AGENT_NAMESPACE, "--create-namespace"])
                .arg("--kubeconfig")
                .arg(&self.admin_kubeconfig)
                .args(extra),
            "helm install",
        );
        self.wait_for_default_service_account(AGENT_NAMESPACE);
        self.chart_installed = true;
    }

    /// `helm uninstall xlb -n xlb-system`, as a user runs it (Helm's
    /// deletion order, background propagation, no waiting).
    pub fn helm_uninstall(&self) {
        checked(
            Command::new("helm")
                .args(["uninstall", "xlb", "-n", AGENT_NAMESPACE])
                .arg("--kubeconfig")
                .arg(&self.admin_kubeconfig),
            "helm uninstall",
        );
    }

    /// A token for the chart's ServiceAccount: whatever the agent does with
    /// it is allowed only if the chart's RBAC allows it.
    pub fn agent_token(&mut self) -> String {
        self.install_chart_identity();
        self.kubectl_ok(&[
            "create",
            "token",
            AGENT_SERVICE_ACCOUNT,
            "-n",
            AGENT_NAMESPACE,
            "--duration=24h",
        ])
        .trim()
        .to_string()
    }

    /// A kubeconfig for the agent, as the chart's ServiceAccount, for a
    /// process in a namespace joined with [`reach_from`](Self::reach_from)
    /// (`host`: [`API_HOST`]) or in the host's (127.0.0.1).
    pub fn write_agent_kubeconfig(&mut self, path: &Path, host: Ipv4Addr) {
        let token = self.agent_token();
        let server = format!("https://{}", SocketAddr::from((host, self.api_port)));
        fs::write(path, token_kubeconfig(&server, &self.ca_file(), &token)).unwrap();
    }

    /// A kube-rs client as the cluster's administrator (for tests that
    /// drive agent parts in-process).
    pub async fn admin_client(&self) -> kube::Client {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.admin_kubeconfig).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    /// A kube-rs client as the chart's ServiceAccount.
    pub async fn agent_client(&mut self) -> kube::Client {
        let path = self.dir.join("agent-inprocess.kubeconfig");
        self.write_agent_kubeconfig(&path, Ipv4Addr::LOCALHOST);
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        kube::Client::try_from(config).unwrap()
    }

    /// Lets processes in `ns` reach the API server at [`API_HOST`]: a veth
    /// from the host into `ns`, with a /32 route each way. Returns the
    /// host end's name.
    pub fn reach_from(&self, ns: &Netns) -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // Unique among namespaces joined at the same time, also across
        // test processes (which do not run at once, but may overlap a
        // crashed run's leftovers).
        let n = (std::process::id().wrapping_mul(31) + NEXT.fetch_add(1, Ordering::Relaxed))
            % 60000
            + 2;
        let inside = Ipv4Addr::new(10, 255, (n >> 8) as u8, (n & 0xff) as u8);
        let host_if = format!("k{}", n);
        crate::netns::sh(&format!(
            "ip link add {host_if} type veth peer name k8sapi netns {ns} && \
             ip addr add {API_HOST}/32 dev {host_if} && ip link set {host_if} up && \
             ip route add {inside}/32 dev {host_if}",
            ns = ns.name
        ));
        ns.run(&format!(
            "ip addr add {inside}/32 dev k8sapi && ip link set k8sapi up && \
             ip route add {API_HOST}/32 dev k8sapi"
        ));
        host_if
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        stop(&mut self.scheduler);
        stop(&mut self.controllers);
        stop(&mut self.apiserver);
        stop(&mut self.etcd);
        // A failed test keeps its logs; a passed one leaves nothing in /tmp.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A Pod as [`Cluster::run_pod`] makes it.
#[derive(Clone, Debug)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub labels: Value,
    pub node: String,
    pub ip: std::net::IpAddr,
    pub port: u16,
    pub ready: bool,
}
