// Consumes one reply's SSE stream and, when the connection drops before the reply's last
// event, reconnects by itself with `Last-Event-ID` (GET /v1/sessions/{id}/stream), so the
// text continues exactly where it stopped.

import { ApiError } from "./api";
import { readSse, SseParser, type SseEvent } from "./sse";

export type StreamEnd = "ended" | "aborted" | "gone";

/**
 * The turn was refused after its response had started: its session's model had to be loaded
 * first (the stream said `model_loading` meanwhile), and then the turn could not start. The
 * stream ends with an `error` event without an id, whose data is the API's error body.
 */
export class TurnRefused extends ApiError {}

/** The refusal an id-less `error` event carries. */
function refusal(data: string): TurnRefused {
  let message = "the turn was refused";
  let status = 503;
  try {
    const body = JSON.parse(data) as { error?: { message?: unknown; code?: unknown } };
    if (typeof body.error?.message === "string") message = body.error.message;
    if (body.error?.code === "model_not_found") status = 404;
    else if (body.error?.code === "invalid_value") status = 422;
  } catch {
    // not JSON: the default message
  }
  return new TurnRefused(status, message);
}

export interface StreamOptions {
  /** The first response (from posting the turn, or a resume after a reload). */
  first: Response;
  /** Opens the stream again after this event id. */
  resume: (lastEventId: string | null, signal: AbortSignal) => Promise<Response>;
  onEvent: (ev: SseEvent) => void;
  /** Called with true while reconnecting, false once events flow again. */
  onReconnecting?: (reconnecting: boolean) => void;
  signal: AbortSignal;
  /** Waits between attempts (tests pass a fake). */
  sleep?: (ms: number) => Promise<void>;
  /** Resolves once the browser is online again (immediately when it is). */
  online?: (signal: AbortSignal) => Promise<void>;
  maxAttempts?: number;
}

const TERMINAL = new Set(["message_end", "error"]);

const defaultSleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** While the browser is offline nothing can succeed: wait for it instead of using up attempts. */
function browserOnline(signal: AbortSignal): Promise<void> {
  if (typeof navigator === "undefined" || navigator.onLine !== false) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      window.removeEventListener("online", done);
      signal.removeEventListener("abort", done);
      resolve();
    };
    window.addEventListener("online", done);
    signal.addEventListener("abort", done);
  });
}

/**
 * Resolves "ended" after `message_end`/`error`, "aborted" when `signal` aborts, and "gone"
 * when the server no longer has the stream (the reply finished long ago: read the stored
 * message instead). Throws when reconnecting keeps failing, and [`TurnRefused`] when the turn
 * was refused once its model had loaded.
 */
export async function consumeStream(o: StreamOptions): Promise<StreamEnd> {
  const sleep = o.sleep ?? defaultSleep;
  const online = o.online ?? browserOnline;
  const maxAttempts = o.maxAttempts ?? 30;
  let lastEventId: string | null = null;
  let response: Response | null = o.first;
  let failures = 0;
  for (;;) {
    if (o.signal.aborted) return "aborted";
    try {
      if (!response) response = await o.resume(lastEventId, o.signal);
      if (!response.body) throw new Error("the response has no body");
      const parser = new SseParser();
      let flowing = false;
      for await (const ev of readSse(response.body, parser)) {
        if (!flowing) {
          flowing = true;
          failures = 0;
          o.onReconnecting?.(false);
        }
        if (ev.event === "error" && !ev.id) throw refusal(ev.data);
        if (ev.id) lastEventId = ev.id;
        o.onEvent(ev);
        if (TERMINAL.has(ev.event)) return "ended";
      }
      // The body ended without the reply's last event: the connection was cut.
    } catch (e) {
      if (o.signal.aborted) return "aborted";
      if (e instanceof TurnRefused) throw e;
      if (e instanceof ApiError) {
        if (e.status === 404) return "gone";
        if (e.status === 401 || e.status === 403) throw e;
      }
    }
    if (o.signal.aborted) return "aborted";
    response = null;
    failures++;
    if (failures > maxAttempts) throw new Error("the connection was lost and could not be restored");
    o.onReconnecting?.(true);
    await online(o.signal);
    await sleep(Math.min(3000, 200 * 2 ** Math.min(failures - 1, 4)));
  }
}
