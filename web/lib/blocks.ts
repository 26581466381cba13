// Splits markdown into top-level blocks so that a streaming reply re-renders only its last
// block: every block before it is finished and its HTML is memoized by its text.
//
// A block ends at a blank line outside a fenced code block, unless the next line is indented
// (a list item's continuation) or continues a list or table. Splitting only ever happens where
// rendering the pieces separately gives the same result as rendering the whole.

const FENCE = /^ {0,3}(`{3,}|~{3,})/;
const LIST_ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s/;
/** What a list item's first line can look like before its marker is complete. */
const MAYBE_ITEM = /^ {0,3}(?:[-*+]|\d{1,9}[.)]?)?$/;

/**
 * `complete`: the text is final. While it streams, its last line may still be growing; a
 * blank line before it is a boundary only once that line cannot continue the block before.
 */
export function splitBlocks(text: string, complete = true): string[] {
  const lines = text.split("\n");
  const blocks: string[] = [];
  let cur: string[] = [];
  let fence: string | null = null;
  let inList = false;
  const flush = () => {
    if (cur.some((l) => l.trim() !== "")) blocks.push(cur.join("\n"));
    cur = [];
    inList = false;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const f = FENCE.exec(line);
    if (fence) {
      cur.push(line);
      if (f && f[1][0] === fence[0] && f[1].length >= fence.length && line.trim() === f[1]) fence = null;
      continue;
    }
    if (f) {
      fence = f[1];
      cur.push(line);
      continue;
    }
    if (line.trim() === "") {
      // Look ahead: a block boundary needs the next line to start something new.
      let j = i + 1;
      while (j < lines.length && lines[j].trim() === "") j++;
      if (j >= lines.length) {
        cur.push(line);
        continue;
      }
      const next = lines[j];
      // A line still growing (the last one of a streaming text) that could yet become a list
      // item would continue the list: wait for it. Anything else is decided by its first
      // character already.
      const undecided = !complete && j === lines.length - 1 && inList && MAYBE_ITEM.test(next);
      const continues =
        undecided || /^\s/.test(next) || (inList && LIST_ITEM.test(next));
      if (!continues && cur.length > 0) {
        flush();
        continue;
      }
      cur.push(line);
      continue;
    }
    if (LIST_ITEM.test(line)) inList = true;
    cur.push(line);
  }
  flush();
  return blocks;
}
