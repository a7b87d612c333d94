//! The agent's HTTP endpoint: `/metrics` (Prometheus text), `/healthz` and
//! `/readyz`, served by hyper. Connections are capped and a client that
//! does not send its request head in time is disconnected, so a slow or
//! hostile scraper cannot starve the probes.

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::{
    body::{Frame, Incoming},
    header,
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::Semaphore};

use crate::metrics::Metrics;

/// Returns `(alive, ready)`. Called on every health request from the async
/// runtime: it must be cheap and must not block.
pub type HealthFn = dyn Fn() -> (bool, bool) + Send + Sync;

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a whole connection may take.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves until the task is dropped or aborted.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<HealthFn>) {
    serve_with(listener, metrics, health, HEAD_TIMEOUT).await
}

async fn serve_with(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<HealthFn>,
    head_timeout: Duration,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return; // The semaphore is never closed.
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Typically EMFILE/ENFILE: back off instead of spinning.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |req| {
                let (metrics, health) = (metrics.clone(), health.clone());
                async move { Ok::<_, Infallible>(respond(req, &metrics, &health).await) }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(head_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "metrics endpoint: connection failed")
                }
                Err(_) => tracing::debug!(%peer, "metrics endpoint: connection timed out"),
            }
        });
    }
}

type Body = BoxBody<Bytes, Infallible>;

/// Parts of a `/metrics` body queued between the encoder and the connection.
const METRICS_PARTS_QUEUED: usize = 8;

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

async fn respond(
    req: Request<Incoming>,
    metrics: &Arc<Metrics>,
    health: &Arc<HealthFn>,
) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let mut r = match req.uri().path() {
        "/metrics" => {
            // The snapshot source reads BPF maps and may block on a lock.
            let m = metrics.clone();
            match tokio::task::spawn_blocking(move || m.scrape()).await {
                Ok(scrape) => {
                    let mut r = Response::new(metrics_body(scrape));
                    r.headers_mut().insert(
                        header::CONTENT_TYPE,
                        header::HeaderValue::from_static(
                            "text/plain; version=0.0.4; charset=utf-8",
                        ),
                    );
                    r
                }
                Err(e) => {
                    tracing::error!(error = %e, "rendering metrics failed");
                    text(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n")
                }
            }
        }
        "/healthz" if health().0 => text(StatusCode::OK, "ok\n"),
        "/healthz" => text(StatusCode::SERVICE_UNAVAILABLE, "not alive\n"),
        "/readyz" if health().1 => text(StatusCode::OK, "ready\n"),
        "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    };
    r.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    r
}

/// The scrape as a streamed body: the encoder runs on a blocking thread
/// and hands over a chunk of series at a time, so a scrape of a large node
/// never holds its whole text. It stops when the client goes away.
fn metrics_body(mut scrape: crate::metrics::Scrape) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(METRICS_PARTS_QUEUED);
    tokio::task::spawn_blocking(move || {
        let head = Bytes::from(std::mem::take(&mut scrape.head));
        if tx.blocking_send(head).is_ok() {
            scrape.encode(|text| {
                tx.blocking_send(Bytes::copy_from_slice(text.as_bytes()))
                    .is_ok()
            });
        }
    });
    let parts = futures::stream::unfold(rx, |mut rx| async move {
        let part = rx.recv().await?;
        Some((Ok::<_, Infallible>(Frame::data(part)), rx))
    });
    StreamBody::new(parts).boxed()
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::atomic::{AtomicBool, Ordering},
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    use super::*;

    struct Server {
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        alive: Arc<AtomicBool>,
        ready: Arc<AtomicBool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn start(head_timeout: Duration) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let alive = Arc::new(AtomicBool::new(true));
        let ready = Arc::new(AtomicBool::new(false));
        let (a, r) = (alive.clone(), ready.clone());
        let health: Arc<HealthFn> =
            Arc::new(move || (a.load(Ordering::SeqCst), r.load(Ordering::SeqCst)));
        let task = tokio::spawn(serve_with(listener, metrics.clone(), health, head_timeout));
        Server {
            addr,
            metrics,
            alive,
            ready,
            task,
        }
    }

    /// Sends `request` and returns (status, head, body); `None` if the
    /// server closed without an answer.
    async fn raw(addr: SocketAddr, request: &[u8]) -> Option<(u16, String, String)> {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .expect("the server answers or closes in time")
            .ok()?;
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let status = head.split(' ').nth(1)?.parse().ok()?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)?
        } else {
            body.to_string()
        };
        Some((status, head.to_string(), body))
    }

    /// A chunked body's content; `None` if it is cut short.
    fn dechunk(mut body: &str) -> Option<String> {
        let mut out = String::new();
        loop {
            let (size, rest) = body.split_once("\r\n")?;
            let size = usize::from_str_radix(size, 16).ok()?;
            if size == 0 {
                return Some(out);
            }
            out.push_str(rest.get(..size)?);
            body = rest.get(size..)?.strip_prefix("\r\n")?;
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
        raw(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes(),
        )
        .await
        .expect("an answer")
    }

    #[tokio::test]
    async fn health_endpoints_follow_the_closure() {
        let srv = start(HEAD_TIMEOUT).await;
        let (status, _, body) = get(srv.addr, "/healthz").await;
        assert_eq!((status, body.as_str()), (200, "ok\n"));
        let (status, _, body) = get(srv.addr, "/readyz").await;
        assert_eq!((status, body.as_str()), (503, "not ready\n"));
        srv.ready.store(true, Ordering::SeqCst);
        assert_eq!(get(srv.addr, "/readyz").await.0, 200);
        assert_eq!(
            get(srv.addr, "/readyz?verbose=1").await.0,
            200,
            "query ignored"
        );
        srv.alive.store(false, Ordering::SeqCst);
        assert_eq!(get(srv.addr, "/healthz").await.0, 503);
    }

    #[tokio::test]
    async fn metrics_are_served_as_prometheus_text() {
        let srv = start(HEAD_TIMEOUT).await;
        srv.metrics.set_ready(true);
        let (status, head, body) = get(srv.addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        assert!(body.lines().any(|l| l == "xlb_agent_ready 1"), "{body}");
    }

    #[tokio::test]
    async fn a_large_scrape_is_streamed_whole() {
        use crate::metrics::{BackendSample, DataplaneSnapshot};
        let srv = start(HEAD_TIMEOUT).await;
        let n = 20_000;
        srv.metrics.set_snapshot_source(move || DataplaneSnapshot {
            backends: (0..n)
                .map(|i| BackendSample {
                    service: "web".into(),
                    backend: format!("10.1.{}.{}:80", i / 256, i % 256),
                    healthy: true,
                    weight: 1,
                    state: Default::default(),
                    closed_flows: 0,
                    stats: Default::default(),
                })
                .collect(),
            conntrack_capacity: 7,
            ..Default::default()
        });
        let (status, _, body) = get(srv.addr, "/metrics").await;
        assert_eq!(status, 200);
        let healthy = body
            .lines()
            .filter(|l| l.starts_with("xlb_backend_healthy{"))
            .count();
        assert_eq!(healthy, n);
        // The last family comes through too: nothing was cut off.
        assert!(
            body.lines().any(|l| l == "xlb_conntrack_capacity 7"),
            "{}",
            &body[body.len() - 500..]
        );
    }

    #[tokio::test]
    async fn wrong_paths_methods_and_requests_are_refused() {
        let srv = start(HEAD_TIMEOUT).await;
        let a = srv.addr;
        assert_eq!(get(a, "/").await.0, 404);
        assert_eq!(get(a, "/metrics/").await.0, 404);
        let (status, head, _) = raw(a, b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
            .await
            .unwrap();
        assert_eq!(status, 405);
        assert!(
            head.to_ascii_lowercase().contains("allow: get, head"),
            "{head}"
        );
        assert_eq!(raw(a, b"garbage\r\n\r\n").await.map(|r| r.0), Some(400));
        // HEAD: the head without the body.
        let (status, _, body) = raw(a, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!((status, body.as_str()), (200, ""));
        assert_eq!(get(a, "/healthz").await.0, 200, "still serving");
    }

    #[tokio::test]
    async fn a_slow_client_is_cut_off_without_blocking_others() {
        let srv = start(Duration::from_millis(300)).await;
        let mut slow = TcpStream::connect(srv.addr).await.unwrap();
        slow.write_all(b"GET /metr").await.unwrap();
        assert_eq!(get(srv.addr, "/healthz").await.0, 200);
        let mut out = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut out)).await;
        assert!(closed.is_ok(), "the slow connection is closed");
        assert!(!String::from_utf8_lossy(&out).contains(" 200 "));
    }

    #[tokio::test]
    async fn a_panicking_source_gives_500_and_the_server_survives() {
        let srv = start(HEAD_TIMEOUT).await;
        srv.metrics
            .set_snapshot_source(|| panic!("test: the snapshot source failed"));
        assert_eq!(get(srv.addr, "/metrics").await.0, 500);
        assert_eq!(get(srv.addr, "/healthz").await.0, 200);
    }
}
