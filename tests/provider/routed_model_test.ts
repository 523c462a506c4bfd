/**
 * A call that names no model (a summary, a task without `model`) goes out as the model the router gave it, the
 * default one, and not as the first model its deployment lists. Before, the router (`src/provider/deployments.ts`)
 * handed out the deployment's client as it was, and `run_call.ts` leaves the model out of such a call, so the client
 * asked for its own first model: with a deployment listing `["backup", "primary"]` and `primary` the default, every
 * summary sent there was answered by `backup` while its permit, price and record said `primary`.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../../src/config.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { buildFlows, buildModels } from "../../src/processes/_model.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("a summary asks its deployment for the default model, not the deployment's first model", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const server = startFakeModel();
  const config = parseConfig(deploymentsEnv([
    deployment("mix", { base_url: server.url, models: ["backup", "primary"] }),
  ], { OPENAI_MODEL: "primary" }));
  const flows = buildFlows(config, r.redis, silentLogger);
  const models = buildModels(config, { flows, log: silentLogger });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, models, keys });
  try {
    assert.equal(models.defaultModel, "primary");
    const jobId = crypto.randomUUID();
    await enqueueToLane(r.redis, keys, {
      jobId,
      tenant: "acme",
      request: { text: "Revenue rose. Costs fell.", notify: "ops@example.com" },
    });
    await worker.runOnce(0);
    await worker.drain();
    await waitFor("the attempt recorded", async () => {
      const rows = await db.sql`SELECT 1 FROM model_attempts WHERE job_id = ${jobId} AND outcome = 'ok'`;
      return rows.length === 1;
    });
    assert.deepEqual(server.bodies.map((b) => b.model), ["primary"], "the request names the routed model");
    const [row] = await db.sql<{ model: string; deployment: string }[]>`
      SELECT model, deployment FROM model_attempts WHERE job_id = ${jobId}`;
    assert.deepEqual({ ...row }, { model: "primary", deployment: "mix" });
  } finally {
    await worker.close();
    await Promise.all(flows.map((f) => f.flow.withdraw()));
    await server.close();
    await r.close();
    await db.close();
  }
});
