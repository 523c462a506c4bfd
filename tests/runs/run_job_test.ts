import assert from "node:assert/strict";
import { createExtractiveLlm } from "../../src/llm/extractive.ts";
import type { LLM } from "../../src/llm/llm.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { commitResults, createGroupCommitter } from "../../src/runs/commit.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { announceLane } from "../../src/queue/lanes.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { errorBody, startFakeModel } from "../support/fake_model_server.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";
import { relayTo, summaryWorker } from "../support/fixtures.ts";
import type { SummaryWorkerOptions } from "../../src/runs/worker.ts";

const TEXT = "Revenue rose 12% in Q3. Costs fell. The board approved the plan. Staff were told on Friday.";

function countingLlm(inner: LLM = createExtractiveLlm()) {
  const llm = {
    calls: 0,
    complete(prompt: string, options: { signal: AbortSignal }) {
      llm.calls++;
      return inner.complete(prompt, options);
    },
  };
  return llm;
}

Deno.test("summary job", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // The worker reads the lanes; the tests' jobs are all tenant acme's.
  const service = serviceKeys(r.prefix);
  const keys = service.lane("acme");
  const counts = async () => {
    const [row] = await db.sql<{ s: number; o: number }[]>`
      SELECT (SELECT count(*) FROM summaries)::int AS s, (SELECT count(*) FROM outbox)::int AS o`;
    return [row!.s, row!.o];
  };
  const reset = async () => {
    await db.sql`TRUNCATE summaries, outbox`;
    await r.redis.del(keys.stream, keys.dead);
    await ensureGroup(r.redis, keys);
  };
  const enqueue = (jobId: string) =>
    enqueueToLane(r.redis, service, { jobId, tenant: "acme", request: { text: TEXT, notify: "ops@example.com" } });
  const jobOptions = { budgetMs: 5_000, perCallTimeoutMs: 2_000, maxAttempts: 4, backoffBaseMs: 1, backoffCapMs: 5 };
  const makeWorker = (consumer: string, llm: LLM, overrides: Partial<SummaryWorkerOptions> = {}) =>
    summaryWorker({ redis: r.redis, sql: db.sql, llm, keys: service }, { consumer, job: jobOptions, ...overrides });
  const pending = async () => ((await r.redis.xpending(keys.stream, keys.group)) as [number])[0];

  try {
    await t.step(
      "crash between commit and XACK: one model call, one summary, one outbox row, one email",
      async () => {
        await reset();
        const jobId = crypto.randomUUID();
        await enqueue(jobId);
        const llm = countingLlm();
        const job = createSummaryJob({
          sql: db.sql,
          models: createDeployment({ llm, model: "extractive" }),
          log: silentLogger,
          committer: createGroupCommitter({ sql: db.sql, log: silentLogger }),
        }, jobOptions);
        // Worker A reads and fully processes the job (commit included), then dies before XACK.
        const reply = await r.redis.xreadgroup("GROUP", keys.group, "w-a", "COUNT", 1, "STREAMS", keys.stream, ">") as [
          string,
          [string, string[]][],
        ][];
        const [id, flat] = reply[0]![1][0]!;
        const fields = Object.fromEntries(
          Array.from({ length: flat.length / 2 }, (_, i) => [flat[2 * i], flat[2 * i + 1]]),
        );
        assert.equal(await job({ id, fields, deliveries: 1 }, new AbortController().signal), "done");
        assert.equal(await pending(), 1);
        // Worker B reclaims it.
        const b = makeWorker("w-b", llm, { claimIdleMs: 0 });
        try {
          assert.equal(await b.runOnce(0), 1);
          await b.drain();
        } finally {
          await b.close();
        }
        assert.equal(await pending(), 0);
        assert.equal(llm.calls, 1, "the pre-check skipped the model");
        assert.deepEqual(await counts(), [1, 1]);
        const [row] = await db.sql`SELECT dedupe_key, payload FROM outbox`;
        assert.equal(row!.dedupe_key, `summary_ready:${jobId}`);
        assert.equal(row!.payload.to, "ops@example.com");
        assert.equal(row!.payload.job_id, jobId);
        // Its outcome says when it was accepted: the stream entry's milliseconds (the console's latency chart).
        const [outcome] = await db.sql`SELECT accepted_at FROM job_outcomes WHERE job_id = ${jobId}`;
        assert.equal((outcome!.accepted_at as Date).getTime(), Number(id.split("-")[0]));
        // Two relay passes send one email.
        const mail = startFakeMail();
        try {
          const relay = relayTo({ sql: db.sql, mailUrl: mail.url }, { maxAttempts: 10 });
          await relay.runOnce();
          await relay.runOnce();
          assert.equal(mail.requests, 1);
          assert.equal(mail.delivered.length, 1);
        } finally {
          await mail.close();
        }
      },
    );

    await t.step("the same job id enqueued twice gives one summary and one outbox row", async () => {
      await reset();
      const jobId = crypto.randomUUID();
      await enqueue(jobId);
      await enqueue(jobId);
      const llm = countingLlm();
      const w = makeWorker("w", llm, { concurrency: 1 });
      try {
        await w.runOnce(0);
        await w.drain();
        await w.runOnce(0);
        await w.drain();
      } finally {
        await w.close();
      }
      assert.equal(llm.calls, 1);
      assert.deepEqual(await counts(), [1, 1]);
      assert.equal(await r.redis.xlen(keys.stream), 0);
    });

    await t.step(
      "a slow worker and a reclaimer racing: done + duplicate, two model calls, one outbox row",
      async () => {
        await reset();
        const jobId = crypto.randomUUID();
        await enqueue(jobId);
        let release!: () => void;
        const both = new Promise<void>((res) => (release = res));
        let calls = 0;
        const gated: LLM = {
          async complete(prompt, options) {
            calls++;
            if (calls === 2) release();
            await both;
            return await createExtractiveLlm().complete(prompt, options);
          },
        };
        const committer = createGroupCommitter({ sql: db.sql, log: silentLogger });
        const models = createDeployment({ llm: gated, model: "extractive" });
        const job = createSummaryJob({ sql: db.sql, models, log: silentLogger, committer }, jobOptions);
        const message = {
          id: "1-0",
          fields: { job_id: jobId, tenant: "acme", payload: JSON.stringify({ text: TEXT, notify: "a@b.co" }) },
          deliveries: 1,
        };
        const signal = new AbortController().signal;
        const results = await Promise.all([job(message, signal), job({ ...message, deliveries: 2 }, signal)]);
        assert.deepEqual(results.sort(), ["done", "duplicate"]);
        assert.equal(calls, 2);
        assert.deepEqual(await counts(), [1, 1]);
      },
    );

    await t.step("a batch containing an already-committed job writes no second outbox row for it", async () => {
      await reset();
      const old = crypto.randomUUID();
      const fresh = [crypto.randomUUID(), crypto.randomUUID()];
      const result = (jobId: string) => ({ jobId, tenant: "acme", summary: "s", notify: "a@b.co" });
      assert.deepEqual([...await commitResults(db.sql, [result(old)])], [old]);
      const inserted = await commitResults(db.sql, [result(fresh[0]!), result(old), result(fresh[1]!)]);
      assert.deepEqual([...inserted].sort(), [...fresh].sort());
      assert.deepEqual(await counts(), [3, 3]);
      const [row] = await db.sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM outbox WHERE dedupe_key = ${"summary_ready:" + old}`;
      assert.equal(row!.n, 1);
    });

    await t.step("the group committer commits jobs that finish together in one transaction, each guarded", async () => {
      await reset();
      const committer = createGroupCommitter({ sql: db.sql, log: silentLogger }, { inFlight: 1 });
      const ids = Array.from({ length: 50 }, () => crypto.randomUUID());
      const outcomes = await Promise.all([
        ...ids.map((jobId) => committer.commit({ jobId, tenant: "acme", summary: "s", notify: "a@b.co" })),
        committer.commit({ jobId: ids[0]!, tenant: "acme", summary: "again", notify: "a@b.co" }),
      ]);
      assert.equal(outcomes.filter((o) => o === "done").length, 50);
      assert.equal(outcomes.filter((o) => o === "duplicate").length, 1);
      assert.deepEqual(await counts(), [50, 50]);
      const [row] = await db.sql<{ n: number }[]>`SELECT count(DISTINCT xmin::text)::int AS n FROM summaries`;
      assert.ok(row!.n < 50, `grouped into ${row!.n} transactions`);
    });

    await t.step("a batch that fails falls back to one transaction per job", async () => {
      await reset();
      const committer = createGroupCommitter({ sql: db.sql, log: silentLogger }, { inFlight: 1 });
      const good = crypto.randomUUID();
      const outcomes = await Promise.allSettled([
        committer.commit({ jobId: crypto.randomUUID(), tenant: "acme", summary: "first", notify: "a@b.co" }),
        committer.commit({ jobId: good, tenant: "acme", summary: "fine", notify: "a@b.co" }),
        committer.commit({ jobId: "not-a-uuid", tenant: "acme", summary: "bad", notify: "a@b.co" }),
      ]);
      assert.equal(outcomes[0]!.status, "fulfilled");
      assert.deepEqual(outcomes[1], { status: "fulfilled", value: "done" });
      assert.equal(outcomes[2]!.status, "rejected");
      assert.deepEqual(await counts(), [2, 2]);
    });

    await t.step("a 503 storm exhausts LLM_MAX_ATTEMPTS and leaves the job pending, not dead-lettered", async () => {
      await reset();
      const model = startFakeModel(() => ({ kind: "status", status: 503 }));
      const w = makeWorker("w", createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url }));
      try {
        const jobId = crypto.randomUUID();
        await enqueue(jobId);
        await w.runOnce(0);
        await w.drain();
        assert.equal(model.requests, 4);
        assert.equal(await pending(), 1);
        assert.equal((await listDeadLetters(r.redis, keys)).length, 0);
        assert.deepEqual(await counts(), [0, 0]);
        assert.equal(await r.redis.hget(keys.job(jobId), "status"), null, "still queued: no status");
      } finally {
        await w.close();
        await model.close();
      }
    });

    await t.step(
      "Postgres failing the between-attempts check (a failover) leaves the job pending, not dead-lettered",
      async () => {
        await reset();
        // The one query in flight when the primary crashes fails, as postgres.js failed it in the chaos run; the
        // next ones reach the new primary (the dead-letter step's too, so a wrong verdict would be stored).
        let breakNext = false;
        const sql = new Proxy(db.sql, {
          apply: (target, self, args) => {
            if (!breakNext) return Reflect.apply(target, self, args);
            breakNext = false;
            return Promise.reject(
              Object.assign(new Error("write CONNECTION_CLOSED 127.0.0.1:5432"), { code: "CONNECTION_CLOSED" }),
            );
          },
        });
        // The first call answers 503, and the check of the job's outcome before the second one fails.
        const model = startFakeModel((n) => {
          breakNext = n === 1;
          return n === 1 ? { kind: "status", status: 503 } : { kind: "ok" };
        });
        const llm = createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url });
        const w = summaryWorker({ redis: r.redis, sql, llm, keys: service }, { consumer: "w", job: jobOptions });
        try {
          const jobId = crypto.randomUUID();
          await enqueue(jobId);
          await w.runOnce(0);
          await w.drain();
          assert.equal(model.requests, 1, "no call after the failed check");
          assert.equal((await listDeadLetters(r.redis, keys)).length, 0);
          assert.equal(await pending(), 1);
          assert.equal(await r.redis.hget(keys.job(jobId), "status"), null, "still queued: no status");
          // The redelivery does the job.
          const b = makeWorker("w-b", llm, { claimIdleMs: 0 });
          try {
            assert.equal(await b.runOnce(0), 1);
            await b.drain();
          } finally {
            await b.close();
          }
          assert.equal(await pending(), 0);
          assert.deepEqual(await counts(), [1, 1]);
        } finally {
          await w.close();
          await model.close();
        }
      },
    );

    await t.step("a 400-class model error is dead-lettered after one call and the job reads as failed", async () => {
      await reset();
      const model = startFakeModel(() => ({
        kind: "status",
        status: 400,
        body: errorBody("context too long", "invalid_request_error"),
      }));
      const w = makeWorker("w", createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url }));
      try {
        const jobId = crypto.randomUUID();
        await enqueue(jobId);
        await w.runOnce(0);
        await w.drain();
        assert.equal(model.requests, 1);
        assert.equal(await pending(), 0);
        const dead = await listDeadLetters(r.redis, keys);
        assert.equal(dead.length, 1);
        assert.equal(dead[0]!.fields.tenant, "acme");
        assert.match(dead[0]!.reason, /^permanent: UpstreamHttpError: Upstream answered 400/);
        const [outcome] = await db.sql`SELECT outcome, accepted_at FROM job_outcomes WHERE job_id = ${jobId}`;
        assert.equal(outcome!.outcome, "failed");
        assert.equal((outcome!.accepted_at as Date).getTime(), Number(dead[0]!.original_id.split("-")[0]));
        assert.deepEqual(await counts(), [0, 0]);
        assert.equal(await r.redis.hget(keys.job(jobId), "status"), "failed");
      } finally {
        await w.close();
        await model.close();
      }
    });

    await t.step(
      "a summary the database refuses (class 22) is dead-lettered after one delivery and one model call",
      async () => {
        await reset();
        const llm = countingLlm({ complete: () => Promise.resolve({ text: "a NUL \u0000 in the summary" }) });
        const w = makeWorker("w", llm);
        try {
          const jobId = crypto.randomUUID();
          await enqueue(jobId);
          await w.runOnce(0);
          await w.drain();
          assert.equal(llm.calls, 1);
          assert.equal(await pending(), 0, "not left pending for another paid delivery");
          const dead = await listDeadLetters(r.redis, keys);
          assert.equal(dead.length, 1);
          assert.match(dead[0]!.reason, /^permanent: the summary cannot be stored/);
          assert.deepEqual(await counts(), [0, 0]);
          assert.equal(await r.redis.hget(keys.job(jobId), "status"), "failed");
        } finally {
          await w.close();
        }
      },
    );

    await t.step("a malformed message is dead-lettered without a model call", async () => {
      await reset();
      await r.redis.xadd(keys.stream, "*", "job_id", "nope", "tenant", "acme", "payload", "{");
      await announceLane(r.redis, service.registry, "acme");
      const llm = countingLlm();
      const w = makeWorker("w", llm);
      try {
        await w.runOnce(0);
        await w.drain();
      } finally {
        await w.close();
      }
      assert.equal(llm.calls, 0);
      assert.equal((await listDeadLetters(r.redis, keys)).length, 1);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
