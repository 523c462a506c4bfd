import assert from "node:assert/strict";
import { createBatcher } from "../../src/async/batcher.ts";

Deno.test("createBatcher() flushes the first call at once and coalesces calls made meanwhile", async () => {
  const flushes: number[][] = [];
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const double = createBatcher<number, number>(async (items) => {
    flushes.push(items);
    if (flushes.length === 1) await gate;
    return items.map((i) => i * 2);
  });
  const first = double(1);
  const rest = [2, 3, 4].map(double);
  await Promise.resolve();
  assert.deepEqual(flushes, [[1]], "the first call did not wait");
  release();
  assert.deepEqual(await Promise.all([first, ...rest]), [2, 4, 6, 8]);
  assert.deepEqual(flushes, [[1], [2, 3, 4]]);
});

Deno.test("createBatcher() rejects every call of a failed flush, and keeps going", async () => {
  let fail = true;
  const call = createBatcher<number, number>((items) => {
    if (fail) return Promise.reject(new Error("down"));
    return Promise.resolve(items);
  });
  await assert.rejects(() => call(1), /down/);
  fail = false;
  assert.equal(await call(2), 2);
});
