import { expect, test } from "@playwright/test";
import { apiClient, reply, send, stackFor, withKey } from "./stack";

test.describe("429", () => {
  // `limited`: 2 generation requests a minute.
  const stack = stackFor(["--auth", "keys"]);

  test("a 429 says when to retry (Retry-After)", async ({ page }) => {
    await withKey(page, stack().keys.limited!);
    await page.goto(stack().url);
    // The limit counts per UTC minute: all three requests must fall in one.
    const left = 60_000 - (Date.now() % 60_000);
    if (left < 20_000) await page.waitForTimeout(left + 50);
    await send(page, "one");
    await expect(reply(page)).toHaveAttribute("data-status", "complete");
    await send(page, "two");
    await expect(page.locator("article.msg.assistant")).toHaveCount(2);
    await expect(reply(page)).toHaveAttribute("data-status", "complete");
    await send(page, "three");
    const banner = page.locator(".banner");
    await expect(banner).toContainText("rate limit");
    await expect(banner).toContainText(/Retry in \d+ s/);
    const secs = Number((await banner.textContent())!.match(/Retry in (\d+) s/)![1]);
    expect(secs).toBeGreaterThan(0);
    expect(secs).toBeLessThanOrEqual(60);
    await expect(banner.getByRole("button", { name: "Retry" })).toBeDisabled();
    // Nothing was stored for the refused turn; the text is back in the composer.
    await expect(page.locator("article.msg.user")).toHaveCount(2);
    await expect(page.getByRole("textbox", { name: "Message" })).toHaveValue("three");
  });
});

test.describe("503", () => {
  // One slot and no queue; the scripted worker makes the reply holding it last 20 s.
  const stack = stackFor(["--scripted-token-ms", "50", "--hearth-arg=--worker-capacity=1", "--hearth-arg=--max-queue=0"]);

  test("a 503 says there is no capacity and offers a retry", async ({ page }) => {
    const api = apiClient(stack());
    const busy = await api.createSession("Busy");
    // Occupy the only slot with a long reply (the request returns once it is under way).
    const hold = fetch(`${stack().url}/v1/sessions/${busy.id}/messages`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ content: "hold the worker", max_tokens: 400 }),
    });
    await expect
      .poll(async () => (await api.messages(busy.id)).some((m) => m.role === "assistant" && m.status === "streaming"))
      .toBe(true);

    await page.goto(stack().url);
    await send(page, "am I served?");
    const banner = page.locator(".banner");
    await expect(banner).toContainText("No capacity");
    const retry = banner.getByRole("button", { name: "Retry" });
    await expect(retry).toBeEnabled();

    await api.call("POST", `/v1/sessions/${busy.id}/stop`, {});
    await (await hold).text().catch(() => "");
    await retry.click();
    await expect(banner).toHaveCount(0);
    await expect(reply(page)).toHaveAttribute("data-status", /complete|streaming/);
    await expect(page.locator("article.msg.user .bubble")).toHaveText(["am I served?"]);
    // The retry went to the chat the first try created, not to a second one.
    const titles = (await api.sessions()).map((s) => s.title).filter((t) => t !== "Busy");
    expect(titles).toHaveLength(1);
  });
});
