import assert from "node:assert/strict";
import type { z } from "zod";

/** `notify` values near every edge of its schema, for the fast checks that must answer each as zod does. */
const ADDRESSES = [
  "ops@example.com",
  "a@b.co",
  "a@b.c",
  ".a@b.co",
  "a..b@c.co",
  "a.@b.co",
  "o'brien+tag@mail.example.org",
  "a@-b.co",
  "a@b-.co",
  "no-at.example.com",
  "two@@example.com",
  "sp ace@example.com",
  "ü@example.com",
  "a@example.com\u0000",
  `${"a".repeat(300)}@example.com`,
  `${"a".repeat(320 - "@example.com".length)}@example.com`,
  `${"a".repeat(321 - "@example.com".length)}@example.com`,
  "ops@EXAMPLE.COM",
  "",
];
export const NOTIFY_CASES: unknown[] = [
  ...ADDRESSES,
  { webhook: "https://hooks.example.com/x" },
  { webhook: "not a url" },
  { webhook: "https://x.example", extra: 1 },
  null,
  42,
  ["ops@example.com"],
];

/**
 * `n` addresses of three shapes each (`s`, `s@example.com`, `a@s.co`) from the characters zod's email pattern
 * cares about, drawn with `random`.
 */
export function randomAddresses(random: () => number, n: number): string[] {
  const alphabet = "ab.-_+'@1Z ";
  const out: string[] = [];
  for (let i = 0; i < n; i++) {
    const length = 1 + Math.floor(random() * 14);
    let s = "";
    for (let j = 0; j < length; j++) s += alphabet[Math.floor(random() * alphabet.length)];
    out.push(s, `${s}@example.com`, `a@${s}.co`);
  }
  return out;
}

/** Asserts that a fast check answered `body` as zod did: the same verdict, data (and key order), or issues. */
export function assertParsedAlike<T extends object>(
  body: unknown,
  fast: z.ZodSafeParseResult<T>,
  zod: z.ZodSafeParseResult<T>,
): void {
  const label = JSON.stringify(body)?.slice(0, 120);
  assert.equal(fast.success, zod.success, label);
  if (fast.success && zod.success) {
    assert.deepEqual(fast.data, zod.data, label);
    assert.deepEqual(Object.keys(fast.data), Object.keys(zod.data), `${label}: same key order`);
  } else {
    assert.deepEqual(fast.error!.issues, zod.error!.issues, label);
  }
}
