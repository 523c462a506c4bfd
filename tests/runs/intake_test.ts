import assert from "node:assert/strict";
import { canonicalJson } from "../../src/idempotency/fingerprint.ts";
import { jobIdFor } from "../../src/idempotency/scope.ts";
import { runRecord, summaryRecord } from "../../src/runs/intake.ts";
import { randomUUID } from "node:crypto";

Deno.test("job ids do not change between releases: the same scope and body name the same job as before", () => {
  // Pinned: a retry after an upgrade must name the job its first attempt named.
  const scope = { tenant: "acme", method: "POST", path: "/v1/summaries", key: "order-2026-0001-x" };
  assert.equal(
    jobIdFor(scope, canonicalJson({ text: "Revenue rose. Costs fell.", notify: "ops@example.com" })),
    "3b99b9ce-7a16-5625-bb93-2f261947d271",
  );
  assert.equal(
    jobIdFor(
      { ...scope, tenant: "ténant", key: "k".repeat(128) },
      canonicalJson({ text: `é€ 漢字 \ud83d\ude00 ${"x".repeat(5000)}`, notify: { webhook: "https://h.example/x" } }),
    ),
    "000344c8-d60c-5e9f-9c55-c0a8f01bd334",
  );
});

Deno.test("a summary's stored record is written exactly as JSON.stringify writes {fp, status, body, headers}", () => {
  for (const path of ["/v1/summaries", '/odd "path"\\']) {
    const jobId = randomUUID();
    const expected = JSON.stringify({
      fp: jobId,
      status: 202,
      body: { job_id: jobId, status: "queued" },
      headers: { location: `${path}/${jobId}` },
    });
    assert.equal(summaryRecord(jobId, path), expected);
  }
});

Deno.test("a run's stored record is written exactly as JSON.stringify writes {fp, status, body, headers}", () => {
  const jobId = randomUUID();
  const expected = JSON.stringify({
    fp: jobId,
    status: 202,
    body: { run_id: jobId, status: "queued" },
    headers: { location: `/v1/runs/${jobId}` },
  });
  assert.equal(runRecord(jobId), expected);
});
