//! The web UI's static files at `/`, over a real socket: content types, Next's `name.html`
//! routes, cache headers, the export's 404 page, path traversal, the API's JSON answers beside
//! them, the page shown when the UI is not built, and the Content-Security-Policy on all of it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hearth_e2e::http::{Reply, Req};
use hearth_orchestrator::api::{router, ApiOptions, AppState, AuthMode};
use hearth_orchestrator::generate::Streams;
use hearth_orchestrator::limits::Limiter;
use hearth_orchestrator::service::{ChatLimits, ChatService, ServiceParts};
use hearth_orchestrator::storage::SqlStore;
use hearth_orchestrator::workers::{Affinity, PoolConfig, WorkerPool};

struct Server {
    addr: std::net::SocketAddr,
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "hearth-web-{tag}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

fn write(root: &Path, rel: &str, body: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("dirs");
    std::fs::write(p, body).expect("write");
}

/// A server with keys on (the UI's files must need none) whose web directory is `web_dir`
/// under a fresh temporary directory; `export` fills it (or not).
async fn start(export: impl FnOnce(&Path)) -> Server {
    let dir = temp_dir("srv");
    let web_dir = dir.join("out");
    export(&web_dir);
    let url = format!("sqlite://{}?mode=rwc", dir.join("hearth.db").display());
    let store = Arc::new(SqlStore::connect(&url).await.expect("store"));
    let tokenizer = dir.join("tokenizer.json");
    hearth_worker::fixtures::write_tiny_tokenizer(&tokenizer, 512).expect("tokenizer");
    let chat = Arc::new(ChatService::new(ServiceParts {
        store: store.clone(),
        pool: WorkerPool::start(&[], Affinity::local(), PoolConfig::default()),
        tokenizers: hearth_orchestrator::service::Tokenizers::from_file(&tokenizer)
            .expect("tokenizer"),
        limiter: Limiter::local(),
        streams: Arc::new(Streams::default()),
        stop_bus: None,
        limits: ChatLimits::default(),
        shared_prompts: Default::default(),
        shared_replies: None,
    }));
    let app = router(AppState {
        chat,
        auth: AuthMode::Keys,
        options: ApiOptions {
            web_dir,
            ..ApiOptions::default()
        },
        metrics: None,
        body_bytes: Arc::new(tokio::sync::Semaphore::new(
            hearth_orchestrator::api::MAX_BODY_BYTES_IN_FLIGHT,
        )),
        sockets: Arc::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    Server { addr, dir }
}

/// What a Next.js static export looks like, plus a file beside it that must stay unreachable.
fn export(out: &Path) {
    write(out, "index.html", "<html>chat home</html>");
    write(out, "settings.html", "<html>settings page</html>");
    write(out, "404.html", "<html>custom not found</html>");
    write(out, "index.txt", "rsc payload");
    write(out, "favicon.ico", "icon");
    write(out, "_next/static/chunks/app-3f2a.js", "console.log('app')");
    write(out, "_next/static/css/site-9c1d.css", "body{}");
    write(out, "_next/static/media/font-1a.woff2", "font");
    write(out, "docs/index.html", "<html>docs index</html>");
    let parent = out.parent().expect("parent");
    write(parent, "secret.txt", "do not serve");
    std::os::unix::fs::symlink(parent.join("secret.txt"), out.join("leak.txt")).expect("symlink");
}

async fn get(s: &Server, path: &str) -> Reply {
    Req::new("GET", path).send(s.addr).await
}

#[tokio::test]
async fn serves_the_export_with_types_routes_and_cache_headers() {
    let s = start(export).await;

    let home = get(&s, "/").await;
    assert_eq!(home.status, 200);
    assert_eq!(home.text(), "<html>chat home</html>");
    assert_eq!(
        home.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(home.header("cache-control"), Some("no-cache"));

    // No key needed for the UI's files, although the API requires one.
    assert_eq!(get(&s, "/v1/sessions").await.status, 401);

    let index = get(&s, "/index.html").await;
    assert_eq!(index.text(), "<html>chat home</html>");

    // Next writes route `/settings` as `settings.html`.
    let settings = get(&s, "/settings").await;
    assert_eq!(settings.status, 200);
    assert_eq!(settings.text(), "<html>settings page</html>");
    assert_eq!(settings.header("cache-control"), Some("no-cache"));
    // A query string does not change the file.
    assert_eq!(
        get(&s, "/settings?x=1").await.text(),
        "<html>settings page</html>"
    );
    assert_eq!(get(&s, "/docs/").await.text(), "<html>docs index</html>");
    assert_eq!(get(&s, "/docs").await.text(), "<html>docs index</html>");

    let js = get(&s, "/_next/static/chunks/app-3f2a.js").await;
    assert_eq!(js.status, 200);
    assert_eq!(js.text(), "console.log('app')");
    assert_eq!(
        js.header("content-type"),
        Some("text/javascript; charset=utf-8")
    );
    assert_eq!(
        js.header("cache-control"),
        Some("public, max-age=31536000, immutable")
    );
    let css = get(&s, "/_next/static/css/site-9c1d.css").await;
    assert_eq!(css.header("content-type"), Some("text/css; charset=utf-8"));
    let font = get(&s, "/_next/static/media/font-1a.woff2").await;
    assert_eq!(font.header("content-type"), Some("font/woff2"));
    let rsc = get(&s, "/index.txt").await;
    assert_eq!(
        rsc.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(rsc.header("cache-control"), Some("no-cache"));
    assert_eq!(
        get(&s, "/favicon.ico").await.header("content-type"),
        Some("image/x-icon")
    );

    // Revalidation: the ETag comes back as 304 with no body.
    let etag = home.header("etag").expect("etag").to_string();
    let again = Req::new("GET", "/")
        .header("If-None-Match", etag)
        .send(s.addr)
        .await;
    assert_eq!(again.status, 304);
    assert!(again.body.is_empty());

    let head = Req::new("HEAD", "/settings").send(s.addr).await;
    assert_eq!(head.status, 200);
    assert_eq!(
        head.header("content-type"),
        Some("text/html; charset=utf-8")
    );
}

#[tokio::test]
async fn unknown_paths_get_the_export_404_and_the_api_keeps_json() {
    let s = start(export).await;

    let missing = get(&s, "/no/such/page").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.text(), "<html>custom not found</html>");
    assert_eq!(
        missing.header("content-type"),
        Some("text/html; charset=utf-8")
    );

    for path in ["/v1/nope", "/v1", "/v1/sessions/x/y/z", "/healthz/x"] {
        let r = get(&s, path).await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.json()["error"]["type"], "not_found_error", "{path}");
    }
    let r = Req::new("DELETE", "/v1/models").send(s.addr).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.json()["error"]["code"], "method_not_allowed");
    // The UI's paths take GET and HEAD only: other methods name no route (a JSON 404).
    for path in ["/settings", "/", "/no/such/page"] {
        let r = Req::new("POST", path).send(s.addr).await;
        assert_eq!(r.status, 404, "{path}");
        assert_eq!(r.json()["error"]["type"], "not_found_error", "{path}");
    }

    assert_eq!(get(&s, "/healthz").await.text(), "ok");
}

#[tokio::test]
async fn path_traversal_reaches_nothing_outside_the_export() {
    let s = start(export).await;
    for path in [
        "/../secret.txt",
        "/..%2fsecret.txt",
        "/%2e%2e/secret.txt",
        "/%2E%2E%2Fsecret.txt",
        "/docs/../../secret.txt",
        "/docs/%2e%2e/%2e%2e/secret.txt",
        "/..%5csecret.txt",
        "//secret.txt",
        "/leak.txt",
        "/./index.html",
        "/index.html%00",
        "/%zz",
    ] {
        let r = get(&s, path).await;
        assert!(
            !r.text().contains("do not serve"),
            "{path} leaked a file outside the export"
        );
        // Either the export's 404 page, or a refusal before any routing (hyper rejects some
        // request targets outright).
        assert!(
            r.status == 404 || r.status == 400,
            "{path}: status {}",
            r.status
        );
    }
}

#[tokio::test]
async fn without_a_build_the_root_says_how_to_build_it_and_the_api_works() {
    let s = start(|_| {}).await;
    let r = get(&s, "/").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.header("content-type"), Some("text/html; charset=utf-8"));
    let page = r.text();
    assert!(page.contains("not built"), "{page}");
    assert!(page.contains("make run"), "{page}");
    assert!(page.contains("npm run build"), "{page}");
    // Other UI paths say the same; the API is unaffected.
    assert!(get(&s, "/settings").await.text().contains("not built"));
    assert_eq!(get(&s, "/healthz").await.text(), "ok");
    assert_eq!(get(&s, "/v1/sessions").await.status, 401);
    let r = get(&s, "/v1/nope").await;
    assert_eq!(r.json()["error"]["type"], "not_found_error");
}

/// A page as Next's export writes it: chunks by `src`, and inline scripts for the theme (before
/// first paint), the bundler's bootstrap and the flight data (`self.__next_f`), which differs
/// from page to page.
fn next_page(text: &str) -> String {
    [
        r#"<!DOCTYPE html><html lang="en"><head><meta charSet="utf-8"/>"#,
        r#"<link rel="stylesheet" href="/_next/static/chunks/site-9c1d.css"/>"#,
        r#"<script src="/_next/static/chunks/app-3f2a.js" async=""></script>"#,
        r#"<script>try{var t=localStorage.getItem("hearth.theme");if(t)"#,
        r#"document.documentElement.dataset.theme=t}catch(e){}</script>"#,
        r#"</head><body><main>"#,
        text,
        r#"</main><script src="/_next/static/chunks/poly-0c.js" noModule=""></script>"#,
        r#"<script id="_R_">(globalThis["TURBOPACK"] || (globalThis["TURBOPACK"] = []))"#,
        r#".push({"otherChunks":["/_next/static/chunks/app-3f2a.js"]})</script>"#,
        r#"<script>(self.__next_f=self.__next_f||[]).push([0])</script>"#,
        r#"<script>self.__next_f.push([1,"1:\"$Sreact.fragment\"\n2:[\"\u003cp\u003e"#,
        text,
        r#"\"]\n"])</script></body></html>"#,
    ]
    .concat()
}

fn next_export(out: &Path) {
    write(out, "index.html", &next_page("chat home"));
    write(out, "settings.html", &next_page("settings page"));
    write(out, "404.html", &next_page("custom not found"));
    write(out, "_next/static/chunks/app-3f2a.js", "console.log('app')");
    write(out, "icon.svg", "<svg xmlns='http://www.w3.org/2000/svg'/>");
}

/// The body of each `<script>` without `src` (enough for the pages above).
fn inline_scripts(page: &str) -> Vec<&str> {
    page.split("<script")
        .skip(1)
        .filter_map(|rest| {
            let (attrs, rest) = rest.split_once('>')?;
            let (body, _) = rest.split_once("</script>")?;
            (!attrs.contains("src=")).then_some(body)
        })
        .collect()
}

fn hash_source(script: &str) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(script.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// The policy of `r` as directive name to sources, after checking what every web answer must
/// carry: the policy, no framing (old browsers too), and no inline script or `eval` by fiat.
fn policy_of(r: &Reply, what: &str) -> HashMap<String, Vec<String>> {
    let header = r
        .header("content-security-policy")
        .unwrap_or_else(|| panic!("{what}: no Content-Security-Policy"));
    let policy: HashMap<String, Vec<String>> = header
        .split(';')
        .filter_map(|d| {
            let mut words = d.split_whitespace().map(str::to_string);
            Some((words.next()?, words.collect()))
        })
        .collect();
    assert_eq!(r.header("x-frame-options"), Some("DENY"), "{what}");
    for (name, sources) in [
        ("frame-ancestors", &["'none'"][..]),
        ("default-src", &["'self'"][..]),
        ("object-src", &["'none'"][..]),
        ("base-uri", &["'none'"][..]),
    ] {
        let got = policy.get(name).cloned().unwrap_or_default();
        assert_eq!(got, sources, "{what}: {header}");
    }
    let scripts = &policy["script-src"];
    assert_eq!(
        scripts.first().map(String::as_str),
        Some("'self'"),
        "{what}"
    );
    for loose in ["'unsafe-inline'", "'unsafe-eval'", "*", "data:"] {
        assert!(!scripts.iter().any(|s| s == loose), "{what}: {header}");
    }
    policy
}

#[tokio::test]
async fn every_page_admits_exactly_its_own_inline_scripts() {
    let s = start(next_export).await;
    let mut hashes_by_page = Vec::new();
    for (path, status) in [("/", 200), ("/settings", 200), ("/no/such/page", 404)] {
        let r = get(&s, path).await;
        assert_eq!(r.status, status, "{path}");
        let page = r.text();
        let inline = inline_scripts(&page);
        assert_eq!(inline.len(), 4, "{path}: {page}");
        let mut hashes: Vec<String> = inline.into_iter().map(hash_source).collect();
        hashes.dedup();
        let policy = policy_of(&r, path);
        assert_eq!(policy["script-src"][1..], hashes[..], "{path}");
        hashes_by_page.push(hashes);
    }
    // The flight data differs, so one page's hashes do not admit another's scripts.
    assert_ne!(hashes_by_page[0], hashes_by_page[1]);

    // A revalidated page keeps its policy: the browser updates its copy's headers from the 304.
    let home = get(&s, "/").await;
    let etag = home.header("etag").expect("etag").to_string();
    let again = Req::new("GET", "/")
        .header("If-None-Match", etag)
        .send(s.addr)
        .await;
    assert_eq!(again.status, 304);
    assert_eq!(
        again.header("content-security-policy"),
        home.header("content-security-policy")
    );

    // Other files carry the policy too (a script's applies to it as a worker, an SVG's when
    // opened on its own), with no inline script admitted.
    for path in ["/_next/static/chunks/app-3f2a.js", "/icon.svg"] {
        let r = get(&s, path).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(policy_of(&r, path)["script-src"], ["'self'"], "{path}");
    }
}

#[tokio::test]
async fn the_page_without_a_build_carries_the_policy_too() {
    let s = start(|_| {}).await;
    let r = get(&s, "/").await;
    assert!(r.text().contains("not built"));
    assert_eq!(policy_of(&r, "/ (not built)")["script-src"], ["'self'"]);
}
