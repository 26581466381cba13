// Measurements, printed (not asserted against thresholds): the JavaScript the chat page loads
// (gzipped) and the main-thread time spent while a 4,000-token markdown reply streams.
import { expect, test, type Page } from "@playwright/test";
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { gzipSync } from "node:zlib";
import { apiClient, reply, setMaxTokens, stackFor, WEB_DIR } from "./stack";

// Scripted worker: echoes the prompt, one token (one ASCII character) every 2 ms.
const stack = stackFor(["--scripted-token-ms", "2"]);

function markdown(chars: number): string {
  const parts: string[] = [];
  for (let i = 1; parts.join("\n").length < chars; i++) {
    parts.push(
      `## Section ${i}`,
      "",
      `Paragraph ${i} with **bold**, _emphasis_ and \`code\`, long enough to wrap across the line in the reply.`,
      "",
      "```rust",
      `fn section_${i}(x: u32) -> u32 {`,
      `    x * ${i} + 1`,
      "}",
      "```",
      "",
      "| key | value |",
      "|-----|------:|",
      `| n | ${i} |`,
      "",
      `- item ${i}.a`,
      `- item ${i}.b`,
      "",
    );
  }
  return parts.join("\n").slice(0, chars);
}

async function streamReply(page: Page, url: string, text: string) {
  await page.goto(url);
  await expect(page.locator(".health .dot.ok")).toBeVisible();
  await setMaxTokens(page, 4000);
  // Set the message as a paste would (one input event); Playwright's fill types multi-line
  // text through editing commands, whose cost is not the page's.
  await page.getByRole("textbox", { name: "Message" }).evaluate((el, value) => {
    const set = Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, "value")!.set!;
    set.call(el, value);
    el.dispatchEvent(new Event("input", { bubbles: true }));
  }, text);
  await page.waitForTimeout(300);
  const cdp = await page.context().newCDPSession(page);
  await cdp.send("Performance.enable");
  const metrics = async () =>
    Object.fromEntries((await cdp.send("Performance.getMetrics")).metrics.map((m) => [m.name, m.value]));
  await page.evaluate(() => {
    const w = window as unknown as { longTasks: number[] };
    w.longTasks = [];
    new PerformanceObserver((l) => l.getEntries().forEach((e) => w.longTasks.push(e.duration))).observe({ type: "longtask" });
  });
  const before = await metrics();
  const t0 = Date.now();
  await page.getByRole("textbox", { name: "Message" }).press("Enter");
  await expect(reply(page)).toHaveAttribute("data-status", "complete", { timeout: 90_000 });
  const wall = Date.now() - t0;
  const after = await metrics();
  const longTasks = await page.evaluate(() => (window as unknown as { longTasks: number[] }).longTasks);

  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(stored[1].content.length).toBeGreaterThanOrEqual(3900);
  expect(await reply(page).getAttribute("data-text")).toBe(stored[1].content);
  await expect(reply(page).locator(".details")).toContainText("4000 tokens");
  const ms = (k: string) => Math.round((after[k] - before[k]) * 1000);
  return {
    wall_ms: wall,
    main_thread_task_ms: ms("TaskDuration"),
    script_ms: ms("ScriptDuration"),
    layout_ms: ms("LayoutDuration"),
    style_ms: ms("RecalcStyleDuration"),
    long_tasks: longTasks.length,
    longest_task_ms: Math.round(Math.max(0, ...longTasks)),
  };
}

test("measure: gzipped JS of the chat page and main-thread time for a 4,000-token reply", async ({ page, browser }) => {
  test.setTimeout(180_000);
  const scripts = new Set<string>();
  page.on("response", (r) => {
    if (r.request().resourceType() === "script") scripts.add(new URL(r.url()).pathname);
  });
  const text = markdown(3990);
  const incremental = await streamReply(page, stack().url, text);
  let gz = 0;
  let raw = 0;
  for (const s of scripts) {
    const body = readFileSync(resolve(WEB_DIR, `.${s}`));
    raw += body.length;
    gz += gzipSync(body, { level: 9 }).length;
  }
  // The same reply with every update parsing the whole text, for comparison.
  const other = await browser.newPage();
  const full = await streamReply(other, `${stack().url}/?render=full`, text);
  await other.close();

  const report = {
    chat_page_js: { scripts: scripts.size, bytes: raw, gzip_bytes: gz, gzip_kib: +(gz / 1024).toFixed(1) },
    reply_4000_tokens: { incremental, full_reparse: full },
    main_thread_ratio_full_over_incremental: +(full.main_thread_task_ms / Math.max(1, incremental.main_thread_task_ms)).toFixed(2),
  };
  console.log(`PERF ${JSON.stringify(report)}`);
});
