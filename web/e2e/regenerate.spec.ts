import { expect, test } from "@playwright/test";
import { apiClient, reply, send, stackFor } from "./stack";

const stack = stackFor([]);

test("regenerate replaces the reply", async ({ page }) => {
  await page.goto(stack().url);
  await send(page, "Name a colour");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  const firstId = await reply(page).getAttribute("data-id");
  const id = new URL(page.url()).searchParams.get("s")!;
  expect((await apiClient(stack()).messages(id)).map((m) => m.id)).toContain(firstId);

  await page.getByRole("button", { name: "Regenerate reply" }).click();
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  await expect(reply(page)).not.toHaveAttribute("data-id", firstId!);
  await expect(page.locator("article.msg")).toHaveCount(2);

  const stored = await apiClient(stack()).messages(id);
  expect(stored).toHaveLength(2);
  expect(stored[1].id).not.toBe(firstId);
  expect(stored[1].id).toBe(await reply(page).getAttribute("data-id"));
  expect(await reply(page).getAttribute("data-text")).toBe(stored[1].content);
});
