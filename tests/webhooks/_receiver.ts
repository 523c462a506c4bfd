/** A webhook receiver's side, for the webhook tests: signature verification and local servers. */

/** What a receiver knows when a webhook arrives. */
export interface ReceivedWebhook {
  headers: Headers;
  body: string;
  secret: string;
  nowSeconds: number;
  toleranceSeconds?: number;
}

function fromBase64(text: string): Uint8Array<ArrayBuffer> {
  return Uint8Array.from(atob(text), (char) => char.charCodeAt(0));
}

/** Compares every byte whatever the first difference, so timing does not leak the expected signature. */
function constantTimeEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i]! ^ b[i]!;
  return diff === 0;
}

/**
 * Standard Webhooks verification, written the way a receiver would: a fresh
 * timestamp (replays are refused), and some `v1,` signature equal to our own
 * HMAC of `id.timestamp.body`.
 */
export async function verifyWebhook(
  { headers, body, secret, nowSeconds, toleranceSeconds = 300 }: ReceivedWebhook,
): Promise<boolean> {
  const id = headers.get("webhook-id");
  const timestamp = headers.get("webhook-timestamp");
  const signatures = headers.get("webhook-signature");
  if (id === null || timestamp === null || signatures === null || !/^\d+$/.test(timestamp)) return false;
  if (Math.abs(nowSeconds - Number(timestamp)) > toleranceSeconds) return false;
  const key = await crypto.subtle.importKey(
    "raw",
    fromBase64(secret.replace(/^whsec_/, "")),
    { name: "HMAC", hash: "SHA-256" },
    false,
    ["sign"],
  );
  const expected = new Uint8Array(
    await crypto.subtle.sign("HMAC", key, new TextEncoder().encode(`${id}.${timestamp}.${body}`)),
  );
  return signatures.split(" ").some((part) => {
    if (!part.startsWith("v1,")) return false;
    try {
      return constantTimeEqual(fromBase64(part.slice(3)), expected);
    } catch {
      return false;
    }
  });
}

/** One request a receiver got. */
export interface ReceivedRequest {
  method: string;
  url: URL;
  headers: Headers;
  body: string;
}

/** A local HTTP receiver. */
export interface Receiver {
  port: number;
  /** Every request received, in order. */
  readonly requests: ReceivedRequest[];
  close(): Promise<void>;
}

/** Starts an HTTP (or, with `tls`, https) receiver on an ephemeral 127.0.0.1 port. */
export function startReceiver(
  answer: (request: ReceivedRequest) => Response | Promise<Response> = () => new Response(null, { status: 204 }),
  tls?: { cert: string; key: string },
): Receiver {
  const requests: ReceivedRequest[] = [];
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {}, ...tls }, async (req) => {
    const received = { method: req.method, url: new URL(req.url), headers: req.headers, body: await req.text() };
    requests.push(received);
    return await answer(received);
  });
  return { port: server.addr.port, requests, close: () => server.shutdown() };
}

/** A raw TCP server: `serve` gets each accepted connection and may hold it open until `closed`. */
export interface RawServer {
  port: number;
  /** Connections accepted. */
  readonly accepted: number;
  close(): Promise<void>;
}

/** Starts a raw TCP server on 127.0.0.1; `close` stops accepting and closes every connection. */
export function startRawServer(serve: (conn: Deno.Conn, closed: Promise<void>) => Promise<void>): RawServer {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const conns = new Set<Deno.Conn>();
  const handlers: Promise<void>[] = [];
  const { promise: closed, resolve: closing } = Promise.withResolvers<void>();
  let accepted = 0;
  const loop = (async () => {
    for await (const conn of listener) {
      accepted++;
      conns.add(conn);
      handlers.push(serve(conn, closed).catch(() => {/* the client hung up */}));
    }
  })().catch(() => {/* listener closed */});
  return {
    port: (listener.addr as Deno.NetAddr).port,
    get accepted() {
      return accepted;
    },
    async close() {
      closing();
      listener.close();
      await loop;
      await Promise.all(handlers);
      for (const conn of conns) {
        try {
          conn.close();
        } catch { /* closed already */ }
      }
    },
  };
}
