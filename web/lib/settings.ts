// A chat's settings as the settings form holds them (text fields, empty meaning "unset") and
// their conversion to and from the session fields the API stores. Pure, so unit tests drive it.

import type { ModelCard, SamplingParams, Session, SessionFields } from "./types";

/** The settings form's fields, as typed. An empty field leaves the server's default. */
export interface SettingsValue {
  systemPrompt: string;
  temperature: string;
  topP: string;
  topK: string;
  maxTokens: string;
  /** DRY's multiplier (`dry_multiplier`): how hard repeating earlier text is penalized. */
  dry: string;
  /** The chat's model, as `/v1/models` lists it (`name`, or `name@version`); empty: the server's default. */
  model: string;
}

/**
 * The DRY multiplier a new chat starts with, measured with `make bench-loops` on the default
 * model (Gemma 3 270M base, greedy): 3 of 20 replies loop within 256 tokens, against 20 of 20
 * without it (docs/benchmarks.md, "Replies that loop").
 */
export const DEFAULT_DRY = "1.5";

/** The form's max tokens as the API takes it: a positive whole number, or null. */
export function maxTokensFrom(v: SettingsValue): number | null {
  const m = v.maxTokens.trim();
  return m ? Number(m) : null;
}

/**
 * The form's sampling fields laid over `base` (the session's stored params, which may hold
 * fields the form does not show): an empty field removes its key; null when nothing is left.
 */
export function paramsFrom(v: SettingsValue, base: SamplingParams | null): SamplingParams | null {
  const p: SamplingParams = { ...(base ?? {}) };
  const set = (k: "temperature" | "top_p" | "top_k" | "dry_multiplier", s: string) => {
    if (s.trim() === "") delete p[k];
    else p[k] = Number(s);
  };
  set("temperature", v.temperature);
  set("top_p", v.topP);
  set("top_k", v.topK);
  set("dry_multiplier", v.dry);
  return Object.keys(p).length ? p : null;
}

/**
 * What the form shows for a stored session, or for a chat not yet created: every field empty
 * but DRY, which new chats use by default.
 */
export function settingsFrom(session: Session | null): SettingsValue {
  const p = session?.params ?? {};
  const max = session?.max_tokens ?? null;
  // The server keeps 32-bit floats (0.7 comes back as 0.699999988…): show what was typed.
  const f32 = (v: number) => String(Number(v.toPrecision(6)));
  return {
    systemPrompt: session?.system_prompt ?? "",
    temperature: p.temperature != null ? f32(p.temperature) : "",
    topP: p.top_p != null ? f32(p.top_p) : "",
    topK: p.top_k != null ? String(p.top_k) : "",
    maxTokens: max ? String(max) : "",
    dry: p.dry_multiplier != null ? f32(p.dry_multiplier) : session ? "" : DEFAULT_DRY,
    model: session?.model ?? "",
  };
}

/** The PATCH that stores the form on an existing session; empty fields clear what was set. */
export function settingsPatch(v: SettingsValue, base: SamplingParams | null): SessionFields {
  return {
    system_prompt: v.systemPrompt.trim() ? v.systemPrompt : null,
    params: paramsFrom(v, base),
    max_tokens: maxTokensFrom(v),
    model: v.model || null,
  };
}

/** What the model list offers: each model by name (its newest version), and each version pinned. */
export function modelChoices(models: ModelCard[]): { value: string; label: string }[] {
  const out: { value: string; label: string }[] = [];
  for (const m of models) {
    const name = m.display_name && m.display_name !== m.id ? `${m.display_name} (${m.id})` : m.id;
    const fetched =
      m.fetched_bytes != null && m.fetch_total_bytes ? ` ${Math.floor((100 * m.fetched_bytes) / m.fetch_total_bytes)}%` : "";
    const note = m.state === "ready" ? "" : m.state === "available" ? " (loads when used)" : `: ${m.state}${fetched}`;
    out.push({ value: m.id, label: name + note });
    const pinned = m.versions.filter((v) => v.version !== "");
    if (pinned.length > 1) {
      for (const v of pinned) out.push({ value: `${m.id}@${v.version}`, label: `${m.id} version ${v.version}` });
    }
  }
  return out;
}
