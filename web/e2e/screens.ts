import { expect, type Page } from "@playwright/test";
import { resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { apiClient, reply, send, setMaxTokens, type Stack } from "./stack";

export const SHOTS = resolve(fileURLToPath(import.meta.url), "..", "..", "screenshots");

/** The scripted worker echoes the prompt, so this markdown comes back as the reply. */
export const SAMPLE = [
  "Here is a **short** example with `inline code`:",
  "",
  "```python",
  "def greet(name: str) -> str:",
  '    return f"Hello, {name}!"',
  "```",
  "",
  "| Model | Tokens/s |",
  "|-------|---------:|",
  "| tiny  | 120 |",
  "",
  "- streams token by token",
  "- resumes after a dropped connection",
].join("\n");

/** A chat with a rendered markdown reply, plus a few older chats in the sidebar. */
export async function sampleChat(page: Page, stack: Stack) {
  const api = apiClient(stack);
  const have = (await api.sessions()).map((s) => s.title);
  for (const t of ["Trip to Lisbon", "Rust lifetimes question", "Sourdough schedule"]) {
    if (!have.includes(t)) await api.createSession(t);
  }
  await page.goto(stack.url);
  // The echo starts with the template's two special tokens (shown as nothing), "user" and a
  // newline, then the message: stop at its end.
  await setMaxTokens(page, 2 + "user\n".length + SAMPLE.length);
  await send(page, SAMPLE);
  await expect(reply(page)).toHaveAttribute("data-status", "complete", { timeout: 30_000 });
  await expect(reply(page).locator("table")).toBeVisible();
  await expect(reply(page).locator(".hljs-keyword").first()).toBeVisible();
}
