import assert from "node:assert/strict";
import { ConfigError, parseConfig } from "../../src/config.ts";

Deno.test("parseConfig() gives the Batch API's defaults: 5000 runs, 300 s, online", () => {
  const c = parseConfig({});
  assert.deepEqual([c.BATCH_MAX_RUNS, c.BATCH_MAX_WAIT_S, c.BATCH_ON_EXPIRY], [5000, 300, "online"]);
});

Deno.test("parseConfig() reads BATCH_* and refuses an unknown BATCH_ON_EXPIRY, naming it", () => {
  const c = parseConfig({ BATCH_MAX_RUNS: "3", BATCH_MAX_WAIT_S: "2", BATCH_ON_EXPIRY: "fail" });
  assert.deepEqual([c.BATCH_MAX_RUNS, c.BATCH_MAX_WAIT_S, c.BATCH_ON_EXPIRY], [3, 2, "fail"]);
  assert.throws(() => parseConfig({ BATCH_ON_EXPIRY: "drop" }), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.match(e.message, /^Cannot start: BATCH_ON_EXPIRY must be online or fail \(got "drop"\)$/);
    return true;
  });
  assert.throws(() => parseConfig({ BATCH_MAX_RUNS: "0" }), /BATCH_MAX_RUNS/);
});
