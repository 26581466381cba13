// The composer's text and the turns a user makes: send it, regenerate the last reply, or edit
// an earlier message. A refused turn shows why, with a retry, and puts a sent text back.

import { useCallback, useEffect, useRef, useState } from "react";
import type { Banner } from "@/lib/banner";
import type { Turn } from "./useReplyStream";

export function useTurns({
  sessionId,
  ensureSession,
  busy,
  isRunning,
  start,
  setBanner,
  showRefusal,
  onTurn,
}: {
  sessionId: string | null;
  /** The session a new message goes to (created on a chat's first message). */
  ensureSession: (content: string) => Promise<string>;
  /** A reply is running, as of this render. */
  busy: boolean;
  /** A reply is running now (a retry may come from an older render). */
  isRunning: () => boolean;
  start: (id: string, t: Turn, onRefused: (e: unknown) => void) => Promise<void>;
  setBanner: (b: Banner | null) => void;
  showRefusal: (e: unknown, retry: () => void) => void;
  /** Called as a turn starts (the message list follows it again). */
  onTurn: () => void;
}) {
  const [draft, setDraft] = useState("");

  const turn = async (t: Turn) => {
    if (isRunning()) return;
    setBanner(null);
    let id: string;
    try {
      id = t.kind === "regenerate" ? sessionId! : await ensureSession(t.content);
    } catch (e) {
      return showRefusal(e, () => void turnRef.current(t));
    }
    if (t.kind === "send") setDraft("");
    onTurn();
    // A retry runs with the state of its own render (turnRef), so it goes to the session this
    // try created rather than creating another.
    await start(id, t, (e) => {
      if (t.kind === "send") setDraft(t.content);
      showRefusal(e, () => void turnRef.current(t));
    });
  };

  // Stable handlers, so messages that did not change are not rendered again on every token.
  const turnRef = useRef(turn);
  useEffect(() => {
    turnRef.current = turn;
  });
  const onRegenerate = useCallback(() => void turnRef.current({ kind: "regenerate" }), []);
  const onEdit = useCallback(
    (messageId: string, content: string) => void turnRef.current({ kind: "edit", messageId, content }),
    [],
  );

  /** Sends the composer's text, unless it is blank or a reply is running. */
  const send = () => {
    const content = draft;
    if (!content.trim() || busy) return;
    void turn({ kind: "send", content });
  };

  return { draft, setDraft, send, onRegenerate, onEdit };
}
