// The chat page: the key prompt until the API accepts the page, then the chat list, the open
// chat and its composer. State lives in hooks (web/hooks/): auth, server health, the banner,
// the chat list, the reply stream, the open chat, its settings, scrolling and turns; this file
// wires them to the components and holds only layout state (drawer, dialogs).

"use client";

import { useRef, useState } from "react";
import { useAuth } from "@/hooks/useAuth";
import { useBanner } from "@/hooks/useBanner";
import { useHealth } from "@/hooks/useHealth";
import { useReplyStream } from "@/hooks/useReplyStream";
import { useSessionList } from "@/hooks/useSessionList";
import { useSessions } from "@/hooks/useSessions";
import { useSettings } from "@/hooks/useSettings";
import { useShortcuts } from "@/hooks/useShortcuts";
import { useStickToBottom } from "@/hooks/useStickToBottom";
import { useTurns } from "@/hooks/useTurns";
import type { Session } from "@/lib/types";
import { BannerBar } from "./BannerBar";
import { Composer } from "./Composer";
import { ConfirmDelete } from "./ConfirmDelete";
import { KeyPrompt } from "./KeyPrompt";
import { MessageList } from "./MessageList";
import { Settings } from "./Settings";
import { Sidebar } from "./Sidebar";
import { TopBar } from "./TopBar";

export function ChatApp() {
  const { auth, keyError, submitKey } = useAuth();
  const ok = auth === "ok";
  const { models, ready } = useHealth(ok);
  const { banner, setBanner, showRefusal, waitSecs } = useBanner();
  const list = useSessionList(ok, setBanner);
  const reply = useReplyStream({ upsert: list.upsert, setBanner });
  const sessions = useSessions({
    enabled: ok,
    chat: reply.chat,
    dispatch: reply.dispatch,
    detach: reply.detach,
    follow: reply.follow,
    upsert: list.upsert,
    removeFromList: list.remove,
    setBanner,
  });
  const settings = useSettings({
    sessionId: sessions.sessionId,
    session: sessions.session,
    setSession: sessions.setSession,
    pendingSettings: sessions.pendingSettings,
    setPendingSettings: sessions.setPendingSettings,
    upsert: list.upsert,
  });
  const scroll = useStickToBottom(reply.chat.messages);
  const turns = useTurns({
    sessionId: sessions.sessionId,
    ensureSession: sessions.ensureSession,
    busy: reply.busy,
    isRunning: reply.isRunning,
    start: reply.start,
    setBanner,
    showRefusal,
    onTurn: scroll.stickToBottom,
  });
  const [drawer, setDrawer] = useState(false);
  const [confirmDelete, setConfirmDelete] = useState<Session | null>(null);
  const composer = useRef<HTMLTextAreaElement>(null);

  const openSession = (id: string | null) => {
    setDrawer(false);
    sessions.select(id);
  };
  const newChat = () => {
    setDrawer(false);
    sessions.startNew();
    setTimeout(() => composer.current?.focus(), 0);
  };
  useShortcuts({ isRunning: reply.isRunning, stop: reply.stop, newChat });

  if (auth === "checking") return <main className="loading muted">Loading…</main>;
  if (auth === "need-key") return <KeyPrompt onKey={(k) => void submitKey(k)} error={keyError} />;

  const { sessionId, session } = sessions;
  const title = session?.title ?? (sessionId ? "" : "New chat");
  // The open chat's model, else the one a new chat would get (the server's default lists first).
  const chosen = sessionId ? session?.model : sessions.pendingSettings?.model;
  const model = chosen || (models[0]?.id ?? null);

  return (
    <div className={drawer ? "app drawer-open" : "app"}>
      <aside className="sidebar" id="sidebar">
        <Sidebar
          sessions={list.sessions}
          activeId={sessionId}
          hasMore={list.hasMore}
          loading={list.loading}
          query={list.query}
          onQuery={list.setQuery}
          onMore={list.loadMore}
          onOpen={openSession}
          onNew={newChat}
          onRename={sessions.rename}
          onDelete={setConfirmDelete}
        />
      </aside>
      {drawer && <div className="backdrop" onClick={() => setDrawer(false)} aria-hidden="true" />}
      <main className="main">
        <TopBar
          title={title}
          drawerOpen={drawer}
          onMenu={() => setDrawer(true)}
          model={model}
          ready={ready}
          onSettings={settings.show}
        />
        <MessageList
          messages={reply.chat.messages}
          busy={reply.busy}
          reconnecting={reply.reconnecting}
          onRegenerate={turns.onRegenerate}
          onEdit={turns.onEdit}
          onScroll={scroll.onScroll}
          bottom={scroll.bottom}
        />
        {banner && <BannerBar banner={banner} waitSecs={waitSecs} onDismiss={() => setBanner(null)} />}
        <Composer
          draft={turns.draft}
          onDraft={turns.setDraft}
          onSend={turns.send}
          busy={reply.busy}
          onStop={() => void reply.stop()}
          inputRef={composer}
        />
      </main>
      {settings.open && (
        <Settings initial={settings.initial()} models={models} onSave={settings.save} onClose={settings.close} />
      )}
      {confirmDelete && (
        <ConfirmDelete
          session={confirmDelete}
          onCancel={() => setConfirmDelete(null)}
          onConfirm={() => {
            const s = confirmDelete;
            setConfirmDelete(null);
            void sessions.remove(s, newChat);
          }}
        />
      )}
    </div>
  );
}
