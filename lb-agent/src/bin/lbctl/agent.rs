//! What only the running agent knows (its readiness, BGP sessions, the
//! allocator's Lease, the L2 VIPs it answers for, its flow-sync peers,
//! service names), read from its own `/metrics`: the series an operator's
//! Prometheus scrapes, so that `lbctl` and the dashboards agree.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};

/// How long the agent has to answer.
const TIMEOUT: Duration = Duration::from_secs(3);
/// A `/metrics` page larger than this is refused (a node with 100,000
/// backends has about 100 MB of series; lbctl reads the small families).
const MAX_PAGE: u64 = 512 << 20;

/// One series: its name, labels and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> &str {
        self.labels.get(name).map_or("", String::as_str)
    }
}

/// The agent's address from `--agent`: `ADDR:PORT`, with or without
/// `http://` (an IPv6 address with or without brackets, as the agent's
/// `--metrics-addr` takes it).
pub fn parse_agent(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    let s = s.strip_prefix("http://").unwrap_or(s);
    lb_agent::config::parse_listen_addr(s.trim_end_matches('/'))
}

/// The agent's series, from `GET /metrics` at `addr`.
pub fn scrape(addr: SocketAddr) -> Result<Vec<Sample>> {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)
        .with_context(|| format!("connecting to the agent at {addr} (is lb-agent running, and is --agent its metrics address?)"))?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut page = Vec::new();
    s.take(MAX_PAGE)
        .read_to_end(&mut page)
        .with_context(|| format!("reading {addr}/metrics"))?;
    let page = String::from_utf8_lossy(&page);
    let (head, body) = page
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}/metrics: not an HTTP answer"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{addr}/metrics answered {status:?}");
    }
    if head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    }) {
        return Ok(parse(&dechunk(body)));
    }
    Ok(parse(body))
}

/// The body of a chunked HTTP/1.1 answer.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// Prometheus' text format: `name{label="value",...} value` lines.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut labels = BTreeMap::new();
    let mut rest = &line[name_end..];
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices();
        let mut key = String::new();
        let mut value = String::new();
        let mut in_value = false;
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match (in_value, c) {
                (false, '}') => {
                    end = Some(i + 1);
                    break;
                }
                (false, '=') => {}
                (false, '"') => in_value = true,
                (false, ',') => {}
                (false, c) => key.push(c),
                (true, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (true, '"') => {
                    labels.insert(std::mem::take(&mut key), std::mem::take(&mut value));
                    in_value = false;
                }
                (true, c) => value.push(c),
            }
        }
        rest = &after[end?..];
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The series of one family.
pub fn family<'a>(all: &'a [Sample], name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
    all.iter().filter(move |s| s.name == name)
}

/// The one value of a family without labels.
pub fn value(all: &[Sample], name: &str) -> Option<f64> {
    family(all, name).next().map(|s| s.value)
}

/// Service names by `(VIP, port, protocol)`: the agent's `service` label
/// (`namespace/name:port` in Kubernetes, the file's `name` otherwise).
pub fn service_names(all: &[Sample]) -> BTreeMap<(IpAddr, u16, String), String> {
    family(all, "xlb_service_packets_total")
        .filter_map(|s| {
            let vip = s.label("vip").parse().ok()?;
            let port = s.label("port").parse().ok()?;
            Some((
                (vip, port, s.label("protocol").to_string()),
                s.label("service").to_string(),
            ))
        })
        .collect()
}

/// What the agent says of one backend of one service.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentBackend {
    /// `active`, `draining`, `terminating` or `unhealthy`.
    pub state: String,
    pub weight: u32,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    pub reply_packets: u64,
    pub reply_bytes: u64,
    pub closed_flows: u64,
}

/// Every backend the agent has, those out of the Maglev table included, by
/// service name and address.
pub fn backends(all: &[Sample]) -> BTreeMap<(String, SocketAddr), AgentBackend> {
    let mut out: BTreeMap<(String, SocketAddr), AgentBackend> = BTreeMap::new();
    for s in all.iter().filter(|s| s.name.starts_with("xlb_backend_")) {
        let Ok(addr) = s.label("backend").parse::<SocketAddr>() else {
            continue;
        };
        let b = out
            .entry((s.label("service").to_owned(), addr))
            .or_default();
        let n = s.value as u64;
        match s.name.as_str() {
            "xlb_backend_state" if s.value == 1.0 => b.state = s.label("state").to_owned(),
            "xlb_backend_weight" => b.weight = n as u32,
            "xlb_backend_packets_total" => b.packets = n,
            "xlb_backend_bytes_total" => b.bytes = n,
            "xlb_backend_new_flows_total" => b.new_flows = n,
            "xlb_backend_reply_packets_total" => b.reply_packets = n,
            "xlb_backend_reply_bytes_total" => b.reply_bytes = n,
            "xlb_backend_closed_flows_total" => b.closed_flows = n,
            _ => {}
        }
    }
    out.retain(|_, b| !b.state.is_empty());
    out
}

/// Seconds since the Unix time `t` (0 if `t` is in the future).
pub fn age(t: f64) -> f64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    (now - t).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_series_with_and_without_labels() {
        let text = "# HELP xlb_agent_ready x\n# TYPE xlb_agent_ready gauge\nxlb_agent_ready 1\n\
                    xlb_service_packets_total{service=\"shop/web:http\",vip=\"192.0.2.1\",port=\"80\",protocol=\"tcp\"} 42\n\
                    xlb_bgp_peer_up{peer=\"10.0.0.1\"} 0\n\
                    odd{a=\"x\\\"y,z}\",b=\"\"} 1.5e3\n";
        let all = parse(text);
        assert_eq!(value(&all, "xlb_agent_ready"), Some(1.0));
        let names = service_names(&all);
        let vip: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(names[&(vip, 80, "tcp".into())], "shop/web:http");
        let odd = family(&all, "odd").next().unwrap();
        assert_eq!(odd.label("a"), "x\"y,z}");
        assert_eq!(odd.label("b"), "");
        assert_eq!(odd.value, 1500.0);
    }

    #[test]
    fn backends_gather_their_series_and_state() {
        let text =
            "xlb_backend_state{service=\"web\",backend=\"10.0.0.2:80\",state=\"draining\"} 1\n\
                    xlb_backend_weight{service=\"web\",backend=\"10.0.0.2:80\"} 0\n\
                    xlb_backend_new_flows_total{service=\"web\",backend=\"10.0.0.2:80\"} 12\n\
                    xlb_backend_closed_flows_total{service=\"web\",backend=\"10.0.0.2:80\"} 9\n\
                    xlb_backend_open_flows{service=\"web\",backend=\"10.0.0.3:80\"} 4\n";
        let got = backends(&parse(text));
        let addr: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let b = &got[&("web".to_owned(), addr)];
        assert_eq!((b.state.as_str(), b.weight), ("draining", 0));
        assert_eq!((b.new_flows, b.closed_flows), (12, 9));
        assert_eq!(
            got.len(),
            1,
            "a backend with no state is not listed: {got:?}"
        );
    }

    #[test]
    fn reads_chunked_bodies() {
        assert_eq!(
            dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
            "hello world"
        );
    }

    #[test]
    fn takes_the_agents_address_as_its_flag_does() {
        let want: SocketAddr = "10.0.0.11:9469".parse().unwrap();
        for s in ["10.0.0.11:9469", "http://10.0.0.11:9469/"] {
            assert_eq!(parse_agent(s), Ok(want));
        }
        let v6: SocketAddr = "[fd00::11]:9469".parse().unwrap();
        assert_eq!(parse_agent("http://[fd00::11]:9469"), Ok(v6));
        assert_eq!(parse_agent("fd00::11:9469"), Ok(v6));
        assert!(parse_agent("localhost").is_err());
    }
}
