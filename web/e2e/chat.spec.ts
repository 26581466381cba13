import { expect, test } from "@playwright/test";
import { apiClient, reply, setMaxTokens, stackFor } from "./stack";

// Scripted worker: one token every 25 ms, echoing the prompt, so the stream is slow enough to
// watch token by token and its text is deterministic.
const stack = stackFor(["--scripted-token-ms", "25"]);

test("send a message, see tokens arrive one by one, reload and see the history", async ({ page }) => {
  await page.goto(stack().url);
  await expect(page.getByLabel("API key")).toHaveCount(0);
  await expect(page.locator(".health .dot.ok")).toBeVisible();
  await setMaxTokens(page, 40);
  // Shift+Enter adds a line; Enter sends.
  const box = page.getByRole("textbox", { name: "Message" });
  await box.fill("Hello");
  await box.press("Shift+Enter");
  await box.pressSequentially("there");
  await expect(box).toHaveValue("Hello\nthere");
  await expect(page.locator("article.msg")).toHaveCount(0);
  await box.fill("Hello there");
  await box.press("Enter");
  await expect(box).toHaveValue("");

  // Watch the reply grow: record each distinct text the page shows while it streams.
  const seen: string[] = await page.evaluate(
    () =>
      new Promise<string[]>((done) => {
        const seen: string[] = [];
        const tick = () => {
          const el = document.querySelector("article.msg.assistant:last-of-type");
          const text = el?.querySelector(".content")?.textContent ?? "";
          if (seen[seen.length - 1] !== text) seen.push(text);
          if (el?.getAttribute("data-status") === "complete") return done(seen);
          requestAnimationFrame(tick);
        };
        tick();
      }),
  );
  const final = seen[seen.length - 1];
  expect(final.length).toBeGreaterThan(10);
  // Many intermediate states, each a prefix of the next: tokens arrived one (or a few) at a time.
  const growing = seen.filter((t) => t !== "…" && t !== "");
  expect(growing.length).toBeGreaterThanOrEqual(15);
  for (let i = 1; i < growing.length; i++) expect(growing[i].startsWith(growing[i - 1].trimEnd())).toBe(true);

  const r = reply(page);
  await expect(r).toHaveAttribute("data-status", "complete");
  await expect(r.locator(".details")).toContainText("40 tokens");
  await expect(r.locator(".details")).toContainText("tok/s");
  await expect(r.locator(".details")).toContainText("TTFT");
  await expect(r.locator(".details")).toContainText("finish: length");
  // The first message titled the new chat.
  await expect(page.getByRole("navigation", { name: "Chats" }).getByRole("link", { name: "Hello there" })).toBeVisible();
  expect(page.url()).toMatch(/\?s=[0-9a-f]{32}$/);

  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(stored.map((m) => [m.role, m.content])).toEqual([
    ["user", "Hello there"],
    ["assistant", expect.any(String)],
  ]);
  expect(await r.getAttribute("data-text")).toBe(stored[1].content);

  await page.reload();
  await expect(page.locator("article.msg.user .bubble")).toHaveText("Hello there");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  expect(await reply(page).getAttribute("data-text")).toBe(stored[1].content);
  await expect(reply(page).locator(".details")).toContainText("40 tokens");
});
