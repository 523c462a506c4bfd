/**
 * The record of model attempts: a real worker calls a fake provider that
 * reports known token counts (and fails some calls), and `deno task usage`
 * and GET report exactly those totals and what they were charged; rows of
 * task runs and cache hits, written as the worker and the cache write them,
 * are reported per task version and model.
 */
import assert from "node:assert/strict";
import { parseSince, usageCommand, usageReport } from "../../src/cli/usage_command.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { type AttemptRowSpec, recordAttempt, recordCacheHit } from "../support/run_rows.ts";
import { costNanos, createPrices, nanosToUsd } from "../../src/llm/prices.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("--since parses seconds, minutes, hours and days, and names a mistake", () => {
  assert.equal(parseSince("90s"), 90);
  assert.equal(parseSince("30m"), 1800);
  assert.equal(parseSince("24h"), 86_400);
  assert.equal(parseSince("7d"), 604_800);
  assert.throws(() => parseSince("yesterday"), /since takes a number and a unit/);
  assert.equal(parseSince("400d"), 400 * 86_400);
  assert.throws(() => parseSince("401d"), /since must be from 1s to 400d/);
  assert.throws(() => parseSince("0s"), /since must be from 1s/);
});

Deno.test("usage and GET report the provider's exact token counts, failures and retries", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // Each document asks for its own token counts; "FLAKY" ones get a 503 on their first call.
  const seenFlaky = new Set<string>();
  const model = startFakeModel((_, prompt) => {
    const [, p, c] = /tokens (\d+)\/(\d+)/.exec(prompt) ?? [];
    if (prompt.includes("FLAKY") && !seenFlaky.has(prompt)) {
      seenFlaky.add(prompt);
      return { kind: "status", status: 503 };
    }
    return { kind: "ok", usage: { prompt_tokens: Number(p), completion_tokens: Number(c) } };
  });
  const stop = new AbortController();
  const worker = summaryWorker({
    redis: r.redis,
    sql: db.sql,
    llm: createOpenAiLlm({ apiKey: "k", model: "gpt-test", baseURL: model.url }),
    keys,
    prices: createPrices({ LLM_PRICE_IN_PER_MTOK: 0.4, LLM_PRICE_OUT_PER_MTOK: 1.6 }),
  }, {
    job: {
      budgetMs: 10_000,
      perCallTimeoutMs: 5_000,
      maxAttempts: 3,
      backoffBaseMs: 1,
      backoffCapMs: 5,
      model: "gpt-test",
    },
  });
  const running = worker.run(stop.signal);
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key" });
  const keysByTenant = { acme: await createApiKey(db.sql, "acme"), globex: await createApiKey(db.sql, "globex") };
  const jobs: { tenant: "acme" | "globex"; prompt: number; completion: number; flaky: boolean }[] = [
    { tenant: "acme", prompt: 120, completion: 30, flaky: false },
    { tenant: "acme", prompt: 1_000, completion: 250, flaky: true },
    { tenant: "acme", prompt: 7, completion: 3, flaky: false },
    { tenant: "globex", prompt: 55, completion: 45, flaky: true },
  ];
  try {
    const ids = await Promise.all(jobs.map(async (job, i) => {
      const res = await handler(
        new Request("http://api/v1/summaries", {
          method: "POST",
          headers: {
            authorization: `Bearer ${keysByTenant[job.tenant]}`,
            "content-type": "application/json",
            "idempotency-key": `usage-key-${String(i).padStart(8, "0")}`,
          },
          body: JSON.stringify({
            text: `Job ${i} wants tokens ${job.prompt}/${job.completion}.${job.flaky ? " FLAKY" : ""} Done.`,
            notify: "ops@example.com",
          }),
        }),
      );
      return (await res.json()).job_id as string;
    }));
    // Done, and every attempt recorded (the record is written in batches, within a second).
    await waitFor("every attempt recorded", async () => {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM model_attempts`;
      return row!.n === jobs.length + jobs.filter((j) => j.flaky).length;
    }, 10_000);

    const report = await usageReport(db.sql, { sinceS: 3600 });
    const acme = jobs.filter((j) => j.tenant === "acme");
    const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
    assert.deepEqual(
      report.map((row) => [row.tenant, row.task, row.version, row.model]),
      [["acme", "summarize", 1, "gpt-test"], ["globex", "summarize", 1, "gpt-test"]],
      "summary jobs are runs of summarize v1",
    );
    const [a, g] = report;
    assert.equal(a!.prompt_tokens, sum(acme.map((j) => j.prompt)));
    assert.equal(a!.completion_tokens, sum(acme.map((j) => j.completion)));
    assert.equal(a!.calls, 4, "three jobs, one of them called twice");
    assert.equal(a!.jobs, 3);
    assert.equal(a!.failures, 1);
    assert.equal(a!.retries, 1);
    assert.ok(a!.p50_ms! > 0 && a!.p99_ms! >= a!.p50_ms!);
    // Each answered call charged at the price, rounded up to the nano-dollar; the 503 charged nothing.
    const price = { in: 0.4, out: 1.6 };
    assert.equal(a!.cost_usd, nanosToUsd(sum(acme.map((j) => costNanos(price, j.prompt, j.completion)))));
    assert.equal(a!.unpriced_calls, 0);
    assert.deepEqual([g!.prompt_tokens, g!.completion_tokens, g!.calls, g!.failures, g!.retries], [55, 45, 2, 1, 1]);

    // The record itself: request ids, statuses, error classes.
    const rows = await db.sql<{ outcome: string; status: number | null; error: string | null; req: string | null }[]>`
      SELECT outcome, status, error, provider_request_id AS req FROM model_attempts ORDER BY started_at`;
    assert.ok(rows.filter((x) => x.outcome === "ok").every((x) => x.req?.startsWith("req_") && x.error === null));
    assert.ok(rows.filter((x) => x.outcome === "retry").every((x) => x.status === 503 && x.error));

    // The CLI: JSON lines, one tenant, its cost as recorded.
    const lines: string[] = [];
    assert.equal(
      await usageCommand(db.sql, ["--tenant", "globex", "--since", "1h", "--json"], {
        out: (l) => lines.push(l),
      }),
      0,
    );
    assert.equal(lines.length, 1);
    const only = JSON.parse(lines[0]!);
    assert.deepEqual([only.tenant, only.task, only.version], ["globex", "summarize", 1]);
    assert.equal(only.cost_usd, nanosToUsd(costNanos(price, 55, 45)));
    assert.deepEqual([only.cache_hits, only.saved_usd], [0, null]);
    assert.equal(await usageCommand(db.sql, ["--since", "yesterday"], { out: () => {} }), 2);

    // GET carries the job's attempts and tokens.
    const doc = await (await handler(
      new Request(`http://api/v1/summaries/${ids[1]}`, { headers: { authorization: `Bearer ${keysByTenant.acme}` } }),
    )).json();
    assert.deepEqual([doc.status, doc.attempts, doc.tokens], ["done", 2, 1_250]);
    assert.equal(doc.cost_usd, nanosToUsd(costNanos(price, 1_000, 250)));
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await model.close();
    await r.close();
    await db.close();
  }
});

Deno.test("usage reports per tenant, task, task version and model, from rows as the worker and cache write them", async () => {
  const db = await createTestDatabase();
  try {
    const id = () => crypto.randomUUID();
    const s1 = id(), e1 = id(), e2 = id(), e3 = id(), g1 = id(), old = id();
    const calls: AttemptRowSpec[] = [
      // A summary job (summarize v1): a 503, then an answer.
      {
        runId: s1,
        tenant: "acme",
        outcome: "retry",
        status: 503,
        promptTokens: null,
        completionTokens: null,
        costUsd: "0",
      },
      { runId: s1, tenant: "acme", attempt: 2, promptTokens: 100, completionTokens: 20, costUsd: "0.00014" },
      // extract v1 on gpt-a; extract v2 on gpt-a and, for another run, on gpt-b.
      { runId: e1, tenant: "acme", task: "extract", version: 1, model: "gpt-a", promptTokens: 10, completionTokens: 1 },
      { runId: e2, tenant: "acme", task: "extract", version: 2, model: "gpt-a", promptTokens: 20, completionTokens: 2 },
      // gpt-b: the first call priced, the second recorded without a price.
      {
        runId: e3,
        tenant: "acme",
        task: "extract",
        version: 2,
        model: "gpt-b",
        promptTokens: 40,
        completionTokens: 4,
        costUsd: "0.000048001",
      },
      { runId: e3, tenant: "acme", task: "extract", version: 2, model: "gpt-b", attempt: 2, promptTokens: 80 },
      {
        runId: g1,
        tenant: "globex",
        task: "extract",
        version: 1,
        model: "gpt-a",
        promptTokens: 5,
        completionTokens: 5,
      },
      // Two days old: outside --since 24h.
      {
        runId: old,
        tenant: "acme",
        task: "extract",
        version: 1,
        model: "gpt-a",
        promptTokens: 9_999,
        startedAt: new Date(Date.now() - 2 * 86_400_000),
      },
    ];
    for (const call of calls) await recordAttempt(db.sql, call);
    // Cache hits: two of extract v2 on gpt-a, one of a task never called (classify), another tenant's, an old one.
    const hit = { tenant: "acme", task: "extract", version: 2, model: "gpt-a", savedPromptTokens: 20 };
    await recordCacheHit(db.sql, { ...hit, runId: id(), savedCompletionTokens: 2, savedUsd: "0.000024" });
    await recordCacheHit(db.sql, { ...hit, runId: id(), savedCompletionTokens: 3, savedUsd: "0.000026" });
    await recordCacheHit(db.sql, {
      runId: id(),
      tenant: "acme",
      task: "classify",
      model: "gpt-a",
      savedPromptTokens: 7,
    });
    await recordCacheHit(db.sql, { ...hit, runId: id(), tenant: "globex", savedUsd: "1" });
    await recordCacheHit(db.sql, {
      ...hit,
      runId: id(),
      savedUsd: "1",
      createdAt: new Date(Date.now() - 2 * 86_400_000),
    });

    const report = await usageReport(db.sql, { sinceS: 86_400 });
    assert.deepEqual(
      report.map((r) => [r.tenant, r.task, r.version, r.model, r.calls, r.jobs, r.prompt_tokens, r.completion_tokens]),
      [
        ["acme", "classify", 1, "gpt-a", 0, 0, 0, 0],
        ["acme", "extract", 1, "gpt-a", 1, 1, 10, 1],
        ["acme", "extract", 2, "gpt-a", 1, 1, 20, 2],
        ["acme", "extract", 2, "gpt-b", 2, 1, 120, 4],
        ["acme", "summarize", 1, "gpt-test", 2, 1, 100, 20],
        ["globex", "extract", 1, "gpt-a", 1, 1, 5, 5],
        ["globex", "extract", 2, "gpt-a", 0, 0, 0, 0],
      ],
    );
    const summarize = report.find((r) => r.task === "summarize")!;
    assert.deepEqual([summarize.failures, summarize.retries, summarize.cost_usd], [1, 1, 0.00014]);
    const gptB = report.find((r) => r.model === "gpt-b")!;
    assert.deepEqual([gptB.retries, gptB.cost_usd, gptB.unpriced_calls], [1, 0.000048001, 1]);
    assert.equal(report.find((r) => r.task === "extract" && r.version === 1)!.cost_usd, null, "no price, no cost");
    // Cache hits and what they saved, on the lines of their task version and model.
    const cached = report.find((r) =>
      r.tenant === "acme" && r.task === "extract" && r.model === "gpt-a" && r.version === 2
    )!;
    assert.deepEqual(
      [cached.calls, cached.cache_hits, cached.saved_prompt_tokens, cached.saved_completion_tokens, cached.saved_usd],
      [1, 2, 40, 5, 0.00005],
    );
    const classify = report.find((r) => r.task === "classify")!;
    assert.deepEqual(
      [classify.cache_hits, classify.saved_prompt_tokens, classify.saved_usd, classify.p50_ms, classify.cost_usd],
      [1, 7, null, null, null],
    );
    assert.equal(report.find((r) => r.tenant === "globex" && r.version === 2)!.cache_hits, 1);

    // The table: the task and version columns after the tenant, one line per task version and model.
    const table: string[] = [];
    assert.equal(await usageCommand(db.sql, ["--tenant", "acme"], { out: (l) => table.push(l) }), 0);
    assert.match(table[0]!, /^tenant\s+task\s+version\s+model\s+calls\s+jobs\s+prompt_tokens\s+completion_tokens\s/);
    assert.deepEqual(
      table.slice(1).map((l) => l.split(/\s+/).slice(0, 5)),
      [
        ["acme", "classify", "1", "gpt-a", "0"],
        ["acme", "extract", "1", "gpt-a", "1"],
        ["acme", "extract", "2", "gpt-a", "1"],
        ["acme", "extract", "2", "gpt-b", "2"],
        ["acme", "summarize", "1", "gpt-test", "2"],
      ],
    );
    assert.match(
      table[0]!,
      /\scost_usd\s+unpriced_calls\s+batch_calls\s+cache_hits\s+saved_prompt_tokens\s+saved_completion_tokens\s+saved_usd$/,
    );

    // JSON lines carry task and version; --since reaches the older call.
    const lines: string[] = [];
    assert.equal(
      await usageCommand(db.sql, ["--tenant", "acme", "--since", "3d", "--json"], { out: (l) => lines.push(l) }),
      0,
    );
    const extractV1 = lines.map((l) => JSON.parse(l)).find((r) => r.task === "extract" && r.version === 1);
    assert.deepEqual([extractV1.calls, extractV1.jobs, extractV1.prompt_tokens], [2, 2, 10_009]);
    const extractV2 = lines.map((l) => JSON.parse(l)).find((r) =>
      r.task === "extract" && r.model === "gpt-a" && r.version === 2
    );
    assert.deepEqual([extractV2.cache_hits, extractV2.saved_usd], [3, 1.00005], "the older hit is within 3d");
    assert.equal(lines.length, 5);
  } finally {
    await db.close();
  }
});
