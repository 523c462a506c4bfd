/**
 * Batch runs through the worker process's own code path (`startWorker`, issue 43): LLM_DEPLOYMENTS with a
 * deployment marked `"batch": true`, parsed as a process parses its environment; runs with priority `batch`
 * queued as intake queues them; the fake provider's Files and Batches endpoints through the real `openai` SDK;
 * real Postgres and a Redis of the test's own (the process's keys are under the service's fixed prefix).
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { parseConfig } from "../../src/config.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createRegistry } from "../../src/metrics/metrics.ts";
import { startWorker } from "../../src/processes/worker_process.ts";
import { putTaskVersion } from "../../src/jobs/task_store.ts";
import { usageReport } from "../../src/cli/usage_command.ts";
import { KEY_PREFIX, serviceKeys } from "../../src/runs/keys.ts";
import type { BatchScript } from "../support/fake_batch_api.ts";
import { type FakeModelServer, startFakeModel } from "../support/fake_model_server.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { enqueueRunToLane } from "../support/enqueue.ts";
import { type PrivateRedis, startPrivateRedis } from "../support/private_redis.ts";
import { createTestDatabase, type TestDatabase, waitFor } from "../_support.ts";

const MODEL = "gpt-test";

/** A worker process with a batch deployment `east` serving {@linkcode MODEL}, each batch going as `script` says. */
async function batchProcess(
  { script = () => ({}), env = {}, respond }: {
    script?: (n: number) => BatchScript;
    env?: Record<string, string>;
    respond?: Parameters<typeof startFakeModel>[0];
  } = {},
) {
  const db: TestDatabase = await createTestDatabase();
  const redis: PrivateRedis = await startPrivateRedis();
  const server: FakeModelServer = startFakeModel(respond, { batches: script });
  const config = parseConfig(deploymentsEnv([
    deployment("east", { base_url: server.url, models: [MODEL], batch: true }),
  ], { OPENAI_MODEL: MODEL, BATCH_MAX_RUNS: "20", BATCH_MAX_WAIT_S: "60", ...env }));
  const stop = new AbortController();
  const running = startWorker(
    { config, redis: redis.redis, sql: db.sql, log: silentLogger, registry: createRegistry() },
    stop.signal,
    { batchTimings: { intervalMs: 50, pollMs: 100 } },
  );
  const keys = serviceKeys(KEY_PREFIX);
  return {
    db,
    sql: db.sql,
    redis,
    server,
    keys,
    /**
     * Queues `n` batch runs of tenant acme, as intake does (on the lane's low stream), of the built-in summarize
     * task or of a task version stored before. @returns their ids.
     */
    async enqueue(n: number, task = { name: "summarize", version: 1 }): Promise<string[]> {
      const ids: string[] = [];
      for (let i = 0; i < n; i++) {
        const jobId = crypto.randomUUID();
        ids.push(jobId);
        const text = `Document ${i}. Revenue rose. Costs fell. The outlook is fine.`;
        await enqueueRunToLane(redis.redis, keys, {
          jobId,
          tenant: "acme",
          run: {
            task: task.name,
            version: task.version,
            input: task.name === "summarize" ? { text } : { ticket: text },
            notify: `ops+${i}@example.com`,
            priority: "batch",
          },
        }, { priority: "low" });
      }
      return ids;
    },
    async close() {
      stop.abort();
      await running;
      await server.close();
      await redis.stop();
      await db.close();
    },
  };
}

/** Each run's outcomes, notifications and batch usage rows, counted. */
async function effects(sql: Sql, ids: string[]) {
  const [row] = await sql<{ done: number; outcomes: number; outbox: number; runs_notified: number; usage: number }[]>`
    SELECT
      (SELECT count(*) FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[]) AND outcome = 'done')::int AS done,
      (SELECT count(*) FROM job_outcomes WHERE job_id = ANY(${ids}::uuid[]))::int AS outcomes,
      (SELECT count(*) FROM outbox WHERE payload->>'job_id' = ANY(${ids}::text[]))::int AS outbox,
      (SELECT count(DISTINCT payload->>'job_id') FROM outbox WHERE payload->>'job_id' = ANY(${ids}::text[]))::int
        AS runs_notified,
      (SELECT count(*) FROM model_attempts WHERE job_id = ANY(${ids}::uuid[]) AND batch_id IS NOT NULL)::int AS usage`;
  return row!;
}

Deno.test("the worker process sends 20 batch runs through one provider batch: each done once, one notification each", async () => {
  const p = await batchProcess();
  try {
    const ids = await p.enqueue(20);
    await waitFor("20 runs done", async () => (await effects(p.sql, ids)).outcomes === 20, 20_000);
    // The poller marks the batch committed after its last line.
    await waitFor("the batch committed", async () => {
      const [b] = await p.sql<{ state: string }[]>`SELECT state FROM batches`;
      return b?.state === "committed";
    }, 5_000);
    const e = await effects(p.sql, ids);
    assert.deepEqual(e, { done: 20, outcomes: 20, outbox: 20, runs_notified: 20, usage: 20 });
    const batches = await p.sql<{ runs: number; state: string }[]>`SELECT runs, state FROM batches`;
    assert.deepEqual(batches.map((b) => [b.runs, b.state]), [[20, "committed"]]);
    assert.equal(p.server.batches.counts.creates, 1, "one provider batch");
    assert.equal(p.server.batches.linesSent, 20, "each line sent once");
    assert.equal(p.server.requests, 0, "no online call");
    // `deno task usage` and GET /v1/usage count them as calls, all of them batch calls.
    const usage = await usageReport(p.sql, { tenant: "acme", sinceS: 3600 });
    assert.deepEqual(usage.map((u) => [u.task, u.calls, u.batch_calls]), [["summarize", 20, 20]]);
  } finally {
    await p.close();
  }
});

Deno.test("the worker process runs a batch's transient error lines online, once each, and commits the rest", async () => {
  const p = await batchProcess({
    script: () => ({ line: (_id, _body, i) => i % 5 === 0 ? { kind: "error", status: 500 } : { kind: "ok" } }),
  });
  try {
    const ids = await p.enqueue(20);
    await waitFor("20 runs done", async () => (await effects(p.sql, ids)).done === 20, 20_000);
    const e = await effects(p.sql, ids);
    assert.equal(e.outcomes, 20);
    assert.equal(e.outbox, 20, "one notification each");
    assert.equal(e.runs_notified, 20);
    const settled = await p.sql<{ settled: string; n: number }[]>`
      SELECT settled, count(*)::int AS n FROM batch_runs GROUP BY settled ORDER BY settled`;
    assert.deepEqual(settled.map((s) => [s.settled, s.n]), [["committed", 16], ["online", 4]]);
    assert.equal(p.server.requests, 4, "the four transient lines, online once each");
    assert.equal(p.server.batches.counts.creates, 1, "not batched again");
  } finally {
    await p.close();
  }
});

Deno.test("structured batch runs: answers checked by the worker, a bad one repaired online once, none called again", async () => {
  const answers = new Map<number, string>([[0, "not JSON at all"], [1, JSON.stringify({ label: 42 })]]);
  const p = await batchProcess({
    script: () => ({ line: (_id, _body, i) => ({ kind: "ok", content: answers.get(i) ?? '{"label":"billing"}' }) }),
    // The repair call, online: a valid answer.
    respond: () => ({ kind: "ok", content: '{"label":"repaired"}' }),
    env: { BATCH_MAX_RUNS: "10" },
  });
  try {
    const { task } = await putTaskVersion(p.sql, "acme", "triage", {
      prompt: "Label this ticket: {{input.ticket}}",
      input_schema: { type: "object", properties: { ticket: { type: "string" } }, required: ["ticket"] },
      output_schema: {
        type: "object",
        properties: { label: { type: "string" } },
        required: ["label"],
        additionalProperties: false,
      },
    });
    const ids = await p.enqueue(10, { name: "triage", version: task.version });
    await waitFor("10 runs done", async () => (await effects(p.sql, ids)).done === 10, 20_000);
    const e = await effects(p.sql, ids);
    assert.deepEqual(e, { done: 10, outcomes: 10, outbox: 10, runs_notified: 10, usage: 10 });
    assert.equal(p.server.batches.counts.creates, 1, "one provider batch");
    const lines = await p.sql<{ format: string | null }[]>`SELECT request->'response_format'->>'type' AS format
      FROM batch_runs`;
    assert.deepEqual(lines.map((l) => l.format), Array(10).fill("json_schema"), "each line asks for the schema");
    // The two bad answers got one repair call each; the eight good ones no call at all.
    assert.equal(p.server.requests, 2, "two online calls: the repairs");
    assert.ok(p.server.prompts.every((prompt) => prompt.startsWith("That answer")), "both are repair calls");
    const outputs = await p.sql<{ output: unknown }[]>`
      SELECT output FROM run_results WHERE run_id = ANY(${ids}::uuid[]) ORDER BY output->>'label'`;
    assert.deepEqual(outputs.map((o) => o.output), [
      ...Array(8).fill({ label: "billing" }),
      { label: "repaired" },
      { label: "repaired" },
    ]);
    const settled = await p.sql<{ settled: string; n: number }[]>`
      SELECT settled, count(*)::int AS n FROM batch_runs GROUP BY settled`;
    assert.deepEqual(settled.map((r) => [r.settled, r.n]), [["online", 10]], "every answer went to a worker to check");
  } finally {
    await p.close();
  }
});
