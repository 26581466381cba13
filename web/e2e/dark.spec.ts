import { expect, test, type Page } from "@playwright/test";
import { resolve } from "node:path";
import { SHOTS, sampleChat } from "./screens";
import { stackFor } from "./stack";

const stack = stackFor(["--scripted-token-ms", "1"]);

const background = (page: Page) => page.evaluate(() => getComputedStyle(document.body).backgroundColor);
const luminance = (rgb: string) => {
  const [r, g, b] = rgb.match(/\d+/g)!.map(Number);
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
};

test.describe("system dark", () => {
  test.use({ colorScheme: "dark" });

  test("dark mode follows the system, the toggle switches and is remembered", async ({ page }) => {
    await sampleChat(page, stack());
    expect(luminance(await background(page))).toBeLessThan(60);
    await page.screenshot({ path: resolve(SHOTS, "desktop-dark.png") });

    await page.getByRole("button", { name: "Switch to light theme" }).click();
    expect(luminance(await background(page))).toBeGreaterThan(200);
    await page.reload();
    await expect(page.getByRole("button", { name: "Switch to dark theme" })).toBeVisible();
    expect(luminance(await background(page))).toBeGreaterThan(200);
  });
});

test.describe("system light", () => {
  test.use({ colorScheme: "light" });

  test("light by default on a light system; the toggle goes dark", async ({ page }) => {
    await sampleChat(page, stack());
    expect(luminance(await background(page))).toBeGreaterThan(200);
    await page.screenshot({ path: resolve(SHOTS, "desktop-light.png") });
    await page.getByRole("button", { name: "Switch to dark theme" }).click();
    expect(luminance(await background(page))).toBeLessThan(60);
  });
});
