"use client";

import { memo, useState } from "react";
import type { ChatMessage } from "@/lib/chat-state";
import type { ToolCall } from "@/lib/types";
import { Markdown } from "./Markdown";

function details(m: ChatMessage): string[] {
  const out: string[] = [];
  if (m.completionTokens != null) out.push(`${m.completionTokens} tokens`);
  if (m.completionTokens != null && m.durationMs) {
    out.push(`${((m.completionTokens * 1000) / m.durationMs).toFixed(1)} tok/s`);
  }
  if (m.ttftMs != null) out.push(`TTFT ${m.ttftMs} ms`);
  if (m.cachedTokens != null) out.push(`${m.cachedTokens}${m.promptTokens != null ? `/${m.promptTokens}` : ""} prompt tokens cached`);
  if (m.finishReason) out.push(`finish: ${m.finishReason}`);
  return out;
}

/** A call's arguments, indented when they are JSON. */
function prettyArguments(args: string): string {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args;
  }
}

function ToolCalls({ calls }: { calls: ToolCall[] }) {
  return (
    <ul className="tool-calls" aria-label="Tool calls">
      {calls.map((c) => (
        <li key={c.id} data-call-id={c.id}>
          <div className="tool-name">
            Calls <code>{c.function.name}</code>
          </div>
          <pre>
            <code>{prettyArguments(c.function.arguments)}</code>
          </pre>
        </li>
      ))}
    </ul>
  );
}

export const MessageView = memo(function MessageView({
  m,
  toolName,
  canRegenerate,
  canEdit,
  reconnecting,
  onRegenerate,
  onEdit,
}: {
  m: ChatMessage;
  /** For a tool's result: the function whose call it answers, when the list holds that call. */
  toolName?: string;
  canRegenerate: boolean;
  canEdit: boolean;
  reconnecting: boolean;
  onRegenerate: () => void;
  onEdit: (id: string, content: string) => void;
}) {
  const [editing, setEditing] = useState(false);
  const [draft, setDraft] = useState(m.content);
  if (m.role === "user") {
    return (
      <article className="msg user" data-id={m.id} aria-label="Your message">
        {editing ? (
          <form
            className="edit"
            onSubmit={(e) => {
              e.preventDefault();
              if (!draft.trim()) return;
              setEditing(false);
              onEdit(m.id, draft);
            }}
          >
            <textarea
              aria-label="Edit message"
              value={draft}
              rows={Math.min(10, draft.split("\n").length + 1)}
              autoFocus
              onChange={(e) => setDraft(e.target.value)}
              onKeyDown={(e) => {
                if (e.key === "Escape") {
                  e.preventDefault();
                  setEditing(false);
                }
              }}
            />
            <div className="row end">
              <button type="button" onClick={() => setEditing(false)}>
                Cancel
              </button>
              <button type="submit" className="primary">
                Save &amp; send
              </button>
            </div>
          </form>
        ) : (
          <>
            <div className="bubble">{m.content}</div>
            {canEdit && !m.pending && (
              <div className="actions">
                <button
                  type="button"
                  aria-label="Edit message"
                  onClick={() => {
                    setDraft(m.content);
                    setEditing(true);
                  }}
                >
                  Edit
                </button>
              </div>
            )}
          </>
        )}
      </article>
    );
  }
  if (m.role === "tool") {
    return (
      <article className="msg tool" data-id={m.id} aria-label="Tool result">
        <div className="tool-name">
          Result of <code>{toolName ?? m.toolCallId ?? "a call"}</code>
        </div>
        <pre>
          <code>{m.content}</code>
        </pre>
      </article>
    );
  }
  const streaming = m.status === "streaming";
  const info = details(m);
  const calls = !streaming && m.toolCalls && m.toolCalls.length > 0 ? m.toolCalls : null;
  return (
    <article
      className={`msg assistant ${m.status}`}
      data-id={m.id}
      data-status={m.status}
      data-text={streaming ? undefined : m.content}
      aria-label="Reply"
      aria-live={streaming ? "polite" : undefined}
      aria-busy={streaming}
    >
      <div className="content">
        {m.content === "" && streaming ? (
          <span className="typing" aria-label="Waiting for the reply">
            …
          </span>
        ) : calls ? (
          <ToolCalls calls={calls} />
        ) : (
          <Markdown text={m.content} streaming={streaming} />
        )}
      </div>
      <div className="meta">
        {streaming && <span className="badge live">{reconnecting ? "Reconnecting…" : "Streaming"}</span>}
        {m.status === "stopped" && <span className="badge">Stopped</span>}
        {m.status === "error" && (
          <span className="badge bad" role="status">
            Error{m.error ? `: ${m.error}` : ""}
          </span>
        )}
        {!streaming && info.length > 0 && <span className="details">{info.join(" · ")}</span>}
        {canRegenerate && (
          <button type="button" className="link" onClick={onRegenerate} aria-label="Regenerate reply">
            ↻ Regenerate
          </button>
        )}
      </div>
    </article>
  );
});
