/**
 * The result cache end to end: the real API handler, a worker calling the
 * fake model (which counts calls) through the real openai SDK, the commit
 * with its outbox and cache_hits rows, and the relay sending every run's own
 * email. Effects are counted: model calls, runs, cache_hits rows, outbox
 * rows, emails.
 */
import assert from "node:assert/strict";
import { OUTCOME_MIN_AGE_MS } from "../../src/processes/relay_process.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { createLogger, silentLogger } from "../../src/log/logger.ts";
import { createRegistry, resultCacheMetrics } from "../../src/metrics/metrics.ts";
import { resultCacheEvents } from "../../src/processes/metrics_wiring.ts";
import { createPrices } from "../../src/llm/prices.ts";
import { Deadline } from "../../src/retry/deadline.ts";
import { JobDeferred } from "../../src/queue/errors.ts";
import { createRetention } from "../../src/retention/retention.ts";
import { cacheKeyHash, createResultCache, skipsCache } from "../../src/cache/result_cache.ts";
import { commitResults } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { runOfPayload, summaryPayload } from "../../src/runs/run_payload.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, recordingLogger, waitFor } from "../_support.ts";

const OBJECT = (properties: Record<string, unknown>, required = Object.keys(properties)) => ({
  type: "object",
  properties,
  required,
  additionalProperties: false,
});

const LABEL = {
  prompt: "Label this ticket: {{input.ticket}}",
  model: "cache-model",
  input_schema: OBJECT({ ticket: { type: "string" }, lang: { type: "string" } }, ["ticket"]),
  output_schema: OBJECT({ label: { type: "string" } }),
  max_output_tokens: 50,
  cache_ttl_s: 3600,
};

/** What each call reports using, so a hit's saved tokens and cost can be checked to the token. */
const USAGE = { prompt_tokens: 120, completion_tokens: 30 };

Deno.test("Cache-Control: no-cache is read as a directive of the list, in any case", () => {
  const h = (v?: string) => new Headers(v === undefined ? {} : { "cache-control": v });
  assert.equal(skipsCache(h()), false);
  assert.equal(skipsCache(h("no-cache")), true);
  assert.equal(skipsCache(h("max-age=0, No-Cache")), true);
  assert.equal(skipsCache(h('no-cache="set-cookie"')), true);
  assert.equal(skipsCache(h("no-store")), false);
  assert.equal(skipsCache(h("max-age=60")), false);
});

Deno.test("no_cache rides in the stream payload only when set; payloads queued before it read as before", () => {
  const request = { text: "Some text.", notify: "a@b.co" };
  assert.equal(summaryPayload(request), JSON.stringify(request));
  assert.equal(runOfPayload(summaryPayload(request)).noCache, undefined);
  const skipping = runOfPayload(summaryPayload(request, { noCache: true }));
  assert.deepEqual(skipping, {
    task: "summarize",
    version: 1,
    input: { text: "Some text." },
    notify: "a@b.co",
    summary: true,
    noCache: true,
  });
  assert.equal(runOfPayload('{"task":"t","version":1,"input":{"a":1}}').noCache, undefined);
  assert.equal(runOfPayload('{"task":"t","version":1,"input":{"a":1},"no_cache":true}').noCache, true);
  // Anything else in a summary's payload is still refused, as at intake.
  assert.throws(() => runOfPayload('{"text":"x","notify":"a@b.co","no_cache":false}'));
});

Deno.test("the result cache: off at a TTL of 0, keyed per tenant, waiters take over a lapsed lock", async (t) => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const cacheWith = (defaultTtlS: number) =>
    createResultCache({ redis: r.redis, log: silentLogger }, {
      defaultTtlS,
      keys: (tenant) => keys.cache(tenant),
      leaseMs: 300,
      pollMinMs: 5,
      pollMaxMs: 20,
    });
  const run = (runId: string, over: Record<string, unknown> = {}) => ({
    tenant: "acme",
    runId,
    task: "label",
    version: 1,
    model: "m",
    input: { a: 1, b: [1, { c: 2, d: 3 }] },
    noCache: false,
    ...over,
  });
  const deadline = () => Deadline.after(5_000);
  const signal = new AbortController().signal;
  try {
    await t.step("a TTL of 0 (the default, or the task's own 0) turns it off: no Redis at all", () => {
      assert.equal(cacheWith(0).forRun(run(crypto.randomUUID())), undefined);
      assert.equal(cacheWith(60).forRun(run(crypto.randomUUID(), { ttlS: 0 })), undefined);
      assert.ok(cacheWith(0).forRun(run(crypto.randomUUID(), { ttlS: 60 })));
    });

    await t.step("the first run holds the key; an identical one waits and gets its result", async () => {
      const cache = cacheWith(60);
      const [a, b] = [
        cache.forRun(run("run-a"))!,
        cache.forRun(run("run-b", { input: { b: [1, { d: 3, c: 2 }], a: 1 } }))!,
      ];
      assert.deepEqual(await a.claim(signal, deadline()), { held: true, waited: false });
      const waiting = b.claim(signal, deadline());
      await a.fill({ output: { x: 1 }, model: "m", promptTokens: 5, completionTokens: 7 });
      const got = await waiting;
      assert.deepEqual(got, {
        hit: { sourceRunId: "run-a", model: "m", promptTokens: 5, completionTokens: 7, savedUsd: null },
        output: { x: 1 },
        waited: true,
      });
      // Another tenant, model or version is another entry.
      for (const other of [{ tenant: "globex" }, { model: "m2" }, { version: 2 }]) {
        const c = cache.forRun(run(`run-${JSON.stringify(other)}`, other))!;
        assert.deepEqual(await c.claim(signal, deadline()), { held: true, waited: false });
        await c.release();
      }
    });

    await t.step("a holder that ends without a result frees the key: a waiter takes it over", async () => {
      const cache = cacheWith(60);
      const [a, b] = [
        cache.forRun(run("run-c", { input: { q: 1 } }))!,
        cache.forRun(run("run-d", { input: { q: 1 } }))!,
      ];
      assert.deepEqual(await a.claim(signal, deadline()), { held: true, waited: false });
      const waiting = b.claim(signal, deadline());
      await a.release();
      assert.deepEqual(await waiting, { held: true, waited: true });
      await b.release();
    });

    await t.step("a crashed holder's lock lapses with its lease, and a waiter takes over", async () => {
      const input = { q: 2 };
      const lock = keys.cache("acme").lock(cacheKeyHash(run("", { input })));
      // A holder whose process died: its lease is not renewed any more.
      await r.redis.set(lock, "dead-run", "PX", 200);
      const b = cacheWith(60).forRun(run("run-e", { input }))!;
      assert.deepEqual(await b.claim(signal, deadline()), { held: true, waited: true });
      assert.equal(await r.redis.get(lock), "run-e");
      await b.release();
      assert.equal(await r.redis.get(lock), null);
    });

    await t.step("a live holder keeps its lease; a waiter at its own deadline goes back to its lane", async () => {
      const cache = cacheWith(60);
      const a = cache.forRun(run("run-f", { input: { q: 3 } }))!;
      assert.deepEqual(await a.claim(signal, deadline()), { held: true, waited: false });
      const b = cache.forRun(run("run-g", { input: { q: 3 } }))!;
      // Longer than the 300 ms lease: only the holder's renewal keeps the lock.
      // Deferred (back to the end of its lane, no delivery spent), not failed like a run that timed out.
      await assert.rejects(b.claim(signal, Deadline.after(800)), JobDeferred);
      await a.release();
    });
  } finally {
    await r.close();
  }
});

Deno.test("runs with the result cache", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // Bad answers still to give (for the failing holder), then valid ones; every answer takes a while, so that
  // identical runs are in flight together.
  let badAnswers = 0;
  const model = startFakeModel((_, prompt) => {
    const delayMs = prompt.includes("Hold") || prompt.includes("Printer on fire") ? 800 : 300;
    if (badAnswers > 0) {
      badAnswers--;
      return { kind: "ok", delayMs, content: "{}", usage: USAGE };
    }
    return { kind: "ok", delayMs, usage: USAGE };
  });
  const mail = startFakeMail();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const acme = await createApiKey(db.sql, "acme");
  const globex = await createApiKey(db.sql, "globex");
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: model.url });
  const registry = createRegistry();
  const lines = recordingLogger();
  const log = createLogger({ write: lines.write });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, log }, {
    concurrency: 32,
    cache: {
      // RESULT_CACHE_TTL_S: summaries (and tasks that set no cache_ttl_s) cache too.
      defaultTtlS: 3600,
      prices: createPrices({ LLM_PRICES: { "cache-model": { in: 1, out: 2 } } }),
      events: resultCacheEvents(resultCacheMetrics(registry)),
    },
  });
  const relay = relayTo({ sql: db.sql, mailUrl: mail.url });
  const stop = new AbortController();
  const running = [worker.run(stop.signal), relay.run(stop.signal)];
  const call = async (key: string, method: string, path: string, body?: unknown, headers = {}) => {
    const res = await api(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${key}`, "content-type": "application/json", ...headers },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, body: await res.json() };
  };
  let posted = 0;
  /** Posts a run under a new Idempotency-Key; @returns its id. */
  const post = async (key: string, task: string, body: unknown, headers: Record<string, string> = {}) => {
    const res = await call(key, "POST", `/v1/tasks/${task}/runs`, body, {
      "idempotency-key": `cache-test-${String(++posted).padStart(6, "0")}`,
      ...headers,
    });
    assert.equal(res.status, 202, JSON.stringify(res.body));
    return res.body.run_id as string;
  };
  const statuses = async (ids: string[]) =>
    (await db.sql<{ status: string }[]>`SELECT status FROM runs WHERE run_id = ANY(${ids}::uuid[])`)
      .map((r) => r.status);
  const finished = (ids: string[]) =>
    waitFor(`${ids.length} runs to finish`, async () => (await statuses(ids)).length === ids.length, 30_000);
  const callsFor = (ticket: string) => model.prompts.filter((p) => p.includes(ticket)).length;
  const hitsOf = (ids: string[]) =>
    db.sql<
      {
        run_id: string;
        source_run_id: string;
        saved_prompt_tokens: number;
        saved_completion_tokens: number;
        saved_usd: string | null;
        model: string | null;
        task: string;
      }[]
    >`
      SELECT run_id::text, source_run_id::text, saved_prompt_tokens, saved_completion_tokens, saved_usd::text, model,
        task
      FROM cache_hits WHERE run_id = ANY(${ids}::uuid[])`;
  const lookups = async (tenant: string, result: string) => {
    const metric = await registry.getSingleMetric("oncely_result_cache_lookups_total")!.get();
    return metric.values.find((v) => v.labels.tenant === tenant && v.labels.result === result)?.value ?? 0;
  };
  try {
    assert.equal((await call(acme, "PUT", "/v1/tasks/label", LABEL)).status, 201);

    await t.step("50 identical runs posted at once make exactly 1 model call and 50 notifications", async () => {
      const ids = await Promise.all(
        Array.from({ length: 50 }, (_, i) =>
          post(acme, "label", {
            // Key order differs between runs: the cache key is the input's canonical form.
            input: i % 2 ? { ticket: "Printer on fire", lang: "en" } : { lang: "en", ticket: "Printer on fire" },
            notify: "ops@example.com",
          })),
      );
      await finished(ids);
      assert.deepEqual(await statuses(ids), Array(50).fill("done"));
      assert.equal(callsFor("Printer on fire"), 1, "one model call between the 50 runs");
      const hits = await hitsOf(ids);
      assert.equal(hits.length, 49);
      const source = ids.find((id) => !hits.some((h) => h.run_id === id))!;
      for (const h of hits) {
        assert.equal(h.source_run_id, source);
        assert.equal(h.task, "label");
        assert.equal(h.model, "cache-model");
        assert.equal(h.saved_prompt_tokens, USAGE.prompt_tokens);
        assert.equal(h.saved_completion_tokens, USAGE.completion_tokens);
        // 120 tokens at 1 USD and 30 at 2 USD per million.
        assert.equal(Number(h.saved_usd), 0.00018);
      }
      const [row] = await db.sql<{ cached: number; results: number; outbox: number }[]>`
        SELECT (SELECT count(*) FROM runs WHERE run_id = ANY(${ids}::uuid[]) AND cached)::int AS cached,
          (SELECT count(*) FROM run_results WHERE run_id = ANY(${ids}::uuid[]) AND cached)::int AS results,
          (SELECT count(*) FROM outbox WHERE dedupe_key = ANY(${ids.map((id) => `run_done:${id}`)}))::int AS outbox`;
      assert.deepEqual(row, { cached: 49, results: 49, outbox: 50 });
      // Each run's own email, once.
      const emailed = () => mail.delivered.filter((e) => ids.some((id) => e.idempotencyKey === `run_done:${id}`));
      await waitFor("50 emails", () => emailed().length === 50, 20_000);
      assert.equal(new Set(emailed().map((e) => e.idempotencyKey)).size, 50);
      // GET: a hit made no call (no attempts, no tokens) and says so; the source shows its call.
      const hit = await call(acme, "GET", `/v1/runs/${hits[0]!.run_id}`);
      const got = await waitFor("the source's attempt recorded", async () => {
        const doc = await call(acme, "GET", `/v1/runs/${source}`);
        return doc.body.attempts === 1 ? doc : undefined;
      });
      assert.deepEqual(hit.body, {
        run_id: hits[0]!.run_id,
        task: "label",
        version: 1,
        status: "done",
        output: got.body.output,
        model: "cache-model",
        attempts: 0,
        tokens: { prompt: 0, completion: 0 },
        cached: true,
      });
      assert.equal(got.body.cached, undefined);
      assert.deepEqual(got.body.tokens, { prompt: 120, completion: 30 });
      const [attempts] = await db.sql<{ n: number }[]>`
        SELECT count(*)::int AS n FROM model_attempts WHERE job_id = ANY(${ids}::uuid[])`;
      assert.equal(attempts!.n, 1, "a hit writes no model_attempts row");
      assert.equal(await lookups("acme", "hit"), 49);
      assert.equal(await lookups("acme", "miss"), 1);
      // In flight together: with 32 runs at once and a slow model, at least the other 31 of the first 32 waited for
      // the one call (the rest may have come after it and found the entry).
      const done = lines.lines.filter((l) => l.event === "job_done" && ids.includes(l.job_id as string));
      const waited = done.filter((l) => l.cached && l.waited).length;
      assert.ok(waited >= 31, `${waited} runs waited`);
      console.log(`50 identical runs: 1 model call, ${waited} hits waited for it in flight, ${49 - waited} came after`);
    });

    await t.step("with Cache-Control: no-cache, each of 50 identical runs makes its own call", async () => {
      const before = callsFor("Printer on fire");
      const ids = await Promise.all(
        Array.from(
          { length: 50 },
          () =>
            post(acme, "label", { input: { ticket: "Printer on fire", lang: "en" } }, { "cache-control": "no-cache" }),
        ),
      );
      await finished(ids);
      assert.deepEqual(await statuses(ids), Array(50).fill("done"));
      assert.equal(callsFor("Printer on fire") - before, 50);
      assert.equal((await hitsOf(ids)).length, 0);
      assert.equal((await call(acme, "GET", `/v1/runs/${ids[0]}`)).body.cached, undefined);
    });

    await t.step("another tenant's identical input makes its own call, then hits its own entry", async () => {
      assert.equal((await call(globex, "PUT", "/v1/tasks/label", LABEL)).status, 201);
      const before = callsFor("Printer on fire");
      const first = await post(globex, "label", { input: { ticket: "Printer on fire", lang: "en" } });
      await finished([first]);
      assert.equal(callsFor("Printer on fire") - before, 1);
      assert.equal((await hitsOf([first])).length, 0);
      const second = await post(globex, "label", { input: { ticket: "Printer on fire", lang: "en" } });
      await finished([second]);
      assert.equal(callsFor("Printer on fire") - before, 1);
      assert.deepEqual((await hitsOf([second])).map((h) => h.source_run_id), [first]);
      assert.equal(await lookups("globex", "hit"), 1);
    });

    await t.step("another input or another version is a miss; the old version still hits", async () => {
      const other = await post(acme, "label", { input: { ticket: "Printer on fire", lang: "fr" } });
      await finished([other]);
      assert.equal((await hitsOf([other])).length, 0);
      assert.equal((await call(acme, "PUT", "/v1/tasks/label", { ...LABEL, temperature: 0 })).body.version, 2);
      const v2 = await post(acme, "label", { input: { ticket: "Printer on fire", lang: "en" } });
      const v1 = await post(acme, "label", { input: { ticket: "Printer on fire", lang: "en" }, version: 1 });
      await finished([v2, v1]);
      assert.equal((await hitsOf([v2])).length, 0);
      assert.equal((await hitsOf([v1])).length, 1);
    });

    await t.step("a task version with cache_ttl_s 0 never caches, whatever RESULT_CACHE_TTL_S says", async () => {
      await call(acme, "PUT", "/v1/tasks/fresh", { ...LABEL, cache_ttl_s: 0, prompt: "Fresh: {{input.ticket}}" });
      const ids: string[] = [];
      for (let i = 0; i < 3; i++) {
        ids.push(await post(acme, "fresh", { input: { ticket: "Always fresh" } }));
        await finished(ids);
      }
      assert.equal(callsFor("Always fresh"), 3);
      assert.equal((await hitsOf(ids)).length, 0);
    });

    await t.step("summaries follow RESULT_CACHE_TTL_S: the second identical one is cached, emailed too", async () => {
      const text = "Summaries cache too. The second identical document costs nothing. Someone lost an umbrella.";
      const summary = async (key: string, headers: Record<string, string> = {}) => {
        const res = await call(acme, "POST", "/v1/summaries", { text, notify: "ops@example.com" }, {
          "idempotency-key": key,
          ...headers,
        });
        assert.equal(res.status, 202);
        await finished([res.body.job_id]);
        return res.body.job_id as string;
      };
      const first = await summary("cache-summary-0001");
      const second = await summary("cache-summary-0002");
      assert.equal(callsFor("Summaries cache too"), 1);
      const doc = await call(acme, "GET", `/v1/summaries/${second}`);
      assert.equal(doc.body.status, "done");
      assert.equal(doc.body.cached, true);
      assert.equal(doc.body.attempts, undefined);
      assert.equal(typeof doc.body.summary, "string");
      const [hit] = await hitsOf([second]);
      assert.deepEqual([hit!.source_run_id, hit!.task, hit!.saved_usd], [first, "summarize", null], "no price");
      await waitFor(
        "both summaries' emails",
        () => [first, second].every((id) => mail.delivered.some((e) => e.idempotencyKey === `summary_ready:${id}`)),
        10_000,
      );
      await summary("cache-summary-0003", { "cache-control": "no-cache" });
      assert.equal(callsFor("Summaries cache too"), 2);
    });

    await t.step("a holder cancelled during its call does not strand the runs waiting for it", async () => {
      const input = { ticket: "Hold then cancel" };
      const holder = await post(acme, "label", { input, version: 1 });
      await waitFor("the holder's call", () => callsFor("Hold then cancel") === 1);
      const waiters = [
        await post(acme, "label", { input, version: 1 }),
        await post(acme, "label", { input, version: 1 }),
      ];
      assert.equal((await call(acme, "DELETE", `/v1/runs/${holder}`)).body.status, "cancelled");
      await finished([holder, ...waiters]);
      assert.deepEqual(await statuses([holder]), ["cancelled"]);
      assert.deepEqual(await statuses(waiters), ["done", "done"]);
      // The holder's answer went nowhere; one waiter called, the other reused its result.
      assert.equal(callsFor("Hold then cancel"), 2);
      const hits = await hitsOf(waiters);
      assert.equal(hits.length, 1);
      assert.ok(waiters.includes(hits[0]!.source_run_id));
    });

    await t.step("a holder that fails for good does not strand the runs waiting for it", async () => {
      const input = { ticket: "Hold then fail" };
      // The holder's answer and its repair call's are both bad: it fails (output_invalid) after two calls.
      badAnswers = 2;
      const holder = await post(acme, "label", { input, version: 1 });
      await waitFor("the holder's call", () => callsFor("Hold then fail") === 1);
      const waiters = [
        await post(acme, "label", { input, version: 1 }),
        await post(acme, "label", { input, version: 1 }),
      ];
      await finished([holder, ...waiters]);
      assert.deepEqual(await statuses([holder]), ["failed"]);
      assert.deepEqual(await statuses(waiters), ["done", "done"]);
      assert.equal(callsFor("Hold then fail"), 2);
      assert.equal((await hitsOf(waiters)).length, 1);
    });

    await t.step("a hit committed twice (a redelivery) is one run, one outbox row and one cache_hits row", async () => {
      const jobId = crypto.randomUUID();
      const cacheHit = {
        sourceRunId: crypto.randomUUID(),
        model: "m",
        promptTokens: 1,
        completionTokens: 2,
        savedUsd: null,
      };
      const result = { jobId, tenant: "acme", summary: "Cached.", notify: "ops@example.com", cacheHit };
      assert.deepEqual([...await commitResults(db.sql, [result])], [jobId]);
      assert.deepEqual([...await commitResults(db.sql, [result])], []);
      const [row] = await db.sql<{ hits: number; outbox: number }[]>`
        SELECT (SELECT count(*) FROM cache_hits WHERE run_id = ${jobId})::int AS hits,
          (SELECT count(*) FROM outbox WHERE dedupe_key = ${`summary_ready:${jobId}`})::int AS outbox`;
      assert.deepEqual(row, { hits: 1, outbox: 1 });
    });

    await t.step("retention deletes cache_hits rows past MODEL_ATTEMPTS_RETENTION_S", async () => {
      const [all] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM cache_hits`;
      assert.ok(all!.n > 50);
      await db.sql`UPDATE cache_hits SET created_at = now() - interval '31 days' WHERE task = 'label'`;
      const retention = createRetention({ sql: db.sql, log: silentLogger }, {
        attemptRetentionMs: 30 * 86_400_000,
        outcomeMinAgeMs: OUTCOME_MIN_AGE_MS,
      });
      await retention.runOnce();
      const [left] = await db.sql<{ label: number; rest: number }[]>`
        SELECT (count(*) FILTER (WHERE task = 'label'))::int AS label, (count(*) FILTER (WHERE task <> 'label'))::int AS rest
        FROM cache_hits`;
      assert.equal(left!.label, 0);
      assert.ok(left!.rest > 0);
    });
  } finally {
    stop.abort();
    await Promise.all(running);
    await worker.close();
    await Promise.all([model.close(), mail.close()]);
    await r.close();
    await db.close();
  }
});
