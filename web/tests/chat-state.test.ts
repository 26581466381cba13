import { describe, expect, it } from "vitest";
import { callNames, chatReducer, initialChat, parseEventId, type ChatState } from "../lib/chat-state";
import type { SseEvent } from "../lib/sse";
import type { ApiMessage } from "../lib/types";

const ev = (id: string, event: string, data: unknown): SseEvent => ({ id, event, data: JSON.stringify(data) });
const start = (mid: string, uid: string | null = "u1") =>
  ev(`${mid}:1`, "message_start", { session_id: "s", message_id: mid, user_message_id: uid });
const tok = (mid: string, n: number, text: string) => ev(`${mid}:${n}`, "token", { text });

function stored(id: string, role: ApiMessage["role"], content: string, seq: number, status = "complete"): ApiMessage {
  return {
    id, seq, role, content, status: status as ApiMessage["status"], finish_reason: role === "assistant" ? "stop" : null,
    prompt_tokens: null, cached_tokens: null, completion_tokens: null, ttft_ms: null, duration_ms: null,
    worker: null, tool_calls: null, tool_call_id: null, created_at: 0, updated_at: 0,
  };
}

const run = (s: ChatState, ...events: SseEvent[]) => chatReducer(s, { type: "events", events });

describe("chatReducer", () => {
  it("appends tokens to the reply that message_start names", () => {
    let s = chatReducer(initialChat, { type: "send", content: "hi" });
    expect(s.messages.map((m) => [m.role, m.content, m.status])).toEqual([
      ["user", "hi", "complete"],
      ["assistant", "", "streaming"],
    ]);
    s = run(s, start("a1"), tok("a1", 2, "Hel"), tok("a1", 3, "lo"));
    expect(s.messages[0].id).toBe("u1");
    expect(s.messages[1]).toMatchObject({ id: "a1", content: "Hello", status: "streaming", pending: false });
    expect(s.live).toMatchObject({ messageId: "a1", lastSeq: 3, lastEventId: "a1:3", ended: false });
    s = run(s, ev("a1:4", "message_end", {
      message_id: "a1", status: "complete", finish_reason: "length",
      usage: { prompt_tokens: 7, cached_tokens: 3, completion_tokens: 2 }, timings: { ttft_ms: 12, duration_ms: 40 },
    }));
    expect(s.messages[1]).toMatchObject({
      status: "complete", finishReason: "length", promptTokens: 7, cachedTokens: 3, completionTokens: 2, ttftMs: 12, durationMs: 40,
    });
    expect(s.live?.ended).toBe(true);
  });

  it("takes a reply's tool calls from message_end and names the function of each result", () => {
    let s = chatReducer(initialChat, { type: "send", content: "weather?" });
    s = run(s, start("a1"), tok("a1", 2, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'));
    const call = { id: "call_1", type: "function", function: { name: "get_weather", arguments: '{"city":"Oslo"}' } };
    s = run(s, ev("a1:3", "message_end", {
      message_id: "a1", status: "complete", finish_reason: "tool_calls", tool_calls: [call],
      usage: { prompt_tokens: 7, cached_tokens: 0, completion_tokens: 9 }, timings: { ttft_ms: 1, duration_ms: 2 },
    }));
    expect(s.messages[1]).toMatchObject({ finishReason: "tool_calls", toolCalls: [call] });
    const result = { ...stored("t1", "tool", "12 °C", 3), tool_call_id: "call_1" };
    const loaded = chatReducer(s, { type: "load", messages: [
      stored("u1", "user", "weather?", 1), { ...stored("a1", "assistant", "{}", 2), tool_calls: [call] }, result,
    ] });
    expect(loaded.messages[2]).toMatchObject({ role: "tool", toolCallId: "call_1", content: "12 °C" });
    expect(callNames(loaded.messages).get("call_1")).toBe("get_weather");
  });

  it("skips events already applied when a resumed stream overlaps", () => {
    let s = chatReducer(initialChat, { type: "send", content: "hi" });
    s = run(s, start("a1"), tok("a1", 2, "a"), tok("a1", 3, "b"));
    // The resumed stream repeats 3 and continues; an event from another reply is ignored too.
    s = run(s, tok("a1", 3, "b"), tok("a1", 2, "a"), tok("zz", 4, "X"), tok("a1", 4, "c"), tok("a1", 5, "d"));
    expect(s.messages[1].content).toBe("abcd");
    expect(s.live?.lastEventId).toBe("a1:5");
  });

  it("rebuilds a reply streamed from its start after a reload", () => {
    let s = chatReducer(initialChat, { type: "load", messages: [stored("u1", "user", "q", 1), stored("a1", "assistant", "par", 2, "streaming")] });
    s = chatReducer(s, { type: "resume", messageId: "a1" });
    s = run(s, start("a1"), tok("a1", 2, "pa"), tok("a1", 3, "rt"), tok("a1", 4, "ial"));
    expect(s.messages.map((m) => m.content)).toEqual(["q", "partial"]);
  });

  it("keeps the partial text on stop and takes the stored message when given", () => {
    let s = chatReducer(initialChat, { type: "send", content: "hi" });
    s = run(s, start("a1"), tok("a1", 2, "par"));
    const local = chatReducer(s, { type: "stopped", message: null });
    expect(local.messages[1]).toMatchObject({ content: "par", status: "stopped" });
    const fromServer = chatReducer(s, { type: "stopped", message: { ...stored("a1", "assistant", "part", 2, "stopped"), finish_reason: "cancelled" } });
    expect(fromServer.messages[1]).toMatchObject({ id: "a1", content: "part", status: "stopped", finishReason: "cancelled" });
    // The stream's own message_end for the stop arrives later and agrees.
    const ended = run(local, ev("a1:3", "message_end", { status: "stopped", finish_reason: "cancelled", usage: {}, timings: {} }));
    expect(ended.messages[1]).toMatchObject({ content: "par", status: "stopped" });
  });

  it("an error event keeps the text the server stored and says why", () => {
    let s = chatReducer(initialChat, { type: "send", content: "hi" });
    s = run(s, start("a1"), tok("a1", 2, "ab"), ev("a1:3", "error", { error_type: "worker_lost", message: "no worker left", content: "abc" }));
    expect(s.messages[1]).toMatchObject({ content: "abc", status: "error", error: "no worker left" });
    expect(s.live?.ended).toBe(true);
  });

  it("a refused request puts the list back; a failure after start marks the reply", () => {
    const loaded = chatReducer(initialChat, { type: "load", messages: [stored("u1", "user", "q", 1), stored("a1", "assistant", "r", 2)] });
    const sent = chatReducer(loaded, { type: "send", content: "again" });
    expect(chatReducer(sent, { type: "refused" }).messages).toEqual(loaded.messages);
    const started = run(sent, start("a2", "u2"), tok("a2", 2, "x"));
    const failed = chatReducer(started, { type: "failed", error: "connection lost" });
    expect(failed.messages[3]).toMatchObject({ id: "a2", content: "x", status: "error", error: "connection lost" });
    expect(failed.live).toBeNull();
  });

  it("regenerate replaces the last reply", () => {
    const loaded = chatReducer(initialChat, { type: "load", messages: [stored("u1", "user", "q", 1), stored("a1", "assistant", "old", 2)] });
    let s = chatReducer(loaded, { type: "regenerate" });
    expect(s.messages.map((m) => [m.id, m.content])).toEqual([["u1", "q"], ["local-reply", ""]]);
    s = run(s, start("a2", "u1"), tok("a2", 2, "new"));
    expect(s.messages.map((m) => [m.id, m.content])).toEqual([["u1", "q"], ["a2", "new"]]);
    expect(chatReducer(s, { type: "refused" }).messages.map((m) => m.content)).toEqual(["q", "old"]);
  });

  it("edit drops the edited message and everything after it", () => {
    const loaded = chatReducer(initialChat, {
      type: "load",
      messages: [stored("u1", "user", "one", 1), stored("a1", "assistant", "r1", 2), stored("u2", "user", "two", 3), stored("a2", "assistant", "r2", 4)],
    });
    let s = chatReducer(loaded, { type: "edit", messageId: "u1", content: "ONE" });
    expect(s.messages.map((m) => [m.role, m.content])).toEqual([["user", "ONE"], ["assistant", ""]]);
    s = run(s, start("a9", "u9"), tok("a9", 2, "fresh"));
    expect(s.messages.map((m) => [m.id, m.content])).toEqual([["u9", "ONE"], ["a9", "fresh"]]);
    // Editing an assistant message or an unknown id changes nothing.
    expect(chatReducer(loaded, { type: "edit", messageId: "a1", content: "x" })).toBe(loaded);
    expect(chatReducer(loaded, { type: "edit", messageId: "nope", content: "x" })).toBe(loaded);
  });

  it("parses event ids", () => {
    expect(parseEventId("abc:12")).toEqual(["abc", 12]);
    expect(parseEventId("abc")).toBeNull();
    expect(parseEventId("abc:0")).toBeNull();
    expect(parseEventId("abc:x")).toBeNull();
    expect(parseEventId(undefined)).toBeNull();
  });
});
