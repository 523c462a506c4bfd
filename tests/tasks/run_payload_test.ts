import assert from "node:assert/strict";
import { runOfPayload } from "../../src/tasks/run_payload.ts";

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
