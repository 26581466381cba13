import { expect, test } from "@playwright/test";
import { startProxy } from "./proxy";
import { apiClient, reply, send, setMaxTokens, stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "20"]);

test("a connection reset mid-reply resumes with Last-Event-ID: nothing repeated, nothing missing", async ({ page }) => {
  // The page talks to the stack through a proxy that resets every open connection on demand,
  // while the reply is still being generated.
  const proxy = await startProxy(stack().url);
  try {
    await page.goto(proxy.url);
    // 400 tokens at 20 ms: the reply runs for about 8 s, long after the cut.
    await setMaxTokens(page, 400);
    const resumes: (string | null)[] = [];
    page.on("request", (r) => {
      if (r.url().endsWith("/stream")) resumes.push(r.headers()["last-event-id"] ?? null);
    });

    await send(page, "Count to a hundred slowly");
    const r = reply(page);
    // Some text has arrived, and the server is still generating: cut now.
    await expect.poll(async () => (await r.locator(".content").innerText()).length).toBeGreaterThan(10);
    await expect.poll(() => new URL(page.url()).searchParams.get("s")).not.toBeNull();
    const id = new URL(page.url()).searchParams.get("s")!;
    const api = apiClient(stack());
    expect((await api.messages(id))[1].status).toBe("streaming");
    expect(proxy.cutAll()).toBeGreaterThan(0);

    await expect(r).toHaveAttribute("data-status", "complete", { timeout: 30_000 });
    expect(resumes.length).toBeGreaterThanOrEqual(1);
    expect(resumes[0]).toMatch(/^\S+:\d+$/);
    const stored = await api.messages(id);
    expect(stored[1].status).toBe("complete");
    expect(await r.getAttribute("data-text")).toBe(stored[1].content);
    await expect(r.locator(".details")).toContainText("400 tokens");
  } finally {
    await proxy.close();
  }
});

test("reloading mid-reply shows the reply still streaming and ends with the stored text", async ({ page }) => {
  await page.goto(stack().url);
  await setMaxTokens(page, 1000);
  await send(page, "Tell me about reloading");
  const r = reply(page);
  await expect.poll(async () => (await r.locator(".content").innerText()).length).toBeGreaterThan(10);
  // The address names the session once the page knows it, which is what a reload reopens.
  await expect(page).toHaveURL(/[?&]s=\w+/);
  const resumes: (string | null)[] = [];
  page.on("request", (q) => {
    if (q.url().endsWith("/stream")) resumes.push(q.headers()["last-event-id"] ?? null);
  });
  await page.reload();
  const again = reply(page);
  // A deadline for a hung page only: the reply runs for 20 s.
  await expect(again).toHaveAttribute("data-status", "streaming", { timeout: 30_000 });
  await expect(again.getByText("Streaming")).toBeVisible();
  await expect(page.getByRole("button", { name: "Stop reply" })).toBeVisible();
  // The reloaded page follows the reply where it stands: its text grows, then it completes.
  const shown = (await again.locator(".content").innerText()).length;
  await expect.poll(async () => (await again.locator(".content").innerText()).length).toBeGreaterThan(shown);
  expect(resumes.length).toBeGreaterThanOrEqual(1);
  await expect(again).toHaveAttribute("data-status", "complete", { timeout: 60_000 });
  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(await again.getAttribute("data-text")).toBe(stored[1].content);
  await expect(again.locator(".details")).toContainText("1000 tokens");
});

test("stop works after a reload (the resumed stream is stoppable)", async ({ page }) => {
  await page.goto(stack().url);
  await setMaxTokens(page, 4000);
  await send(page, "Keep going until I stop you");
  await expect.poll(async () => (await reply(page).locator(".content").innerText()).length).toBeGreaterThan(10);
  await page.reload();
  const r = reply(page);
  await expect(r).toHaveAttribute("data-status", "streaming");
  await expect.poll(async () => (await r.locator(".content").innerText()).length).toBeGreaterThan(30);
  await page.getByRole("button", { name: "Stop reply" }).click();
  await expect(r).toHaveAttribute("data-status", "stopped");
  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(stored[1].status).toBe("stopped");
  expect(stored[1].content.length).toBeLessThan(4000);
  expect(await r.getAttribute("data-text")).toBe(stored[1].content);
});
