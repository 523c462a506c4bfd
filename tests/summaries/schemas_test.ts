import assert from "node:assert/strict";
import { idempotencyKeyOf, parseSummaryRequest, SummaryRequest } from "../../src/summaries/schemas.ts";
import { seededRandom } from "../_support.ts";

/** Bodies near every edge of the schema: the fast check and zod must answer each alike. */
function bodies(): unknown[] {
  const random = seededRandom(26);
  const texts = [
    "",
    "x",
    "Revenue rose.",
    "x".repeat(200_000),
    "x".repeat(200_001),
    "nul\u0000inside",
    "lone \ud800 surrogate",
    "pair \ud83d\ude00 ok",
    "é€ 漢字",
  ];
  const addresses = [
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
  const notifies: unknown[] = [
    ...addresses,
    { webhook: "https://hooks.example.com/x" },
    { webhook: "not a url" },
    { webhook: "https://x.example", extra: 1 },
    null,
    42,
    ["ops@example.com"],
  ];
  const out: unknown[] = [null, "text", 1, [], ["a"], {}, { text: "x" }, { notify: "ops@example.com" }];
  for (const text of [...texts, 1, null]) for (const notify of notifies) out.push({ text, notify });
  out.push({ text: "x", notify: "ops@example.com", extra: true });
  out.push(JSON.parse('{"text":"x","notify":"ops@example.com","__proto__":{"a":1}}'));
  out.push(JSON.parse('{"__proto__":{"text":"x","notify":"ops@example.com"}}'));
  out.push(Object.assign(Object.create({ inherited: 1 }), { text: "x", notify: "ops@example.com" }));
  // Random addresses from the characters the pattern cares about.
  const alphabet = "ab.-_+'@1Z ";
  for (let i = 0; i < 3_000; i++) {
    const n = 1 + Math.floor(random() * 14);
    let s = "";
    for (let j = 0; j < n; j++) s += alphabet[Math.floor(random() * alphabet.length)];
    out.push({ text: "x", notify: s }, { text: "x", notify: `${s}@example.com` }, { text: "x", notify: `a@${s}.co` });
  }
  return out;
}

Deno.test("parseSummaryRequest answers every body exactly as the zod schema does", () => {
  for (const body of bodies()) {
    const fast = parseSummaryRequest(body);
    const zod = SummaryRequest.safeParse(body);
    const label = JSON.stringify(body)?.slice(0, 120);
    assert.equal(fast.success, zod.success, label);
    if (fast.success && zod.success) {
      assert.deepEqual(fast.data, zod.data, label);
      assert.deepEqual(Object.keys(fast.data), Object.keys(zod.data), `${label}: same key order`);
    } else {
      assert.deepEqual(fast.error!.issues, zod.error!.issues, label);
    }
  }
});

Deno.test("idempotencyKeyOf reads a bare key as is and unquotes a Structured Field string", () => {
  assert.equal(idempotencyKeyOf("order-2026-0001-x"), "order-2026-0001-x");
  assert.equal(idempotencyKeyOf('"order-2026-0001-x"'), "order-2026-0001-x");
  assert.equal(idempotencyKeyOf('"a\\"b\\\\c-0123456789"'), 'a"b\\c-0123456789');
  assert.equal(idempotencyKeyOf('"unterminated'), '"unterminated');
  assert.equal(idempotencyKeyOf('x"quoted"'), 'x"quoted"');
});
