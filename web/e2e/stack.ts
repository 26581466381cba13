// Starts the real stack for a spec file: `hearth-stack` runs hearth (debug build) and a
// hearth-worker with a tiny generated model and SQLite, serving the exported UI (out/).
import { spawn, type ChildProcess } from "node:child_process";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import { test, type Page } from "@playwright/test";

const HERE = dirname(fileURLToPath(import.meta.url));
export const WEB_DIR = resolve(HERE, "..", "out");
export const STACK_BIN = process.env.HEARTH_STACK ?? resolve(HERE, "..", "..", "target", "debug", "hearth-stack");

export interface Stack {
  url: string;
  auth: "none" | "keys";
  keys: { full?: string; limited?: string; other?: string };
  stop: () => Promise<void>;
}

export async function startStack(args: string[]): Promise<Stack> {
  const child: ChildProcess = spawn(STACK_BIN, ["--web-dir", WEB_DIR, ...args], {
    stdio: ["pipe", "pipe", "pipe"],
  });
  const stderr: string[] = [];
  child.stderr!.on("data", (d: Buffer) => {
    stderr.push(d.toString());
    if (stderr.length > 200) stderr.shift();
  });
  const line = await new Promise<string>((ok, fail) => {
    const rl = createInterface({ input: child.stdout! });
    const timer = setTimeout(() => fail(new Error(`hearth-stack did not start in 150 s:\n${stderr.join("")}`)), 150_000);
    rl.once("line", (l) => {
      clearTimeout(timer);
      ok(l);
    });
    child.once("exit", (code) => {
      clearTimeout(timer);
      fail(new Error(`hearth-stack exited (${code}):\n${stderr.join("")}`));
    });
  });
  const info = JSON.parse(line) as { url: string; auth: "none" | "keys"; keys?: Stack["keys"] };
  return {
    url: info.url,
    auth: info.auth,
    keys: info.keys ?? {},
    stop: () =>
      new Promise<void>((ok) => {
        if (child.exitCode !== null) return ok();
        child.once("exit", () => ok());
        child.kill("SIGTERM");
        setTimeout(() => child.kill("SIGKILL"), 10_000).unref();
      }),
  };
}

/** One stack for every test of the describe block (or file) it is called in. */
export function stackFor(args: string[] = []): () => Stack {
  let stack: Stack | null = null;
  test.beforeAll(async () => {
    test.setTimeout(180_000);
    stack = await startStack(args);
  });
  test.afterAll(async () => {
    await stack?.stop();
  });
  return () => {
    if (!stack) throw new Error("the stack is not running");
    return stack;
  };
}

/** A client for the stack's public API (what a script would do). */
export function apiClient(stack: Stack, key?: string) {
  const headers: Record<string, string> = { "Content-Type": "application/json" };
  const k = key ?? stack.keys.full;
  if (stack.auth === "keys" && k) headers.Authorization = `Bearer ${k}`;
  const call = async (method: string, path: string, body?: unknown) => {
    const r = await fetch(`${stack.url}${path}`, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    const text = await r.text();
    return { status: r.status, headers: r.headers, json: text ? JSON.parse(text) : null, text };
  };
  return {
    call,
    async createSession(title: string) {
      const r = await call("POST", "/v1/sessions", { title });
      if (r.status !== 201) throw new Error(`create session: ${r.status} ${r.text}`);
      return r.json as { id: string; title: string };
    },
    async messages(id: string) {
      const r = await call("GET", `/v1/sessions/${id}/messages`);
      return r.json.data as { id: string; role: string; content: string; status: string; finish_reason: string | null }[];
    },
    async sessions(q?: string) {
      const r = await call("GET", `/v1/sessions?limit=100${q ? `&q=${encodeURIComponent(q)}` : ""}`);
      return r.json.data as { id: string; title: string }[];
    },
  };
}

/** Opens the page with an API key already stored (as the key prompt would leave it). */
export async function withKey(page: Page, key: string) {
  await page.addInitScript((k) => localStorage.setItem("hearth.apiKey", k), key);
}

/** Sets max tokens for the chat opened next (the settings dialog, before sending; stored with the session). */
export async function setMaxTokens(page: Page, n: number) {
  await page.getByRole("button", { name: "Chat settings" }).click();
  await page.getByLabel("Max tokens").fill(String(n));
  await page.getByRole("button", { name: "Save" }).click();
  await test.expect(page.getByRole("dialog")).toBeHidden();
}

export function reply(page: Page, n = -1) {
  const all = page.locator("article.msg.assistant");
  return n < 0 ? all.last() : all.nth(n);
}

export async function send(page: Page, text: string) {
  const box = page.getByRole("textbox", { name: "Message" });
  await box.fill(text);
  await box.press("Enter");
}
