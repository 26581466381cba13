// @vitest-environment happy-dom
import { act } from "react";
import { createRoot } from "react-dom/client";
import { afterEach, describe, expect, it, vi } from "vitest";

const parsed: string[] = [];
vi.mock("@/lib/markdown", async (importOriginal) => {
  const real = await importOriginal<typeof import("@/lib/markdown")>();
  return {
    ...real,
    renderBlock: (text: string, done?: boolean) => {
      parsed.push(text);
      return real.renderBlock(text, done);
    },
  };
});

const { Markdown } = await import("@/components/Markdown");

(globalThis as { IS_REACT_ACT_ENVIRONMENT?: boolean }).IS_REACT_ACT_ENVIRONMENT = true;

const REPLY = ["# Plan", "", "First paragraph.", "", "- one", "- two", "", "Closing words, streamed token by token."].join("\n");

describe("Markdown while streaming", () => {
  afterEach(() => {
    parsed.length = 0;
  });

  it("parses only the last block again on each update; finished blocks keep their HTML", async () => {
    const el = document.createElement("div");
    const root = createRoot(el);
    let text = "";
    let updates = 0;
    for (const ch of REPLY) {
      text += ch;
      updates++;
      await act(async () => root.render(<Markdown text={text} streaming />));
    }
    // Each update parses one block (the growing tail), plus each block once more when it
    // finishes (rendered as done). Re-parsing everything would be ~blocks × updates.
    const blocks = 4;
    expect(parsed.length).toBeLessThanOrEqual(updates + blocks);
    // A finished block is parsed at most twice in all (as the tail, and once when done): never
    // again however many tokens follow it.
    expect(parsed.filter((t) => t === "# Plan").length).toBeLessThanOrEqual(2);
    expect(parsed.filter((t) => t === "First paragraph.").length).toBeLessThanOrEqual(2);
    expect(el.querySelector("h1")?.textContent).toBe("Plan");
    expect(el.querySelectorAll("li")).toHaveLength(2);
    expect(el.textContent).toContain("Closing words, streamed token by token.");

    // When the reply ends, only the last block is parsed again (now final).
    parsed.length = 0;
    await act(async () => root.render(<Markdown text={text} streaming={false} />));
    expect(parsed).toEqual(["Closing words, streamed token by token."]);
    act(() => root.unmount());
  });
});
