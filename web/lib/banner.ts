// The one-line notice above the composer: what a refused request (429, 503, 409, other errors)
// shows, and how long a rate-limited retry must wait. Pure; hooks/useBanner.ts holds the state.

import { ApiError } from "./api";

export interface Banner {
  kind: "rate" | "capacity" | "conflict" | "error";
  message: string;
  /** Epoch ms after which a retry may succeed (429). */
  retryAt?: number;
  retry?: () => void;
}

/**
 * The banner for a request the server refused, with `retry` to try it again; null for a 401,
 * which the key prompt handles instead. `now` is epoch ms.
 */
export function refusalBanner(e: unknown, retry: () => void, now: number): Banner | null {
  if (e instanceof ApiError) {
    if (e.status === 429) {
      const wait = e.retryAfter ?? 60;
      return {
        kind: "rate",
        message: "Too many requests: the rate limit for this key is reached.",
        retryAt: now + wait * 1000,
        retry,
      };
    }
    if (e.status === 503) {
      return { kind: "capacity", message: "No capacity right now: every worker is busy. Try again in a moment.", retry };
    }
    if (e.status === 409) return { kind: "conflict", message: "A reply is already running in this chat." };
    if (e.status === 401) return null;
  }
  return { kind: "error", message: e instanceof Error ? e.message : String(e), retry };
}

/** Whole seconds until a rate-limited retry may be made (0 when it may, or for other banners). */
export function secondsLeft(banner: Banner | null, now: number): number {
  return banner?.retryAt ? Math.max(0, Math.ceil((banner.retryAt - now) / 1000)) : 0;
}
