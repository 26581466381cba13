// Markdown to safe HTML: GFM through `marked`, code highlighted by highlight.js core with a
// handful of registered languages (each costs a few KiB of the page's JavaScript). Raw HTML in the text is shown as text, never interpreted, and
// links may only be http(s), mailto or relative.

import { Marked, type Tokens } from "marked";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import go from "highlight.js/lib/languages/go";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";

const LANGS = { bash, c, go, javascript, json, python, rust, typescript, xml, yaml };
for (const [name, lang] of Object.entries(LANGS)) hljs.registerLanguage(name, lang);
hljs.registerAliases(["sh", "shell", "zsh"], { languageName: "bash" });
hljs.registerAliases(["js", "jsx", "mjs"], { languageName: "javascript" });
hljs.registerAliases(["ts", "tsx"], { languageName: "typescript" });
hljs.registerAliases(["py"], { languageName: "python" });
hljs.registerAliases(["rs"], { languageName: "rust" });
hljs.registerAliases(["html", "svg"], { languageName: "xml" });
hljs.registerAliases(["yml"], { languageName: "yaml" });
hljs.registerAliases(["h", "cpp", "c++", "hpp"], { languageName: "c" });

export function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
}

function safeHref(href: string): string | null {
  const h = href.trim();
  if (/^(https?:|mailto:)/i.test(h) || /^[/#?.]/.test(h) || !/^[a-z][a-z0-9+.-]*:/i.test(h)) return h;
  return null;
}

function codeBlock(text: string, lang: string | undefined, highlight: boolean): string {
  const name = (lang ?? "").trim().split(/\s+/)[0].toLowerCase();
  const known = name !== "" && hljs.getLanguage(name) !== undefined;
  const body = highlight && known ? hljs.highlight(text, { language: name, ignoreIllegals: true }).value : escapeHtml(text);
  const label = name ? escapeHtml(name) : "text";
  return (
    `<div class="code"><div class="code-head"><span>${label}</span>` +
    `<button type="button" class="copy" data-copy aria-label="Copy code">Copy</button></div>` +
    `<pre><code class="hljs${known ? ` language-${escapeHtml(name)}` : ""}">${body}</code></pre></div>`
  );
}

function makeMarked(highlight: boolean): Marked {
  const m = new Marked({ gfm: true, breaks: false });
  m.use({
    renderer: {
      html({ text }: Tokens.HTML | Tokens.Tag) {
        return escapeHtml(text);
      },
      code({ text, lang }: Tokens.Code) {
        return codeBlock(text, lang, highlight);
      },
      link({ href, title, tokens }: Tokens.Link) {
        const inner = this.parser.parseInline(tokens);
        const safe = safeHref(href);
        if (safe === null) return inner;
        const t = title ? ` title="${escapeHtml(title)}"` : "";
        return `<a href="${escapeHtml(safe)}"${t} target="_blank" rel="noopener noreferrer">${inner}</a>`;
      },
      image({ href, text }: Tokens.Image) {
        // No remote fetches from model output: show the alt text and the address.
        return `[${escapeHtml(text)}](${escapeHtml(href)})`;
      },
    },
  });
  return m;
}

const finished = makeMarked(true);
const streaming = makeMarked(false);

/** HTML for one block. `done`: the block will not change any more (worth highlighting). */
export function renderBlock(text: string, done = true): string {
  return (done ? finished : streaming).parse(text, { async: false }) as string;
}
