//! Workers found by DNS (`--worker dns:NAME:PORT`), against a DNS server of the test's own
//! whose answer the test changes while `hearth` runs: a worker that appears in DNS starts taking
//! new sessions, and one that leaves it while streaming a reply hands the reply to the other
//! worker, which finishes it. The workers share one port on two loopback addresses, as workers
//! on two hosts behind one name would.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_e2e::http::Req;
use hearth_e2e::stack::{
    assets, finish, history, json_turn, metric, new_session, read_tokens, stream_turn, token_text,
    worker_at, worker_in_flight, Hearth,
};
use hickory_proto::op::Message;
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// The name the workers are found under.
const NAME: &str = "workers.hearth.test";

/// Scripted workers: a token every 40 ms, so a reply's length is set here, not by the machine.
const SCRIPTED: [&str; 2] = ["--scripted-token-ms", "40"];

/// A DNS server on 127.0.0.1 (UDP and TCP on one port) that answers A queries for [`NAME`]
/// with the addresses the test sets, at TTL 0, and every other query with no records.
struct Dns {
    addr: SocketAddr,
    answer: Arc<Mutex<Vec<Ipv4Addr>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Dns {
    async fn start() -> Self {
        let (udp, tcp) = bind_udp_and_tcp().await;
        let addr = udp.local_addr().expect("DNS address");
        let answer = Arc::new(Mutex::new(Vec::new()));
        let tasks = vec![
            tokio::spawn(serve_udp(udp, answer.clone())),
            tokio::spawn(serve_tcp(tcp, answer.clone())),
        ];
        Self {
            addr,
            answer,
            tasks,
        }
    }

    /// From now on [`NAME`] resolves to `ips`.
    fn set(&self, ips: &[Ipv4Addr]) {
        *self.answer.lock().expect("answer") = ips.to_vec();
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A UDP socket and a TCP listener on the same loopback port.
async fn bind_udp_and_tcp() -> (UdpSocket, TcpListener) {
    for _ in 0..20 {
        let udp = UdpSocket::bind("127.0.0.1:0").await.expect("UDP socket");
        let addr = udp.local_addr().expect("UDP address");
        if let Ok(tcp) = TcpListener::bind(addr).await {
            return (udp, tcp);
        }
    }
    panic!("no port free for both UDP and TCP");
}

/// The reply to the DNS message `query`, or `None` if it is not one.
fn respond(query: &[u8], answer: &Mutex<Vec<Ipv4Addr>>) -> Option<Vec<u8>> {
    let q = Message::from_vec(query).ok()?;
    let mut r = Message::response(q.metadata.id, q.metadata.op_code);
    r.metadata.authoritative = true;
    r.metadata.recursion_desired = q.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    for query in &q.queries {
        r.add_query(query.clone());
        let name = query.name().to_string();
        let ours = name.trim_end_matches('.').eq_ignore_ascii_case(NAME);
        if ours && query.query_type() == RecordType::A {
            for ip in answer.lock().expect("answer").iter() {
                let rdata = RData::A(A(*ip));
                r.add_answer(Record::from_rdata(query.name().clone(), 0, rdata));
            }
        }
    }
    r.to_vec().ok()
}

async fn serve_udp(udp: UdpSocket, answer: Arc<Mutex<Vec<Ipv4Addr>>>) {
    let mut buf = vec![0u8; 4096];
    while let Ok((n, from)) = udp.recv_from(&mut buf).await {
        if let Some(reply) = respond(&buf[..n], &answer) {
            let _ = udp.send_to(&reply, from).await;
        }
    }
}

async fn serve_tcp(tcp: TcpListener, answer: Arc<Mutex<Vec<Ipv4Addr>>>) {
    while let Ok((stream, _)) = tcp.accept().await {
        tokio::spawn(serve_tcp_connection(stream, answer.clone()));
    }
}

/// DNS over TCP: each message after its 2-byte length.
async fn serve_tcp_connection(mut s: TcpStream, answer: Arc<Mutex<Vec<Ipv4Addr>>>) {
    loop {
        let Ok(len) = s.read_u16().await else { return };
        let mut query = vec![0u8; usize::from(len)];
        if s.read_exact(&mut query).await.is_err() {
            return;
        }
        let Some(reply) = respond(&query, &answer) else {
            return;
        };
        let Ok(len) = u16::try_from(reply.len()) else {
            return;
        };
        if s.write_u16(len).await.is_err() || s.write_all(&reply).await.is_err() {
            return;
        }
    }
}

/// `/readyz`'s workers, once `want` holds for them; panics after 60 s.
async fn wait_workers(addr: SocketAddr, what: &str, want: impl Fn(&[serde_json::Value]) -> bool) {
    for _ in 0..600 {
        let r = Req::new("GET", "/readyz").send(addr).await;
        let workers = r.json()["workers"].as_array().cloned().unwrap_or_default();
        if want(&workers) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/readyz never showed {what}");
}

fn all_ready(workers: &[serde_json::Value], n: usize) -> bool {
    workers.len() == n && workers.iter().all(|w| w["ready"] == true)
}

/// A short turn in a new session, answered as JSON; the worker that served it.
async fn new_session_worker(addr: SocketAddr) -> String {
    let sid = new_session(addr, "").await;
    let r = json_turn(addr, "", &sid, "hello", 3).await;
    r["worker"].as_str().expect("worker").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_come_and_go_with_dns_and_a_leaving_worker_s_reply_moves() {
    let a = assets("discovery");
    let (ip_a, ip_b) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));
    let worker_a = worker_at(&a.model, &format!("{ip_a}:0"), &SCRIPTED);
    let port = worker_a
        .grpc
        .rsplit_once(':')
        .expect("host:port")
        .1
        .to_string();
    let worker_b = worker_at(&a.model, &format!("{ip_b}:{port}"), &SCRIPTED);
    let dns = Dns::start().await;
    dns.set(&[ip_a]);
    let args = a.open_args(&[
        "--worker",
        &format!("dns:{NAME}:{port}"),
        "--dns-server",
        &dns.addr.to_string(),
        "--dns-refresh-secs",
        "1",
    ]);
    let hearth = Hearth::spawn(&args);

    // One worker in DNS: it serves.
    wait_workers(hearth.addr, "the first worker ready", |w| all_ready(w, 1)).await;
    let name_a = new_session_worker(hearth.addr).await;

    // The second appears in DNS: after a refresh it is connected and takes a new session while
    // the first is busy with a long reply (both idle, a tie goes to the first found).
    dns.set(&[ip_a, ip_b]);
    wait_workers(hearth.addr, "both workers ready", |w| all_ready(w, 2)).await;
    let sid = new_session(hearth.addr, "").await;
    let mut sse = stream_turn(hearth.addr, "", &sid, 300).await;
    let head = token_text(&read_tokens(&mut sse, 10).await);
    assert_eq!(
        worker_in_flight(&worker_a).await,
        1.0,
        "the long reply is on the first worker"
    );
    let name_b = new_session_worker(hearth.addr).await;
    assert_ne!(name_b, name_a, "a new session went to the worker DNS added");

    // The first leaves DNS while streaming: its reply continues on the second and ends whole.
    dns.set(&[ip_b]);
    let (rest, end) = tokio::time::timeout(Duration::from_secs(120), finish(&mut sse))
        .await
        .expect("the reply did not end within 120 s");
    assert_eq!(end.event, "message_end", "{end:?}");
    let e = end.json();
    assert_eq!(e["status"], "complete", "{e}");
    assert_eq!(e["finish_reason"], "length", "{e}");
    assert_eq!(e["usage"]["completion_tokens"], 300, "{e}");
    assert_eq!(
        e["worker"],
        name_b.as_str(),
        "the reply ended on the remaining worker"
    );
    let msgs = history(hearth.addr, "", &sid).await;
    assert_eq!(msgs.len(), 2, "{msgs:#?}");
    assert_eq!(
        msgs[1]["content"],
        head + &rest,
        "the stored reply is what was streamed"
    );
    let failovers = metric(hearth.addr, "hearth_worker_failovers_total").await;
    assert_eq!(failovers, 1.0, "the reply moved once");
    // The removed worker's slot is gone from the list.
    wait_workers(hearth.addr, "only the second worker", |w| {
        w.len() == 1 && w[0]["name"] == name_b.as_str()
    })
    .await;
    drop(hearth);
    drop((worker_a, worker_b, dns));
    let _ = std::fs::remove_dir_all(&a.dir);
}
