// The open chat: which one it is (the URL's `?s=` names it, on load and on back/forward),
// opening it (its messages, and a reply still running in it), creating it on the first message,
// renaming and deleting. Settings chosen before a chat exists wait here until it is created.

import { useCallback, useEffect, useState } from "react";
import { api, ApiError } from "@/lib/api";
import type { Banner } from "@/lib/banner";
import type { ChatAction, ChatState } from "@/lib/chat-state";
import { newSessionFields, sessionIdFrom, titleFrom } from "@/lib/sessions";
import type { SettingsValue } from "@/lib/settings";
import type { Session } from "@/lib/types";

function sessionFromUrl(): string | null {
  return sessionIdFrom(window.location.search);
}

function setUrl(id: string | null, push = true) {
  const url = id ? `?s=${id}` : window.location.pathname;
  if (push) window.history.pushState(null, "", url);
  else window.history.replaceState(null, "", url);
}

export function useSessions({
  enabled,
  chat,
  dispatch,
  detach,
  follow,
  upsert,
  removeFromList,
  setBanner,
}: {
  /** The API may be called (auth is settled). */
  enabled: boolean;
  chat: ChatState;
  dispatch: (a: ChatAction) => void;
  /** Lets go of the reply being read, if any (it belongs to the chat being left). */
  detach: () => void;
  /** Reads a reply found still streaming in the chat just opened. */
  follow: (id: string, messageId: string) => Promise<void>;
  upsert: (s: Session) => void;
  removeFromList: (id: string) => void;
  setBanner: (b: Banner | null) => void;
}) {
  const [sessionId, setSessionId] = useState<string | null>(null);
  const [session, setSession] = useState<Session | null>(null);
  /** Settings chosen for a chat not created yet; its first message creates it with them. */
  const [pendingSettings, setPendingSettings] = useState<SettingsValue | null>(null);

  const open = useCallback(
    async (id: string | null) => {
      detach();
      setBanner(null);
      setSessionId(id);
      setSession(null);
      dispatch({ type: "load", messages: [] });
      if (!id) return;
      try {
        const [s, msgs] = await Promise.all([api.getSession(id), api.messages(id)]);
        setSession(s);
        dispatch({ type: "load", messages: msgs });
        const last = msgs[msgs.length - 1];
        // Reloaded (or came back) mid-reply: follow it from its first event.
        if (last && last.role === "assistant" && last.status === "streaming") await follow(id, last.id);
      } catch (e) {
        if (e instanceof ApiError && e.status === 404) {
          setSessionId(null);
          setUrl(null, false);
          setBanner({ kind: "error", message: "That chat does not exist (it may have been deleted)." });
        } else if (!(e instanceof ApiError && e.status === 401)) {
          setBanner({ kind: "error", message: `Could not open the chat: ${(e as Error).message}` });
        }
      }
    },
    [detach, dispatch, follow, setBanner],
  );

  useEffect(() => {
    if (!enabled) return;
    // The URL is the outside state this follows (on load and on back/forward).
    void Promise.resolve().then(() => open(sessionFromUrl()));
    const onPop = () => void open(sessionFromUrl());
    window.addEventListener("popstate", onPop);
    return () => window.removeEventListener("popstate", onPop);
  }, [enabled, open]);

  /** Opens chat `id` (null: a new, empty one) and records it in the history. */
  const select = (id: string | null) => {
    if (id === sessionId) return;
    setUrl(id);
    void open(id);
  };

  /** A new chat, with no settings carried over from one not yet created. */
  const startNew = () => {
    select(null);
    setPendingSettings(null);
  };

  /**
   * The session a first message goes to: the open one (titled from the message if it is still
   * an empty "New chat"), or a new one created with the waiting settings.
   */
  const ensureSession = async (content: string): Promise<string> => {
    if (sessionId) {
      if (chat.messages.length === 0 && session && session.title === "New chat") {
        upsert(await api.patchSession(sessionId, { title: titleFrom(content) }));
      }
      return sessionId;
    }
    const s = await api.createSession(newSessionFields(content, pendingSettings));
    setPendingSettings(null);
    setSessionId(s.id);
    setSession(s);
    setUrl(s.id);
    upsert(s);
    return s.id;
  };

  const rename = async (id: string, title: string) => {
    try {
      const s = await api.patchSession(id, { title });
      upsert(s);
      if (id === sessionId) setSession(s);
    } catch (e) {
      setBanner({ kind: "error", message: `Could not rename: ${(e as Error).message}` });
    }
  };

  /** Deletes chat `s`; `onOpenDeleted` runs when it was the open one. */
  const remove = async (s: Session, onOpenDeleted: () => void) => {
    try {
      await api.deleteSession(s.id);
      removeFromList(s.id);
      if (s.id === sessionId) onOpenDeleted();
    } catch (e) {
      setBanner({ kind: "error", message: `Could not delete: ${(e as Error).message}` });
    }
  };

  return {
    sessionId,
    session,
    setSession,
    pendingSettings,
    setPendingSettings,
    select,
    startNew,
    ensureSession,
    rename,
    remove,
  };
}
