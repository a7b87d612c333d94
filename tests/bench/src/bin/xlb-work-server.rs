//! The application behind the load-aware benchmark: an HTTP/1.1 server with
//! a fixed number of workers and a bounded queue, as an application server
//! with a thread pool is. `GET /?cost_us=N` burns N µs of CPU (the thread's
//! own CPU time, so a CPU quota stretches it in wall time) and answers the
//! server's name; a request that finds every worker busy and the queue full
//! is answered 503 at once, as an overloaded application's proxy does.
//!
//! `xlb-work-server LISTEN NAME WORKERS QUEUE`

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    sync::{
        mpsc::{sync_channel, TrySendError},
        Arc, Mutex,
    },
    time::Duration,
};

use clap::Parser;

/// An HTTP/1.1 server with a fixed pool of workers and a bounded queue:
/// `GET /?cost_us=N` burns N µs of CPU; a request beyond the queue gets 503.
#[derive(Parser, Debug)]
#[command(name = "xlb-work-server")]
struct Cli {
    /// Address to listen on (ADDR:PORT)
    listen: String,
    /// The server's name, its answer's body
    name: String,
    /// Worker threads
    workers: usize,
    /// Requests that may wait for a worker
    queue: usize,
}

fn main() {
    let cli = Cli::parse();
    let listener = TcpListener::bind(&cli.listen).unwrap_or_else(|e| {
        eprintln!("binding {}: {e}", cli.listen);
        std::process::exit(1)
    });
    let name: Arc<str> = cli.name.into();
    let (workers, queue) = (cli.workers, cli.queue);
    let (tx, rx) = sync_channel::<TcpStream>(queue);
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..workers {
        let (rx, name) = (rx.clone(), name.clone());
        std::thread::spawn(move || loop {
            let next = rx.lock().expect("queue").recv();
            match next {
                Ok(s) => serve(s, &name),
                Err(_) => return,
            }
        });
    }
    for stream in listener.incoming().flatten() {
        match tx.try_send(stream) {
            Ok(()) => {}
            Err(TrySendError::Full(s)) => {
                let _ = reply(s, 503, "busy");
            }
            Err(TrySendError::Disconnected(_)) => return,
        }
    }
}

/// Answers with `status` and `body`, then closes. The 503 path does not
/// read the request first, so the client sees the answer and then a reset,
/// as from many overloaded servers.
fn reply(mut s: TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    let reason = if status == 200 {
        "OK"
    } else {
        "Service Unavailable"
    };
    write!(
        s,
        "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}

fn read_head(s: &mut TcpStream) -> Option<String> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 512];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

fn serve(mut s: TcpStream, name: &str) {
    let Some(head) = read_head(&mut s) else {
        return;
    };
    let cost_us: u64 = head
        .split_whitespace()
        .nth(1)
        .and_then(|path| path.split_once("cost_us="))
        .and_then(|(_, v)| v.split(['&', ' ']).next()?.parse().ok())
        .unwrap_or(0);
    burn(Duration::from_micros(cost_us));
    let _ = reply(s, 200, name);
}

/// Spends `d` of this thread's CPU time.
fn burn(d: Duration) {
    let start = thread_cpu();
    let mut x = 0u64;
    while thread_cpu() - start < d {
        for i in 0..1000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
        }
        std::hint::black_box(x);
    }
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    #[test]
    fn the_load_aware_benchmarks_invocation_parses() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from(["xlb-work-server", "10.2.0.2:8080", "b1", "4", "4"]).unwrap();
        assert_eq!(
            (c.listen.as_str(), c.name.as_str(), c.workers, c.queue),
            ("10.2.0.2:8080", "b1", 4, 4)
        );
        Cli::try_parse_from(["xlb-work-server", "10.2.0.2:8080", "b1", "4"]).unwrap_err();
    }
}
