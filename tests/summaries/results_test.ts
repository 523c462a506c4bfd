/**
 * Results the way programs want them: `Prefer: wait=N` answers with the
 * finished job, woken by the commit's NOTIFY; `DELETE` cancels a queued job,
 * and a cancel racing a commit ends with exactly one outcome.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import type { LLM } from "../../src/llm/llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { cancelJob } from "../../src/jobs/job_store.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { createJobWaiter, MAX_WAIT_S, preferredWaitS } from "../../src/runs/job_waiter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, seededRandom, waitFor } from "../_support.ts";

Deno.test("Prefer: wait parsing follows RFC 7240 and caps N", () => {
  const wait = (prefer?: string) => preferredWaitS(new Headers(prefer === undefined ? {} : { prefer }));
  assert.equal(wait(), undefined);
  assert.equal(wait("wait=10"), 10);
  assert.equal(wait("respond-async, wait=5"), 5);
  assert.equal(wait("WAIT = 7"), 7);
  assert.equal(wait('wait="3"'), 3);
  assert.equal(wait("wait=600"), MAX_WAIT_S);
  assert.equal(wait("wait=0"), undefined);
  assert.equal(wait("wait=abc"), undefined);
  assert.equal(wait("wait=-1"), undefined);
  assert.equal(wait("handling=lenient"), undefined);
});

Deno.test("results: wait for the finished job, cancel a queued one", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const apiKey = await createApiKey(db.sql, "acme");
  const otherKey = await createApiKey(db.sql, "globex");
  // The model's delay is chosen by the document: SLOW-ME 3 s, HANG-ME never, otherwise 300 ms.
  const model = startFakeModel((_, prompt) =>
    prompt.includes("HANG-ME") ? { kind: "hang" } : { kind: "ok", delayMs: prompt.includes("SLOW-ME") ? 3_000 : 300 }
  );
  const modelCalls = () => model.prompts.length;
  const llm: LLM = createOpenAiLlm({ apiKey: "k", model: "m", baseURL: model.url });
  let n = 0;
  const newKey = () => `results-key-${String(++n).padStart(8, "0")}`;
  const post = (text: string, headers: Record<string, string> = {}, key = newKey()) =>
    handler(
      new Request("http://api/v1/summaries", {
        method: "POST",
        headers: {
          authorization: `Bearer ${apiKey}`,
          "content-type": "application/json",
          "idempotency-key": key,
          ...headers,
        },
        body: JSON.stringify({ text, notify: "ops@example.com" }),
      }),
    );
  const request = (method: string, jobId: string, headers: Record<string, string> = {}, key = apiKey) =>
    handler(
      new Request(`http://api/v1/summaries/${jobId}`, {
        method,
        headers: { authorization: `Bearer ${key}`, ...headers },
      }),
    );
  /** A running summary worker; `close` stops it (abandoning what does not finish within 1 s) and closes it. */
  const startWorker = (workerLlm: LLM) => {
    const stop = new AbortController();
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm: workerLlm, keys }, {
      graceMs: 1_000,
      job: { budgetMs: 20_000, perCallTimeoutMs: 10_000, maxAttempts: 2, backoffBaseMs: 1, backoffCapMs: 5 },
    });
    const running = worker.run(stop.signal);
    return {
      async close() {
        stop.abort();
        await running;
        await worker.close();
      },
    };
  };
  const rowsOf = async (jobId: string) => {
    const [row] = await db.sql<{ summaries: number; outbox: number }[]>`
      SELECT (SELECT count(*)::int FROM summaries WHERE job_id = ${jobId}) AS summaries,
             (SELECT count(*)::int FROM outbox WHERE payload->>'job_id' = ${jobId}) AS outbox`;
    return row!;
  };

  try {
    await t.step("POST with Prefer: wait=10 answers 200 with the finished document", async () => {
      const worker = startWorker(llm);
      try {
        const res = await post("Revenue rose. Costs fell. The plan passed.", { prefer: "wait=10" });
        assert.equal(res.status, 200);
        assert.equal(res.headers.get("preference-applied"), "wait=10");
        const doc = await res.json();
        assert.equal(doc.status, "done");
        assert.match(doc.summary, /Revenue rose/);
        // The same document GET returns (attempts and tokens are recorded within a second, so left aside).
        const { attempts: _a, tokens: _t, ...got } = await (await request("GET", doc.job_id)).json();
        const { attempts: _b, tokens: _u, ...waited } = doc;
        assert.deepEqual(got, waited);

        // A replay waits too: the job is done, so at once.
        const key = newKey();
        const first = await post("Replay me. Then again.", { prefer: "wait=10" }, key);
        assert.equal(first.status, 200);
        await first.body?.cancel();
        const replay = await post("Replay me. Then again.", { prefer: "wait=10" }, key);
        assert.equal(replay.status, 200);
        assert.equal(replay.headers.get("idempotent-replayed"), "true");
        assert.equal(replay.headers.get("preference-applied"), "wait=10");
        assert.equal((await replay.json()).status, "done");
      } finally {
        await worker.close();
      }
    });

    await t.step("with wait=1 and a 3 s model, 202 after about 1 s; GET with wait then gets the result", async () => {
      const worker = startWorker(llm);
      try {
        const started = performance.now();
        const res = await post("A SLOW-ME document. It takes the model three seconds.", { prefer: "wait=1" });
        const elapsed = performance.now() - started;
        assert.equal(res.status, 202);
        // The wait ran out, but it was applied (RFC 7240): the client can tell "waited" from "ignored".
        assert.equal(res.headers.get("preference-applied"), "wait=1");
        assert.equal(res.headers.get("vary"), "prefer", "a response Prefer can change says so");
        const { job_id } = await res.json();
        assert.ok(elapsed >= 950 && elapsed < 2_500, `answered after ${Math.round(elapsed)} ms`);
        const got = await request("GET", job_id, { prefer: "wait=10" });
        assert.equal(got.status, 200);
        assert.equal(got.headers.get("preference-applied"), "wait=10");
        assert.equal((await got.json()).status, "done");
      } finally {
        await worker.close();
      }
    });

    await t.step("without the preference, or with a malformed one, nothing waits", async () => {
      for (const prefer of [undefined, "wait=abc"]) {
        const res = await post("No wait here. None at all.", prefer ? { prefer } : {});
        assert.equal(res.status, 202);
        assert.equal(res.headers.get("preference-applied"), null, "ignored, and says nothing");
        assert.equal(res.headers.get("vary"), "prefer");
        await res.body?.cancel();
      }
    });

    await t.step("on shutdown, waiting requests answer at once with the current status", async () => {
      const worker = startWorker(llm);
      const stopping = new AbortController();
      const stoppingHandler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
        authMode: "api-key",
        waiter,
        shutdown: stopping.signal,
      });
      const pending = stoppingHandler(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: {
            authorization: `Bearer ${apiKey}`,
            "content-type": "application/json",
            "idempotency-key": newKey(),
            prefer: "wait=30",
          },
          body: JSON.stringify({ text: "This one will HANG-ME in the model.", notify: "ops@example.com" }),
        }),
      );
      await waitFor("the model call", () => model.prompts.some((p) => p.includes("HANG-ME")), 5_000);
      const started = performance.now();
      stopping.abort();
      const res = await pending;
      assert.equal(res.status, 202);
      await res.body?.cancel();
      assert.ok(performance.now() - started < 2_000, "answered promptly, not after 30 s");
      await worker.close(); // abandons the hung call after the grace; the message stays pending
    });

    await t.step("DELETE cancels a queued job: no model call, no summary, no outbox row", async () => {
      const res = await post("Cancel me before any worker runs.");
      const { job_id } = await res.json();
      const callsBefore = modelCalls();
      const cancelled = await request("DELETE", job_id);
      assert.equal(cancelled.status, 200);
      assert.deepEqual(await cancelled.json(), { job_id, status: "cancelled" });
      const again = await request("DELETE", job_id);
      assert.equal(again.status, 200, "cancelling twice gives the same answer");
      assert.equal((await again.json()).status, "cancelled");
      assert.equal((await request("DELETE", job_id, {}, otherKey)).status, 404, "another tenant's job");
      assert.equal((await request("GET", job_id)).status, 200);
      assert.equal((await (await request("GET", job_id)).json()).status, "cancelled");

      const worker = startWorker(llm);
      try {
        // The worker takes it, sees the cancel and acknowledges it (ack deletes it) without calling the model.
        await waitFor("the message to be acknowledged", async () => {
          const entries = await r.redis.xrange(keys.lane("acme").stream, "-", "+");
          return !entries.some(([, fields]) => fields.includes(job_id));
        }, 5_000);
      } finally {
        await worker.close();
      }
      assert.equal(modelCalls(), callsBefore, "no model call for a cancelled job");
      assert.deepEqual(await rowsOf(job_id), { summaries: 0, outbox: 0 });
      assert.equal((await (await request("GET", job_id, { prefer: "wait=5" })).json()).status, "cancelled");
    });

    await t.step("DELETE of a finished job is 409; of an unknown one 404", async () => {
      const worker = startWorker(llm);
      try {
        const res = await post("Finish me. Then try to cancel.", { prefer: "wait=10" });
        const { job_id, status } = await res.json();
        assert.equal(status, "done");
        const conflict = await request("DELETE", job_id);
        assert.equal(conflict.status, 409);
        assert.match((await conflict.json()).detail, /already done/);
        assert.equal((await request("DELETE", crypto.randomUUID())).status, 404);
        assert.equal((await request("DELETE", "not-a-uuid")).status, 404);
        assert.deepEqual(await rowsOf(job_id), { summaries: 1, outbox: 1 });
      } finally {
        await worker.close();
      }
    });

    await t.step("a cancel during a failing model call stops the job before its next attempt", async () => {
      // Each call for this document takes 400 ms and fails with a 503: without the cancel, it would be retried.
      const flaky = startFakeModel(() => ({ kind: "status", status: 503 }));
      let calls = 0;
      const slowFlaky: LLM = {
        complete: async (prompt, options) => {
          calls++;
          await new Promise((resolve) => setTimeout(resolve, 400));
          return await createOpenAiLlm({ apiKey: "k", model: "m", baseURL: flaky.url }).complete(prompt, options);
        },
      };
      const worker = startWorker(slowFlaky);
      try {
        const { job_id } = await (await post("Cancel me mid-flight. Please.")).json();
        await waitFor("the first call to start", () => calls === 1, 5_000);
        assert.equal((await request("DELETE", job_id)).status, 200);
        await waitFor("the message to be acknowledged", async () => {
          const entries = await r.redis.xrange(keys.lane("acme").stream, "-", "+");
          return !entries.some(([, fields]) => fields.includes(job_id));
        }, 10_000);
        assert.equal(calls, 1, "no model call after the cancel was seen");
        assert.equal(flaky.requests, 1);
        assert.deepEqual(await rowsOf(job_id), { summaries: 0, outbox: 0 });
      } finally {
        await worker.close();
        await flaky.close();
      }
    });

    await t.step("cancel racing commit, 300 times: exactly one outcome, with all its effects or none", async () => {
      const random = seededRandom(13);
      const jittered = async <T>(f: () => Promise<T>) => {
        await new Promise((resolve) => setTimeout(resolve, random() * 3));
        return await f();
      };
      let commits = 0, cancels = 0;
      for (let i = 0; i < 300; i++) {
        const jobId = crypto.randomUUID();
        const [committed, cancel] = await Promise.all([
          jittered(() => commitResults(db.sql, [{ jobId, tenant: "acme", summary: "s", notify: "a@b.co" }])),
          jittered(() => cancelJob(db.sql, jobId, "acme")),
        ]);
        const rows = await rowsOf(jobId);
        const [outcome] = await db.sql<{ outcome: string }[]>`SELECT outcome FROM job_outcomes WHERE job_id = ${jobId}`;
        if (committed.has(jobId)) {
          commits++;
          assert.equal(cancel, "done", "the cancel lost, and says so");
          assert.deepEqual(rows, { summaries: 1, outbox: 1 });
          assert.equal(outcome!.outcome, "done");
        } else {
          cancels++;
          assert.equal(cancel, "cancelled");
          assert.deepEqual(rows, { summaries: 0, outbox: 0 }, "a cancelled job has no effects");
          assert.equal(outcome!.outcome, "cancelled");
        }
      }
      // Both sides won some races: the test exercised the race, not one fixed order.
      assert.ok(commits > 0 && cancels > 0, `commits ${commits}, cancels ${cancels}`);
    });

    await t.step("cancel racing a running worker, through the API: every job is done xor cancelled", async () => {
      const fast = startFakeModel(() => ({ kind: "ok", delayMs: Math.floor(Math.random() * 30) }));
      const worker = startWorker(createOpenAiLlm({ apiKey: "k", model: "m", baseURL: fast.url }));
      try {
        // The worker is reading before the race starts (on a loaded machine, and on a cluster, its start-up can
        // take longer than the cancels' random delays, and then every cancel would win without a race).
        const { job_id: warmUp } = await (await post("A warm-up job. It runs before the race.")).json();
        await waitFor(
          "the warm-up job done",
          async () => (await (await request("GET", warmUp)).json()).status === "done",
        );
        const random = seededRandom(7);
        const outcomes = await Promise.all(Array.from({ length: 60 }, async (_, i) => {
          const { job_id } = await (await post(`Race number ${i}. It ends one way.`)).json();
          await new Promise((resolve) => setTimeout(resolve, random() * 400));
          const cancel = await request("DELETE", job_id);
          await cancel.body?.cancel();
          return { job_id, cancel: cancel.status };
        }));
        let done = 0, cancelled = 0;
        for (const { job_id, cancel } of outcomes) {
          const final = await waitFor("a final status", async () => {
            const doc = await (await request("GET", job_id)).json();
            return doc.status === "done" || doc.status === "cancelled" ? doc.status : false;
          }, 10_000);
          const rows = await rowsOf(job_id);
          if (cancel === 200) {
            cancelled++;
            assert.equal(final, "cancelled");
            assert.deepEqual(rows, { summaries: 0, outbox: 0 });
          } else {
            done++;
            assert.equal(cancel, 409);
            assert.equal(final, "done");
            assert.deepEqual(rows, { summaries: 1, outbox: 1 });
          }
        }
        assert.ok(done > 0 && cancelled > 0, `done ${done}, cancelled ${cancelled}: both sides won some races`);
      } finally {
        await worker.close();
        await fast.close();
      }
    });
  } finally {
    await waiter.close();
    await model.close();
    await r.close();
    await db.close();
  }
});
