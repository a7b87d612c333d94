//! Client traffic for the end-to-end tests: HTTP requests to a VIP from the
//! client namespace, counted by the backend (nginx `b<N>`) that answered.

use std::{
    collections::BTreeMap,
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use crate::topology::{in_netns, set_affinity, HttpConn, Topology};

/// One `GET /` on a new connection to `vip` (closed by nginx after the
/// answer). Returns the client port and the backend's name.
pub fn one_request(vip: SocketAddr) -> io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(5))?;
    let port = s.local_addr()?.port();
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok((port, body.trim().into())),
        _ => Err(io::Error::other(format!("bad response {text:?}"))),
    }
}

/// `n` connections from the client to `vip`, one after another, from a
/// thread restricted to `cpu` if given; every one must be answered.
/// Returns (client port, backend name) per connection.
pub fn requests_on(
    t: &Topology,
    vip: SocketAddr,
    n: usize,
    cpu: Option<usize>,
) -> Vec<(u16, String)> {
    let results = in_netns(&t.client, move || {
        if let Some(c) = cpu {
            set_affinity(0, &[c]);
        }
        (0..n)
            .map(|_| one_request(vip))
            .collect::<Vec<io::Result<(u16, String)>>>()
    })
    .join()
    .expect("client thread");
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|e| panic!("connection {i} of {n} failed: {e}")))
        .collect()
}

/// Connections per backend name.
pub fn count(results: &[(u16, String)]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for (_, b) in results {
        *m.entry(b.clone()).or_insert(0) += 1;
    }
    m
}

/// Opens keep-alive connections to `vip` until one lands on the backend
/// named `name` (the others are dropped).
pub fn keepalive_to(t: &Topology, vip: SocketAddr, name: &str) -> HttpConn {
    for _ in 0..200 {
        let mut c = HttpConn::connect_in(&t.client, vip).expect("keep-alive connection");
        if c.get().expect("first request") == name {
            return c;
        }
    }
    panic!("no keep-alive connection reached {name} in 200 tries");
}

/// Polls `f` every 50 ms until it returns `Some`, at most `timeout`.
pub fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    poll_until(timeout, Duration::from_millis(50), || f().ok_or(()))
        .unwrap_or_else(|()| panic!("timed out after {timeout:?}: {what}"))
}

/// Calls `attempt` every `interval` until it returns `Ok`, at most
/// `timeout`; then returns its last `Err`. Failing is left to the caller,
/// whose message can then borrow what `attempt` borrowed mutably (a child
/// process, say) to add logs.
pub fn poll_until<T, E>(
    timeout: Duration,
    interval: Duration,
    mut attempt: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + timeout;
    loop {
        match attempt() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(interval),
        }
    }
}

/// A stream of new connections from a namespace: one `GET` every `every`,
/// each in a thread of its own, whether the ones before it are answered or
/// not, until stopped.
pub struct ConnectionStream {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, Vec<String>)>,
}

impl ConnectionStream {
    pub fn start(client: &crate::netns::Netns, addr: SocketAddr, every: Duration) -> Self {
        use std::sync::{atomic::AtomicBool, Arc};
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = in_netns(client, move || {
            // Threads started here live in the client's namespace too.
            let started = Instant::now();
            let mut running = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let next = Instant::now() + every;
                running.push(std::thread::spawn(move || {
                    let at = started.elapsed();
                    match crate::topology::http_get(addr, "/", Duration::from_secs(5)) {
                        Ok((200, _)) => None,
                        Ok((status, _)) => Some(format!("status {status} (opened after {at:?})")),
                        Err(e) => Some(format!("{e} (opened after {at:?})")),
                    }
                }));
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            let opened = running.len();
            let failed = running
                .into_iter()
                .filter_map(|t| t.join().unwrap_or_else(|_| Some("panicked".into())))
                .collect();
            (opened, failed)
        });
        ConnectionStream { stop, thread }
    }

    /// Connections opened, and why each failed one failed.
    pub fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("connection stream thread")
    }
}

/// Keep-alive connections from a namespace, each asking again every
/// `every` until stopped; a connection that fails once is counted as lost
/// and not used again.
pub struct KeepAlive {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(String, Option<String>)>>,
}

impl KeepAlive {
    /// Opens `n` connections to `addr`, one request each (all must be
    /// answered), then keeps asking.
    pub fn start(
        client: &crate::netns::Netns,
        addr: SocketAddr,
        n: usize,
        every: Duration,
    ) -> io::Result<Self> {
        use std::sync::{atomic::AtomicBool, Arc};
        let mut conns = Vec::new();
        for _ in 0..n {
            let mut c = HttpConn::connect_in(client, addr)?;
            let first = c.get()?;
            conns.push((c, first));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let started = Instant::now();
            let mut lost: Vec<Option<String>> = vec![None; conns.len()];
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let next = Instant::now() + every;
                for (i, (c, _)) in conns.iter_mut().enumerate() {
                    if lost[i].is_none() {
                        if let Err(e) = c.get() {
                            lost[i] = Some(format!("{e} (after {:?})", started.elapsed()));
                        }
                    }
                }
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            conns
                .into_iter()
                .zip(lost)
                .map(|((_, first), l)| (first, l))
                .collect()
        });
        Ok(KeepAlive { stop, thread })
    }

    /// Per connection: its first answer (which backend), and why it was
    /// lost, if it was.
    pub fn stop(self) -> Vec<(String, Option<String>)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("keep-alive thread")
    }
}
