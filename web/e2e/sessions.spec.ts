import { expect, test } from "@playwright/test";
import { apiClient, stackFor } from "./stack";

const stack = stackFor([]);

test("sessions: newest first, paging on scroll, search, rename, delete with confirmation", async ({ page }) => {
  const api = apiClient(stack());
  for (let i = 1; i <= 33; i++) await api.createSession(`Filler ${String(i).padStart(2, "0")}`);
  // Apart in time, so "newest first" has one answer (timestamps are milliseconds).
  const pause = () => new Promise((r) => setTimeout(r, 20));
  await pause();
  const alpha = await api.createSession("Alpha notes");
  await pause();
  await api.createSession("Beta plans");
  await pause();
  await api.createSession("Gamma ideas");

  await page.goto(stack().url);
  const nav = page.getByRole("navigation", { name: "Chats" });
  const links = nav.getByRole("link");
  // The first page (30), newest first, under today's heading.
  await expect(links).toHaveCount(30);
  await expect(links.nth(0)).toHaveText("Gamma ideas");
  await expect(links.nth(1)).toHaveText("Beta plans");
  await expect(links.nth(2)).toHaveText("Alpha notes");
  await expect(nav.getByRole("heading", { name: "Today" })).toBeVisible();
  // Scrolling to the end loads the rest through the `before` cursor.
  await links.last().scrollIntoViewIfNeeded();
  await nav.locator(".session-list").evaluate((el) => el.scrollTo(0, el.scrollHeight));
  await expect(links).toHaveCount(36);
  // Every session once: the pages neither overlap nor leave a gap.
  const titles = await links.allTextContents();
  expect(new Set(titles).size).toBe(36);
  expect(titles.filter((t) => t.startsWith("Filler "))).toHaveLength(33);

  // Search (by title, server side).
  const search = page.getByRole("searchbox", { name: "Search chats" });
  await search.fill("beta");
  await expect(links).toHaveCount(1);
  await expect(links.first()).toHaveText("Beta plans");
  await search.fill("");
  await expect(links.first()).toHaveText("Gamma ideas");

  // Rename.
  await nav.getByRole("button", { name: "Rename Alpha notes" }).click();
  const input = nav.getByRole("textbox", { name: "New title" });
  await input.fill("Alpha renamed");
  await input.press("Enter");
  await expect(nav.getByRole("link", { name: "Alpha renamed" })).toBeVisible();
  expect((await api.call("GET", `/v1/sessions/${alpha.id}`)).json.title).toBe("Alpha renamed");

  // Open it: the URL names it and the header shows its title.
  await nav.getByRole("link", { name: "Alpha renamed" }).click();
  await expect(page).toHaveURL(new RegExp(`\\?s=${alpha.id}$`));
  await expect(page.getByRole("heading", { level: 1 })).toHaveText("Alpha renamed");

  // Delete asks first; Cancel keeps it.
  await nav.getByRole("button", { name: "Delete Gamma ideas" }).click();
  const dialog = page.getByRole("alertdialog");
  await expect(dialog).toContainText("Gamma ideas");
  await dialog.getByRole("button", { name: "Cancel" }).click();
  await expect(nav.getByRole("link", { name: "Gamma ideas" })).toBeVisible();
  await nav.getByRole("button", { name: "Delete Gamma ideas" }).click();
  await page.getByRole("alertdialog").getByRole("button", { name: "Delete" }).click();
  await expect(nav.getByRole("link", { name: "Gamma ideas" })).toHaveCount(0);
  expect((await api.sessions()).map((s) => s.title)).not.toContain("Gamma ideas");

  // Deleting the open chat goes back to a new chat.
  await nav.getByRole("button", { name: "Delete Alpha renamed" }).click();
  await page.getByRole("alertdialog").getByRole("button", { name: "Delete" }).click();
  await expect(page.getByRole("heading", { level: 1 })).toHaveText("New chat");
  expect((await api.call("GET", `/v1/sessions/${alpha.id}`)).status).toBe(404);

  // Ctrl+Shift+O opens a new chat from anywhere.
  await nav.getByRole("link", { name: "Beta plans" }).click();
  await expect(page.getByRole("heading", { level: 1 })).toHaveText("Beta plans");
  await page.keyboard.press("Control+Shift+O");
  await expect(page.getByRole("heading", { level: 1 })).toHaveText("New chat");
});
