import { describe, expect, it } from "vitest";
import { ApiError } from "../lib/api";
import type { SseEvent } from "../lib/sse";
import { consumeStream, TurnRefused } from "../lib/stream";

/** A response whose body delivers these chunks, then ends (or fails, as a cut connection does). */
function body(chunks: string[], fail = false): Response {
  const enc = new TextEncoder();
  return new Response(
    new ReadableStream<Uint8Array>({
      // One chunk per read, so a failure comes after the chunks were delivered.
      pull(c) {
        const next = chunks.shift();
        if (next !== undefined) c.enqueue(enc.encode(next));
        else if (fail) c.error(new TypeError("network error"));
        else c.close();
      },
    }),
  );
}

const e = (n: number, event: string, data: string) => `id: m:${n}\nevent: ${event}\ndata: ${data}\n\n`;

describe("consumeStream", () => {
  it("passes model_loading on and throws the refusal of an error without an id", async () => {
    const got: string[] = [];
    let resumed = 0;
    const refusal = JSON.stringify({
      error: { message: "the model beta@1 could not be loaded: no room", type: "server_error", code: "unavailable" },
    });
    const run = consumeStream({
      first: body([
        'event: model_loading\ndata: {"model":"beta@1","waited_s":0}\n\n',
        `event: error\ndata: ${refusal}\n\n`,
      ]),
      resume: async () => {
        resumed++;
        return body([]);
      },
      onEvent: (ev) => got.push(ev.event),
      signal: new AbortController().signal,
      sleep: async () => {},
    });
    await expect(run).rejects.toBeInstanceOf(TurnRefused);
    await expect(run).rejects.toThrow("the model beta@1 could not be loaded: no room");
    expect(got).toEqual(["model_loading"]);
    expect(resumed).toBe(0);
  });

  it("reconnects after a cut with the last event id and ends at message_end", async () => {
    const got: SseEvent[] = [];
    const asked: (string | null)[] = [];
    const reconnecting: boolean[] = [];
    const end = await consumeStream({
      first: body([e(1, "message_start", "{}"), e(2, "token", "a"), "id: m:3\nevent: tok"], true),
      resume: async (last) => {
        asked.push(last);
        if (asked.length === 1) return body([]); // ends at once: try again
        return body([e(3, "token", "b"), e(4, "message_end", "{}"), e(5, "token", "never")]);
      },
      onEvent: (ev) => got.push(ev),
      onReconnecting: (r) => reconnecting.push(r),
      signal: new AbortController().signal,
      sleep: async () => {},
    });
    expect(end).toBe("ended");
    expect(asked).toEqual(["m:2", "m:2"]);
    expect(got.map((g) => g.id)).toEqual(["m:1", "m:2", "m:3", "m:4"]);
    expect(reconnecting).toEqual([false, true, true, false]);
  });

  it("waits for the browser to be online before trying again", async () => {
    const order: string[] = [];
    const end = await consumeStream({
      first: body([e(1, "message_start", "{}")], true),
      resume: async (last) => {
        order.push(`resume ${last}`);
        return body([e(2, "message_end", "{}")]);
      },
      onEvent: () => {},
      signal: new AbortController().signal,
      sleep: async () => {
        order.push("sleep");
      },
      online: async () => {
        order.push("online");
      },
    });
    expect(end).toBe("ended");
    expect(order).toEqual(["online", "sleep", "resume m:1"]);
  });

  it("reports a stream the server no longer has", async () => {
    const end = await consumeStream({
      first: body([e(1, "message_start", "{}")]),
      resume: async () => {
        throw new ApiError(404, "stream not found");
      },
      onEvent: () => {},
      signal: new AbortController().signal,
      sleep: async () => {},
    });
    expect(end).toBe("gone");
  });

  it("gives up after the allowed attempts, and stops at once when aborted", async () => {
    const fail = consumeStream({
      first: body([], true),
      resume: async () => {
        throw new TypeError("offline");
      },
      onEvent: () => {},
      signal: new AbortController().signal,
      sleep: async () => {},
      maxAttempts: 3,
    });
    await expect(fail).rejects.toThrow("could not be restored");

    const ctrl = new AbortController();
    let calls = 0;
    const end = await consumeStream({
      first: body([], true),
      resume: async () => {
        calls++;
        ctrl.abort();
        throw new TypeError("aborted");
      },
      onEvent: () => {},
      signal: ctrl.signal,
      sleep: async () => {},
    });
    expect(end).toBe("aborted");
    expect(calls).toBe(1);
  });
});
