// The message list of the open session and how streamed events change it. Pure: the
// `useReplyStream` hook feeds it actions, the unit tests do the same.

import type { ApiMessage, MessageStart, MessageStatus, ReplyEnd, ReplyFailed, Role, TokenText, ToolCall } from "./types";
import type { SseEvent } from "./sse";

export interface ChatMessage {
  id: string;
  role: Role;
  content: string;
  status: MessageStatus;
  finishReason?: string | null;
  promptTokens?: number | null;
  cachedTokens?: number | null;
  completionTokens?: number | null;
  ttftMs?: number | null;
  durationMs?: number | null;
  /** The tool calls a reply makes (its content is the text that made them). */
  toolCalls?: ToolCall[] | null;
  /** The call a `tool` message answers. */
  toolCallId?: string | null;
  /** Why the reply failed, when it did. */
  error?: string;
  /** Shown before the server has named it (ids `local-…`). */
  pending?: boolean;
}

/** The reply being streamed into the list. */
export interface Live {
  /** The reply's message id; null until `message_start` names it. */
  messageId: string | null;
  /** The highest event number applied (events are `<message id>:<n>`); later duplicates are skipped. */
  lastSeq: number;
  /** The last event id applied, for `Last-Event-ID`. */
  lastEventId: string | null;
  /** A `message_end` or `error` arrived. */
  ended: boolean;
  /** The list before this turn changed it, to put back if the request is refused. */
  before: ChatMessage[];
}

export interface ChatState {
  messages: ChatMessage[];
  live: Live | null;
}

export type ChatAction =
  | { type: "load"; messages: ApiMessage[] }
  | { type: "send"; content: string }
  | { type: "regenerate" }
  | { type: "edit"; messageId: string; content: string }
  | { type: "resume"; messageId: string }
  | { type: "events"; events: SseEvent[] }
  | { type: "stopped"; message: ApiMessage | null }
  | { type: "refused" }
  | { type: "failed"; error: string }
  | { type: "finished" };

export const initialChat: ChatState = { messages: [], live: null };

export const LOCAL_USER = "local-user";
export const LOCAL_REPLY = "local-reply";

export function fromApi(m: ApiMessage): ChatMessage {
  return {
    id: m.id,
    role: m.role,
    content: m.content,
    status: m.status,
    finishReason: m.finish_reason,
    promptTokens: m.prompt_tokens,
    cachedTokens: m.cached_tokens,
    completionTokens: m.completion_tokens,
    ttftMs: m.ttft_ms,
    durationMs: m.duration_ms,
    toolCalls: m.tool_calls,
    toolCallId: m.tool_call_id,
  };
}

/** The function each call of the list's replies names, by call id (for their `tool` results). */
export function callNames(messages: ChatMessage[]): Map<string, string> {
  const names = new Map<string, string>();
  for (const m of messages) {
    for (const c of m.toolCalls ?? []) names.set(c.id, c.function.name);
  }
  return names;
}

function placeholderReply(): ChatMessage {
  return { id: LOCAL_REPLY, role: "assistant", content: "", status: "streaming", pending: true };
}

function startLive(before: ChatMessage[], messageId: string | null = null): Live {
  return { messageId, lastSeq: 0, lastEventId: null, ended: false, before };
}

/** `<message id>:<n>` → [id, n]; null for anything else. */
export function parseEventId(id: string | undefined): [string, number] | null {
  if (!id) return null;
  const at = id.lastIndexOf(":");
  if (at <= 0) return null;
  const n = Number(id.slice(at + 1));
  return Number.isInteger(n) && n > 0 ? [id.slice(0, at), n] : null;
}

function parseData(data: string): Record<string, unknown> {
  try {
    const v: unknown = JSON.parse(data);
    return v && typeof v === "object" ? (v as Record<string, unknown>) : {};
  } catch {
    return {};
  }
}

const num = (v: unknown): number | null => (typeof v === "number" ? v : null);
const str = (v: unknown): string | null => (typeof v === "string" ? v : null);

function updateReply(
  messages: ChatMessage[],
  id: string | null,
  f: (m: ChatMessage) => ChatMessage,
): ChatMessage[] {
  // The reply is the last assistant message with this id (or the local placeholder).
  for (let i = messages.length - 1; i >= 0; i--) {
    const m = messages[i];
    if (m.role === "assistant" && (m.id === id || (m.pending && m.id === LOCAL_REPLY))) {
      const next = messages.slice();
      next[i] = f(m);
      return next;
    }
  }
  return messages;
}

function applyEvent(state: ChatState, ev: SseEvent): ChatState {
  const live = state.live;
  if (!live) return state;
  const parsed = parseEventId(ev.id);
  if (!parsed) return state;
  const [mid, n] = parsed;
  if (live.messageId !== null && mid !== live.messageId) return state; // another reply's event
  if (n <= live.lastSeq) return state; // already applied (a resumed stream repeats nothing twice)
  const nextLive: Live = { ...live, messageId: mid, lastSeq: n, lastEventId: ev.id ?? null };
  const d = parseData(ev.data);
  let messages = state.messages;
  switch (ev.event) {
    case "message_start": {
      const start = d as Partial<MessageStart>;
      const userId = str(start.user_message_id);
      if (userId) {
        messages = messages.map((m) => (m.pending && m.id === LOCAL_USER ? { ...m, id: userId, pending: false } : m));
      }
      // The stream starts from the beginning: whatever text the list had is replayed.
      messages = updateReply(messages, mid, (m) => ({ ...m, id: mid, content: "", status: "streaming", pending: false }));
      break;
    }
    case "token": {
      const token = d as Partial<TokenText>;
      const text = str(token.text) ?? "";
      messages = updateReply(messages, mid, (m) => ({ ...m, id: mid, content: m.content + text, pending: false }));
      break;
    }
    case "message_end": {
      const end = d as Partial<ReplyEnd>;
      const usage: Partial<ReplyEnd["usage"]> = end.usage ?? {};
      const timings: Partial<ReplyEnd["timings"]> = end.timings ?? {};
      messages = updateReply(messages, mid, (m) => ({
        ...m,
        id: mid,
        pending: false,
        status: (str(end.status) as MessageStatus | null) ?? "complete",
        finishReason: str(end.finish_reason),
        promptTokens: num(usage.prompt_tokens),
        cachedTokens: num(usage.cached_tokens),
        completionTokens: num(usage.completion_tokens),
        ttftMs: num(timings.ttft_ms),
        durationMs: num(timings.duration_ms),
        toolCalls: Array.isArray(end.tool_calls) ? end.tool_calls : null,
      }));
      nextLive.ended = true;
      break;
    }
    case "error": {
      const failed = d as Partial<ReplyFailed>;
      messages = updateReply(messages, mid, (m) => ({
        ...m,
        id: mid,
        pending: false,
        status: "error",
        content: str(failed.content) ?? m.content,
        error: str(failed.message) ?? "the reply failed",
      }));
      nextLive.ended = true;
      break;
    }
    default:
      return { ...state, live: nextLive };
  }
  return { messages, live: nextLive };
}

export function chatReducer(state: ChatState, action: ChatAction): ChatState {
  switch (action.type) {
    case "load":
      return { messages: action.messages.map(fromApi), live: null };
    case "send":
      return {
        messages: [
          ...state.messages,
          { id: LOCAL_USER, role: "user", content: action.content, status: "complete", pending: true },
          placeholderReply(),
        ],
        live: startLive(state.messages),
      };
    case "regenerate": {
      const last = state.messages[state.messages.length - 1];
      if (!last || last.role !== "assistant") return state;
      return { messages: [...state.messages.slice(0, -1), placeholderReply()], live: startLive(state.messages) };
    }
    case "edit": {
      const at = state.messages.findIndex((m) => m.id === action.messageId);
      if (at === -1 || state.messages[at].role !== "user") return state;
      return {
        messages: [
          ...state.messages.slice(0, at),
          { id: LOCAL_USER, role: "user", content: action.content, status: "complete", pending: true },
          placeholderReply(),
        ],
        live: startLive(state.messages),
      };
    }
    case "resume":
      return { ...state, live: startLive(state.messages, action.messageId) };
    case "events": {
      let s = state;
      for (const ev of action.events) s = applyEvent(s, ev);
      return s;
    }
    case "stopped": {
      const m = action.message;
      const id = m?.id ?? state.live?.messageId ?? null;
      const messages = updateReply(state.messages, id, (old) =>
        m ? { ...fromApi(m) } : { ...old, status: "stopped", pending: false },
      );
      return { messages, live: state.live ? { ...state.live, ended: true } : null };
    }
    case "refused":
      // Refused before anything was stored: the list goes back to what it was.
      return state.live ? { messages: state.live.before, live: null } : state;
    case "failed": {
      const id = state.live?.messageId ?? null;
      const messages = updateReply(state.messages, id, (m) =>
        m.status === "streaming" ? { ...m, status: "error", error: action.error, pending: false } : m,
      );
      return { messages, live: null };
    }
    case "finished":
      return { ...state, live: null };
  }
}
