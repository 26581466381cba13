import { describe, expect, it } from "vitest";
import { newSessionFields } from "../lib/sessions";
import {
  DEFAULT_DRY,
  maxTokensFrom,
  modelChoices,
  paramsFrom,
  settingsFrom,
  settingsPatch,
  type SettingsValue,
} from "../lib/settings";
import type { ModelCard } from "../lib/types";
import type { Session } from "../lib/types";

const EMPTY: SettingsValue = { systemPrompt: "", temperature: "", topP: "", topK: "", maxTokens: "", dry: "", model: "" };

function session(over: Partial<Session> = {}): Session {
  return {
    id: "a".repeat(32),
    title: "A chat",
    created_at: 1,
    updated_at: 2,
    system_prompt: null,
    params: null,
    max_tokens: null,
    model: null,
    ...over,
  };
}

describe("settings form ↔ session fields", () => {
  it("max tokens: a number, or null when the field is blank", () => {
    expect(maxTokensFrom({ ...EMPTY, maxTokens: " 64 " })).toBe(64);
    expect(maxTokensFrom({ ...EMPTY, maxTokens: "  " })).toBeNull();
  });

  it("params: typed fields are set, blank ones removed, others in the base kept", () => {
    const base = { temperature: 0.2, top_k: 5, min_p: 0.1 };
    expect(paramsFrom({ ...EMPTY, temperature: "0.7", topP: "0.9" }, base)).toEqual({
      temperature: 0.7,
      top_p: 0.9,
      min_p: 0.1,
    });
    expect(paramsFrom(EMPTY, { top_k: 5 })).toBeNull();
    expect(paramsFrom({ ...EMPTY, topK: "40" }, null)).toEqual({ top_k: 40 });
  });

  it("shows stored 32-bit floats as they were typed", () => {
    const v = settingsFrom(
      session({ system_prompt: "Be terse.", params: { temperature: 0.699999988079071, top_p: 0.8999999761581421, top_k: 40 }, max_tokens: 64 }),
    );
    expect(v).toEqual({ systemPrompt: "Be terse.", temperature: "0.7", topP: "0.9", topK: "40", maxTokens: "64", dry: "", model: "" });
  });

  it("a session with nothing set shows empty fields; a chat not yet created, DRY on", () => {
    expect(settingsFrom(session())).toEqual(EMPTY);
    expect(settingsFrom(null)).toEqual({ ...EMPTY, dry: DEFAULT_DRY });
  });

  it("DRY: the multiplier is stored as dry_multiplier, blank turns it off", () => {
    expect(paramsFrom({ ...EMPTY, dry: "0.8" }, null)).toEqual({ dry_multiplier: 0.8 });
    expect(paramsFrom(EMPTY, { dry_multiplier: 0.8, dry_base: 2 })).toEqual({ dry_base: 2 });
    expect(settingsFrom(session({ params: { dry_multiplier: 0.5 } })).dry).toBe("0.5");
  });

  it("the PATCH clears what the form left blank", () => {
    expect(settingsPatch({ ...EMPTY, systemPrompt: "  " }, { temperature: 1 })).toEqual({
      system_prompt: null,
      params: null,
      max_tokens: null,
      model: null,
    });
    expect(settingsPatch({ ...EMPTY, systemPrompt: " Hi ", topP: "0.5", maxTokens: "10" }, null)).toEqual({
      system_prompt: " Hi ",
      params: { top_p: 0.5 },
      max_tokens: 10,
      model: null,
    });
    expect(settingsPatch({ ...EMPTY, model: "alpha@1" }, null).model).toBe("alpha@1");
  });

  it("a chat's model is stored as chosen; none leaves the server's default", () => {
    expect(settingsFrom(session({ model: "beta" })).model).toBe("beta");
    expect(newSessionFields("Hi", { ...EMPTY, model: "beta" }).model).toBe("beta");
    expect(newSessionFields("Hi", EMPTY)).not.toHaveProperty("model");
  });

  it("the model list names each model, pins versions when there are several, and says what is not ready", () => {
    const version = (v: string, state: ModelCard["state"] = "ready") => ({
      version: v,
      display_name: "x",
      max_model_len: 100,
      state,
      workers: 1,
      known_workers: 1,
    });
    const card = (over: Partial<ModelCard>): ModelCard => ({
      id: "a",
      object: "model",
      created: 0,
      owned_by: "hearth",
      max_model_len: 100,
      version: "2",
      display_name: "a",
      state: "ready",
      workers: 1,
      versions: [version("2")],
      ...over,
    });
    expect(
      modelChoices([
        card({ display_name: "Alpha", versions: [version("2"), version("1")] }),
        card({ id: "b", display_name: "b", state: "loading", fetched_bytes: 25, fetch_total_bytes: 100 }),
        card({ id: "c", display_name: "c", state: "available", workers: 0 }),
      ]),
    ).toEqual([
      { value: "a", label: "Alpha (a)" },
      { value: "a@2", label: "a version 2" },
      { value: "a@1", label: "a version 1" },
      { value: "b", label: "b: loading 25%" },
      { value: "c", label: "c (loads when used)" },
    ]);
  });
});
