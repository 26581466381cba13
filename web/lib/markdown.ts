// Markdown to safe HTML: GFM through `marked`; finished code blocks are highlighted once the
// highlighter (lib/highlight.ts, loaded on demand) is there. Raw HTML in the text is shown as
// text, never interpreted, and links may only be http(s), mailto or relative.

import { Marked, type Tokens } from "marked";

type Highlighter = typeof import("./highlight");
let highlighter: Highlighter | null = null;
let loading: Promise<void> | null = null;

/** Whether code blocks can be highlighted yet. */
export function highlighterReady(): boolean {
  return highlighter !== null;
}

/** Loads the highlighter (once); blocks rendered after it resolves are highlighted. */
export function loadHighlighter(): Promise<void> {
  loading ??= import("./highlight").then((m) => {
    highlighter = m;
  });
  return loading;
}

export function escapeHtml(s: string): string {
  return s.replace(/[&<>"']/g, (ch) => `&#${ch.charCodeAt(0)};`);
}

/** Protocols a link in a reply may use; a relative link takes the page's (http or https). */
const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);
/** Stands in for the page when resolving: any http(s) page gives a relative link the same
 *  protocol, and a fixed one keeps rendering independent of where it runs. */
const LINK_BASE = "https://hearth.invalid/";

/** `href` if a browser would follow it to an allowed protocol, else null. Judged by the URL
 *  parser itself, not by matching text: the parser drops tabs and newlines anywhere and leading
 *  spaces and control characters, so `java\tscript:` is a javascript: link. */
function safeHref(href: string): string | null {
  const h = href.trim();
  let url: URL;
  try {
    url = new URL(h, LINK_BASE);
  } catch {
    return null;
  }
  return LINK_PROTOCOLS.has(url.protocol) ? h : null;
}

function codeBlock(text: string, lang: string | undefined, highlight: boolean): string {
  const name = (lang ?? "").trim().split(/\s+/)[0].toLowerCase();
  const lit = highlight && highlighter ? highlighter.highlight(text, name) : null;
  const known = lit !== null;
  const body = lit ?? escapeHtml(text);
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
