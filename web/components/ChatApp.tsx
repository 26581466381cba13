"use client";

import { useCallback, useEffect, useReducer, useRef, useState } from "react";
import { api, ApiError, loadKey, setKey, setUnauthorizedHandler } from "@/lib/api";
import { chatReducer, initialChat } from "@/lib/chat-state";
import type { SseEvent } from "@/lib/sse";
import { consumeStream } from "@/lib/stream";
import type { SamplingParams, Session } from "@/lib/types";
import { KeyPrompt } from "./KeyPrompt";
import { MessageView } from "./MessageView";
import { Settings, type SettingsValue } from "./Settings";
import { Sidebar } from "./Sidebar";
import { ThemeToggle } from "./ThemeToggle";

type Auth = "checking" | "need-key" | "ok";

interface Banner {
  kind: "rate" | "capacity" | "conflict" | "error";
  message: string;
  /** Epoch ms after which a retry may succeed (429). */
  retryAt?: number;
  retry?: () => void;
}

interface Running {
  sessionId: string;
  ctrl: AbortController;
}

const PAGE = 30;

/** The settings form's max tokens as the API takes it: a positive whole number, or null. */
function maxTokensFrom(v: SettingsValue): number | null {
  const m = v.maxTokens.trim();
  return m ? Number(m) : null;
}

/** A new chat's title: the first line of its first message, without markdown markers. */
function titleFrom(content: string): string {
  const line = content
    .trim()
    .split("\n")[0]
    .replace(/^#+\s*/, "")
    .replace(/[*`~]+/g, "")
    .trim();
  return line.length > 60 ? `${line.slice(0, 57)}…` : line || "New chat";
}

async function copyText(text: string): Promise<void> {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const ta = document.createElement("textarea");
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    document.execCommand("copy");
    ta.remove();
  }
}

function onCopyClick(e: React.MouseEvent) {
  const button = (e.target as HTMLElement).closest<HTMLButtonElement>("button[data-copy]");
  const code = button?.closest(".code")?.querySelector("code");
  if (!button || !code) return;
  void copyText(code.textContent ?? "").then(() => {
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
}

function sessionFromUrl(): string | null {
  const s = new URLSearchParams(window.location.search).get("s");
  return s && /^[0-9a-f]{32}$/.test(s) ? s : null;
}

function setUrl(id: string | null, push = true) {
  const url = id ? `?s=${id}` : window.location.pathname;
  if (push) window.history.pushState(null, "", url);
  else window.history.replaceState(null, "", url);
}

function paramsFrom(v: SettingsValue, base: SamplingParams | null): SamplingParams | null {
  const p: SamplingParams = { ...(base ?? {}) };
  const set = (k: "temperature" | "top_p" | "top_k", s: string) => {
    if (s.trim() === "") delete p[k];
    else p[k] = Number(s);
  };
  set("temperature", v.temperature);
  set("top_p", v.topP);
  set("top_k", v.topK);
  return Object.keys(p).length ? p : null;
}

export function ChatApp() {
  const [auth, setAuth] = useState<Auth>("checking");
  const [keyError, setKeyError] = useState<string | null>(null);
  const [sessionId, setSessionId] = useState<string | null>(null);
  const [session, setSession] = useState<Session | null>(null);
  const [chat, dispatch] = useReducer(chatReducer, initialChat);
  const [running, setRunning] = useState<Running | null>(null);
  const runningRef = useRef<Running | null>(null);
  const [reconnecting, setReconnecting] = useState(false);
  const [banner, setBanner] = useState<Banner | null>(null);
  const [now, setNow] = useState(() => Date.now());
  const [draft, setDraft] = useState("");
  const [settingsOpen, setSettingsOpen] = useState(false);
  const [pendingSettings, setPendingSettings] = useState<SettingsValue | null>(null);
  const [drawer, setDrawer] = useState(false);
  const [confirmDelete, setConfirmDelete] = useState<Session | null>(null);
  const [model, setModel] = useState<string | null>(null);
  const [ready, setReady] = useState<boolean | null>(null);
  // Sessions sidebar
  const [sessions, setSessions] = useState<Session[]>([]);
  const [cursor, setCursor] = useState<string | null>(null);
  const [listLoading, setListLoading] = useState(false);
  const [query, setQuery] = useState("");
  const listGen = useRef(0);
  const composer = useRef<HTMLTextAreaElement>(null);
  const bottom = useRef<HTMLDivElement>(null);
  const stick = useRef(true);
  const queued = useRef<SseEvent[]>([]);
  const frame = useRef<number | null>(null);

  // ---- auth -------------------------------------------------------------------------------
  useEffect(() => {
    setUnauthorizedHandler((hadKey) => {
      setKey(null);
      setKeyError(hadKey ? "The API key was not accepted. Enter a valid key." : null);
      setAuth("need-key");
    });
    loadKey();
    api
      .listSessions({ limit: 1 })
      .then(() => setAuth("ok"))
      .catch((e) => {
        if (!(e instanceof ApiError && e.status === 401)) setAuth("ok");
      });
    return () => setUnauthorizedHandler(null);
  }, []);

  const submitKey = async (key: string) => {
    setKey(key);
    try {
      await api.listSessions({ limit: 1 });
      setKeyError(null);
      setAuth("ok");
    } catch (e) {
      if (!(e instanceof ApiError && e.status === 401)) {
        setKeyError(e instanceof Error ? e.message : String(e));
      }
    }
  };

  // ---- model and health -------------------------------------------------------------------
  useEffect(() => {
    if (auth !== "ok") return;
    let alive = true;
    const poll = async () => {
      try {
        const r = await api.ready();
        if (alive) setReady(r.ready);
      } catch {
        if (alive) setReady(false);
      }
      try {
        const m = await api.model();
        if (alive) setModel(m);
      } catch {
        // keep the last name
      }
    };
    void poll();
    const t = setInterval(poll, 15_000);
    return () => {
      alive = false;
      clearInterval(t);
    };
  }, [auth]);

  // ---- sessions list ----------------------------------------------------------------------
  const loadSessions = useCallback(async (q: string, before: string | null) => {
    const gen = before ? listGen.current : ++listGen.current;
    setListLoading(true);
    try {
      const page = await api.listSessions({ q: q.trim() || undefined, before, limit: PAGE });
      if (gen !== listGen.current) return;
      setSessions((old) => (before ? [...old, ...page.data.filter((s) => !old.some((o) => o.id === s.id))] : page.data));
      setCursor(page.next_cursor);
    } catch (e) {
      if (gen === listGen.current && !(e instanceof ApiError && e.status === 401)) {
        setBanner({ kind: "error", message: `Could not load chats: ${(e as Error).message}` });
      }
    } finally {
      if (gen === listGen.current) setListLoading(false);
    }
  }, []);

  useEffect(() => {
    if (auth !== "ok") return;
    const t = setTimeout(() => void loadSessions(query, null), query ? 250 : 0);
    return () => clearTimeout(t);
  }, [auth, query, loadSessions]);

  const loadMore = useCallback(() => {
    if (cursor && !listLoading) void loadSessions(query, cursor);
  }, [cursor, listLoading, loadSessions, query]);

  const queryRef = useRef(query);
  useEffect(() => {
    queryRef.current = query;
  }, [query]);
  const upsert = useCallback((s: Session) => {
    setSessions((old) => {
      const rest = old.filter((o) => o.id !== s.id);
      const q = queryRef.current.trim().toLowerCase();
      if (q && !s.title.toLowerCase().includes(q)) return rest;
      return [s, ...rest].sort((a, b) => b.updated_at - a.updated_at);
    });
  }, []);

  // ---- streaming ----------------------------------------------------------------------------
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
    async (id: string, run: Running, first: Response) => {
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
        dispatch({ type: "failed", error: (e as Error).message });
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

  const begin = (id: string): Running => {
    const run = { sessionId: id, ctrl: new AbortController() };
    runningRef.current = run;
    setRunning(run);
    setReconnecting(false);
    return run;
  };

  const showRefusal = (e: unknown, retry: () => void) => {
    if (e instanceof ApiError) {
      if (e.status === 429) {
        const wait = e.retryAfter ?? 60;
        setNow(Date.now());
        return setBanner({
          kind: "rate",
          message: "Too many requests: the rate limit for this key is reached.",
          retryAt: Date.now() + wait * 1000,
          retry,
        });
      }
      if (e.status === 503) {
        return setBanner({ kind: "capacity", message: "No capacity right now: every worker is busy. Try again in a moment.", retry });
      }
      if (e.status === 409) return setBanner({ kind: "conflict", message: "A reply is already running in this chat." });
      if (e.status === 401) return;
    }
    setBanner({ kind: "error", message: e instanceof Error ? e.message : String(e), retry });
  };

  // Abandon (locally) a stream of another session; the server keeps generating and storing it.
  const detach = () => {
    runningRef.current?.ctrl.abort();
    runningRef.current = null;
    setRunning(null);
    queued.current = [];
    setReconnecting(false);
  };

  // ---- opening a session --------------------------------------------------------------------
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
        if (last && last.role === "assistant" && last.status === "streaming") {
          // Reloaded (or came back) mid-reply: follow it from its first event.
          dispatch({ type: "resume", messageId: last.id });
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
        }
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
    [stream],
  );

  useEffect(() => {
    if (auth !== "ok") return;
    // The URL is the outside state this follows (on load and on back/forward).
    void Promise.resolve().then(() => open(sessionFromUrl()));
    const onPop = () => void open(sessionFromUrl());
    window.addEventListener("popstate", onPop);
    return () => window.removeEventListener("popstate", onPop);
  }, [auth, open]);

  const openSession = (id: string | null) => {
    setDrawer(false);
    if (id === sessionId) return;
    setUrl(id);
    void open(id);
  };

  const newChat = () => {
    openSession(null);
    setPendingSettings(null);
    setTimeout(() => composer.current?.focus(), 0);
  };

  // ---- turns ----------------------------------------------------------------------------------
  const ensureSession = async (content: string): Promise<string> => {
    if (sessionId) {
      if (chat.messages.length === 0 && session && session.title === "New chat") {
        upsert(await api.patchSession(sessionId, { title: titleFrom(content) }));
      }
      return sessionId;
    }
    const ps = pendingSettings;
    const s = await api.createSession({
      title: titleFrom(content),
      ...(ps?.systemPrompt.trim() ? { system_prompt: ps.systemPrompt } : {}),
      ...(ps ? { params: paramsFrom(ps, null), max_tokens: maxTokensFrom(ps) } : {}),
    });
    setPendingSettings(null);
    setSessionId(s.id);
    setSession(s);
    setUrl(s.id);
    upsert(s);
    return s.id;
  };

  type Turn = { kind: "send"; content: string } | { kind: "regenerate" } | { kind: "edit"; messageId: string; content: string };

  const turn = async (t: Turn) => {
    if (runningRef.current) return;
    setBanner(null);
    let id: string;
    try {
      id = t.kind === "regenerate" ? sessionId! : await ensureSession(t.content);
    } catch (e) {
      return showRefusal(e, () => void turn(t));
    }
    if (t.kind === "send") dispatch({ type: "send", content: t.content });
    else if (t.kind === "regenerate") dispatch({ type: "regenerate" });
    else dispatch({ type: "edit", messageId: t.messageId, content: t.content });
    if (t.kind === "send") setDraft("");
    stick.current = true;
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
      if (t.kind === "send") setDraft(t.content);
      return showRefusal(e, () => void turn(t));
    }
    await stream(id, run, first);
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

  const send = () => {
    const content = draft;
    if (!content.trim() || running) return;
    void turn({ kind: "send", content });
  };

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
  }, [flush]);

  // ---- keyboard -------------------------------------------------------------------------------
  const newChatRef = useRef(newChat);
  useEffect(() => {
    newChatRef.current = newChat;
  });
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      if (e.key === "Escape" && runningRef.current && !e.defaultPrevented) {
        e.preventDefault();
        void stop();
      } else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === "o") {
        e.preventDefault();
        newChatRef.current();
      }
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [stop]);

  // ---- misc effects ---------------------------------------------------------------------------
  useEffect(() => {
    if (!banner?.retryAt) return;
    const t = setInterval(() => setNow(Date.now()), 500);
    return () => clearInterval(t);
  }, [banner]);

  // Follow the reply as it grows, unless the reader has scrolled up.
  useEffect(() => {
    if (stick.current) bottom.current?.scrollIntoView({ block: "end" });
  }, [chat.messages]);

  // ---- settings -------------------------------------------------------------------------------
  const settingsInitial = (): SettingsValue => {
    if (!sessionId && pendingSettings) return pendingSettings;
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
    };
  };

  const saveSettings = async (v: SettingsValue) => {
    if (!sessionId) return setPendingSettings(v);
    const s = await api.patchSession(sessionId, {
      system_prompt: v.systemPrompt.trim() ? v.systemPrompt : null,
      params: paramsFrom(v, session?.params ?? null),
      max_tokens: maxTokensFrom(v),
    });
    setSession(s);
    upsert(s);
  };

  // ---- render ---------------------------------------------------------------------------------
  if (auth === "checking") return <main className="loading muted">Loading…</main>;
  if (auth === "need-key") return <KeyPrompt onKey={(k) => void submitKey(k)} error={keyError} />;

  const busy = running !== null;
  const last = chat.messages[chat.messages.length - 1];
  const waitSecs = banner?.retryAt ? Math.max(0, Math.ceil((banner.retryAt - now) / 1000)) : 0;
  const title = session?.title ?? (sessionId ? "" : "New chat");

  return (
    <div className={drawer ? "app drawer-open" : "app"}>
      <aside className="sidebar" id="sidebar">
        <Sidebar
          sessions={sessions}
          activeId={sessionId}
          hasMore={cursor !== null}
          loading={listLoading}
          query={query}
          onQuery={setQuery}
          onMore={loadMore}
          onOpen={openSession}
          onNew={newChat}
          onRename={async (id, t) => {
            try {
              const s = await api.patchSession(id, { title: t });
              upsert(s);
              if (id === sessionId) setSession(s);
            } catch (e) {
              setBanner({ kind: "error", message: `Could not rename: ${(e as Error).message}` });
            }
          }}
          onDelete={setConfirmDelete}
        />
      </aside>
      {drawer && <div className="backdrop" onClick={() => setDrawer(false)} aria-hidden="true" />}
      <main className="main">
        <header className="top">
          <button
            type="button"
            className="icon menu"
            aria-label="Open chats"
            aria-controls="sidebar"
            aria-expanded={drawer}
            onClick={() => setDrawer(true)}
          >
            ☰
          </button>
          <h1 className="title" title={title}>
            {title}
          </h1>
          <span className="health" role="status" aria-label="Server status">
            <span className={ready === null ? "dot" : ready ? "dot ok" : "dot bad"} aria-hidden="true" />
            <span className="model">{model ?? "…"}</span>
            <span className="sr-only">{ready === null ? "checking" : ready ? "ready" : "not ready"}</span>
          </span>
          <button type="button" className="icon" aria-label="Chat settings" title="Chat settings" onClick={() => setSettingsOpen(true)}>
            ⚙
          </button>
          <ThemeToggle />
        </header>
        {/* Copy buttons are inside the rendered markdown: one delegated handler serves them all. */}
        <section
          className="messages"
          aria-label="Messages"
          onClick={onCopyClick}
          onScroll={(e) => {
            const el = e.currentTarget;
            stick.current = el.scrollHeight - el.scrollTop - el.clientHeight < 80;
          }}
        >
          {chat.messages.length === 0 && (
            <div className="empty muted">
              <p>Ask anything. Enter sends, Shift+Enter adds a line, Esc stops a reply.</p>
            </div>
          )}
          {chat.messages.map((m, i) => (
            <MessageView
              key={`${i}-${m.id}`}
              m={m}
              canEdit={!busy}
              canRegenerate={!busy && m === last && m.role === "assistant"}
              reconnecting={reconnecting && m.status === "streaming"}
              onRegenerate={onRegenerate}
              onEdit={onEdit}
            />
          ))}
          <div ref={bottom} />
        </section>
        {banner && (
          <div className={`banner ${banner.kind}`} role="alert">
            <span>
              {banner.message}
              {banner.kind === "rate" && (waitSecs > 0 ? ` Retry in ${waitSecs} s.` : " You can retry now.")}
            </span>
            {banner.retry && (
              <button type="button" onClick={banner.retry} disabled={waitSecs > 0}>
                Retry
              </button>
            )}
            <button type="button" className="icon" aria-label="Dismiss" onClick={() => setBanner(null)}>
              ✕
            </button>
          </div>
        )}
        <form
          className="composer"
          onSubmit={(e) => {
            e.preventDefault();
            send();
          }}
        >
          <textarea
            ref={composer}
            aria-label="Message"
            placeholder="Message Hearth"
            rows={Math.min(8, Math.max(1, draft.split("\n").length))}
            value={draft}
            onChange={(e) => setDraft(e.target.value)}
            onKeyDown={(e) => {
              if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
                e.preventDefault();
                send();
              }
            }}
          />
          {busy ? (
            <button type="button" className="stop" onClick={() => void stop()} aria-label="Stop reply">
              ■ Stop
            </button>
          ) : (
            <button type="submit" className="primary" aria-label="Send message" disabled={!draft.trim()}>
              Send
            </button>
          )}
        </form>
      </main>
      {settingsOpen && <Settings initial={settingsInitial()} onSave={saveSettings} onClose={() => setSettingsOpen(false)} />}
      {confirmDelete && (
        <div className="overlay">
          <div
            role="alertdialog"
            aria-modal="true"
            aria-labelledby="del-title"
            className="card dialog"
            onKeyDown={(e) => {
              if (e.key === "Escape") {
                e.preventDefault();
                setConfirmDelete(null);
              }
            }}
          >
            <h2 id="del-title">Delete chat?</h2>
            <p>
              “{confirmDelete.title}” and all its messages will be deleted. This cannot be undone.
            </p>
            <div className="row end">
              <button type="button" onClick={() => setConfirmDelete(null)} autoFocus>
                Cancel
              </button>
              <button
                type="button"
                className="danger"
                onClick={async () => {
                  const s = confirmDelete;
                  setConfirmDelete(null);
                  try {
                    await api.deleteSession(s.id);
                    setSessions((old) => old.filter((o) => o.id !== s.id));
                    if (s.id === sessionId) newChat();
                  } catch (e) {
                    setBanner({ kind: "error", message: `Could not delete: ${(e as Error).message}` });
                  }
                }}
              >
                Delete
              </button>
            </div>
          </div>
        </div>
      )}
    </div>
  );
}
