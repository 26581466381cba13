// @vitest-environment happy-dom
// Links in rendered Markdown, judged the way a browser reads them: the href attribute as the
// HTML parser decodes it, then the URL parser (which drops tabs and newlines anywhere and
// leading spaces and control characters), resolved against the page.
import { describe, expect, it } from "vitest";
import { renderBlock } from "../lib/markdown";

const PAGE = "https://hearth.test/chat";
const ALLOWED = ["http:", "https:", "mailto:"];

/** Each link's href as the browser will follow it (null: it names no URL at all). */
function followed(markdown: string): { href: string; protocol: string | null }[] {
  const box = document.createElement("div");
  box.innerHTML = renderBlock(markdown);
  return Array.from(box.querySelectorAll("a")).map((a) => {
    const href = a.getAttribute("href") ?? "";
    try {
      return { href, protocol: new URL(href, PAGE).protocol };
    } catch {
      return { href, protocol: null };
    }
  });
}

const HOSTILE: [string, string][] = [
  ["a tab inside the scheme", "[x](<java\tscript:alert(1)>)"],
  ["a tab before the colon", "[x](<javascript\t:alert(1)>)"],
  ["a newline inside the scheme", "[x](<java\nscript:alert(1)>)"],
  ["leading spaces and a tab", "[x](<  \tjavascript:alert(1)>)"],
  ["a leading control character", "[x](<\u0001javascript:alert(1)>)"],
  ["a leading unit separator", "[x](<\u001fjavascript:alert(1)>)"],
  ["a control character inside the scheme", "[x](<java\u0000script:alert(1)>)"],
  ["mixed case", "[x](JaVaScRiPt:alert(1))"],
  ["a mixed-case autolink", "<JaVaScRiPt:alert(1)>"],
  ["a data: URL", "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)"],
  ["vbscript:", "[x](vbscript:msgbox(1))"],
  ["an entity-encoded tab", "[x](java&#9;script:alert(1))"],
  ["an entity-encoded newline", "[x](java&#x0A;script:alert(1))"],
  ["an entity-encoded letter", "[x](&#106;avascript:alert(1))"],
  ["an entity-encoded colon", "[x](javascript&colon;alert(1))"],
  ["a reference definition with a tab", "[r]: <java\tscript:alert(1)>\n\n[x][r]"],
];

describe("links in rendered Markdown", () => {
  it.each(HOSTILE)("drops a script link hidden by %s", (_, markdown) => {
    for (const link of followed(markdown)) {
      expect(ALLOWED, `href ${JSON.stringify(link.href)}`).toContain(link.protocol);
    }
  });

  it("keeps http(s), mailto and relative links as written", () => {
    const cases: [string, string, string][] = [
      ["[a](https://example.com/a?b=1#c)", "https://example.com/a?b=1#c", "https:"],
      ["[a](http://example.com)", "http://example.com", "http:"],
      ["[a](HTTPS://Example.com)", "HTTPS://Example.com", "https:"],
      ["[a](mailto:someone@example.com)", "mailto:someone@example.com", "mailto:"],
      ["[a](/docs/page)", "/docs/page", "https:"],
      ["[a](docs/page)", "docs/page", "https:"],
      ["[a](#section)", "#section", "https:"],
      ["[a](?q=1)", "?q=1", "https:"],
      ["[a](//example.com/x)", "//example.com/x", "https:"],
      ["<https://example.com>", "https://example.com", "https:"],
      ["see www.example.com", "http://www.example.com", "http:"],
    ];
    for (const [markdown, href, protocol] of cases) {
      expect(followed(markdown), markdown).toEqual([{ href, protocol }]);
    }
  });

  it("shows the text of a dropped link without an anchor", () => {
    const html = renderBlock("[click *here*](<java\tscript:alert(1)>)");
    expect(html).not.toContain("<a");
    expect(html).toContain("click <em>here</em>");
  });
});
