import { expect, test } from "@playwright/test";
import { resolve } from "node:path";
import { SHOTS, sampleChat } from "./screens";
import { stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "1"]);

test.use({ viewport: { width: 390, height: 844 }, isMobile: true, hasTouch: true });

test("mobile: the sidebar is a drawer", async ({ page }) => {
  await sampleChat(page, stack());
  const nav = page.getByRole("navigation", { name: "Chats" });
  await expect(nav).toBeHidden();
  // Nothing overflows sideways.
  expect(await page.evaluate(() => document.documentElement.scrollWidth)).toBeLessThanOrEqual(390);
  await page.screenshot({ path: resolve(SHOTS, "mobile.png") });

  const menu = page.getByRole("button", { name: "Open chats" });
  await menu.click();
  await expect(nav).toBeVisible();
  await expect(menu).toHaveAttribute("aria-expanded", "true");
  await nav.getByRole("link", { name: "Trip to Lisbon" }).click();
  await expect(nav).toBeHidden();
  await expect(page.getByRole("heading", { level: 1 })).toHaveText("Trip to Lisbon");

  // The backdrop closes it too.
  await menu.click();
  await expect(nav).toBeVisible();
  await page.mouse.click(380, 400);
  await expect(nav).toBeHidden();
});
