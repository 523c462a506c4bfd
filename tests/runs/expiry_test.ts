/**
 * Expiry (issue 41): a run whose model call has not started by its
 * `expires_at` ends `expired`, decided in Postgres, with no model call, no
 * budget charge and one `run.expired` notification; at every stage (taken
 * after its expiry, deferred for budget, waiting for a permit, reclaimed
 * after a crash) and against a cancel in both orders. Once a run's first
 * attempt has gone out, the expiry no longer applies: that call finishes, its
 * retries go out past the expiry, and a delivery after its worker died
 * mid-call calls it again (the run's record is marked before the send); such a
 * run ends done or failed, never expired.
 */
import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import type { LLM } from "../../src/llm/llm.ts";
import type { Acquired, Models } from "../../src/llm/models.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { ensureGroup } from "../../src/queue/stream_worker.ts";
import { cancelJob } from "../../src/jobs/job_store.ts";
import { expireRun } from "../../src/runs/commit.ts";
import { decideStart, readStartDecision } from "../../src/runs/job_status.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import type { RunPayload } from "../../src/runs/run_payload.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { setTenantBudget } from "../../src/tenants/tenant_budgets.ts";
import { ensureWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { enqueueRunToLane } from "../support/enqueue.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { recordAttempt } from "../support/run_rows.ts";
import { apiHandler, budgetsOn, jsonClient, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";
import type { StreamWorker } from "../../src/queue/stream_worker.ts";

/** How long the fake model takes to answer a backlog run's call (`[[backlog]]`). */
const BACKLOG_CALL_MS = 500;

const TASK = {
  prompt: "Echo: {{input.text}}",
  input_schema: { type: "object", properties: { text: { type: "string" } }, required: ["text"] },
};

/** A deployment in a pause that never ends: its permits are waited for until the wait's signal aborts. */
function pausedModels(): Models & { waits: number } {
  const models = {
    defaultModel: "m",
    waits: 0,
    acquire(_models: readonly string[], _estimate: number, options?: { signal?: AbortSignal }) {
      models.waits++;
      return new Promise<Acquired>((_, reject) => {
        const signal = options?.signal;
        if (signal?.aborted) return reject(signal.reason);
        signal?.addEventListener("abort", () => reject(signal.reason), { once: true });
      });
    },
  };
  return models;
}

/** A deployment that does not hear its signal: it grants a permit after `ms`, whatever happened meanwhile. */
function lateModels(llm: LLM, ms: number): Models & { settled: unknown[] } {
  const settled: unknown[] = [];
  return {
    defaultModel: "m",
    settled,
    acquire: () =>
      new Promise<Acquired>((resolve) =>
        setTimeout(() =>
          resolve({
            llm,
            model: "m",
            deployment: "late",
            permit: {
              waitedMs: ms,
              settle: (outcome) => {
                settled.push(outcome);
                return Promise.resolve(false);
              },
            },
          }), ms)
      ),
  };
}

Deno.test("expiry", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // A run's calls are those whose prompt carries its text; markers steer the fake: `[[slow]]` answers after 3 s,
  // `[[fail]]` answers 500 to the first call and `[[then-400]]` 400 to every later one (else they are answered),
  // `[[slow-once]]` answers its first call after 3 s and the others at once, `[[backlog]]` answers after 500 ms.
  const model = startFakeModel((_, prompt) => {
    const nth = model.prompts.filter((p) => p === prompt).length;
    arrivals.set(prompt, [...(arrivals.get(prompt) ?? []), Date.now()]);
    if (prompt.includes("[[backlog]]")) return { kind: "ok", content: "ok", delayMs: BACKLOG_CALL_MS };
    if (prompt.includes("[[slow]]") || (prompt.includes("[[slow-once]]") && nth === 1)) {
      return { kind: "ok", content: "late answer", delayMs: 3_000 };
    }
    const boom = { error: { message: "boom" } };
    if (prompt.includes("[[fail]]") && nth === 1) return { kind: "status", status: 500, body: boom };
    if (prompt.includes("[[then-400]]")) return { kind: "status", status: 400, body: boom };
    return { kind: "ok", content: "ok" };
  });
  /** When each request of a prompt arrived (epoch ms). */
  const arrivals = new Map<string, number[]>();
  const arrivalsFor = (text: string) => [...arrivals].filter(([p]) => p.includes(text)).flatMap(([, at]) => at);
  const callsFor = (text: string) => model.prompts.filter((p) => p.includes(text)).length;
  const hooks: Record<string, unknown>[] = [];
  const receiver = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    hooks.push(await req.json());
    return new Response(null, { status: 204 });
  });
  const hookUrl = `http://127.0.0.1:${receiver.addr.port}/hook`;
  const mail = startFakeMail();
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const acme = jsonClient(api, await createApiKey(db.sql, "acme"));
  await ensureWebhookSecret(db.sql, "acme");
  const lane = keys.lane("acme");

  const enqueue = async (text: string, extra: Partial<RunPayload> = {}) => {
    const runId = crypto.randomUUID();
    const run: RunPayload = { task: "echo", version: 1, input: { text }, notify: { webhook: hookUrl }, ...extra };
    await enqueueRunToLane(r.redis, keys, { jobId: runId, tenant: "acme", run });
    return runId;
  };
  const outcomeOf = async (runId: string) =>
    (await db.sql<{ outcome: string }[]>`SELECT outcome FROM job_outcomes WHERE job_id = ${runId}`)[0]?.outcome;
  const outboxOf = (sql: Sql, runId: string) =>
    sql<{ dedupe_key: string; topic: string }[]>`
      SELECT dedupe_key, topic FROM outbox WHERE dedupe_key LIKE ${"%" + runId}`;
  const expectExpired = async (runId: string, text: string, notify: "webhook" | "email" = "webhook") => {
    assert.equal(await outcomeOf(runId), "expired");
    assert.equal(callsFor(text), 0, "no model call");
    const rows = await outboxOf(db.sql, runId);
    const key = notify === "webhook" ? `run_expired_webhook:${runId}` : `run_expired:${runId}`;
    assert.deepEqual(rows.map((row) => row.dedupe_key), [key], "one run.expired notification");
    const got = await acme("GET", `/v1/runs/${runId}`);
    assert.equal(got.status, 200);
    assert.equal(got.body.status, "expired");
    assert.equal(got.body.attempts, 0);
  };
  const running = (worker: StreamWorker) => {
    const stop = new AbortController();
    const loop = worker.run(stop.signal);
    return async () => {
      stop.abort();
      await loop;
      await worker.close();
    };
  };
  const pending = async () => ((await r.redis.xpending(lane.stream, lane.group)) as [number])[0];
  // Every message of the lane taken and acknowledged (acknowledging deletes the entry).
  const drained = async () => (await r.redis.xlen(lane.stream)) === 0 && (await pending()) === 0;

  try {
    assert.equal((await acme("PUT", "/v1/tasks/echo", TASK)).status, 201);

    await t.step(
      "intake accepts priority and expires_in, carries them in the payload, and fingerprints them",
      async () => {
        const before = Date.now();
        const post = (key: string, body: Record<string, unknown>) =>
          acme("POST", "/v1/tasks/echo/runs", { input: { text: "intake" }, ...body }, { "idempotency-key": key });
        const high = await post("expiry-intake-00001", { priority: "high", expires_in: 30 });
        assert.equal(high.status, 202, JSON.stringify(high.body));
        const normal = await post("expiry-intake-00002", { priority: "normal" });
        assert.equal(normal.status, 202);
        // Each on its priority's stream of the lane (normal's is intake's stream of old).
        assert.equal(await r.redis.xlen(lane.streamOf("high")), 1);
        const entries = (await Promise.all(lane.streams.map((stream) => r.redis.xrange(stream, "-", "+"))))
          .flat() as [string, string[]][];
        const payloads = new Map(entries.map(([, flat]) => {
          const fields = Object.fromEntries(flat.flatMap((v, i) => (i % 2 ? [] : [[v, flat[i + 1]]])));
          return [fields.job_id, JSON.parse(fields.payload ?? "null")];
        }));
        const carried = payloads.get(high.body.run_id);
        assert.equal(carried.priority, "high");
        assert.ok(carried.expires_at >= before + 30_000 && carried.expires_at <= Date.now() + 30_000);
        // A normal run's payload is as every release wrote it: no priority, no expiry.
        assert.deepEqual(Object.keys(payloads.get(normal.body.run_id)).sort(), ["input", "task", "version"]);
        // The same key with another priority or expiry is another body: 422. The same body is a replay.
        assert.equal((await post("expiry-intake-00001", { priority: "low", expires_in: 30 })).status, 422);
        assert.equal((await post("expiry-intake-00001", { priority: "high", expires_in: 31 })).status, 422);
        assert.equal((await post("expiry-intake-00001", { priority: "high" })).status, 422);
        const replay = await post("expiry-intake-00001", { expires_in: 30, priority: "high" });
        assert.equal(replay.status, 202);
        assert.equal(replay.body.run_id, high.body.run_id);
        const tooLong = await post("expiry-intake-00003", { expires_in: 7 * 24 * 3600 + 1 });
        assert.equal(tooLong.status, 422);
        assert.equal(tooLong.body.errors[0].pointer, "/expires_in");
        // Cleared, so no later step's worker runs them.
        await acme("DELETE", `/v1/runs/${high.body.run_id}`);
        await acme("DELETE", `/v1/runs/${normal.body.run_id}`);
      },
    );

    await t.step("taken after its expiry: decided at once, no call, one run.expired webhook and email", async () => {
      const hooked = await enqueue("queued-webhook", { expires_at: Date.now() - 1 });
      const mailed = await enqueue("queued-email", { expires_at: Date.now() - 1, notify: "ops@example.com" });
      const stop = running(summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }));
      try {
        await waitFor("both expired", async () => (await outcomeOf(hooked)) && (await outcomeOf(mailed)));
        await waitFor("the lane drained", drained);
      } finally {
        await stop();
      }
      await expectExpired(hooked, "queued-webhook");
      await expectExpired(mailed, "queued-email", "email");
      const relay = relayTo({ sql: db.sql, mailUrl: mail.url });
      await relay.runOnce();
      await relay.runOnce();
      assert.deepEqual(hooks, [{ type: "run.expired", run_id: hooked, task: "echo", version: 1, status: "expired" }]);
      const email = mail.delivered.find((e) => e.subject.includes(mailed));
      assert.ok(email);
      assert.match(email.subject, /^Your run of echo expired/);
      assert.match(email.text, /expired: its model call had not started/);
      assert.equal(email.idempotencyKey, `run_expired:${mailed}`);
    });

    await t.step("waiting for a permit in a provider pause: the wait ends at the expiry, no call", async () => {
      const models = pausedModels();
      // Seconds, not milliseconds (a CI run on a Redis Cluster once took the run after a 400 ms expiry: decided at
      // once, it never asked for a permit): the worker must start and take the run before it expires.
      const expiresAt = Date.now() + 2_000;
      const runId = await enqueue("paused", { expires_at: expiresAt });
      const stop = running(summaryWorker({ redis: r.redis, sql: db.sql, models, keys }));
      try {
        await waitFor("the run to wait for its permit", () => models.waits > 0);
        assert.equal(await outcomeOf(runId), undefined, "still waiting before its expiry");
        await waitFor("expired", () => outcomeOf(runId));
        assert.ok(Date.now() >= expiresAt);
        await waitFor("acknowledged", async () => (await pending()) === 0);
      } finally {
        await stop();
      }
      await expectExpired(runId, "paused");
    });

    await t.step("a permit granted past the expiry by a deployment deaf to its signal goes back unsent", async () => {
      // Margins of seconds, not milliseconds: a loaded machine (CI beside other runs) may take a few hundred ms to
      // start the worker, and a run taken after its expiry never asks for a permit at all.
      const models = lateModels(llm, 3_000);
      const runId = await enqueue("late-permit", { expires_at: Date.now() + 1_500 });
      const stop = running(summaryWorker({ redis: r.redis, sql: db.sql, models, keys }));
      try {
        await waitFor("expired", () => outcomeOf(runId));
        await waitFor("the late permit settled", () => models.settled.length > 0, 10_000);
      } finally {
        await stop();
      }
      assert.deepEqual(models.settled, [{ aborted: true, notSent: true }]);
      await expectExpired(runId, "late-permit");
    });

    await t.step("deferred for budget, expired meanwhile: the next take decides it, nothing charged", async () => {
      const prices = createPrices({});
      const budgets = budgetsOn({ redis: r.redis, sql: db.sql, keys }, { prices, ttlMs: 100 });
      // Spent up to the limit already: the run's worst case does not fit now, but would in a larger budget.
      await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 50_000 });
      await recordAttempt(db.sql, {
        runId: crypto.randomUUID(),
        tenant: "acme",
        promptTokens: 25_000,
        completionTokens: 25_000,
      });
      const runId = await enqueue("budget-deferred", { expires_at: Date.now() + 500 });
      const stop = running(summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, budgets }));
      try {
        await waitFor(
          "the run deferred (the tenant marked waiting)",
          async () => (await budgets.waitingUntil("acme")) > 0,
        );
        assert.equal(await outcomeOf(runId), undefined);
        await new Promise((resolve) => setTimeout(resolve, 600));
        // The budget is raised after the run's expiry: its lane is read again, and the take decides it expired.
        await setTenantBudget(db.sql, "acme", { "--tokens-per-day": 10_000_000 });
        await waitFor("expired", () => outcomeOf(runId), 10_000);
        await waitFor("acknowledged", async () => (await pending()) === 0);
      } finally {
        await stop();
      }
      await expectExpired(runId, "budget-deferred");
      const [day] = await budgets.views("acme");
      assert.equal(day?.spent, 50_000, "nothing charged for the expired run");
      assert.equal(day?.reserved, 0, "nothing held for it");
      await setTenantBudget(db.sql, "acme", { "--tokens-per-day": null });
    });

    await t.step("reclaimed after a crash, past its expiry: decided expired, no call", async () => {
      const runId = await enqueue("crashed", { expires_at: Date.now() + 200 });
      await ensureGroup(r.redis, lane);
      // A worker reads it and dies before anything else.
      const reply = await r.redis.xreadgroup("GROUP", lane.group, "w-dead", "COUNT", 1, "STREAMS", lane.stream, ">");
      assert.ok(reply);
      assert.equal(await pending(), 1);
      await new Promise((resolve) => setTimeout(resolve, 250));
      const b = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { consumer: "w-b", claimIdleMs: 0 });
      try {
        assert.equal(await b.runOnce(0), 1);
        await b.drain();
      } finally {
        await b.close();
      }
      assert.equal(await pending(), 0);
      await expectExpired(runId, "crashed");
    });

    await t.step("expiry against cancel, in both orders and raced: the first decision stands", async () => {
      // Cancelled first: the expired take finds it cancelled and writes nothing.
      const cancelled = await enqueue("cancel-first", { expires_at: Date.now() - 1 });
      assert.equal((await acme("DELETE", `/v1/runs/${cancelled}`)).body.status, "cancelled");
      const stop = running(summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }));
      try {
        await waitFor("taken and acknowledged", drained);
      } finally {
        await stop();
      }
      assert.equal(await outcomeOf(cancelled), "cancelled");
      assert.equal((await outboxOf(db.sql, cancelled)).length, 0);
      assert.equal((await acme("GET", `/v1/runs/${cancelled}`)).body.status, "cancelled");
      // Expired first: the cancel is a 409 and changes nothing.
      const expired = await enqueue("expire-first", { expires_at: Date.now() - 1 });
      const again = running(summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }));
      try {
        await waitFor("expired", () => outcomeOf(expired));
      } finally {
        await again();
      }
      const refused = await acme("DELETE", `/v1/runs/${expired}`);
      assert.equal(refused.status, 409);
      await expectExpired(expired, "expire-first");
      // 300 runs: cancel then expire, expire then cancel, and both at once (100 each). One outcome each, and a
      // run.expired row exactly when the expiry won.
      const ids = Array.from({ length: 300 }, () => crypto.randomUUID());
      const run = { tenant: "acme", task: "echo", version: 1, notify: "ops@example.com" };
      const results = await Promise.all(ids.map(async (id, i) => {
        const expire = () => expireRun(db.sql, { ...run, jobId: id }, Date.now());
        const cancel = () => cancelJob(db.sql, id, "acme", run);
        if (i % 3 === 0) {
          const cancelledAs = await cancel();
          return [await expire(), cancelledAs] as const;
        }
        if (i % 3 === 1) {
          const expiredAs = await expire();
          return [expiredAs, await cancel()] as const;
        }
        return await Promise.all([expire(), cancel()]);
      }));
      let expiredWins = 0;
      for (const [i, [expiredAs, cancelledAs]] of results.entries()) {
        const outcome = await outcomeOf(ids[i]!);
        const rows = await outboxOf(db.sql, ids[i]!);
        if (outcome === "expired") {
          expiredWins++;
          assert.equal(expiredAs, "expired");
          assert.equal(cancelledAs, "expired");
          assert.equal(rows.length, 1);
        } else {
          assert.equal(outcome, "cancelled");
          assert.equal(expiredAs, "cancelled");
          assert.equal(cancelledAs, "cancelled");
          assert.equal(rows.length, 0);
        }
      }
      assert.ok(expiredWins >= 100 && expiredWins <= 200, `expiry won ${expiredWins}`);
    });

    await t.step("a call already sent when the run expires finishes, and the run is done", async () => {
      // The call starts well within the expiry (1.5 s, however loaded the machine) and answers after it (3 s).
      const runId = await enqueue("[[slow]] in flight", { expires_at: Date.now() + 1_500 });
      const stop = running(
        summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
          job: { perCallTimeoutMs: 6_000, budgetMs: 10_000 },
        }),
      );
      try {
        await waitFor("done", () => outcomeOf(runId), 10_000);
      } finally {
        await stop();
      }
      assert.equal(await outcomeOf(runId), "done");
      assert.equal(callsFor("[[slow]] in flight"), 1);
      assert.deepEqual((await outboxOf(db.sql, runId)).map((row) => row.dedupe_key), [`run_done_webhook:${runId}`]);
    });

    await t.step(
      "a retry due after the expiry goes out: the run started, so it ends done or failed, never expired",
      async () => {
        // The first attempt starts well within the expiry (1.5 s) and fails (500); the retry is due 3 s after it.
        const expiresAt = Date.now() + 1_500;
        const done = await enqueue("[[fail]] then done", { expires_at: expiresAt });
        // The same, but the retry is refused for good (400): the run fails, as any run would.
        const failed = await enqueue("[[fail]] [[then-400]] then failed", { expires_at: expiresAt });
        const stop = running(
          summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
            job: { backoffBaseMs: 3_000, backoffCapMs: 3_000, random: () => 1, budgetMs: 10_000 },
          }),
        );
        try {
          await waitFor("both decided", async () => (await outcomeOf(done)) && (await outcomeOf(failed)), 15_000);
          await waitFor("acknowledged", async () => (await pending()) === 0);
        } finally {
          await stop();
        }
        assert.equal(await outcomeOf(done), "done");
        assert.equal(await outcomeOf(failed), "failed");
        const cases = [[done, "then done", "run_done_webhook"], [failed, "then failed", "run_failed_webhook"]] as const;
        for (const [runId, text, key] of cases) {
          const at = arrivalsFor(text);
          assert.equal(at.length, 2, `${text}: the first attempt and its retry`);
          assert.ok(at[0]! < expiresAt, `${text}: the first attempt went out before the expiry`);
          assert.ok(at[1]! >= expiresAt, `${text}: the retry went out after it`);
          assert.deepEqual((await outboxOf(db.sql, runId)).map((row) => row.dedupe_key), [`${key}:${runId}`]);
          const got = await acme("GET", `/v1/runs/${runId}`);
          assert.equal(got.body.status, runId === done ? "done" : "failed");
        }
        assert.equal((await acme("GET", `/v1/runs/${done}`)).body.attempts, 2);
      },
    );

    await t.step("reclaimed after its worker died mid-call, past its expiry: called again and done", async () => {
      // Worker A sends the first attempt well within the expiry (1.5 s); its answer would come after 3 s, but A
      // stops first (a grace period of 50 ms), leaving the message pending for A as a crash would.
      const text = "[[slow-once]] died mid-call";
      const expiresAt = Date.now() + 1_500;
      const runId = await enqueue(text, { expires_at: expiresAt });
      const a = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
        consumer: "w-a",
        graceMs: 50,
        job: { perCallTimeoutMs: 6_000, budgetMs: 10_000 },
      });
      const stopA = running(a);
      try {
        await waitFor("the first attempt sent", () => callsFor(text) === 1);
      } finally {
        await stopA();
      }
      assert.equal(await outcomeOf(runId), undefined, "undecided");
      assert.equal(await pending(), 1, "still pending");
      // What survives A: the mark it wrote in the run's record before the attempt went out.
      const mark = Number(await r.redis.hget(lane.job(runId), "started"));
      assert.ok(mark > 0 && mark < expiresAt, `marked started before the expiry (${mark})`);
      await waitFor("past the expiry", () => Date.now() > expiresAt + 100);
      const b = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { consumer: "w-b", claimIdleMs: 0 });
      try {
        assert.equal(await b.runOnce(0), 1);
        await b.drain();
      } finally {
        await b.close();
      }
      assert.equal(await pending(), 0);
      assert.equal(await outcomeOf(runId), "done", "not expired: its call had started");
      const at = arrivalsFor(text);
      assert.equal(at.length, 2, "A's attempt and B's");
      assert.ok(at[1]! > expiresAt, "B's attempt after the expiry");
      assert.deepEqual((await outboxOf(db.sql, runId)).map((row) => row.dedupe_key), [`run_done_webhook:${runId}`]);
    });

    await t.step(
      "a run that never sent an attempt leaves no mark: its redelivery past the expiry expires it",
      async () => {
        // The step "reclaimed after a crash" above, with the record looked at: a worker that died before its first
        // attempt went out wrote no mark, so the expiry still applies.
        const runId = await enqueue("no-mark", { expires_at: Date.now() + 200 });
        await ensureGroup(r.redis, lane);
        assert.ok(await r.redis.xreadgroup("GROUP", lane.group, "w-dead", "COUNT", 1, "STREAMS", lane.stream, ">"));
        assert.equal(await r.redis.hget(lane.job(runId), "started"), null);
        await new Promise((resolve) => setTimeout(resolve, 250));
        const b = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { consumer: "w-b", claimIdleMs: 0 });
        try {
          assert.equal(await b.runOnce(0), 1);
          await b.drain();
        } finally {
          await b.close();
        }
        await expectExpired(runId, "no-mark");
        assert.equal(await r.redis.hget(lane.job(runId), "started"), "expired", "decided expired, never let start");
      },
    );

    await t.step(
      "the start decision is made once for every delivery: the first of 'start' and 'expire' stands",
      async () => {
        const key = (id: string) => lane.job(id);
        const future = Date.now() + 60_000;
        // A start before the expiry is let go out; an 'expire' after it finds the start, and so does a resend.
        const started = await decideStart(r.redis, key("decide-1"), "start", future);
        assert.ok(typeof started === "number" && started <= Date.now() && started > Date.now() - 5_000);
        assert.equal(await decideStart(r.redis, key("decide-1"), "expire", future), started, "expire finds the start");
        assert.equal(await decideStart(r.redis, key("decide-1"), "start", future), started, "a resend answers it");
        // A delivery deciding the run expired first: a concurrent one's start, even before the expiry, is refused.
        assert.equal(await decideStart(r.redis, key("decide-2"), "expire", future), "expired");
        assert.equal(await decideStart(r.redis, key("decide-2"), "start", future), "expired", "start after expire");
        // A start asked at or after the expiry, by Redis's clock, decides it expired.
        assert.equal(await decideStart(r.redis, key("decide-3"), "start", Date.now() - 1), "expired");
        assert.equal(await readStartDecision(r.redis, key("decide-3")), "expired");
        assert.equal(await readStartDecision(r.redis, key("decide-4")), undefined, "no decision: none read");
        await r.redis.del(key("decide-1"), key("decide-2"), key("decide-3"));
      },
    );

    await t.step(
      "a run another delivery decided expired sends nothing, even taken before its expiry",
      async () => {
        // As a delivery that stalled past its claim, whose clock passed the expiry, decides it while another
        // worker took the run over: the other, before the expiry by its own clock, must not send.
        const expiresAt = Date.now() + 30_000;
        const runId = await enqueue("decided-expired", { expires_at: expiresAt });
        assert.equal(await decideStart(r.redis, lane.job(runId), "expire", expiresAt), "expired");
        const b = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { consumer: "w-b" });
        try {
          assert.equal(await b.runOnce(0), 1);
          await b.drain();
        } finally {
          await b.close();
        }
        await expectExpired(runId, "decided-expired");
        assert.equal(callsFor("decided-expired"), 0);
      },
    );

    await t.step(
      "posted behind a backlog with expires_in 2: expired, no call, one run.expired webhook, GET says expired",
      async () => {
        // The case through the real route: a backlog of 8 runs without expiry, then 5 with `expires_in: 2`
        // and a webhook, one tenant, all posted before a worker with one call at a time starts. Each backlog call
        // takes 500 ms, so the first expiring run cannot be taken before 8 × 500 ms = 4 s after its POST, twice its
        // expiry; a loaded machine only makes that wait longer.
        const step = crypto.randomUUID().slice(0, 8);
        const post = (text: string, extra: Record<string, unknown> = {}) =>
          acme("POST", "/v1/tasks/echo/runs", { input: { text }, ...extra }, {
            "idempotency-key": `expiry-backlog-${step}-${text.replace(/\W+/g, "-")}`,
          });
        const backlog: { runId: string; text: string }[] = [];
        for (let i = 1; i <= 8; i++) {
          const text = `[[backlog]] ahead ${step} #${i}`;
          const res = await post(text);
          assert.equal(res.status, 202, JSON.stringify(res.body));
          backlog.push({ runId: res.body.run_id, text });
        }
        const expiring: { runId: string; text: string }[] = [];
        for (let i = 1; i <= 5; i++) {
          const text = `behind the backlog ${step} #${i}`;
          const res = await post(text, { expires_in: 2, notify: { webhook: hookUrl } });
          assert.equal(res.status, 202, JSON.stringify(res.body));
          expiring.push({ runId: res.body.run_id, text });
        }
        const all = [...backlog, ...expiring];
        const stop = running(
          summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, {
            concurrency: 1,
            job: { perCallTimeoutMs: 10_000, budgetMs: 20_000 },
          }),
        );
        try {
          await waitFor("all 13 decided", async () => {
            for (const { runId } of all) if (!(await outcomeOf(runId))) return false;
            return true;
          }, 60_000);
          await waitFor("the lane drained", drained, 10_000);
        } finally {
          await stop();
        }
        for (const { runId, text } of backlog) {
          assert.equal(await outcomeOf(runId), "done", text);
          assert.equal(callsFor(text), 1, `${text}: one call`);
          assert.equal((await acme("GET", `/v1/runs/${runId}`)).body.status, "done");
        }
        // Expired, no call for its input, exactly one run.expired outbox row, GET says expired with 0 attempts.
        for (const { runId, text } of expiring) await expectExpired(runId, text);
        // The relay's real sender delivers each run.expired webhook once to the receiver. Earlier steps' rows
        // are delivered too (so the relay may take several passes); one more pass after ours must add nothing.
        const relay = relayTo({ sql: db.sql, mailUrl: mail.url });
        const delivered = (runId: string) => hooks.filter((hook) => hook.run_id === runId);
        await waitFor("each run.expired webhook delivered", async () => {
          await relay.runOnce();
          return expiring.every(({ runId }) => delivered(runId).length > 0);
        }, 30_000);
        await relay.runOnce();
        for (const { runId } of expiring) {
          assert.deepEqual(delivered(runId), [
            { type: "run.expired", run_id: runId, task: "echo", version: 1, status: "expired" },
          ]);
        }
        const sent = await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM outbox
          WHERE dedupe_key = ANY(${expiring.map(({ runId }) => `run_expired_webhook:${runId}`)})
            AND sent_at IS NOT NULL`;
        assert.equal(sent[0]?.n, expiring.length, "each row recorded as sent");
      },
    );
  } finally {
    await receiver.shutdown();
    await mail.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
