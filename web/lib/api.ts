// The public HTTP API, on the page's own origin. One place adds the API key and turns error
// responses into ApiError (status, message, Retry-After).

import type { ApiMessage, ErrorBody, ModelCard, Session, SessionFields, SessionPage } from "./types";

export type { SessionFields };

const KEY_STORAGE = "hearth.apiKey";

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    /** Seconds, from `Retry-After` on a 429. */
    readonly retryAfter: number | null = null,
  ) {
    super(message);
  }
}

let apiKey: string | null = null;
let onUnauthorized: ((hadKey: boolean) => void) | null = null;

export function loadKey(): string | null {
  try {
    apiKey = localStorage.getItem(KEY_STORAGE);
  } catch {
    apiKey = null;
  }
  return apiKey;
}

export function setKey(key: string | null) {
  apiKey = key;
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: the key lasts for this page only
  }
}

/** Called on any 401 (the key is missing, wrong or revoked). */
export function setUnauthorizedHandler(f: ((hadKey: boolean) => void) | null) {
  onUnauthorized = f;
}

export async function errorFrom(r: Response): Promise<ApiError> {
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = (await r.json()) as Partial<ErrorBody>;
    if (body.error?.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  const ra = r.headers.get("retry-after");
  const retry = ra !== null && /^\d+$/.test(ra.trim()) ? Number(ra.trim()) : null;
  return new ApiError(r.status, message, retry);
}

/** fetch with the key; non-2xx answers throw ApiError. */
export async function request(path: string, init: RequestInit = {}): Promise<Response> {
  const headers = new Headers(init.headers);
  if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
  if (init.body !== undefined && !headers.has("Content-Type")) headers.set("Content-Type", "application/json");
  const r = await fetch(path, { ...init, headers });
  if (!r.ok) {
    const e = await errorFrom(r);
    if (r.status === 401) onUnauthorized?.(apiKey !== null);
    throw e;
  }
  return r;
}

async function json<T>(path: string, init?: RequestInit): Promise<T> {
  return (await (await request(path, init)).json()) as T;
}

const body = (v: unknown) => JSON.stringify(v);
const sid = (id: string) => `/v1/sessions/${encodeURIComponent(id)}`;

export const api = {
  listSessions(opts: { q?: string; before?: string | null; limit?: number }): Promise<SessionPage> {
    const p = new URLSearchParams();
    p.set("limit", String(opts.limit ?? 30));
    if (opts.q) p.set("q", opts.q);
    if (opts.before) p.set("before", opts.before);
    return json(`/v1/sessions?${p}`);
  },
  createSession(v: SessionFields): Promise<Session> {
    return json("/v1/sessions", { method: "POST", body: body(v) });
  },
  getSession(id: string): Promise<Session> {
    return json(sid(id));
  },
  patchSession(id: string, v: SessionFields): Promise<Session> {
    return json(sid(id), { method: "PATCH", body: body(v) });
  },
  async deleteSession(id: string): Promise<void> {
    await request(sid(id), { method: "DELETE" });
  },
  /** Every message of a session, oldest first: the newest page, then earlier ones. */
  async messages(id: string): Promise<ApiMessage[]> {
    let all: ApiMessage[] = [];
    let before: string | null = null;
    do {
      const query: string = before ? `?before=${encodeURIComponent(before)}` : "";
      const page: { data: ApiMessage[]; next_cursor: string | null } = await json(
        `${sid(id)}/messages${query}`,
      );
      all = page.data.concat(all);
      before = page.next_cursor;
    } while (before);
    return all;
  },
  async stop(id: string): Promise<{ stopped: boolean; message?: ApiMessage }> {
    return json(`${sid(id)}/stop`, { method: "POST", body: "{}" });
  },
  /** Starts a reply; the answer is an SSE stream. */
  send(id: string, content: string, signal: AbortSignal): Promise<Response> {
    return request(`${sid(id)}/messages`, {
      method: "POST",
      body: body({ content }),
      headers: { Accept: "text/event-stream" },
      signal,
    });
  },
  regenerate(id: string, signal: AbortSignal): Promise<Response> {
    return request(`${sid(id)}/regenerate`, {
      method: "POST",
      body: "{}",
      headers: { Accept: "text/event-stream" },
      signal,
    });
  },
  edit(id: string, messageId: string, content: string, signal: AbortSignal): Promise<Response> {
    return request(`${sid(id)}/messages/${encodeURIComponent(messageId)}/edit`, {
      method: "POST",
      body: body({ content }),
      headers: { Accept: "text/event-stream" },
      signal,
    });
  },
  /** The session's running (or just finished) reply, after `lastEventId`. */
  resume(id: string, lastEventId: string | null, signal: AbortSignal): Promise<Response> {
    const headers: Record<string, string> = { Accept: "text/event-stream" };
    if (lastEventId) headers["Last-Event-ID"] = lastEventId;
    return request(`${sid(id)}/stream`, { headers, signal });
  },
  /** The served models, each with its versions (GET /v1/models). */
  async models(): Promise<ModelCard[]> {
    const r = await json<{ data?: ModelCard[] }>("/v1/models");
    return r.data ?? [];
  },
  /** Readiness without throwing: a 503 here is an answer, not an error. */
  async ready(): Promise<{ ready: boolean; workers: number }> {
    const r = await fetch("/readyz");
    const v = (await r.json().catch(() => ({}))) as { ready?: boolean; workers?: unknown[] };
    return { ready: r.ok && v.ready === true, workers: Array.isArray(v.workers) ? v.workers.length : 0 };
  },
};
