/**
 * Verifying Oncely's webhooks on the receiving side, per Standard Webhooks
 * (https://www.standardwebhooks.com/): `webhook-signature` holds one or more
 * space-separated `v1,<base64 HMAC-SHA256 of "id.timestamp.body">`, keyed
 * with the tenant's `whsec_` secret. Web Crypto only, so it runs in Deno,
 * Node and browsers alike.
 */
import type { WebhookEvent } from "./documents.ts";
import { WebhookVerificationError } from "./errors.ts";

/** A replayed webhook older (or further in the future) than this many seconds is refused by default. */
export const DEFAULT_WEBHOOK_TOLERANCE_S = 300;

const SECRET_PREFIX = "whsec_";

/** Request headers as a `Headers`, or as Node's `IncomingHttpHeaders`-style plain object. */
export type WebhookHeaders = Headers | { [name: string]: string | string[] | undefined };

/** What a receiver has when a webhook arrives. */
export interface VerifyWebhookOptions {
  /** The tenant's signing secret (`whsec_...`); or give `secrets`. */
  secret?: string;
  /** Every secret to accept, during a rotation the old and the new one. */
  secrets?: string[];
  headers: WebhookHeaders;
  /** The raw body exactly as received: a re-serialised object will not verify. */
  body: string | Uint8Array;
  /** How far `webhook-timestamp` may be from now, in seconds; 300 when unset. */
  toleranceS?: number;
  /** Now, as a Date or epoch milliseconds; the system clock when unset. */
  now?: Date | number;
}

/**
 * Checks a webhook's signature and timestamp, then returns its parsed body.
 * @throws {WebhookVerificationError} when the webhook must not be trusted (answer it with a 4xx).
 * @throws {TypeError} for no secret or a secret that is not `whsec_` + base64.
 */
export async function verifyWebhook<T = WebhookEvent>(options: VerifyWebhookOptions): Promise<T> {
  const secrets = options.secrets ?? (options.secret === undefined ? [] : [options.secret]);
  if (secrets.length === 0) throw new TypeError("verifyWebhook needs a secret (or secrets)");
  const keys = secrets.map(secretBytes);
  const id = header(options.headers, "webhook-id");
  const timestamp = header(options.headers, "webhook-timestamp");
  const signatures = header(options.headers, "webhook-signature");
  if (!/^\d{1,12}$/.test(timestamp)) {
    throw new WebhookVerificationError(`webhook-timestamp is not Unix seconds (got ${JSON.stringify(timestamp)})`);
  }
  const nowMs = options.now === undefined ? Date.now() : Number(options.now);
  const toleranceS = options.toleranceS ?? DEFAULT_WEBHOOK_TOLERANCE_S;
  // NaN compares false with everything: a NaN clock or tolerance would accept any timestamp at all.
  if (!Number.isFinite(nowMs)) throw new TypeError(`verifyWebhook's now is not a time (got ${String(options.now)})`);
  if (!Number.isFinite(toleranceS) || toleranceS < 0) {
    throw new TypeError(
      `verifyWebhook's toleranceS is not a number of seconds ≥ 0 (got ${String(options.toleranceS)})`,
    );
  }
  const ageS = Math.floor(nowMs / 1000) - Number(timestamp);
  // The timestamp is signed, so a captured delivery cannot be replayed later with a fresh one.
  if (Math.abs(ageS) > toleranceS) {
    throw new WebhookVerificationError(
      `webhook-timestamp is ${Math.abs(ageS)} s in the ${
        ageS > 0 ? "past" : "future"
      }, over the ${toleranceS} s tolerance`,
    );
  }
  const body = typeof options.body === "string" ? new TextEncoder().encode(options.body) : options.body;
  const signed = concat(new TextEncoder().encode(`${id}.${timestamp}.`), body);
  const expected = await Promise.all(keys.map((key) => hmacSha256(key, signed)));
  const offered = signatures.split(" ").flatMap((part) => {
    const [version, value] = part.split(",", 2);
    const bytes = version === "v1" && value !== undefined ? fromBase64(value) : undefined;
    return bytes ? [bytes] : [];
  });
  // Every pair is compared in full, so the time taken says nothing about how close a forgery came.
  let matched = false;
  for (const signature of offered) {
    for (const mac of expected) matched = constantTimeEqual(signature, mac) || matched;
  }
  if (!matched) throw new WebhookVerificationError("webhook-signature matches none of the secrets");
  try {
    return JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(body)) as T;
  } catch (error) {
    throw new WebhookVerificationError("the webhook body is not UTF-8 JSON", { cause: error });
  }
}

/** One header's value, from either shape; a missing one cannot be verified. */
function header(headers: WebhookHeaders, name: string): string {
  let value: string | string[] | null | undefined;
  if (typeof (headers as Headers).get === "function") value = (headers as Headers).get(name);
  else {
    const plain = headers as { [name: string]: string | string[] | undefined };
    value = plain[name] ?? Object.entries(plain).find(([key]) => key.toLowerCase() === name)?.[1];
  }
  if (Array.isArray(value)) value = value.join(" ");
  if (value === null || value === undefined || value === "") {
    throw new WebhookVerificationError(`the ${name} header is missing`);
  }
  return value;
}

/** The key bytes of a `whsec_` secret. The error never quotes the secret. */
function secretBytes(secret: string): Uint8Array<ArrayBuffer> {
  const bytes = fromBase64(secret.startsWith(SECRET_PREFIX) ? secret.slice(SECRET_PREFIX.length) : secret);
  if (!bytes || bytes.length === 0) throw new TypeError("a webhook secret is whsec_ followed by base64");
  return bytes;
}

function fromBase64(text: string): Uint8Array<ArrayBuffer> | undefined {
  try {
    return Uint8Array.from(atob(text), (char) => char.charCodeAt(0));
  } catch {
    return undefined;
  }
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

async function hmacSha256(key: Uint8Array<ArrayBuffer>, data: Uint8Array<ArrayBuffer>): Promise<Uint8Array> {
  const imported = await crypto.subtle.importKey("raw", key, { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  return new Uint8Array(await crypto.subtle.sign("HMAC", imported, data));
}

/** Equal bytes, in time that depends only on the lengths. */
function constantTimeEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i]! ^ b[i]!;
  return diff === 0;
}
