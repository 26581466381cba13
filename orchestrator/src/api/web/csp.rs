//! The web UI's Content-Security-Policy: what its pages may load and run, and that no other
//! site may frame them.
//!
//! Next's static export runs inline `<script>`s: the flight data (`self.__next_f.push(...)`),
//! the bundler's bootstrap and the theme set before first paint. Rather than allow every inline
//! script (`'unsafe-inline'`, which would let injected markup run), a page's policy lists the
//! SHA-256 of each inline script in that very file, computed as it is served, so a rebuilt UI
//! needs no change here. Everything else comes from the UI's own origin: scripts and styles
//! from `/_next/static`, API calls to `/v1`. The export has no inline styles (React sets style
//! properties through the DOM, which a policy does not govern), so `style-src` is `'self'` too.
//! `data:` images are allowed for icons; nothing may be framed, be a plugin, change the base URL
//! or post a form elsewhere.

use base64::Engine as _;
use sha2::{Digest, Sha256};

/// The policy without `script-src`, which [`policy`] adds.
const DIRECTIVES: &str = "default-src 'self'; connect-src 'self'; img-src 'self' data:; \
     style-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

/// `X-Frame-Options`, for browsers that predate `frame-ancestors`.
pub const FRAME_OPTIONS: &str = "DENY";

/// The policy for a response whose body is `html` (`None`: not an HTML page): scripts from
/// this origin, plus each inline script of the page by hash.
pub fn policy(html: Option<&[u8]>) -> String {
    let mut script_src = String::from("script-src 'self'");
    let mut seen: Vec<String> = Vec::new();
    if let Some(html) = html {
        for script in inline_scripts(&String::from_utf8_lossy(html)) {
            let source = format!("'sha256-{}'", sha256_base64(&script));
            if !seen.contains(&source) {
                script_src.push(' ');
                script_src.push_str(&source);
                seen.push(source);
            }
        }
    }
    format!("{DIRECTIVES}; {script_src}")
}

fn sha256_base64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(Sha256::digest(text.as_bytes()))
}

/// The text of each `<script>` without a `src` in `html`, as a browser hashes it: the raw text
/// up to `</script`, line endings normalised to `\n` as the HTML parser does. Tags are found
/// as the HTML tokenizer finds them (case-insensitive, attribute values quoted or not); a
/// script that hides `</script>` inside `<!--` (which the export never writes) would be cut
/// short here, its hash would not match and the browser would refuse it: this errs towards
/// running less, never more.
fn inline_scripts(html: &str) -> Vec<String> {
    let lower = html.to_ascii_lowercase();
    let bytes = lower.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(start) = find_tag(bytes, at, b"<script") {
        let Some((body_start, has_src)) = open_tag(bytes, start + b"<script".len()) else {
            break;
        };
        let body_end = find_tag(bytes, body_start, b"</script").unwrap_or(bytes.len());
        if !has_src {
            // `lower` has the same byte offsets as `html` (ASCII case changes only).
            let text = &html[body_start..body_end];
            out.push(text.replace("\r\n", "\n").replace('\r', "\n"));
        }
        at = body_end;
    }
    out
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c')
}

/// The next `name` at or after `from` that is a whole tag name (followed by a space, `/` or
/// `>`, so `<scripts>` is not `<script`).
fn find_tag(bytes: &[u8], from: usize, name: &[u8]) -> Option<usize> {
    let mut at = from;
    loop {
        let i = at
            + bytes
                .get(at..)?
                .windows(name.len())
                .position(|w| w == name)?;
        let next = bytes.get(i + name.len()).copied();
        if next.is_some_and(|b| is_space(b) || b == b'/' || b == b'>') {
            return Some(i);
        }
        at = i + 1;
    }
}

/// Reads an open tag's attributes from `i` (just after its name): where its content starts
/// (after the `>`) and whether one attribute is `src`. `None` when the tag never closes.
fn open_tag(bytes: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let mut has_src = false;
    loop {
        while bytes.get(i).is_some_and(|&b| is_space(b) || b == b'/') {
            i += 1;
        }
        if *bytes.get(i)? == b'>' {
            return Some((i + 1, has_src));
        }
        // An attribute name runs to a space, `/`, `>` or `=` (a leading `=` belongs to it).
        let name_start = i;
        i += 1;
        while bytes
            .get(i)
            .is_some_and(|&b| !is_space(b) && !matches!(b, b'/' | b'>' | b'='))
        {
            i += 1;
        }
        has_src |= &bytes[name_start..i] == b"src";
        while bytes.get(i).copied().is_some_and(is_space) {
            i += 1;
        }
        if bytes.get(i) != Some(&b'=') {
            continue;
        }
        i += 1;
        while bytes.get(i).copied().is_some_and(is_space) {
            i += 1;
        }
        match bytes.get(i) {
            Some(&q) if q == b'"' || q == b'\'' => {
                i += 1 + bytes.get(i + 1..)?.iter().position(|&b| b == q)? + 1;
            }
            _ => {
                while bytes.get(i).is_some_and(|&b| !is_space(b) && b != b'>') {
                    i += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_the_csp_specification_example() {
        // CSP Level 3, "hash-source": this script's sha256 as the specification gives it.
        let page = b"<script>alert('Hello, world.');</script>";
        assert!(policy(Some(page))
            .ends_with("script-src 'self' 'sha256-qznLcsROx4GACP2dm0UCKCzCG+HiZ1guq6ZZDob/Tng='"));
    }

    #[test]
    fn only_inline_scripts_count() {
        let page = concat!(
            r#"<SCRIPT SRC="/a.js" async=""></SCRIPT>"#,
            r#"<script data-src="/b.js">one()</script>"#,
            r#"<script id="_R_" data-x='a>b'>two()</script>"#,
            "<script\n src=/c.js></script>",
            "<scripts>not a script</scripts>",
            r#"<script type="text/javascript">three("</scrip", "<\/script>")</Script >"#,
            "<script>four()</script>",
        );
        assert_eq!(
            inline_scripts(page),
            [
                "one()",
                "two()",
                r#"three("</scrip", "<\/script>")"#,
                "four()"
            ]
        );
    }

    #[test]
    fn line_endings_are_normalised_as_the_parser_does() {
        assert_eq!(
            inline_scripts("<script>a\r\nb\rc\n</script>"),
            ["a\nb\nc\n"]
        );
    }

    #[test]
    fn unterminated_tags_and_scripts() {
        assert!(inline_scripts("<script src='x").is_empty());
        assert_eq!(inline_scripts("<script>tail"), ["tail"]);
    }

    #[test]
    fn the_policy_frames_nothing_and_allows_no_inline_script_by_default() {
        let p = policy(None);
        assert!(p.contains("frame-ancestors 'none'"));
        assert!(p.contains("script-src 'self'"));
        assert!(!p.contains("unsafe"));
        // The same script twice is listed once.
        let twice = policy(Some(b"<script>x()</script><script>x()</script>"));
        assert_eq!(twice.matches("'sha256-").count(), 1);
    }
}
