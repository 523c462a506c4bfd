import assert from "node:assert/strict";
import { idempotencyKeyOf, parseSummaryRequest, SummaryRequest } from "../../src/runs/shapes.ts";
import { seededRandom } from "../_support.ts";
import { assertParsedAlike, NOTIFY_CASES, randomAddresses } from "./_notify_cases.ts";

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
  const out: unknown[] = [null, "text", 1, [], ["a"], {}, { text: "x" }, { notify: "ops@example.com" }];
  for (const text of [...texts, 1, null]) for (const notify of NOTIFY_CASES) out.push({ text, notify });
  out.push({ text: "x", notify: "ops@example.com", extra: true });
  out.push(JSON.parse('{"text":"x","notify":"ops@example.com","__proto__":{"a":1}}'));
  out.push(JSON.parse('{"__proto__":{"text":"x","notify":"ops@example.com"}}'));
  out.push(Object.assign(Object.create({ inherited: 1 }), { text: "x", notify: "ops@example.com" }));
  for (const notify of randomAddresses(random, 3_000)) {
    out.push({ text: "x", notify });
  }
  return out;
}

Deno.test("parseSummaryRequest answers every body exactly as the zod schema does", () => {
  for (const body of bodies()) {
    assertParsedAlike(body, parseSummaryRequest(body), SummaryRequest.safeParse(body));
  }
});

Deno.test("idempotencyKeyOf reads a bare key as is and unquotes a Structured Field string", () => {
  assert.equal(idempotencyKeyOf("order-2026-0001-x"), "order-2026-0001-x");
  assert.equal(idempotencyKeyOf('"order-2026-0001-x"'), "order-2026-0001-x");
  assert.equal(idempotencyKeyOf('"a\\"b\\\\c-0123456789"'), 'a"b\\c-0123456789');
  assert.equal(idempotencyKeyOf('"unterminated'), '"unterminated');
  assert.equal(idempotencyKeyOf('x"quoted"'), 'x"quoted"');
});
