import { expect, test } from "@playwright/test";
import { apiClient, reply, send, setMaxTokens, stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "20"]);

test("a connection cut mid-reply resumes with Last-Event-ID: nothing repeated, nothing missing", async ({ page }) => {
  await page.goto(stack().url);
  await setMaxTokens(page, 120);
  // The first turn's stream is cut in the middle of an event, after about a third of it.
  let cut = false;
  await page.route("**/v1/sessions/*/messages", async (route) => {
    if (route.request().method() !== "POST" || cut) return route.continue();
    cut = true;
    const response = await route.fetch();
    const body = await response.text();
    // Whole events for the first third, then half of the next one (its id line included, so
    // the client must resume after the last event it completed, not the last id it read).
    const events = body.split("\n\n");
    const third = Math.floor(events.length / 3);
    const keep = events.slice(0, third).join("\n\n") + "\n\n" + events[third].slice(0, 60);
    expect(events[third].indexOf("\n")).toBeLessThan(60);
    await route.fulfill({
      status: response.status(),
      headers: { "content-type": "text/event-stream", "cache-control": "no-cache" },
      body: keep,
    });
  });
  const resumes: (string | null)[] = [];
  page.on("request", (r) => {
    if (r.url().endsWith("/stream")) resumes.push(r.headers()["last-event-id"] ?? null);
  });

  await send(page, "Count to a hundred slowly");
  const r = reply(page);
  await expect(r).toHaveAttribute("data-status", "complete", { timeout: 30_000 });
  expect(cut).toBe(true);
  expect(resumes.length).toBeGreaterThanOrEqual(1);
  expect(resumes[0]).toMatch(/^\S+:\d+$/);

  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(stored[1].status).toBe("complete");
  expect(await r.getAttribute("data-text")).toBe(stored[1].content);
  await expect(r.locator(".details")).toContainText("120 tokens");
});

// The reloads below wait on events, not time: they begin once the reply's first tokens show, and
// the replies are long (20 s and 80 s at 20 ms a token) so the server is still generating when the
// reloaded page asks for them however slowly the page reloads; each test then waits for what the
// page shows.
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
