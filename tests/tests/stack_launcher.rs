//! `hearth-stack`, the launcher the web UI's browser specs use: its JSON line, its keys, the UI
//! it serves, and that its children never outlive it (stdin closed, or `kill -9`).

use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hearth_e2e::http::Req;
use hearth_e2e::stack::stack_bin;
use serde_json::{json, Value};

struct Launched {
    child: Child,
    line: Value,
    addr: SocketAddr,
    children: Vec<u32>,
}

impl Drop for Launched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn launch(args: &[&str]) -> Launched {
    let mut child = Command::new(stack_bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start hearth-stack");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("line");
    let line: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("hearth-stack printed `{line}`: {e}"));
    let addr = line["url"]
        .as_str()
        .and_then(|u| u.strip_prefix("http://"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no url in {line}"));
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))
        .expect("children")
        .split_whitespace()
        .map(|p| p.parse().expect("pid"))
        .collect();
    Launched {
        child,
        line,
        addr,
        children,
    }
}

fn alive(pid: u32) -> bool {
    // A zombie has exited already; only a running (or sleeping) process counts.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

fn wait_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "children still running: {pids:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn turn(addr: SocketAddr, key: &str, sid: &str) -> (u16, Option<String>) {
    let r = Req::new("POST", &format!("/v1/sessions/{sid}/messages"))
        .key(Some(key))
        .json(&json!({"content": "hi", "max_tokens": 2, "stream": false}))
        .send(addr)
        .await;
    (r.status, r.header("retry-after").map(str::to_string))
}

#[tokio::test]
async fn prints_url_and_keys_serves_the_ui_and_takes_its_children_along() {
    let web = std::env::temp_dir().join(format!(
        "hearth-stack-web-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&web).expect("dir");
    std::fs::write(web.join("index.html"), "<html>the chat page</html>").expect("index");
    let web_arg = web.display().to_string();
    let mut s = launch(&["--auth", "keys", "--web-dir", &web_arg]);
    assert_eq!(s.line["auth"], "keys");
    assert_eq!(
        s.children.len(),
        2,
        "hearth and hearth-worker: {:?}",
        s.children
    );
    let key = |name: &str| {
        s.line["keys"][name]
            .as_str()
            .unwrap_or_else(|| panic!("no {name} key in {}", s.line))
            .to_string()
    };
    let (full, limited, other) = (key("full"), key("limited"), key("other"));

    let page = Req::new("GET", "/").send(s.addr).await;
    assert_eq!(page.text(), "<html>the chat page</html>");
    let r = Req::new("POST", "/v1/sessions")
        .key(Some(&full))
        .json(&json!({}))
        .send(s.addr)
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let sid = r.json()["id"].as_str().expect("id").to_string();
    assert_eq!(turn(s.addr, &full, &sid).await.0, 200);
    // `other` is another user; `limited` is the same user with 2 requests a minute.
    let r = Req::new("GET", &format!("/v1/sessions/{sid}"))
        .key(Some(&other))
        .send(s.addr)
        .await;
    assert_eq!(r.status, 404);
    assert_eq!(turn(s.addr, &limited, &sid).await.0, 200);
    assert_eq!(turn(s.addr, &limited, &sid).await.0, 200);
    let (status, retry) = turn(s.addr, &limited, &sid).await;
    assert_eq!(status, 429);
    assert!(retry.is_some(), "429 without Retry-After");

    // Closing stdin (the parent went away) ends it, and its children with it.
    drop(s.child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = s.child.try_wait().expect("wait") {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "hearth-stack ignored its closed stdin"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    wait_gone(&s.children);
    let _ = std::fs::remove_dir_all(&web);
}

#[tokio::test]
async fn its_children_die_with_it_even_on_kill_9() {
    let mut s = launch(&["--scripted-token-ms", "5", "--web-dir", "/nonexistent"]);
    assert_eq!(s.line["auth"], "none");
    assert_eq!(s.line["keys"], json!({}));
    // No UI built there: the page says so, the API works.
    let page = Req::new("GET", "/").send(s.addr).await;
    assert!(page.text().contains("not built"), "{}", page.text());
    let r = Req::new("GET", "/v1/models").send(s.addr).await;
    assert_eq!(r.json()["data"][0]["id"], "scripted");
    assert!(s.children.iter().all(|&p| alive(p)));
    s.child.kill().expect("kill -9");
    let _ = s.child.wait();
    wait_gone(&s.children);
}
