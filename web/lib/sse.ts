// The one Server-Sent Events parser the UI uses (fetch + reader, so requests can carry an
// `Authorization` header, which EventSource cannot). Follows the HTML standard's event-stream
// rules: lines end in CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of
// the next are one line end), `data:` lines join with "\n", lines starting with ":" are
// comments (keep-alives), and a blank line dispatches the event.

export interface SseEvent {
  /** The event's `event:` field, "message" when absent. */
  event: string;
  data: string;
  /** The `id:` in force for this event (the last one seen on the stream), if any. */
  id: string | undefined;
}

export class SseParser {
  private buf = "";
  private skipLf = false;
  private data: string[] = [];
  private hasData = false;
  private eventType = "";
  /** The last event id seen on this stream (what to send as `Last-Event-ID`). */
  lastEventId: string | undefined;

  /** Feeds decoded text; returns the events it completed. */
  feed(chunk: string): SseEvent[] {
    const out: SseEvent[] = [];
    let text = chunk;
    if (this.skipLf && text.startsWith("\n")) text = text.slice(1);
    this.skipLf = false;
    this.buf += text;
    let start = 0;
    for (let i = 0; i < this.buf.length; i++) {
      const c = this.buf.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      const line = this.buf.slice(start, i);
      if (c === 13) {
        if (i + 1 < this.buf.length) {
          if (this.buf.charCodeAt(i + 1) === 10) i++;
        } else {
          this.skipLf = true;
        }
      }
      start = i + 1;
      const ev = this.line(line);
      if (ev) out.push(ev);
    }
    this.buf = this.buf.slice(start);
    return out;
  }

  private line(line: string): SseEvent | null {
    if (line === "") {
      const type = this.eventType || "message";
      this.eventType = "";
      if (!this.hasData) return null;
      const ev = { event: type, data: this.data.join("\n"), id: this.lastEventId };
      this.data = [];
      this.hasData = false;
      return ev;
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    switch (field) {
      case "data":
        this.data.push(value);
        this.hasData = true;
        break;
      case "event":
        this.eventType = value;
        break;
      case "id":
        if (!value.includes("\0")) this.lastEventId = value;
        break;
      default:
        break; // `retry` and unknown fields are ignored
    }
    return null;
  }
}

/** Reads a response body as SSE events, decoding UTF-8 across chunk boundaries. */
export async function* readSse(
  body: ReadableStream<Uint8Array>,
  parser: SseParser = new SseParser(),
): AsyncGenerator<SseEvent> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      for (const ev of parser.feed(decoder.decode(value, { stream: true }))) yield ev;
    }
    for (const ev of parser.feed(decoder.decode())) yield ev;
  } finally {
    reader.releaseLock();
  }
}
