//! The web UI: the statically exported Next.js app (`web/out`, `--web-dir`), served at `/` on the
//! API's own origin, so the browser needs no CORS and the UI no server of its own.
//!
//! This is the router's fallback: every path no API route claims. Paths under `/v1` and the
//! operations routes keep their JSON 404s, and so does any method but GET and HEAD. Static files need no key (the UI asks for one and
//! sends it with its API calls). A path resolves to the file itself, then `name.html` (Next's
//! export writes route `/name` there), then `name/index.html`; anything else is the export's
//! `404.html` with status 404. Every segment is checked before the file system is touched, and
//! the resolved file must lie inside the directory, so `..`, encoded or not, reaches nothing.
//!
//! Every answer from here carries the UI's Content-Security-Policy ([`csp`]; an HTML page's
//! lists its own inline scripts by hash) and may not be framed.

mod csp;

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};

/// Build outputs under here have content hashes in their names: cache them for good.
const IMMUTABLE_PREFIX: &str = "_next/static/";
const IMMUTABLE: &str = "public, max-age=31536000, immutable";
/// Everything else (HTML, RSC payloads, icons) may change with the next build: revalidate.
const REVALIDATE: &str = "no-cache";

/// Paths that belong to the API even when nothing matches: their 404s stay JSON.
const API_PREFIXES: [&str; 4] = ["/v1", "/healthz", "/readyz", "/metrics"];

fn is_api_path(path: &str) -> bool {
    API_PREFIXES.iter().any(|p| {
        path.strip_prefix(p)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    })
}

/// The fallback handler.
pub async fn fallback(
    State(s): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    // The UI's files take GET and HEAD only; anything else names no route, as before the UI.
    if is_api_path(uri.path()) || (method != Method::GET && method != Method::HEAD) {
        return ApiError::NotFound("route").into_response();
    }
    let root = &s.options.web_dir;
    let mut response = match serve(root, uri.path(), &headers).await {
        Some(r) => r,
        None => not_built(root),
    };
    if method == Method::HEAD {
        *response.body_mut() = Body::empty();
    }
    response
}

/// The response for `path` from the export in `root`, or `None` when there is no export.
async fn serve(root: &Path, path: &str, headers: &HeaderMap) -> Option<Response> {
    let root = tokio::fs::canonicalize(root).await.ok()?;
    if !root.join("index.html").is_file() {
        return None;
    }
    let found = match relative(path) {
        Some(rel) => resolve(&root, &rel).await,
        None => None,
    };
    Some(match found {
        Some((file, rel)) => file_response(&file, &rel, StatusCode::OK, headers).await,
        None => match resolve(&root, "404.html").await {
            Some((file, rel)) => {
                file_response(&file, &rel, StatusCode::NOT_FOUND, &HeaderMap::new()).await
            }
            None => (StatusCode::NOT_FOUND, "not found").into_response(),
        },
    })
}

/// The request path as a relative file path (`""` for `/`, `dir/` for a directory), or `None`
/// when a segment could escape the directory or is not a plain name: `..`, `.`, empty
/// (`//`), hidden (`.x`), or containing `/`, `\` or NUL once percent-decoded.
fn relative(path: &str) -> Option<String> {
    let trimmed = path.strip_prefix('/')?;
    if trimmed.is_empty() {
        return Some(String::new());
    }
    let (body, dir) = match trimmed.strip_suffix('/') {
        Some(b) => (b, true),
        None => (trimmed, false),
    };
    let mut out = Vec::new();
    for raw in body.split('/') {
        let seg = percent_decode(raw)?;
        if seg.is_empty()
            || seg.starts_with('.')
            || seg.contains(['/', '\\', '\0'])
            || seg.chars().any(char::is_control)
        {
            return None;
        }
        out.push(seg);
    }
    let mut rel = out.join("/");
    if dir {
        rel.push('/');
    }
    Some(rel)
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The first existing file among `rel`, `rel.html` and `rel/index.html` (`index.html` for
/// the root), with its path relative to `root`; only files inside `root` count.
async fn resolve(root: &Path, rel: &str) -> Option<(PathBuf, String)> {
    let candidates = if rel.is_empty() {
        vec!["index.html".to_string()]
    } else if let Some(dir) = rel.strip_suffix('/') {
        vec![format!("{dir}/index.html"), format!("{dir}.html")]
    } else {
        vec![
            rel.to_string(),
            format!("{rel}.html"),
            format!("{rel}/index.html"),
        ]
    };
    for c in candidates {
        let Ok(file) = tokio::fs::canonicalize(root.join(&c)).await else {
            continue;
        };
        // A symbolic link pointing out of the export does not count.
        if file.starts_with(root) && file.is_file() {
            return Some((file, c));
        }
    }
    None
}

async fn file_response(
    file: &Path,
    rel: &str,
    status: StatusCode,
    headers: &HeaderMap,
) -> Response {
    let meta = match tokio::fs::metadata(file).await {
        Ok(m) => m,
        Err(e) => return ApiError::Internal(format!("{}: {e}", file.display())).into_response(),
    };
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let etag = format!("\"{:x}-{modified:x}\"", meta.len());
    let cache = if rel.starts_with(IMMUTABLE_PREFIX) {
        IMMUTABLE
    } else {
        REVALIDATE
    };
    let unchanged = status == StatusCode::OK
        && headers
            .get(header::IF_NONE_MATCH)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let content_type = content_type(rel);
    let html = content_type.starts_with("text/html");
    // A page's policy depends on its inline scripts, so a page is read for a 304 too: the
    // browser updates its cached copy's headers from the 304, and they must stay the same.
    let bytes = if unchanged && !html {
        None
    } else {
        match tokio::fs::read(file).await {
            Ok(b) => Some(b),
            Err(e) => {
                return ApiError::Internal(format!("{}: {e}", file.display())).into_response()
            }
        }
    };
    let policy = csp::policy(bytes.as_deref().filter(|_| html));
    let mut builder = Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, cache)
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(header::CONTENT_SECURITY_POLICY, policy)
        .header(header::X_FRAME_OPTIONS, csp::FRAME_OPTIONS);
    if let Ok(v) = HeaderValue::from_str(&etag) {
        builder = builder.header(header::ETAG, v);
    }
    let (status, body) = match bytes {
        Some(b) if !unchanged => (status, Body::from(b)),
        _ => (StatusCode::NOT_MODIFIED, Body::empty()),
    };
    builder
        .status(status)
        .body(body)
        .unwrap_or_else(|e| ApiError::Internal(e.to_string()).into_response())
}

/// By extension, for what a Next.js export contains.
fn content_type(rel: &str) -> &'static str {
    let ext = rel
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "webmanifest" => "application/manifest+json",
        // React Server Component payloads of the export.
        "txt" => "text/plain; charset=utf-8",
        "xml" => "application/xml",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "webp" => "image/webp",
        "avif" => "image/avif",
        "ico" => "image/x-icon",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "ttf" => "font/ttf",
        "otf" => "font/otf",
        "wasm" => "application/wasm",
        _ => "application/octet-stream",
    }
}

/// What `/` shows when the UI has not been built: the API works regardless.
fn not_built(root: &Path) -> Response {
    let dir = html_escape(&root.display().to_string());
    let page = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Hearth: web UI not built</title></head>\n<body>\n\
         <h1>The web UI is not built</h1>\n\
         <p>Hearth serves its chat UI from <code>{dir}</code>, which has no \
         <code>index.html</code>.</p>\n\
         <p>Build it with <code>make run</code> (it builds the UI when it is missing or stale, \
         then starts the server), or by hand: <code>cd web &amp;&amp; npm ci &amp;&amp; npm run \
         build</code>. <code>--web-dir</code> (<code>HEARTH_WEB_DIR</code>) points hearth at \
         another directory.</p>\n\
         <p>The API works regardless: <a href=\"/v1/models\">/v1/models</a>, \
         <a href=\"/readyz\">/readyz</a>.</p>\n</body></html>\n"
    );
    (
        StatusCode::NOT_FOUND,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8".to_string()),
            (header::CACHE_CONTROL, REVALIDATE.to_string()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_string()),
            (
                header::CONTENT_SECURITY_POLICY,
                csp::policy(Some(page.as_bytes())),
            ),
            (header::X_FRAME_OPTIONS, csp::FRAME_OPTIONS.to_string()),
        ],
        page,
    )
        .into_response()
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_could_escape_are_refused() {
        for bad in [
            "/..",
            "/../etc/passwd",
            "/a/../../x",
            "/%2e%2e/x",
            "/%2E%2E%2Fx",
            "/a%2f..%2f..%2fx",
            "/a%5c..%5cx",
            "/.env",
            "//etc/passwd",
            "/a//b",
            "/a%00.html",
            "/%zz",
            "/%ff",
            "relative",
        ] {
            assert_eq!(relative(bad), None, "{bad}");
        }
    }

    #[test]
    fn plain_paths_resolve_to_names() {
        assert_eq!(relative("/").as_deref(), Some(""));
        assert_eq!(relative("/settings").as_deref(), Some("settings"));
        assert_eq!(relative("/docs/").as_deref(), Some("docs/"));
        assert_eq!(
            relative("/_next/static/chunks/a%20b.js").as_deref(),
            Some("_next/static/chunks/a b.js")
        );
    }

    #[test]
    fn api_paths_are_recognised() {
        for p in ["/v1", "/v1/", "/v1/nope", "/healthz", "/metrics/x"] {
            assert!(is_api_path(p), "{p}");
        }
        for p in ["/", "/v1x", "/index.html", "/readyzz", "/_next/static/a.js"] {
            assert!(!is_api_path(p), "{p}");
        }
    }

    #[test]
    fn content_types_by_extension() {
        assert_eq!(content_type("index.html"), "text/html; charset=utf-8");
        assert_eq!(
            content_type("_next/static/chunks/x.JS"),
            "text/javascript; charset=utf-8"
        );
        assert_eq!(content_type("a.woff2"), "font/woff2");
        assert_eq!(content_type("noext"), "application/octet-stream");
    }
}
