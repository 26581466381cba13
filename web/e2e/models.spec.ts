import { expect, test } from "@playwright/test";
import { apiClient, reply, send, stackFor } from "./stack";

// One worker serving two models of a repository: `tiny` (the default) and `tiny-b`.
const stack = stackFor(["--model", "two"]);

test("a chat's model is chosen in its settings, stored with it and shown in the header", async ({ page }) => {
  await page.goto(stack().url);
  const shown = page.locator(".health .model");
  await expect(shown).toHaveText("tiny");

  // Before the chat exists: the choice waits for its first message.
  await page.getByRole("button", { name: "Chat settings" }).click();
  const dialog = page.getByRole("dialog", { name: "Chat settings" });
  const model = dialog.getByLabel("Model");
  await expect(model.locator("option")).toHaveText(["Server default (tiny)", "tiny", "tiny-b"]);
  await model.selectOption("tiny-b");
  await dialog.getByRole("button", { name: "Save" }).click();
  await expect(dialog).toBeHidden();
  await expect(shown).toHaveText("tiny-b");
  await send(page, "Hello");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  const id = new URL(page.url()).searchParams.get("s")!;
  const api = apiClient(stack());
  expect((await api.call("GET", `/v1/sessions/${id}`)).json.model).toBe("tiny-b");

  // Reloaded, the chat still names it; changed back, the session follows the default.
  await page.reload();
  await expect(shown).toHaveText("tiny-b");
  await page.getByRole("button", { name: "Chat settings" }).click();
  await expect(model).toHaveValue("tiny-b");
  await model.selectOption("");
  await dialog.getByRole("button", { name: "Save" }).click();
  await expect(dialog).toBeHidden();
  await expect(shown).toHaveText("tiny");
  expect((await api.call("GET", `/v1/sessions/${id}`)).json.model).toBeNull();
  await send(page, "again");
  await expect(page.locator("article.msg.assistant")).toHaveCount(2);
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
});
