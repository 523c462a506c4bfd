/**
 * A local HTTP server speaking Resend's `POST /emails` wire format. Like
 * Resend, it dedupes on Idempotency-Key: the same key and payload returns the
 * first response without sending again; the same key with another payload is
 * a 409 `invalid_idempotent_request`; a key still in flight is a 409
 * `concurrent_idempotent_requests`.
 */

/** What the server does with one request before deduping (a scripted failure, or a delay). */
export type MailBehaviour =
  | { kind: "ok"; delayMs?: number }
  | { kind: "status"; status: number; body?: unknown; headers?: Record<string, string> };

/** One email the provider delivered. */
export interface DeliveredEmail {
  id: string;
  idempotencyKey: string | null;
  from: string;
  to: string[];
  subject: string;
  text: string;
}

/** A running fake Resend. */
export interface FakeMailServer {
  url: string;
  /** Every POST /emails received, duplicates included. */
  readonly requests: number;
  /** Emails actually delivered (once per idempotency key). */
  readonly delivered: DeliveredEmail[];
  /** Authorization headers seen. */
  readonly authorizations: Set<string>;
  /** Requests answered from an earlier send with the same Idempotency-Key (duplicates absorbed). */
  readonly deduplicated: number;
  close(): Promise<void>;
}

/** Starts the server on an ephemeral loopback port. */
export function startFakeMail(
  behave: (n: number, key: string | null) => MailBehaviour = () => ({ kind: "ok" }),
): FakeMailServer {
  const state = { requests: 0, deduplicated: 0, delivered: [] as DeliveredEmail[], authorizations: new Set<string>() };
  const byKey = new Map<string, { payload: string; id?: string }>();
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    if (req.method !== "POST" || new URL(req.url).pathname !== "/emails") {
      return Response.json({ statusCode: 404, name: "not_found", message: "Not found" }, { status: 404 });
    }
    const n = ++state.requests;
    state.authorizations.add(req.headers.get("authorization") ?? "");
    const key = req.headers.get("idempotency-key");
    const payload = await req.text();
    const behaviour = behave(n, key);
    if (behaviour.kind === "status") {
      return Response.json(
        behaviour.body ?? { statusCode: behaviour.status, name: "application_error", message: "scripted failure" },
        { status: behaviour.status, headers: behaviour.headers },
      );
    }
    let email: DeliveredEmail;
    try {
      const body = JSON.parse(payload);
      if (typeof body.from !== "string" || !Array.isArray(body.to) || typeof body.subject !== "string") throw 0;
      email = { id: crypto.randomUUID(), idempotencyKey: key, ...body };
    } catch {
      return Response.json({ statusCode: 422, name: "validation_error", message: "Invalid body" }, { status: 422 });
    }
    if (key !== null) {
      const seen = byKey.get(key);
      if (seen) {
        if (seen.payload !== payload) {
          return Response.json({
            statusCode: 409,
            name: "invalid_idempotent_request",
            message: "Same idempotency key used with a different request payload",
          }, { status: 409 });
        }
        if (!seen.id) {
          return Response.json({
            statusCode: 409,
            name: "concurrent_idempotent_requests",
            message: "Same idempotency key used while original request is still in progress",
          }, { status: 409 });
        }
        state.deduplicated++;
        return Response.json({ id: seen.id });
      }
      byKey.set(key, { payload });
    }
    if (behaviour.delayMs) await new Promise((r) => setTimeout(r, behaviour.delayMs));
    state.delivered.push(email);
    if (key !== null) byKey.set(key, { payload, id: email.id });
    return Response.json({ id: email.id });
  });
  const addr = server.addr as Deno.NetAddr;
  return {
    url: `http://127.0.0.1:${addr.port}`,
    get requests() {
      return state.requests;
    },
    get delivered() {
      return state.delivered;
    },
    get authorizations() {
      return state.authorizations;
    },
    get deduplicated() {
      return state.deduplicated;
    },
    close: () => server.shutdown(),
  };
}
