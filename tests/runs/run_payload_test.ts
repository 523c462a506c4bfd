import assert from "node:assert/strict";
import { runOfPayload, summaryForms, summaryPayload } from "../../src/runs/run_payload.ts";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import type { SummaryRequest } from "../../src/runs/shapes.ts";

Deno.test("a run's payload keeps its input as accepted, a key named __proto__ included", () => {
  const run = runOfPayload('{"task":"t","version":2,"input":{"__proto__":{"x":1},"a":2},"notify":"a@b.co"}');
  assert.ok(Object.hasOwn(run.input, "__proto__"));
  assert.equal(JSON.stringify(run.input), '{"__proto__":{"x":1},"a":2}');
  assert.deepEqual([run.task, run.version, run.summary, run.notify], ["t", 2, false, "a@b.co"]);
  // A summary job's payload reads as a run of summarize.
  const summary = runOfPayload('{"text":"Some text.","notify":{"webhook":"https://h.example/x"}}');
  assert.deepEqual(summary, {
    task: "summarize",
    version: 1,
    input: { text: "Some text." },
    notify: { webhook: "https://h.example/x" },
    summary: true,
  });
  assert.throws(() => runOfPayload('{"task":"t","version":1,"input":[1]}'));
});

Deno.test("summaryForms writes the payload and the canonical JSON exactly as summaryPayload and canonicalJson do", () => {
  const requests: SummaryRequest[] = [
    { text: "Revenue rose.", notify: "ops@example.com" },
    { text: 'quotes " and \\ and \n and \u2028 and é€ \ud83d\ude00', notify: "o'brien+x@mail.example.org" },
    { text: "x".repeat(10_000), notify: "a@b.co" },
    { text: "web", notify: { webhook: 'https://h.example/x?a=1&b="2"' } },
    // Not the parser's key order: the generic forms are used.
    { notify: "ops@example.com", text: "reordered" } as SummaryRequest,
  ];
  for (const request of requests) {
    for (const noCache of [false, true]) {
      assert.deepEqual(summaryForms(request, { noCache }), {
        payload: summaryPayload(request, { noCache }),
        canonical: canonicalJson(request),
      });
    }
  }
});
