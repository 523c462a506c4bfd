import assert from "node:assert/strict";
import { errorResponse, HttpError } from "../../src/http/problem.ts";
import { createLogger } from "../../src/log/logger.ts";
import { recordingLogger } from "../_support.ts";

Deno.test("client errors are logged at info, and a repeated identical one is folded, not repeated", async () => {
  const rec = recordingLogger();
  const log = createLogger(rec);
  const fields = { method: "POST", path: "/v1/summaries" };
  for (let i = 0; i < 500; i++) {
    await errorResponse(new HttpError(400, "Idempotency-Key header is required"), log, fields).body?.cancel();
  }
  await errorResponse(new HttpError(422, "The request body failed validation"), log, fields).body?.cancel();
  const refused = rec.lines.filter((l) => l.event === "request_refused");
  assert.deepEqual(refused.map((l) => [l.level, l.status]), [["info", 400], ["info", 422]]);
  assert.equal(refused[0]!.detail, "Idempotency-Key header is required");
  // A server error is always logged, at error level.
  await errorResponse(new Error("boom"), log, fields).body?.cancel();
  assert.equal(rec.lines.at(-1)!.level, "error");
});

Deno.test("a refusal's log line and its folding key are bounded, whatever the client sent", async () => {
  const rec = recordingLogger();
  const log = createLogger(rec);
  for (let i = 0; i < 1_500; i++) {
    const huge = `${i}-${"k".repeat(100_000)}`;
    await errorResponse(new HttpError(400, `Request body has the key "${huge}" twice`), log, {
      method: "GET",
      path: `/v1/summaries/${huge}`,
    }).body?.cancel();
  }
  const longest = Math.max(...rec.lines.map((l) => JSON.stringify(l).length));
  assert.ok(longest < 1_000, `a log line of ${longest} characters`);
});
