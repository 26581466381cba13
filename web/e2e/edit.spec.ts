import { expect, test } from "@playwright/test";
import { apiClient, reply, send, stackFor } from "./stack";

// Scripted worker: the reply echoes the prompt, so it shows which user message it answered.
const stack = stackFor(["--scripted-token-ms", "1"]);

test("edit-and-resend replaces the message and everything after it, then answers", async ({ page }) => {
  await page.goto(stack().url);
  await send(page, "first question");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  await send(page, "second question");
  await expect(page.locator("article.msg.assistant")).toHaveCount(2);
  await expect(reply(page)).toHaveAttribute("data-status", "complete");

  const first = page.locator("article.msg.user").first();
  await first.hover();
  await first.getByRole("button", { name: "Edit message" }).click();
  await first.getByRole("textbox", { name: "Edit message" }).fill("edited question");
  await first.getByRole("button", { name: "Save & send" }).click();

  await expect(page.locator("article.msg")).toHaveCount(2);
  await expect(page.locator("article.msg.user .bubble")).toHaveText(["edited question"]);
  await expect(reply(page)).toHaveAttribute("data-status", "complete");

  const id = new URL(page.url()).searchParams.get("s")!;
  const stored = await apiClient(stack()).messages(id);
  expect(stored.map((m) => m.role)).toEqual(["user", "assistant"]);
  expect(stored[0].content).toBe("edited question");
  expect(stored[1].content).toContain("edited question");
  expect(stored[1].content).not.toContain("second question");
  expect(await reply(page).getAttribute("data-text")).toBe(stored[1].content);

  await page.reload();
  await expect(page.locator("article.msg.user .bubble")).toHaveText(["edited question"]);
});
