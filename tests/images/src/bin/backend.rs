//! The backend the real-node tests run as a Deployment: on one port it
//! answers HTTP/1.1 over TCP (keep-alive, so a test can hold connections
//! through an upgrade) and echoes UDP. Every answer names the Pod and the
//! client address the Pod saw, which is how a test tells nat from snat and
//! which Pod served it:
//!   `pod=<POD_NAME> client=<address:port>`
//!
//! Environment: `PORT` (default 8080), `POD_NAME` (default: the hostname).
//! `Connection: close` is honoured. SIGTERM closes the listener and ends the process once every open
//! connection has been idle for a second, like a server that drains.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::Duration,
};

static STOPPING: AtomicBool = AtomicBool::new(false);
static OPEN: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_sigterm(_: libc::c_int) {
    STOPPING.store(true, Ordering::SeqCst);
}

fn main() {
    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(8080);
    let pod = std::env::var("POD_NAME").unwrap_or_else(|_| hostname());
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t);
    }
    let any = SocketAddr::from(([0u16; 8], port));
    let tcp = TcpListener::bind(any).unwrap_or_else(|e| panic!("bind tcp {any}: {e}"));
    let udp = UdpSocket::bind(any).unwrap_or_else(|e| panic!("bind udp {any}: {e}"));
    eprintln!("backend {pod} listening on tcp and udp port {port}");

    let udp_pod = pod.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        loop {
            if let Ok((_, from)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(answer(&udp_pod, from).as_bytes(), from);
            }
        }
    });
    std::thread::spawn(move || {
        for stream in tcp.incoming().flatten() {
            let pod = pod.clone();
            OPEN.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let _ = serve(stream, &pod);
                OPEN.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    while !STOPPING.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("SIGTERM: serving open connections until they are idle");
    while OPEN.load(Ordering::SeqCst) > 0 {
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn answer(pod: &str, client: SocketAddr) -> String {
    let ip = match client.ip() {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(std::net::IpAddr::V4)
            .unwrap_or(std::net::IpAddr::V6(v6)),
        v4 => v4,
    };
    format!("pod={pod} client={}\n", SocketAddr::new(ip, client.port()))
}

/// Requests on one connection until the client closes it; a request is
/// its header lines (bodies are not expected). Once stopping, a connection
/// idle for a second is closed.
fn serve(stream: TcpStream, pod: &str) -> std::io::Result<()> {
    let client = stream.peer_addr()?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut line = String::new();
    let mut in_request = false;
    let mut close = false;
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if STOPPING.load(Ordering::SeqCst) && !in_request {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(e),
        }
        if line == "\r\n" || line == "\n" {
            in_request = false;
            let body = answer(pod, client);
            write!(
                writer,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{}\r\n{body}",
                body.len(),
                if close { "Connection: close\r\n" } else { "" }
            )?;
            if close {
                return Ok(());
            }
        } else {
            in_request = true;
            // HTTP/1.1: the client asks to end the connection after this.
            close |= line.to_ascii_lowercase().starts_with("connection: close");
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}
