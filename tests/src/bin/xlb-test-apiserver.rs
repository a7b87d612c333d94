//! Runs the test Kubernetes API server (xlb_tests::apiserver) on its own,
//! for trying lb-agent or kubectl against it by hand:
//!
//! ```sh
//! cargo run -p xlb-tests --bin xlb-test-apiserver -- --port 6443 --kubeconfig /tmp/xlb.kubeconfig
//! KUBECONFIG=/tmp/xlb.kubeconfig kubectl get services -A
//! ```
//!
//! It prints the URL and the kubeconfig path, then one line per request,
//! and serves until killed.

use std::time::Duration;

use xlb_tests::apiserver::{ServerOptions, TestApiServer};

const USAGE: &str = "usage: xlb-test-apiserver [--port PORT] [--kubeconfig PATH]";

fn main() {
    let mut options = ServerOptions::default();
    let mut kubeconfig = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value\n{USAGE}");
                std::process::exit(2)
            })
        };
        match arg.as_str() {
            "--port" => {
                let text = value("--port");
                options.port = text.parse().unwrap_or_else(|_| {
                    eprintln!("--port: {text:?} is not a port number\n{USAGE}");
                    std::process::exit(2)
                });
            }
            "--kubeconfig" => kubeconfig = Some(value("--kubeconfig")),
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            other => {
                eprintln!("unknown argument {other:?}\n{USAGE}");
                std::process::exit(2)
            }
        }
    }
    let server = TestApiServer::start_blocking_with(options);
    let path = kubeconfig.unwrap_or_else(|| {
        format!(
            "/tmp/xlb-test-apiserver-{}.kubeconfig",
            server.addr().port()
        )
    });
    if let Err(err) = server.write_kubeconfig(&path) {
        eprintln!("cannot write {path}: {err}");
        std::process::exit(1);
    }
    println!("serving {}\nkubeconfig: {path}", server.url());
    let mut printed = 0;
    loop {
        let requests = server
            .wait_for_blocking(Duration::from_secs(3600), |s| {
                let all = s.requests();
                (all.len() > printed).then_some(all)
            })
            .unwrap_or_default();
        for r in requests.iter().skip(printed) {
            let query = if r.query.is_empty() {
                String::new()
            } else {
                format!("?{}", r.query)
            };
            println!("{} {}{query} -> {}", r.method, r.path, r.status);
        }
        printed = printed.max(requests.len());
    }
}
