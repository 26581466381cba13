import { describe, expect, it } from "vitest";
import { splitBlocks } from "../lib/blocks";
import { loadHighlighter, renderBlock } from "../lib/markdown";

const DOC = [
  "# Title",
  "",
  "A paragraph",
  "over two lines.",
  "",
  "1. one",
  "",
  "2. two",
  "",
  "   continued",
  "",
  "```python",
  "x = 1",
  "",
  "y = 2",
  "```",
  "",
  "| a | b |",
  "|---|---|",
  "| 1 | 2 |",
  "",
  "- [x] done",
  "- [ ] todo",
].join("\n");

describe("splitBlocks", () => {
  it("splits at blank lines outside fences and keeps lists and code whole", () => {
    expect(splitBlocks(DOC)).toEqual([
      "# Title",
      "A paragraph\nover two lines.",
      "1. one\n\n2. two\n\n   continued",
      "```python\nx = 1\n\ny = 2\n```",
      "| a | b |\n|---|---|\n| 1 | 2 |",
      "- [x] done\n- [ ] todo",
    ]);
  });

  it("renders the blocks as the whole text renders", () => {
    const whole = renderBlock(DOC).replace(/\s+/g, "");
    const parts = splitBlocks(DOC).map((b) => renderBlock(b)).join("").replace(/\s+/g, "");
    expect(parts).toBe(whole);
  });

  it("keeps an unclosed fence open to the end (a streaming code block)", () => {
    expect(splitBlocks("intro\n\n```js\nlet a;\n\nlet b;")).toEqual(["intro", "```js\nlet a;\n\nlet b;"]);
  });

  it("every prefix of a stream splits into finished blocks that stay finished", () => {
    const other = "- a\n- b\n\n10. ten\n\n11) eleven\n\nAfter the list.\n\n* star\n\n    indented code\n\nEnd";
    for (const doc of [DOC, other]) {
      const final = splitBlocks(doc);
      for (let i = 1; i <= doc.length; i++) {
        const blocks = splitBlocks(doc.slice(0, i), false);
        // All but the last block of a prefix are already final.
        expect(blocks.slice(0, -1), `prefix ${i}`).toEqual(final.slice(0, blocks.length - 1));
      }
    }
  });

  it("closes a block as soon as the next line cannot continue it", () => {
    expect(splitBlocks("- one\n- two\n\nC", false)).toEqual(["- one\n- two", "C"]);
    expect(splitBlocks("- one\n- two\n\n1", false)).toEqual(["- one\n- two\n\n1"]);
    expect(splitBlocks("Para\n\n-", false)).toEqual(["Para", "-"]);
  });
});

describe("renderBlock", () => {
  it("renders code unhighlighted until the highlighter is loaded", () => {
    const html = renderBlock("```python\nx = 1\n```");
    expect(html).toContain("x = 1");
    expect(html).not.toContain("hljs-number");
    expect(html).toContain('aria-label="Copy code"');
  });

  it("renders GFM tables, task lists and highlighted code with a copy button", async () => {
    await loadHighlighter();
    const html = splitBlocks(DOC).map((b) => renderBlock(b)).join("");
    expect(html).toContain("<table>");
    expect(html).toContain('type="checkbox"');
    expect(html).toContain('class="hljs language-python"');
    expect(html).toContain("hljs-number");
    expect(html).toContain('aria-label="Copy code"');
  });

  it("shows raw HTML as text and drops unsafe links", () => {
    const html = renderBlock('<img src=x onerror="alert(1)"> [a](javascript:alert(1)) [b](https://x.test)');
    expect(html).not.toContain("<img");
    expect(html).toContain("&#60;img");
    expect(html).not.toContain("javascript:");
    expect(html).toContain('<a href="https://x.test"');
  });
});
