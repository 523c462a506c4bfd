/**
 * Standard Webhooks signatures (https://www.standardwebhooks.com/): the
 * receiver recomputes an HMAC-SHA256 over `id.timestamp.body` with the shared
 * secret, so it knows who sent the message and that nobody changed or
 * replayed it. Secrets are `whsec_` + base64 of the key bytes.
 */

const SECRET_PREFIX = "whsec_";
const SECRET_BYTES = 24;

function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}

/** The key bytes of a `whsec_` secret. The error never quotes the secret. */
function secretKey(secret: string): Uint8Array<ArrayBuffer> {
  const encoded = secret.startsWith(SECRET_PREFIX) ? secret.slice(SECRET_PREFIX.length) : secret;
  let binary: string;
  try {
    binary = atob(encoded);
  } catch {
    throw new TypeError("webhook secret is not valid base64 after its whsec_ prefix");
  }
  if (binary.length === 0) throw new TypeError("webhook secret is empty");
  return Uint8Array.from(binary, (char) => char.charCodeAt(0));
}

/** A new signing secret: `whsec_` + base64 of 24 random bytes. */
export function newWebhookSecret(): string {
  return SECRET_PREFIX + toBase64(crypto.getRandomValues(new Uint8Array(SECRET_BYTES)));
}

/** What {@linkcode signWebhook} signs. */
export interface WebhookToSign {
  /** The message id, the same on every retry (receivers dedupe on it). */
  id: string;
  /** Unix seconds, as sent in `webhook-timestamp`. */
  timestamp: number;
  /** The exact bytes sent, as text: a receiver verifies the raw body, not a re-serialisation. */
  body: string;
  /** Every active secret: during a rotation the receiver may hold either one. */
  secrets: string[];
}

/**
 * The `webhook-signature` header value: `v1,<base64 HMAC-SHA256>` per secret,
 * space-separated.
 * @throws {TypeError} for no secrets, a malformed secret, or a non-integer timestamp.
 */
export async function signWebhook({ id, timestamp, body, secrets }: WebhookToSign): Promise<string> {
  if (secrets.length === 0) throw new TypeError("cannot sign a webhook without a secret");
  if (!Number.isSafeInteger(timestamp)) {
    throw new TypeError(`webhook timestamp must be whole seconds (got ${timestamp})`);
  }
  const message = new TextEncoder().encode(`${id}.${timestamp}.${body}`);
  const signatures = await Promise.all(secrets.map(async (secret) => {
    const key = await crypto.subtle.importKey("raw", secretKey(secret), { name: "HMAC", hash: "SHA-256" }, false, [
      "sign",
    ]);
    return `v1,${toBase64(new Uint8Array(await crypto.subtle.sign("HMAC", key, message)))}`;
  }));
  return signatures.join(" ");
}
