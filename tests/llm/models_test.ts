/**
 * The model-call seam: a run takes each attempt's deployment and permit from `Models.acquire`, and the worker's
 * read gate asks the same object. A `Models` of two deployments, written here from two single deployments and
 * nothing else, chooses per call: no change to the run job, the retry policy or the worker is needed for it.
 */
import assert from "node:assert/strict";
import type { Acquired, Capacity, Models } from "../../src/llm/models.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { createProviderFlow, type ProviderFlow, providerStateKey } from "../../src/provider/flow_control.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { enqueueRunToLane, enqueueToLane } from "../support/enqueue.ts";
import { errorBody, type FakeModelServer, startFakeModel } from "../support/fake_model_server.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

/** One deployment of the stub: its name, the models it serves (its default first), its flow and its calls. */
interface Deployment {
  name: string;
  serves: string[];
  flow: ProviderFlow;
  models: Models;
}

/**
 * Two (or more) deployments as one {@linkcode Models}: a call goes to the first deployment serving a model it
 * accepts (any, when it accepts any), skipping the one whose last call for the same job failed; the read gate
 * adds up their permits.
 */
function failoverModels(deployments: Deployment[]): Models & { chosen: string[] } {
  const failedFor = new Map<string, string>();
  const chosen: string[] = [];
  return {
    chosen,
    defaultModel: deployments[0]!.serves[0]!,
    async acquire(models, estimate, options = {}) {
      const serving = deployments.filter((d) => models.length === 0 || models.some((m) => d.serves.includes(m)));
      const failed = options.jobId === undefined ? undefined : failedFor.get(options.jobId);
      const deployment = serving.find((d) => d.name !== failed) ?? serving[0]!;
      chosen.push(deployment.name);
      const acquired: Acquired = await deployment.models.acquire(
        models.filter((m) => deployment.serves.includes(m)),
        estimate,
        options,
      );
      const { permit } = acquired;
      if (!permit || options.jobId === undefined) return acquired;
      const jobId = options.jobId;
      return {
        ...acquired,
        permit: {
          waitedMs: permit.waitedMs,
          settle(outcome) {
            if (outcome.error !== undefined) failedFor.set(jobId, deployment.name);
            else if (!outcome.aborted) failedFor.delete(jobId);
            return permit.settle(outcome);
          },
        },
      };
    },
    async capacity(averageTokens): Promise<Capacity> {
      const each = await Promise.all(deployments.map((d) => d.models.capacity!(averageTokens)));
      const permits = each.reduce((n, c) => n + c.permits, 0);
      return { permits, waitMs: permits > 0 ? 0 : Math.min(...each.map((c) => c.waitMs)) };
    },
  };
}

Deno.test("a Models of two deployments chooses per call: the retry of a 503 goes to the other, a task's model picks its deployment", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // Deployment a answers 503 to every call; deployment b answers.
  const serverA = startFakeModel(() => ({
    kind: "status",
    status: 503,
    body: errorBody("overloaded", "server_error"),
  }));
  const serverB = startFakeModel();
  const deployment = (name: string, server: FakeModelServer, serves: string[]): Deployment => {
    const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
      key: providerStateKey(r.prefix, { baseURL: server.url, model: serves[0]!, apiKey: `sk-${name}` }),
      cooldownMs: 30_000,
      probeLeaseMs: 5_000,
    });
    const llm = createOpenAiLlm({ apiKey: `sk-${name}`, model: serves[0]!, baseURL: server.url });
    return { name, serves, flow, models: createDeployment({ llm, flow, model: serves[0]!, name }) };
  };
  const a = deployment("a", serverA, ["model-a", "shared"]);
  const b = deployment("b", serverB, ["model-b", "shared"]);
  const models = failoverModels([a, b]);
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, models, keys }, { job: { maxAttempts: 3 } });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const attempts = async (jobId: string) => {
    await waitFor("the attempts recorded", async () => {
      const [row] = await db.sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM model_attempts WHERE job_id = ${jobId} AND outcome = 'ok'`;
      return row!.n === 1;
    });
    return await db.sql<{ attempt: number; deployment: string; model: string; outcome: string; status: number }[]>`
      SELECT attempt, deployment, model, outcome, status FROM model_attempts WHERE job_id = ${jobId} ORDER BY attempt`;
  };
  try {
    await t.step("a summary: its first attempt to a (503), its retry to b, committed once", async () => {
      const jobId = crypto.randomUUID();
      await enqueueToLane(r.redis, keys, {
        jobId,
        tenant: "acme",
        request: { text: "Revenue rose 12% in Q3. Costs fell.", notify: "ops@example.com" },
      });
      await waitFor("the summary", async () => (await db.sql`SELECT 1 FROM summaries WHERE job_id = ${jobId}`).length);
      assert.deepEqual(models.chosen, ["a", "b"]);
      assert.equal(serverA.requests, 1);
      assert.equal(serverB.requests, 1);
      // A call that accepts any model asks each deployment's own.
      assert.equal(serverA.bodies[0]!.model, "model-a");
      assert.equal(serverB.bodies[0]!.model, "model-b");
      const rows = await attempts(jobId);
      assert.deepEqual(rows.map((x) => ({ ...x })), [
        { attempt: 1, deployment: "a", model: "model-a", outcome: "retry", status: 503 },
        { attempt: 2, deployment: "b", model: "model-b", outcome: "ok", status: null },
      ]);
      const [effects] = await db.sql<{ s: number; o: number }[]>`
        SELECT (SELECT count(*) FROM summaries)::int AS s, (SELECT count(*) FROM outbox)::int AS o`;
      assert.deepEqual({ ...effects }, { s: 1, o: 1 });
      // Each permit was settled with its own deployment's flow: a's breaker counts the failure, b's nothing.
      assert.equal((await a.flow.status()).breaker.failures, 1);
      assert.equal((await b.flow.status()).breaker.failures, 0);
    });

    await t.step("a run of a task naming model-b goes to b alone, asks for model-b, and records it", async () => {
      const { task } = await putTaskVersion(db.sql, "acme", "classify", {
        prompt: "Classify: {{input.body}}",
        model: ["model-b"],
        input_schema: { type: "object", properties: { body: { type: "string" } }, required: ["body"] },
        max_output_tokens: 50,
      });
      const jobId = crypto.randomUUID();
      const before = { a: serverA.requests, b: serverB.requests, chosen: models.chosen.length };
      await enqueueRunToLane(r.redis, keys, {
        jobId,
        tenant: "acme",
        run: { task: "classify", version: task.version, input: { body: "The export button crashes." } },
      });
      const rows = await attempts(jobId);
      assert.deepEqual(rows.map((x) => ({ ...x })), [
        { attempt: 1, deployment: "b", model: "model-b", outcome: "ok", status: null },
      ]);
      assert.deepEqual(models.chosen.slice(before.chosen), ["b"]);
      assert.equal(serverA.requests, before.a, "no call to a");
      assert.equal(serverB.requests, before.b + 1);
      assert.equal(serverB.bodies.at(-1)!.model, "model-b");
      const [result] = await db.sql<{ model: string }[]>`SELECT model FROM run_results WHERE run_id = ${jobId}`;
      assert.equal(result?.model, "model-b");
    });
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await Promise.all([a.flow.settled(), b.flow.settled()]);
    await serverA.close();
    await serverB.close();
    await r.close();
    await db.close();
  }
});
