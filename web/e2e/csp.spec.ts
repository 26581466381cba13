import { expect, test } from "@playwright/test";
import { sampleChat } from "./screens";
import { stackFor } from "./stack";

// The UI under the Content-Security-Policy hearth sends with it. A refused inline script
// leaves a page that never hydrates (other specs would time out); a refused style, image or
// fetch may only show here, as a violation the browser reports.
const stack = stackFor(["--scripted-token-ms", "1"]);

test("the UI works under its Content-Security-Policy with nothing refused", async ({ page }) => {
  const refused: string[] = [];
  page.on("console", (m) => {
    if (/Content Security Policy/i.test(m.text())) refused.push(m.text());
  });
  await page.exposeFunction("cspRefused", (what: string) => refused.push(what));
  await page.addInitScript(() => {
    document.addEventListener("securitypolicyviolation", (e) => {
      (window as unknown as { cspRefused: (w: string) => void }).cspRefused(
        `${e.effectiveDirective} refused ${e.blockedURI || "inline"} (${e.sourceFile}:${e.lineNumber})`,
      );
    });
  });

  const home = await page.goto(stack().url);
  const policy = home?.headers()["content-security-policy"] ?? "";
  expect(policy).toContain("frame-ancestors 'none'");
  expect(policy).toMatch(/script-src 'self'( 'sha256-[A-Za-z0-9+/]+=*')+($|;)/);
  expect(policy).not.toContain("unsafe");
  expect(home?.headers()["x-frame-options"]).toBe("DENY");
  // Inline scripts run (or are refused) while the page loads: say so now rather than time out.
  await page.waitForLoadState("load");
  expect(refused, "refused while loading").toEqual([]);

  // Streaming, Markdown with a table and highlighted code, the theme toggle, a reload.
  await sampleChat(page, stack());
  await page.getByRole("button", { name: /Switch to (dark|light) theme/ }).click();
  await page.reload();
  await expect(page.locator(".health .dot.ok")).toBeVisible();

  // The export's 404 page hydrates too: its link navigates in place (an RSC fetch).
  const missing = await page.goto(`${stack().url}/no/such/page`);
  expect(missing?.status()).toBe(404);
  expect(missing?.headers()["content-security-policy"]).toContain("frame-ancestors 'none'");
  await page.evaluate(() => Object.assign(window, { sameDocument: true }));
  await page.getByRole("link", { name: "Open the chat" }).click();
  await expect(page.getByRole("textbox", { name: "Message" })).toBeVisible();
  expect(await page.evaluate(() => "sameDocument" in window)).toBe(true);

  expect(refused).toEqual([]);
});
