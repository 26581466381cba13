// The chat list and the open chat, as plain data: how a new chat is titled and created, how a
// page or a changed session merges into the list, and which `?s=` values name a session.
// Pure, so unit tests drive it; hooks/useSessionList.ts and hooks/useSessions.ts hold the state.

import { maxTokensFrom, paramsFrom, settingsFrom, type SettingsValue } from "./settings";
import type { Session, SessionFields } from "./types";

/** A new chat's title: the first line of its first message, without markdown markers. */
export function titleFrom(content: string): string {
  const line = content
    .trim()
    .split("\n")[0]
    .replace(/^#+\s*/, "")
    .replace(/[*`~]+/g, "")
    .trim();
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || "New chat";
}

/**
 * The body that creates a chat on its first message: the title from that message, plus the
 * settings chosen before the chat existed, or else the new-chat defaults (DRY on).
 */
export function newSessionFields(content: string, pending: SettingsValue | null): SessionFields {
  // Unchanged settings are the new-chat defaults (DRY on).
  const settings = pending ?? settingsFrom(null);
  return {
    title: titleFrom(content),
    ...(settings.systemPrompt.trim() ? { system_prompt: settings.systemPrompt } : {}),
    params: paramsFrom(settings, null),
    max_tokens: maxTokensFrom(settings),
    ...(settings.model ? { model: settings.model } : {}),
  };
}

/**
 * The list after a page arrives: a first page (`before` null) replaces it; a later page is
 * appended, less any session already listed (one may have moved up since the last page).
 */
export function mergePage(old: Session[], page: Session[], before: string | null): Session[] {
  return before ? [...old, ...page.filter((s) => !old.some((o) => o.id === s.id))] : page;
}

/**
 * The list after `s` was created or changed: it moves to its place by `updated_at` (newest
 * first), or leaves the list when a search is on and its title no longer matches.
 */
export function upsertSession(old: Session[], s: Session, query: string): Session[] {
  const rest = old.filter((o) => o.id !== s.id);
  const q = query.trim().toLowerCase();
  if (q && !s.title.toLowerCase().includes(q)) return rest;
  return [s, ...rest].sort((a, b) => b.updated_at - a.updated_at);
}

/** The session a page URL's query string (`?s=<32 hex digits>`) names, or null. */
export function sessionIdFrom(search: string): string | null {
  const s = new URLSearchParams(search).get("s");
  return s && /^[0-9a-f]{32}$/.test(s) ? s : null;
}
