import assert from "node:assert/strict";
import { createLogger } from "../../src/log/logger.ts";

Deno.test("the logger writes one JSON object per line with level, event and fields, above LOG_LEVEL only", () => {
  const lines: string[] = [];
  const log = createLogger({ level: "info", write: (l) => lines.push(l), now: () => new Date(0) })
    .child({ job_id: "j1", tenant: "acme" });
  log.debug("hidden");
  log.info("job_done", { msg_id: "1-0", attempt: 2 });
  log.error("boom", { error: new TypeError("bad value") });
  assert.equal(lines.length, 2);
  assert.deepEqual(JSON.parse(lines[0]!), {
    ts: "1970-01-01T00:00:00.000Z",
    level: "info",
    event: "job_done",
    job_id: "j1",
    tenant: "acme",
    msg_id: "1-0",
    attempt: 2,
  });
  const error = JSON.parse(lines[1]!);
  assert.deepEqual(error.error, { name: "TypeError", message: "bad value" }, "errors are logged without stacks");
  assert.ok(lines.every((l) => !l.includes("\n")));
});
