/**
 * Nothing accepted is stranded: each narrow window of the chain, the ones a
 * random kill rarely hits, gets a seam that stops the process exactly there.
 * Intake between its script and the announce; a worker between its commit
 * and its ack on the last allowed delivery; a dead letter while another
 * delivery still runs; the pruner between its look and its delete; a re-POST
 * after the key's record expired. (Run on one Redis and, by
 * `deno task test:cluster`, on a Redis Cluster.)
 */
import assert from "node:assert/strict";
import { OUTCOME_MIN_AGE_MS } from "../../src/processes/relay_process.ts";
import { dlqCommand } from "../../src/cli/dlq_command.ts";
import type { LLM } from "../../src/llm/llm.ts";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { DEAD_LETTER_BOUNDS, deadLetter, listDeadLetters } from "../../src/queue/dead_letter.ts";
import { createStreamWorker, ensureGroup } from "../../src/queue/stream_worker.ts";
import { staticLanes } from "../../src/queue/static_lanes.ts";
import { PermanentJobError } from "../../src/queue/errors.ts";
import { createRetention } from "../../src/retention/retention.ts";
import { SUMMARIES } from "../../src/summaries/api.ts";
import { failJob } from "../../src/jobs/job_store.ts";
import { commitResults, createGroupCommitter } from "../../src/runs/commit.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { markFailedHook } from "../../src/runs/job_status.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { JobFailedElsewhere } from "../../src/runs/run_decided.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TEXT = "Revenue rose 12% in Q3. Costs fell. The board approved the plan. Staff were told on Friday.";
const DAY_MS = 24 * 3600 * 1000;

Deno.test("nothing accepted is stranded", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  let n = 0;
  const newKey = () => `stranded-key-${String(++n).padStart(8, "0")}`;
  /** An API whose intake runs `afterScript` between its script and the announce. */
  const api = (afterScript?: () => Promise<void>) =>
    apiHandler({ redis: r.redis, sql: db.sql, keys }, {
      authMode: "api-key",
      intake: createIntake({ redis: r.redis, faults: { afterScript } }, {
        keys,
        resultTtlS: 86_400,
        path: SUMMARIES,
      }),
    });
  const post = (handler: (req: Request) => Promise<Response>, apiKey: string, key: string, text = TEXT) =>
    handler(
      new Request("http://api/v1/summaries", {
        method: "POST",
        headers: { authorization: `Bearer ${apiKey}`, "content-type": "application/json", "idempotency-key": key },
        body: JSON.stringify({ text, notify: "ops@example.com" }),
      }),
    );
  const request = (method: string, apiKey: string, jobId: string) =>
    api()(new Request(`http://api/v1/summaries/${jobId}`, { method, headers: { authorization: `Bearer ${apiKey}` } }));
  const summariesOf = async (tenant: string) =>
    (await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM summaries WHERE tenant = ${tenant}`)[0]!.n;
  const effects = async (jobId: string) => {
    const [row] = await db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries WHERE job_id = ${jobId}::uuid)::int AS s,
        (SELECT count(*) FROM outbox WHERE payload->>'job_id' = ${jobId})::int AS o`;
    return [row!.s, row!.o];
  };
  /** A running summary worker; `stop` ends it. */
  const startWorker = (options: { laneSweepMs?: number; claimIdleMs?: number; maxDeliveries?: number } = {}) => {
    const stop = new AbortController();
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: createExtractiveLlm(), keys }, {
      consumer: `w-${crypto.randomUUID().slice(0, 8)}`,
      claimIdleMs: options.claimIdleMs ?? 60_000,
      maxDeliveries: options.maxDeliveries ?? 5,
      laneSweepMs: options.laneSweepMs ?? 60_000,
    });
    const running = worker.run(stop.signal);
    return {
      async stop() {
        stop.abort();
        await running;
        await worker.close();
      },
    };
  };
  const crash = () => Promise.reject(new Error("the API process died here"));

  try {
    await t.step(
      "intake dies between its script and the announce for a brand-new tenant: the job is done, with no further POST",
      async () => {
        const sweepMs = 500;
        const worker = startWorker({ laneSweepMs: sweepMs });
        try {
          const apiKey = await createApiKey(db.sql, "newcomer-1");
          const res = await post(api(crash), apiKey, newKey());
          assert.equal(res.status, 500, "the client never got its 202");
          await res.body?.cancel();
          // CLAIM_IDLE_MS plays no part (nothing was delivered yet): the sweep interval, and a margin.
          await waitFor("the stranded job done", async () => (await summariesOf("newcomer-1")) === 1, sweepMs + 10_000);
        } finally {
          await worker.stop();
        }
      },
    );

    await t.step("the same, with the client's retry arriving first: the replay announces the lane", async () => {
      // No sweep within the test's time: only the replay's announce can tell the worker.
      const worker = startWorker({ laneSweepMs: 600_000 });
      try {
        const apiKey = await createApiKey(db.sql, "newcomer-2");
        const key = newKey();
        const first = await post(api(crash), apiKey, key);
        assert.equal(first.status, 500);
        await first.body?.cancel();
        const retry = await post(api(), apiKey, key);
        assert.equal(retry.status, 202);
        assert.equal(retry.headers.get("idempotent-replayed"), "true");
        const { job_id } = await retry.json();
        await waitFor("the job done", async () => (await effects(job_id))[0] === 1, 4_000);
        assert.deepEqual(await effects(job_id), [1, 1]);
      } finally {
        await worker.stop();
      }
    });

    await t.step(
      "commit on the last allowed delivery, killed before the ack: acknowledged, never dead-lettered",
      async () => {
        const apiKey = await createApiKey(db.sql, "lastgasp");
        const lane = keys.lane("lastgasp");
        const res = await post(api(), apiKey, newKey());
        const { job_id } = await res.json();
        await ensureGroup(r.redis, lane);
        // The doomed process: its only delivery (the last allowed) commits, then it dies before XACK.
        const job = createSummaryJob({
          sql: db.sql,
          models: createDeployment({ llm: createExtractiveLlm(), model: "extractive" }),
          log: silentLogger,
          committer: createGroupCommitter({ sql: db.sql, log: silentLogger }),
        }, { budgetMs: 5_000, perCallTimeoutMs: 2_000, maxAttempts: 1 });
        const doomed = createStreamWorker({ redis: r.redis, log: silentLogger }, {
          lanes: staticLanes([lane]),
          consumer: "doomed",
          claimIdleMs: 60_000,
          maxDeliveries: 1,
          concurrency: 1,
          blockMs: 10,
        }, async (message, signal) => {
          assert.equal(await job(message, signal), "done");
          throw new Error("SIGKILL between commit and ack");
        });
        assert.equal(await doomed.runOnce(10), 1);
        await doomed.drain();
        await doomed.close();
        assert.deepEqual(await effects(job_id), [1, 1]);
        // Another worker reclaims it as its second delivery, past MAX_DELIVERIES=1.
        const worker = startWorker({ claimIdleMs: 50, maxDeliveries: 1 });
        try {
          await waitFor("the message settled", async () => (await r.redis.xlen(lane.stream)) === 0, 5_000);
        } finally {
          await worker.stop();
        }
        assert.equal((await listDeadLetters(r.redis, lane)).length, 0, "not dead-lettered");
        assert.deepEqual(await effects(job_id), [1, 1]);
        const doc = await (await request("GET", apiKey, job_id)).json();
        assert.equal(doc.status, "done");
      },
    );

    await t.step(
      "a dead letter of a decided job is refused by replay, by name, and still after retention has run",
      async () => {
        const tenant = "decided";
        const lane = keys.lane(tenant);
        const jobId = crypto.randomUUID();
        await commitResults(db.sql, [{ jobId, tenant, summary: "s", notify: "ops@example.com" }]);
        const fields = { job_id: jobId, tenant, payload: JSON.stringify({ text: TEXT, notify: "ops@example.com" }) };
        // A dead letter of a done job, as a worker of the previous release could leave one.
        await ensureGroup(r.redis, lane);
        const id = await r.redis.xadd(lane.stream, "*", ...Object.entries(fields).flat()) as string;
        await deadLetter(r.redis, lane, { id, fields, deliveries: 6 }, "exceeded 5 deliveries", markFailedHook);
        await r.redis.sadd(keys.registry.all, tenant);
        const errors: string[] = [];
        const io = { out: () => {}, err: (line: string) => errors.push(line) };
        assert.equal(await dlqCommand({ redis: r.redis, sql: db.sql }, keys, ["replay", "--all"], io), 1);
        assert.match(errors.join("\n"), new RegExp(`job ${jobId}.* already done`));
        assert.equal(await r.redis.xlen(lane.stream), 0, "nothing queued again");
        assert.equal((await listDeadLetters(r.redis, lane)).length, 1, "left for the operator to read");

        // Eight days on, retention has deleted the summary, the sent email and the outcome; the dead letter,
        // as old as they are, is past its own bound and still refused.
        await db.sql`UPDATE outbox SET sent_at = now() - interval '9 days' WHERE payload->>'job_id' = ${jobId}`;
        await db.sql`UPDATE summaries SET created_at = now() - interval '9 days' WHERE job_id = ${jobId}::uuid`;
        await db.sql`UPDATE job_outcomes SET decided_at = now() - interval '9 days' WHERE job_id = ${jobId}::uuid`;
        await r.redis.del(lane.dead);
        await r.redis.xadd(lane.dead, `${Date.now() - 8 * DAY_MS}-0`, ...Object.entries(fields).flat());
        await createRetention({ sql: db.sql, log: silentLogger }, {
          summaryRetentionMs: DAY_MS,
          outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
        }).runOnce();
        assert.deepEqual(await effects(jobId), [0, 0], "retention ran");
        errors.length = 0;
        assert.equal(await dlqCommand({ redis: r.redis, sql: db.sql }, keys, ["replay", "--all"], io), 1);
        assert.match(errors.join("\n"), /older than 7 days; it cannot be replayed/);
        assert.equal(await r.redis.xlen(lane.stream), 0, "nothing queued again");

        // An outcome younger than its dead letters' bound, plus a day, is never purged.
        const recent = crypto.randomUUID();
        await commitResults(db.sql, [{ jobId: recent, tenant, summary: "s", notify: "ops@example.com" }]);
        const ageDays = DEAD_LETTER_BOUNDS.maxAgeS / 86_400 + 0.5;
        await db.sql`UPDATE job_outcomes SET decided_at = now() - ${ageDays} * interval '1 day'
          WHERE job_id = ${recent}::uuid`;
        await db.sql`DELETE FROM summaries WHERE job_id = ${recent}::uuid`;
        await createRetention({ sql: db.sql, log: silentLogger }, {
          summaryRetentionMs: DAY_MS,
          outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
        }).runOnce();
        const [kept] = await db.sql`SELECT outcome FROM job_outcomes WHERE job_id = ${recent}::uuid`;
        assert.equal(kept?.outcome, "done");
      },
    );

    await t.step(
      "a job dead-lettered while a stalled delivery still runs stays failed: the late commit writes nothing",
      async () => {
        const apiKey = await createApiKey(db.sql, "stalled");
        const lane = keys.lane("stalled");
        const res = await post(api(), apiKey, newKey());
        const { job_id } = await res.json();
        await ensureGroup(r.redis, lane);
        // The stalled owner: its model call waits until released.
        let release!: () => void;
        const held = new Promise<void>((resolve) => (release = resolve));
        let calls = 0;
        const stalledLlm: LLM = {
          async complete(prompt, options) {
            calls++;
            await held;
            return await createExtractiveLlm().complete(prompt, options);
          },
        };
        const job = createSummaryJob({
          sql: db.sql,
          models: createDeployment({ llm: stalledLlm, model: "extractive" }),
          log: silentLogger,
          committer: createGroupCommitter({ sql: db.sql, log: silentLogger }),
        }, { budgetMs: 60_000, perCallTimeoutMs: 60_000, maxAttempts: 1 });
        let result: Promise<unknown> | undefined;
        const stalled = createStreamWorker({ redis: r.redis, log: silentLogger }, {
          lanes: staticLanes([lane]),
          consumer: "stalled",
          claimIdleMs: 60_000,
          maxDeliveries: 1,
          concurrency: 1,
          blockMs: 10,
        }, (message, signal) => (result = job(message, signal)));
        assert.equal(await stalled.runOnce(10), 1);
        await waitFor("the stalled call under way", () => calls === 1);
        // Its heartbeats stopped; another worker reclaims it past MAX_DELIVERIES and dead-letters it.
        const worker = startWorker({ claimIdleMs: 50, maxDeliveries: 1 });
        try {
          await waitFor("dead-lettered", async () => (await listDeadLetters(r.redis, lane)).length === 1, 5_000);
        } finally {
          await worker.stop();
        }
        const failed = await (await request("GET", apiKey, job_id)).json();
        assert.equal(failed.status, "failed");
        assert.equal(failed.error, "exceeded 1 deliveries");
        release();
        // The late commit loses to the dead letter and writes nothing; its message is left alone, not acked
        // (had the dead-lettering worker died before its MULTI, a later delivery would dead-letter it).
        await assert.rejects(result!, JobFailedElsewhere);
        await stalled.drain();
        await stalled.close();
        assert.equal((await listDeadLetters(r.redis, lane)).length, 1, "one dead letter, not two");
        assert.deepEqual(await effects(job_id), [0, 0], "no summary, no email");
        assert.equal((await (await request("GET", apiKey, job_id)).json()).status, "failed", "still failed");
        assert.equal((await request("DELETE", apiKey, job_id)).status, 409);
        // A replay takes the decision back, and the job then runs once.
        const replayWorker = startWorker();
        try {
          const io = { out: () => {}, err: () => {} };
          const [dead] = await listDeadLetters(r.redis, lane);
          const args = ["replay", dead!.id, "--tenant", "stalled"];
          assert.equal(await dlqCommand({ redis: r.redis, sql: db.sql }, keys, args, io), 0);
          await waitFor("the replayed job done", async () => (await effects(job_id))[0] === 1, 5_000);
        } finally {
          await replayWorker.stop();
        }
        assert.deepEqual(await effects(job_id), [1, 1]);
        assert.equal((await (await request("GET", apiKey, job_id)).json()).status, "done");
      },
    );

    await t.step(
      "a worker dies between deciding a job failed and its dead-letter step: the next delivery dead-letters it",
      async () => {
        const apiKey = await createApiKey(db.sql, "halfburied");
        const lane = keys.lane("halfburied");
        const { job_id } = await (await post(api(), apiKey, newKey())).json();
        await ensureGroup(r.redis, lane);
        const dying = createStreamWorker({ redis: r.redis, log: silentLogger, faults: { beforeDeadLetter: crash } }, {
          lanes: staticLanes([lane]),
          consumer: "dying",
          claimIdleMs: 60_000,
          maxDeliveries: 5,
          concurrency: 1,
          blockMs: 10,
          beforeDeadLetter: async (m, reason) =>
            (await failJob(db.sql, m.fields.job_id!, m.fields.tenant!, reason)) === "failed",
        }, () => Promise.reject(new PermanentJobError("the model refused this document")));
        assert.equal(await dying.runOnce(10), 1);
        await dying.drain();
        await dying.close();
        assert.equal((await listDeadLetters(r.redis, lane)).length, 0, "it died before the dead-letter step");
        assert.equal((await (await request("GET", apiKey, job_id)).json()).status, "failed", "already final");
        const worker = startWorker({ claimIdleMs: 50 });
        try {
          await waitFor("dead-lettered", async () => (await listDeadLetters(r.redis, lane)).length === 1, 5_000);
        } finally {
          await worker.stop();
        }
        assert.equal(await r.redis.xlen(lane.stream), 0);
        assert.deepEqual(await effects(job_id), [0, 0], "no model call committed");
        const doc = await (await request("GET", apiKey, job_id)).json();
        assert.deepEqual([doc.status, doc.error], ["failed", "failed"], "the tenant sees a class, not the text");
        const [outcome] = await db.sql`SELECT error FROM job_outcomes WHERE job_id = ${job_id}::uuid`;
        assert.equal(outcome!.error, "permanent: the model refused this document", "operators see all of it");
      },
    );

    await t.step("a failed job's decision is made once: failJob does not overturn done or cancelled", async () => {
      const done = crypto.randomUUID();
      await commitResults(db.sql, [{ jobId: done, tenant: "acme", summary: "s", notify: "ops@example.com" }]);
      assert.equal(await failJob(db.sql, done, "acme", "x"), "done");
      const other = crypto.randomUUID();
      assert.equal(await failJob(db.sql, other, "acme", "first"), "failed");
      assert.equal(await failJob(db.sql, other, "acme", "second"), "failed");
      const [row] = await db.sql`SELECT outcome, error FROM job_outcomes WHERE job_id = ${other}::uuid`;
      assert.deepEqual([row!.outcome, row!.error], ["failed", "first"]);
    });

    await t.step(
      "a re-POST after the key's record expired neither enqueues the job again nor resets its status",
      async () => {
        const apiKey = await createApiKey(db.sql, "repost");
        const lane = keys.lane("repost");
        const key = newKey();
        const first = await post(api(), apiKey, key);
        const { job_id } = await first.json();
        assert.equal((await request("DELETE", apiKey, job_id)).status, 200);
        const ttlBefore = await r.redis.ttl(lane.job(job_id));
        const length = await r.redis.xlen(lane.stream);
        // IDEMPOTENCY_RESULT_TTL_S passes: the key's record is gone, the job's status record is not.
        const scope = { tenant: "repost", method: "POST", path: SUMMARIES, key };
        await createIntake({ redis: r.redis }, { keys, resultTtlS: 86_400, path: SUMMARIES }).forget(scope);
        const again = await post(api(), apiKey, key);
        assert.equal(again.status, 202);
        assert.equal((await again.json()).job_id, job_id);
        assert.equal(await r.redis.xlen(lane.stream), length, "not enqueued again");
        assert.equal(await r.redis.hget(lane.job(job_id), "status"), "cancelled", "status not reset");
        assert.ok((await r.redis.ttl(lane.job(job_id))) <= ttlBefore, "its lifetime not extended");
        assert.equal((await (await request("GET", apiKey, job_id)).json()).status, "cancelled");
      },
    );
  } finally {
    await r.close();
    await db.close();
  }
});
