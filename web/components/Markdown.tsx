"use client";

import { memo, useEffect, useMemo, useState } from "react";
import { splitBlocks } from "@/lib/blocks";
import { highlighterReady, loadHighlighter, renderBlock } from "@/lib/markdown";

const FENCED = /^ {0,3}(```|~~~)/m;

/**
 * `?render=full` turns the incremental rendering off (the whole reply is parsed on every
 * update), so the measurement in e2e/perf.spec.ts can compare the two in one run.
 */
const FULL = typeof window !== "undefined" && new URLSearchParams(window.location.search).get("render") === "full";

/** One block's HTML, rebuilt only when its own text changes. */
const Block = memo(function Block({ text, done }: { text: string; done: boolean }) {
  // A finished code block loads the highlighter once, then renders again highlighted.
  const [highlighted, setHighlighted] = useState(highlighterReady);
  const wants = done && !highlighted && FENCED.test(text);
  useEffect(() => {
    if (wants) void loadHighlighter().then(() => setHighlighted(true));
  }, [wants]);
  const html = useMemo(() => renderBlock(text, done && highlighted), [text, done, highlighted]);
  return <div className="md-block" dangerouslySetInnerHTML={{ __html: html }} />;
});

/**
 * A reply as markdown. While it streams, only the last block changes, so only it is parsed
 * again on each update; finished blocks keep their memoized HTML.
 */
export function Markdown({ text, streaming }: { text: string; streaming: boolean }) {
  const blocks = useMemo(() => (FULL ? [text] : splitBlocks(text, !streaming)), [text, streaming]);
  return (
    <div className="md">
      {blocks.map((b, i) => (
        <Block key={i} text={b} done={!streaming || i < blocks.length - 1} />
      ))}
    </div>
  );
}
