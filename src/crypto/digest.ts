import { createHash } from "node:crypto";

/** Lowercase hex of bytes. */
export function toHex(bytes: Uint8Array): string {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// node:crypto hashes synchronously: on the request path that is several times
// cheaper than crypto.subtle's async dispatch for inputs this small.

/** SHA-256 of a UTF-8 string or bytes. */
export function sha256(data: string | Uint8Array): Uint8Array {
  return new Uint8Array(createHash("sha256").update(data).digest());
}

/** SHA-256 of a UTF-8 string or bytes, as lowercase hex. */
export function sha256Hex(data: string | Uint8Array): string {
  return createHash("sha256").update(data).digest("hex");
}
