import { expect, test } from "@playwright/test";
import { apiClient, reply, send, stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "1"]);

test("session settings are stored with the session; code blocks copy their code", async ({ page, context }) => {
  await context.grantPermissions(["clipboard-read", "clipboard-write"]);
  await page.goto(stack().url);
  await send(page, "```python\nprint('copied')\n```");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  const id = new URL(page.url()).searchParams.get("s")!;
  // A new chat starts with the repetition guard (DRY) on.
  const created = (await apiClient(stack()).call("GET", `/v1/sessions/${id}`)).json;
  expect(created.params.dry_multiplier).toBeCloseTo(1.5, 6);

  await page.getByRole("button", { name: "Chat settings" }).click();
  const dialog = page.getByRole("dialog", { name: "Chat settings" });
  await dialog.getByLabel("System prompt").fill("You are terse.");
  await dialog.getByLabel("Temperature").fill("0.7");
  await dialog.getByLabel("Top-p").fill("0.9");
  await dialog.getByLabel("Top-k").fill("40");
  await dialog.getByLabel("Max tokens").fill("64");
  await expect(dialog.getByLabel("Repetition guard (DRY)")).toHaveValue("1.5");
  await dialog.getByLabel("Repetition guard (DRY)").fill("0.5");
  // A value out of range is refused in place, naming the field.
  await dialog.getByLabel("Top-p").fill("3");
  await dialog.getByRole("button", { name: "Save" }).click();
  await expect(dialog.getByRole("alert")).toContainText("Top-p");
  await dialog.getByLabel("Top-p").fill("0.9");
  await dialog.getByRole("button", { name: "Save" }).click();
  await expect(dialog).toBeHidden();

  const s = (await apiClient(stack()).call("GET", `/v1/sessions/${id}`)).json;
  expect(s.system_prompt).toBe("You are terse.");
  // Stored as 32-bit floats.
  expect(s.params.temperature).toBeCloseTo(0.7, 6);
  expect(s.params.top_p).toBeCloseTo(0.9, 6);
  expect(s.params.top_k).toBe(40);
  expect(s.max_tokens).toBe(64);
  expect(s.params.dry_multiplier).toBeCloseTo(0.5, 6);

  // Reopened after a reload, the dialog shows what is stored.
  // In a fresh browser context (nothing in local storage), since everything lives on the server.
  await page.evaluate(() => localStorage.clear());
  await page.reload();
  await page.getByRole("button", { name: "Chat settings" }).click();
  await expect(dialog.getByLabel("System prompt")).toHaveValue("You are terse.");
  await expect(dialog.getByLabel("Temperature")).toHaveValue("0.7");
  await expect(dialog.getByLabel("Top-p")).toHaveValue("0.9");
  await expect(dialog.getByLabel("Top-k")).toHaveValue("40");
  await expect(dialog.getByLabel("Max tokens")).toHaveValue("64");
  await expect(dialog.getByLabel("Repetition guard (DRY)")).toHaveValue("0.5");
  await dialog.getByRole("button", { name: "Cancel" }).click();

  // The next turn is limited to 64 tokens and uses the stored system prompt.
  await send(page, "again");
  await expect(page.locator("article.msg.assistant")).toHaveCount(2);
  await expect(reply(page)).toHaveAttribute("data-status", "complete");
  await expect(reply(page).locator(".details")).toContainText("64 tokens");
  expect(await reply(page).getAttribute("data-text")).toContain("You are terse.");

  // Copy.
  const code = reply(page, 0).locator(".code").first();
  await code.getByRole("button", { name: "Copy code" }).click();
  await expect(code.getByRole("button", { name: "Copy code" })).toHaveText("Copied");
  expect(await page.evaluate(() => navigator.clipboard.readText())).toBe("print('copied')");
});
