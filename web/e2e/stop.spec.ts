import { expect, test } from "@playwright/test";
import { apiClient, reply, send, setMaxTokens, stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "40"]);

test("stop keeps the partial text and marks it stopped", async ({ page }) => {
  await page.goto(stack().url);
  await setMaxTokens(page, 500);
  await send(page, "Tell me a long story about a lighthouse keeper");
  const r = reply(page);
  await expect(r).toHaveAttribute("data-status", "streaming");
  await expect.poll(async () => (await r.locator(".content").innerText()).length).toBeGreaterThan(15);
  await page.getByRole("button", { name: "Stop reply" }).click();

  await expect(r).toHaveAttribute("data-status", "stopped");
  await expect(r.getByText("Stopped", { exact: true })).toBeVisible();
  const partial = (await r.getAttribute("data-text")) ?? "";
  expect(partial.length).toBeGreaterThan(15);
  await page.waitForTimeout(500);
  expect(await r.getAttribute("data-text")).toBe(partial);
  await expect(page.getByRole("button", { name: "Send message" })).toBeVisible();

  const id = new URL(page.url()).searchParams.get("s")!;
  const [, stored] = await apiClient(stack()).messages(id);
  expect(stored.status).toBe("stopped");
  expect(stored.content).toBe(partial);
  // Far fewer than the 500 tokens asked for: it really stopped.
  expect(stored.content.length).toBeLessThan(400);

  // Esc stops too.
  await send(page, "Another one");
  const r2 = reply(page);
  await expect.poll(async () => (await r2.locator(".content").innerText()).length).toBeGreaterThan(5);
  // Esc in a dialog closes the dialog only.
  await page.getByRole("button", { name: "Chat settings" }).click();
  await page.keyboard.press("Escape");
  await expect(page.getByRole("dialog")).toBeHidden();
  await expect(r2).toHaveAttribute("data-status", "streaming");
  await page.keyboard.press("Escape");
  await expect(r2).toHaveAttribute("data-status", "stopped");

  await page.reload();
  await expect(reply(page, 0)).toHaveAttribute("data-status", "stopped");
  expect(await reply(page, 0).getAttribute("data-text")).toBe(partial);
});
