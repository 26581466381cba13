// A TCP proxy between the page and the stack that can reset every connection through it at
// once, the way a lost network does to a stream that is already open (Chromium's offline
// emulation leaves open streams alone, and a routed request is buffered whole).
import { createServer, connect, type Socket } from "node:net";

export interface Proxy {
  /** The stack's address, through the proxy. */
  url: string;
  /** Resets every open connection, both ways; later connections go through. */
  cutAll: () => number;
  close: () => Promise<void>;
}

export async function startProxy(target: string): Promise<Proxy> {
  const to = new URL(target);
  const open = new Set<Socket>();
  const server = createServer((client) => {
    const upstream = connect(Number(to.port), to.hostname);
    for (const s of [client, upstream]) {
      open.add(s);
      s.on("close", () => open.delete(s));
      s.on("error", () => s.destroy());
    }
    client.pipe(upstream);
    upstream.pipe(client);
    client.on("close", () => upstream.destroy());
    upstream.on("close", () => client.destroy());
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const address = server.address();
  if (address === null || typeof address === "string") throw new Error("the proxy has no port");
  return {
    url: `http://127.0.0.1:${address.port}`,
    cutAll: () => {
      const n = open.size;
      for (const s of open) s.resetAndDestroy();
      return n;
    },
    close: () => new Promise<void>((ok) => server.close(() => ok())),
  };
}
