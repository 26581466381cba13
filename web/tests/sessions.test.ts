import { describe, expect, it } from "vitest";
import { mergePage, newSessionFields, sessionIdFrom, titleFrom, upsertSession } from "../lib/sessions";
import { DEFAULT_DRY } from "../lib/settings";
import type { Session } from "../lib/types";

function s(id: string, title: string, updated_at: number): Session {
  return { id, title, created_at: 0, updated_at, system_prompt: null, params: null, max_tokens: null, model: null };
}

describe("titleFrom", () => {
  it("takes the first line without markdown markers", () => {
    expect(titleFrom("## **Plan** a `trip`\nmore")).toBe("Plan a trip");
  });

  it("shortens long lines to 58 characters with an ellipsis", () => {
    const t = titleFrom("x".repeat(61));
    expect(t).toBe(`${"x".repeat(57)}…`);
    expect(titleFrom("y".repeat(60))).toBe("y".repeat(60));
  });

  it("falls back to New chat when nothing is left", () => {
    expect(titleFrom("  \n")).toBe("New chat");
    expect(titleFrom("***")).toBe("New chat");
  });
});

describe("newSessionFields", () => {
  it("without waiting settings: the title and the new-chat defaults (DRY on)", () => {
    expect(newSessionFields("Hello there", null)).toEqual({
      title: "Hello there",
      params: { dry_multiplier: Number(DEFAULT_DRY) },
      max_tokens: null,
    });
  });

  it("with waiting settings: system prompt only when set, params and max tokens always", () => {
    const v = { systemPrompt: " ", temperature: "0.5", topP: "", topK: "", maxTokens: "", dry: "", model: "" };
    expect(newSessionFields("Hi", v)).toEqual({ title: "Hi", params: { temperature: 0.5 }, max_tokens: null });
    expect(newSessionFields("Hi", { ...v, systemPrompt: "Be brief." })).toEqual({
      title: "Hi",
      system_prompt: "Be brief.",
      params: { temperature: 0.5 },
      max_tokens: null,
    });
  });
});

describe("chat list", () => {
  const a = s("a", "Alpha", 30);
  const b = s("b", "Beta", 20);
  const c = s("c", "Gamma", 10);

  it("a first page replaces the list; a later one appends what is new", () => {
    expect(mergePage([a, b], [c], null)).toEqual([c]);
    expect(mergePage([a, b], [b, c], "cursor")).toEqual([a, b, c]);
  });

  it("a changed session moves to its place by updated_at", () => {
    const newer = { ...c, updated_at: 40 };
    expect(upsertSession([a, b, c], newer, "").map((x) => x.id)).toEqual(["c", "a", "b"]);
    expect(upsertSession([a, c], b, "").map((x) => x.id)).toEqual(["a", "b", "c"]);
  });

  it("during a search, a session whose title no longer matches leaves the list", () => {
    const renamed = { ...a, title: "Zeta", updated_at: 50 };
    expect(upsertSession([a, b], renamed, " al ").map((x) => x.id)).toEqual(["b"]);
    expect(upsertSession([b], { ...a, updated_at: 50 }, "AL").map((x) => x.id)).toEqual(["a", "b"]);
  });
});

describe("sessionIdFrom", () => {
  it("accepts 32 lowercase hex digits only", () => {
    const id = "0123456789abcdef0123456789abcdef";
    expect(sessionIdFrom(`?s=${id}`)).toBe(id);
    expect(sessionIdFrom(`?x=1&s=${id}`)).toBe(id);
    expect(sessionIdFrom(`?s=${id.toUpperCase()}`)).toBeNull();
    expect(sessionIdFrom(`?s=${id}0`)).toBeNull();
    expect(sessionIdFrom("")).toBeNull();
  });
});
