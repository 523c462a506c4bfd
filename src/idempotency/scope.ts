import { createHash } from "node:crypto";

/** What an Idempotency-Key is scoped to. */
export interface Scope {
  tenant: string;
  method: string;
  path: string;
  key: string;
}

/**
 * Encodes a scope unambiguously: a JSON array, so no tenant name or key can
 * contain a separator that makes two different scopes encode the same.
 * (Joining with ":" would let tenant "a:POST" reach tenant "a"'s keys.)
 */
export function encodeScope({ tenant, method, path, key }: Scope): string {
  return JSON.stringify([tenant, method.toUpperCase(), path, key]);
}

/** Namespace for job ids, fixed forever: changing it changes every job id. */
export const JOB_ID_NAMESPACE = "6f1c2b7e-4d0a-5c39-9a6e-2f4b8d1e0c57";

function uuidBytes(uuid: string): Uint8Array {
  const hex = uuid.replaceAll("-", "");
  if (!/^[0-9a-f]{32}$/i.test(hex)) throw new TypeError(`Not a UUID: "${uuid}"`);
  return Uint8Array.from(hex.match(/../g)!, (h) => parseInt(h, 16));
}

const namespaces = new Map<string, Uint8Array>();

/** RFC 9562 UUIDv5 (SHA-1, name-based) of `name` in `namespace`. */
export function uuidV5(name: string, namespace: string): string {
  let ns = namespaces.get(namespace);
  if (!ns) namespaces.set(namespace, ns = uuidBytes(namespace));
  // On the request path: hash the namespace bytes and the UTF-8 name without copying them together.
  const hex = createHash("sha1").update(ns).update(name, "utf8").digest("hex");
  // Version 5 in the high nibble of byte 6; the RFC variant (10xx) in the high bits of byte 8.
  const variant = ((parseInt(hex[16]!, 16) & 0x3) | 0x8).toString(16);
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-5${hex.slice(13, 16)}-${variant}${hex.slice(17, 20)}-${
    hex.slice(20, 32)
  }`;
}

/**
 * The job id of a scope and a body (its canonical JSON): the same key with
 * the same body from the same tenant always names the same job, and another
 * body never does.
 */
export function jobIdFor(scope: Scope, canonicalBody: string): string {
  return uuidV5(`${encodeScope(scope)}\n${canonicalBody}`, JOB_ID_NAMESPACE);
}

/**
 * The scope's digest, 128 bits of the SHA-1 of its encoding in base64url (22 characters): the field of its
 * idempotency record, which its tenant's lane already names. Short, so that a record costs a few dozen bytes
 * rather than the encoding's length (an Idempotency-Key may have 128 characters).
 */
export function scopeDigest(scope: Scope): string {
  return createHash("sha1").update(encodeScope(scope), "utf8").digest("base64url").slice(0, 22);
}
