// The open chat's messages and the reply being streamed into them. `start` makes a turn's
// request (send, regenerate, edit) and reads its SSE stream; lib/stream.ts reconnects with
// `Last-Event-ID` when the connection drops; `follow` picks up a reply that was already running
// when its chat was opened; `stop` asks the server to end it; `detach` lets go of it locally.
// Events are applied through lib/chat-state.ts, batched once per animation frame.

import { useCallback, useReducer, useRef, useState } from "react";
import { api, ApiError } from "@/lib/api";
import type { Banner } from "@/lib/banner";
import { chatReducer, initialChat } from "@/lib/chat-state";
import type { SseEvent } from "@/lib/sse";
import { consumeStream, TurnRefused } from "@/lib/stream";
import type { Session } from "@/lib/types";

export type Turn =
  | { kind: "send"; content: string }
  | { kind: "regenerate" }
  | { kind: "edit"; messageId: string; content: string };

/** The reply this page is reading; a stream whose run is no longer current changes nothing. */
interface Running {
  sessionId: string;
  ctrl: AbortController;
}

export function useReplyStream({
  upsert,
  setBanner,
}: {
  /** Takes the session as stored after a reply (its `updated_at` moved). */
  upsert: (s: Session) => void;
  setBanner: (b: Banner | null) => void;
}) {
  const [chat, dispatch] = useReducer(chatReducer, initialChat);
  const [running, setRunning] = useState<Running | null>(null);
  // The same run, for callbacks that outlive the render that started it.
  const runningRef = useRef<Running | null>(null);
  const [reconnecting, setReconnecting] = useState(false);
  const queued = useRef<SseEvent[]>([]);
  const frame = useRef<number | null>(null);

  const flush = useCallback(() => {
    if (frame.current !== null) cancelAnimationFrame(frame.current);
    frame.current = null;
    if (queued.current.length) {
      const events = queued.current;
      queued.current = [];
      dispatch({ type: "events", events });
    }
  }, []);

  /** Events are applied once per animation frame, however fast tokens arrive. */
  const enqueue = useCallback(
    (ev: SseEvent) => {
      queued.current.push(ev);
      if (frame.current === null) frame.current = requestAnimationFrame(flush);
    },
    [flush],
  );

  const stream = useCallback(
    async (id: string, run: Running, first: Response, onRefused?: (e: unknown) => void) => {
      const mine = () => runningRef.current === run;
      try {
        const end = await consumeStream({
          first,
          resume: (last, signal) => api.resume(id, last, signal),
          onEvent: (ev) => mine() && enqueue(ev),
          onReconnecting: (r) => mine() && setReconnecting(r),
          signal: run.ctrl.signal,
        });
        if (!mine()) return;
        flush();
        if (end === "gone") dispatch({ type: "load", messages: await api.messages(id) });
        else dispatch({ type: "finished" });
      } catch (e) {
        if (!mine()) return;
        flush();
        if (e instanceof TurnRefused && onRefused) {
          dispatch({ type: "refused" });
          onRefused(e);
        } else dispatch({ type: "failed", error: (e as Error).message });
      } finally {
        if (mine()) {
          runningRef.current = null;
          setRunning(null);
          setReconnecting(false);
          api.getSession(id).then(upsert, () => {});
        }
      }
    },
    [enqueue, flush, upsert],
  );

  const begin = useCallback((id: string): Running => {
    const run = { sessionId: id, ctrl: new AbortController() };
    runningRef.current = run;
    setRunning(run);
    setReconnecting(false);
    return run;
  }, []);

  /** Whether a reply is running now (not as of the last render). */
  const isRunning = useCallback(() => runningRef.current !== null, []);

  // Abandon (locally) a stream of another session; the server keeps generating and storing it.
  const detach = useCallback(() => {
    runningRef.current?.ctrl.abort();
    runningRef.current = null;
    setRunning(null);
    queued.current = [];
    setReconnecting(false);
  }, []);

  /**
   * Makes turn `t` in session `id` and streams its reply. When the request is refused, the
   * list is put back as it was and `onRefused` says why (unless another run took over).
   */
  const start = useCallback(
    async (id: string, t: Turn, onRefused: (e: unknown) => void) => {
      if (t.kind === "send") dispatch({ type: "send", content: t.content });
      else if (t.kind === "regenerate") dispatch({ type: "regenerate" });
      else dispatch({ type: "edit", messageId: t.messageId, content: t.content });
      const run = begin(id);
      let first: Response;
      try {
        first =
          t.kind === "send"
            ? await api.send(id, t.content, run.ctrl.signal)
            : t.kind === "regenerate"
              ? await api.regenerate(id, run.ctrl.signal)
              : await api.edit(id, t.messageId, t.content, run.ctrl.signal);
      } catch (e) {
        if (runningRef.current !== run) return;
        runningRef.current = null;
        setRunning(null);
        dispatch({ type: "refused" });
        return onRefused(e);
      }
      await stream(id, run, first, onRefused);
    },
    [begin, stream],
  );

  /** Follows reply `messageId`, found still streaming when its chat was opened, from its first event. */
  const follow = useCallback(
    async (id: string, messageId: string) => {
      dispatch({ type: "resume", messageId });
      const run = begin(id);
      try {
        const first = await api.resume(id, null, run.ctrl.signal);
        await stream(id, run, first);
      } catch (e) {
        if (runningRef.current === run) {
          runningRef.current = null;
          setRunning(null);
          // The stream is gone (another replica, or long finished): show what is stored.
          if (e instanceof ApiError && e.status === 404) dispatch({ type: "load", messages: await api.messages(id) });
        }
      }
    },
    [begin, stream],
  );

  const stop = useCallback(async () => {
    const run = runningRef.current;
    if (!run) return;
    try {
      const r = await api.stop(run.sessionId);
      if (r.message) {
        flush();
        dispatch({ type: "stopped", message: r.message });
      }
    } catch (e) {
      setBanner({ kind: "error", message: `Could not stop the reply: ${(e as Error).message}` });
    }
  }, [flush, setBanner]);

  return { chat, dispatch, busy: running !== null, reconnecting, isRunning, start, follow, detach, stop };
}
