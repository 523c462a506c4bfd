/**
 * What operators and clients see of batch runs (issue 43): `deno task batches list [--json]`, and
 * `waiting_for: "batch"` on `GET /v1/runs/{id}` for a run recorded in a batch not yet committed.
 */
import assert from "node:assert/strict";
import { batchOfRun } from "../../src/batches/batch_store.ts";
import { batchesCommand } from "../../src/cli/batches_command.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestRedis } from "../_support.ts";
import { batchPayload, batchWorld, DEPLOYMENT, MODEL } from "./_fixture.ts";

Deno.test("batches list shows each batch with its deployment, runs, state and age; --json a line each", async () => {
  const world = await batchWorld({ maxRuns: 3 });
  try {
    const lines: string[] = [];
    const io = { out: (l: string) => lines.push(l), err: (l: string) => lines.push(`ERR ${l}`) };
    assert.equal(await batchesCommand(world.sql, ["list"], io), 0);
    assert.deepEqual(lines, ["No batches in flight or committed in the last 24 h."]);
    await world.recordRuns(4);
    lines.length = 0;
    assert.equal(await batchesCommand(world.sql, ["list", "--json"], io), 0);
    const rows = lines.map((l) => JSON.parse(l));
    assert.deepEqual(rows.map((r) => [r.deployment, r.model, r.runs, r.state]), [
      [DEPLOYMENT, MODEL, 1, "open"],
      [DEPLOYMENT, MODEL, 3, "closed"],
    ]);
    assert.ok(rows.every((r) => typeof r.age_s === "number" && r.age_s >= 0));
    lines.length = 0;
    assert.equal(await batchesCommand(world.sql, ["list"], io), 0);
    assert.match(lines[0]!, /^id +deployment +model +runs +state/);
    assert.equal(lines.length, 3);
    lines.length = 0;
    assert.equal(await batchesCommand(world.sql, ["show"], io), 2);
    assert.match(lines[0]!, /^ERR Usage: deno task batches list/);
  } finally {
    await world.close();
  }
});

Deno.test("GET /v1/runs/{id} says waiting_for batch while the run is in a batch not yet committed", async () => {
  const world = await batchWorld();
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const handler = apiHandler({ redis: r.redis, sql: world.sql, keys }, {
      authMode: "api-key",
      batchOf: (runId) => batchOfRun(world.sql, runId),
    });
    const apiKey = await createApiKey(world.sql, "acme");
    const call = (method: string, path: string, body?: unknown) =>
      handler(
        new Request(`http://api.test${path}`, {
          method,
          headers: {
            authorization: `Bearer ${apiKey}`,
            "content-type": "application/json",
            ...(method === "POST" ? { "idempotency-key": crypto.randomUUID() } : {}),
          },
          body: body === undefined ? undefined : JSON.stringify(body),
        }),
      );
    const posted = await call("POST", "/v1/tasks/summarize/runs", {
      input: { text: "Revenue rose. Costs fell." },
      priority: "batch",
    });
    assert.equal(posted.status, 202);
    const { run_id } = await posted.json();
    const get = async () => await (await call("GET", `/v1/runs/${run_id}`)).json();
    assert.equal((await get()).waiting_for, undefined, "queued, not in a batch yet");
    // A worker records it into the open batch.
    await world.intake.record({
      runId: run_id,
      tenant: "acme",
      payload: batchPayload("Revenue rose. Costs fell."),
      call: { prompt: "Summarise", models: [], options: {} },
      target: { deployment: DEPLOYMENT, model: MODEL },
    });
    const doc = await get();
    assert.equal(doc.status, "queued");
    assert.equal(doc.waiting_for, "batch");
    // Its line settled (sent online, here): no longer waiting for the batch.
    await world.sql`UPDATE batch_runs SET settled = 'online' WHERE run_id = ${run_id}::uuid`;
    assert.equal((await get()).waiting_for, undefined);
  } finally {
    await r.close();
    await world.close();
  }
});
