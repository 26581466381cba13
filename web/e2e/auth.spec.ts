import { expect, test } from "@playwright/test";
import { reply, send, stackFor } from "./stack";

const stack = stackFor(["--auth", "keys"]);

test("with --auth keys: a key prompt, the key kept, a 401 returns to the prompt", async ({ page }) => {
  await page.goto(stack().url);
  const key = page.getByLabel("API key");
  await expect(key).toBeVisible();

  await key.fill("hk_not_a_real_key");
  await page.getByRole("button", { name: "Continue" }).click();
  await expect(page.locator(".error-text")).toHaveText(/not accepted/);

  await key.fill(stack().keys.full!);
  await page.getByRole("button", { name: "Continue" }).click();
  await expect(page.getByRole("textbox", { name: "Message" })).toBeVisible();
  await send(page, "hello with a key");
  await expect(reply(page)).toHaveAttribute("data-status", "complete");

  // Kept in local storage: a reload goes straight to the chat.
  await page.reload();
  await expect(page.locator("article.msg.user .bubble")).toHaveText(["hello with a key"]);
  await expect(page.getByLabel("API key")).toHaveCount(0);

  // A key the server no longer accepts sends the user back to the prompt.
  await page.evaluate(() => localStorage.setItem("hearth.apiKey", "hk_revoked"));
  await page.reload();
  await expect(page.getByLabel("API key")).toBeVisible();
  expect(await page.evaluate(() => localStorage.getItem("hearth.apiKey"))).toBeNull();
});
