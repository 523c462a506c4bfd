import assert from "node:assert/strict";
import { createDeadlineQueue } from "../../src/async/deadline_queue.ts";
import { waitFor } from "../_support.ts";

Deno.test("deadlines of one queue pass in order, each once, except those cleared", async () => {
  const queue = createDeadlineQueue(40);
  const passed: string[] = [];
  const a = queue.set(() => passed.push("a"));
  const b = queue.set(() => passed.push("b"));
  await new Promise((r) => setTimeout(r, 10));
  queue.set(() => passed.push("c"));
  queue.clear(b);
  assert.equal(queue.size, 2);
  await waitFor("a and c", () => passed.length === 2, 2_000);
  assert.deepEqual(passed, ["a", "c"]);
  assert.equal(queue.size, 0);
  // Clearing one that passed, or clearing twice, changes nothing.
  queue.clear(a);
  queue.clear(b);
  assert.equal(queue.size, 0);
});

Deno.test("a cleared oldest deadline does not delay the next one, nor make it pass early", async () => {
  const queue = createDeadlineQueue(60);
  const first = queue.set(() => assert.fail("cleared"));
  await new Promise((r) => setTimeout(r, 30));
  const setAt = performance.now();
  let passedAt = 0;
  queue.set(() => passedAt = performance.now());
  queue.clear(first);
  await waitFor("the second deadline", () => passedAt > 0, 2_000);
  assert.ok(passedAt - setAt >= 59, `passed ${(passedAt - setAt).toFixed(1)} ms after it was set`);
  assert.ok(passedAt - setAt < 1_000);
});

Deno.test("the queue's timer never keeps a process alive: a script whose deadlines are set exits at once", async () => {
  const module = new URL("../../src/async/deadline_queue.ts", import.meta.url).href;
  const started = performance.now();
  const out = await new Deno.Command(Deno.execPath(), {
    args: [
      "eval",
      `import { createDeadlineQueue } from "${module}";
      const q = createDeadlineQueue(30_000); q.set(() => {}); q.clear(q.set(() => {}));`,
    ],
  }).output();
  assert.equal(out.code, 0);
  assert.ok(performance.now() - started < 20_000, "it did not wait for the 30 s deadline");
});
