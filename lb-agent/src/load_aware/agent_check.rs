//! HAProxy's agent check: connect to a TCP port on the backend, read one
//! line, close. The line holds words separated by spaces, commas or tabs: a
//! percentage (`75%`, the weight relative to the configured one), a state
//! (`up`, `ready`, `drain`, `down`, `fail`, `stopped`, `maint`), or fields
//! xlb does not use (`maxconn:30`), which are ignored. A sidecar or the app
//! reports CPU, memory or queue depth this way, in a protocol HAProxy users
//! already run.

use std::{net::SocketAddr, time::Duration};

use tokio::{io::AsyncReadExt, net::TcpStream};

use super::controller::Report;

/// The most of an answer read: one short line.
const MAX_ANSWER: usize = 512;

/// The report in an answer; `Ok(None)`: up, with nothing to say about load.
pub fn parse(answer: &str) -> Result<Option<Report>, String> {
    let line = answer.lines().next().unwrap_or("").trim();
    let mut report = None;
    let mut state = None;
    for word in line
        .split([' ', ',', '\t'])
        .map(str::trim)
        .filter(|w| !w.is_empty())
    {
        let lower = word.to_ascii_lowercase();
        if let Some(pct) = lower.strip_suffix('%') {
            let pct: u32 = pct
                .parse()
                .map_err(|_| format!("{word:?} is not a percentage"))?;
            report = Some(Report::Percent(pct));
        } else if matches!(lower.as_str(), "drain") {
            state = Some(Report::Drain);
        } else if matches!(lower.as_str(), "down" | "fail" | "stopped" | "maint") {
            state = Some(Report::Down);
        } else if matches!(lower.as_str(), "up" | "ready") || lower.contains(':') {
            // `up`/`ready` clear a state; `name:value` fields are not ours.
        } else {
            return Err(format!("{word:?} is not a percentage or a state"));
        }
    }
    if line.is_empty() {
        return Err("the answer is empty".into());
    }
    // A state outranks a percentage given beside it (`drain 50%`).
    Ok(state.or(report))
}

/// Asks the agent at `addr`, within `timeout`.
pub async fn ask(addr: SocketAddr, timeout: Duration) -> Result<Option<Report>, String> {
    let read = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let mut buf = Vec::with_capacity(64);
        let mut chunk = [0u8; 128];
        while buf.len() < MAX_ANSWER && !buf.contains(&b'\n') {
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|e| format!("reading: {e}"))?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        parse(&text)
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_answers_parse() {
        assert_eq!(parse("75%\n"), Ok(Some(Report::Percent(75))));
        assert_eq!(parse("up 30%"), Ok(Some(Report::Percent(30))));
        assert_eq!(parse("drain"), Ok(Some(Report::Drain)));
        assert_eq!(parse("DOWN"), Ok(Some(Report::Down)));
        assert_eq!(parse("maint\r\n"), Ok(Some(Report::Down)));
        assert_eq!(parse("ready,maxconn:10"), Ok(None));
        assert_eq!(parse("drain 50%"), Ok(Some(Report::Drain)));
        assert_eq!(parse("up\nignored 10%"), Ok(None));
    }

    #[test]
    fn nonsense_is_refused() {
        assert!(parse("").is_err());
        assert!(parse("busy").unwrap_err().contains("busy"));
        assert!(parse("x%").is_err());
        assert!(parse("-5%").is_err());
    }

    #[tokio::test]
    async fn asks_a_real_socket() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"40%\n").await.unwrap();
        });
        assert_eq!(
            ask(addr, Duration::from_secs(5)).await,
            Ok(Some(Report::Percent(40)))
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_an_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        assert!(ask(addr, Duration::from_secs(5)).await.is_err());
    }
}
