import { sha1, toHex } from "../crypto/digest.ts";

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

/** RFC 9562 UUIDv5 (SHA-1, name-based) of `name` in `namespace`. */
export function uuidV5(name: string, namespace: string): string {
  const ns = uuidBytes(namespace);
  const text = new TextEncoder().encode(name);
  const input = new Uint8Array(ns.length + text.length);
  input.set(ns);
  input.set(text, ns.length);
  const bytes = sha1(input).slice(0, 16);
  bytes[6] = (bytes[6]! & 0x0f) | 0x50;
  bytes[8] = (bytes[8]! & 0x3f) | 0x80;
  const hex = toHex(bytes);
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** The job id of a scope: the same key from the same tenant always names the same job. */
export function jobIdFor(scope: Scope): string {
  return uuidV5(encodeScope(scope), JOB_ID_NAMESPACE);
}
