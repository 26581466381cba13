// The open chat's messages, an empty-state hint, and the copy buttons of rendered code blocks
// (one delegated click handler serves them all). Scrolling is reported to the caller, which
// decides whether the list follows a growing reply.

"use client";

import { useMemo } from "react";
import { callNames, type ChatMessage } from "@/lib/chat-state";
import { MessageView } from "./MessageView";

async function copyText(text: string): Promise<void> {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API (an insecure origin, or permission refused): the old way.
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

export function MessageList({
  messages,
  busy,
  reconnecting,
  onRegenerate,
  onEdit,
  onScroll,
  bottom,
}: {
  messages: ChatMessage[];
  /** A reply is running: nothing may be edited or regenerated meanwhile. */
  busy: boolean;
  /** The running reply's stream dropped and is being reconnected. */
  reconnecting: boolean;
  onRegenerate: () => void;
  onEdit: (messageId: string, content: string) => void;
  onScroll: (e: React.UIEvent<HTMLElement>) => void;
  /** Placed after the last message, to scroll it into view. */
  bottom: React.Ref<HTMLDivElement>;
}) {
  const last = messages[messages.length - 1];
  const names = useMemo(() => callNames(messages), [messages]);
  return (
    <section className="messages" aria-label="Messages" onClick={onCopyClick} onScroll={onScroll}>
      {messages.length === 0 && (
        <div className="empty muted">
          <p>Ask anything. Enter sends, Shift+Enter adds a line, Esc stops a reply.</p>
        </div>
      )}
      {messages.map((m, i) => (
        <MessageView
          key={`${i}-${m.id}`}
          m={m}
          toolName={m.toolCallId ? names.get(m.toolCallId) : undefined}
          canEdit={!busy}
          canRegenerate={!busy && m === last && m.role === "assistant"}
          reconnecting={reconnecting && m.status === "streaming"}
          onRegenerate={onRegenerate}
          onEdit={onEdit}
        />
      ))}
      <div ref={bottom} />
    </section>
  );
}
