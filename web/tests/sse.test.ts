import { describe, expect, it } from "vitest";
import { readSse, SseParser, type SseEvent } from "../lib/sse";

const STREAM =
  "id: m1:1\nevent: message_start\ndata: {\"message_id\":\"m1\"}\n\n" +
  ": keep-alive\n\n" +
  "id: m1:2\r\nevent: token\r\ndata: {\"text\":\"Hé\"}\r\n\r\n" +
  "id: m1:3\revent: token\rdata: line one\rdata: line two\r\r" +
  "id: m1:4\nevent: message_end\ndata:{\"status\":\"complete\"}\n\n";

const EXPECTED: SseEvent[] = [
  { event: "message_start", data: '{"message_id":"m1"}', id: "m1:1" },
  { event: "token", data: '{"text":"Hé"}', id: "m1:2" },
  { event: "token", data: "line one\nline two", id: "m1:3" },
  { event: "message_end", data: '{"status":"complete"}', id: "m1:4" },
];

describe("SseParser", () => {
  it("parses LF, CRLF and CR line ends, comments, ids and multi-line data", () => {
    const p = new SseParser();
    expect(p.feed(STREAM)).toEqual(EXPECTED);
    expect(p.lastEventId).toBe("m1:4");
  });

  it("gives the same events whatever the chunk boundaries", () => {
    for (let size = 1; size <= STREAM.length; size++) {
      const p = new SseParser();
      const got: SseEvent[] = [];
      for (let i = 0; i < STREAM.length; i += size) got.push(...p.feed(STREAM.slice(i, i + size)));
      expect(got, `chunk size ${size}`).toEqual(EXPECTED);
    }
  });

  it("splits every pair of chunks at every position", () => {
    for (let cut = 0; cut <= STREAM.length; cut++) {
      const p = new SseParser();
      const got = [...p.feed(STREAM.slice(0, cut)), ...p.feed(STREAM.slice(cut))];
      expect(got, `cut at ${cut}`).toEqual(EXPECTED);
    }
  });

  it("treats a CR at a chunk's end and an LF at the next one's start as one line end", () => {
    const p = new SseParser();
    expect(p.feed("data: a\r")).toEqual([]);
    // Had the LF counted as a second line end, this would dispatch an event now.
    expect(p.feed("\n")).toEqual([]);
    expect(p.feed("\r\n")).toEqual([{ event: "message", data: "a", id: undefined }]);
  });

  it("keeps an incomplete event until its blank line and drops a cut-off one", () => {
    const p = new SseParser();
    expect(p.feed("id: x:1\nevent: token\ndata: {\"te")).toEqual([]);
    expect(p.lastEventId).toBe("x:1");
    expect(p.feed("xt\":\"a\"}\n")).toEqual([]);
    expect(p.feed("\n")).toEqual([{ event: "token", data: '{"text":"a"}', id: "x:1" }]);
  });

  it("ignores comments, retry, unknown fields and blank events; keeps an empty data line", () => {
    const p = new SseParser();
    expect(p.feed(":\n\nretry: 10\nfoo: bar\n\nevent: ping\n\ndata\n\ndata:\ndata:\n\n")).toEqual([
      { event: "message", data: "", id: undefined },
      { event: "message", data: "\n", id: undefined },
    ]);
  });

  it("only strips one leading space and keeps colons in the value", () => {
    const p = new SseParser();
    expect(p.feed("data:  two: spaces\n\n")).toEqual([
      { event: "message", data: " two: spaces", id: undefined },
    ]);
  });
});

describe("readSse", () => {
  it("decodes UTF-8 split inside a character across reads", async () => {
    const bytes = new TextEncoder().encode(STREAM);
    const body = new ReadableStream<Uint8Array>({
      start(c) {
        for (const b of bytes) c.enqueue(new Uint8Array([b]));
        c.close();
      },
    });
    const got: SseEvent[] = [];
    for await (const ev of readSse(body)) got.push(ev);
    expect(got).toEqual(EXPECTED);
  });
});
