/**
 * Self-service usage: a real worker calls a fake provider that reports known
 * token counts, fails some calls with a 503 and holds one past the call
 * timeout; `GET /v1/usage` and `deno task usage --json` then report exactly
 * what the provider reported, charged at each model's price (the timed-out
 * call at its reservation), and a tenant never sees another's figures.
 */
import { type Budgets, worstCaseTokens } from "../../src/budgets/budgets.ts";
import assert from "node:assert/strict";
import { usageCommand } from "../../src/cli/usage_command.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { costNanos, createPrices, type ModelPrice, nanosToUsd } from "../../src/llm/prices.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import type { BudgetView } from "../../src/budgets/budget_view.ts";
import { UsageDocument } from "../../src/usage/usage_schemas.ts";
import { type ModelBehaviour, startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, summaryWorker } from "../support/fixtures.ts";
import { recordCacheHit } from "../support/run_rows.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const PRICES: Record<string, ModelPrice> = {
  "gpt-test": { in: 0.4, out: 1.6 },
  "gpt-big": { in: 2.5, out: 10 },
  // gpt-free has no price: its calls are recorded with no cost.
};

/** A task on a priced model and one on a model without a price. */
const TASKS = {
  extract: { prompt: "Extract the facts: {{input.text}}", model: "gpt-big", max_output_tokens: 300 },
  tag: { prompt: "Tag this: {{input.text}}", model: "gpt-free", max_output_tokens: 50 },
};
const INPUT_SCHEMA = { type: "object", properties: { text: { type: "string" } }, required: ["text"] };

/** What the fake provider did with one request, read from the request (the test's own ledger). */
interface Answer {
  tenant: string;
  model: string;
  task: string;
  /** The usage it reported; none for a refused or held call. */
  usage?: { prompt: number; completion: number };
  kind: "ok" | "503" | "held";
  /** The request's messages (system and user) and output cap: what the worker reserved (`worstCaseTokens`). */
  messages: string[];
  maxTokens: number;
}

Deno.test("GET /v1/usage and usage --json report what the provider reported, at each model's price", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  // A document asks for its token counts ("tokens P/C"); "FLAKY" gets a 503 first, "SLOW" is held past the
  // call timeout first (then answered: the run still finishes).
  const seen = new Set<string>();
  const answers: Answer[] = [];
  const model = startFakeModel((n, prompt): ModelBehaviour => {
    const body = model.bodies[n - 1] as {
      model: string;
      max_completion_tokens: number;
      messages: { content: string }[];
    };
    const [, p, c] = /tokens (\d+)\/(\d+)/.exec(prompt) ?? [];
    const answer: Answer = {
      tenant: /tenant (\w+)/.exec(prompt)![1]!,
      model: body.model,
      task: /^Extract/.test(prompt) ? "extract" : /^Tag/.test(prompt) ? "tag" : "summarize",
      kind: "ok",
      messages: body.messages.map((m) => m.content),
      maxTokens: body.max_completion_tokens,
    };
    answers.push(answer);
    for (const [marker, kind] of [["FLAKY", "503"], ["SLOW", "held"]] as const) {
      if (prompt.includes(marker) && !seen.has(prompt)) {
        seen.add(prompt);
        answer.kind = kind;
        return kind === "503" ? { kind: "status", status: 503 } : { kind: "hang" };
      }
    }
    answer.usage = { prompt: Number(p), completion: Number(c) };
    return { kind: "ok", usage: { prompt_tokens: Number(p), completion_tokens: Number(c) } };
  });
  const worker = summaryWorker({
    redis: r.redis,
    sql: db.sql,
    llm: createOpenAiLlm({ apiKey: "k", model: "gpt-test", baseURL: model.url }),
    keys,
    prices: createPrices({ LLM_PRICES: PRICES }),
  }, {
    job: {
      budgetMs: 20_000,
      // LLM_CALL_TIMEOUT_S: the held call is abandoned after this and charged its reservation.
      perCallTimeoutMs: 500,
      maxAttempts: 3,
      backoffBaseMs: 1,
      backoffCapMs: 5,
      model: "gpt-test",
    },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  const budget: BudgetView = {
    period: "day",
    unit: "usd",
    limit: 5,
    spent: 1.25,
    reserved: 0.5,
    resets_at: "2030-01-02T00:00:00.000Z",
  };
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    // Only the report's view of budgets is under test here (tests/budgets covers the real ones): intake sees none.
    budgets: {
      of: () => Promise.resolve(undefined),
      views: (tenant: string) => Promise.resolve(tenant === "acme" ? [budget] : []),
    } as Partial<Budgets> as Budgets,
  });
  const bearer = { acme: await createApiKey(db.sql, "acme"), globex: await createApiKey(db.sql, "globex") };
  const send = async (tenant: keyof typeof bearer, method: string, path: string, body?: unknown, key?: string) => {
    const res = await handler(
      new Request(`http://api${path}`, {
        method,
        headers: {
          authorization: `Bearer ${bearer[tenant]}`,
          "content-type": "application/json",
          ...(key ? { "idempotency-key": key } : {}),
        },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, body: await res.json() };
  };
  try {
    for (const [name, task] of Object.entries(TASKS)) {
      const put = await send("acme", "PUT", `/v1/tasks/${name}`, { ...task, input_schema: INPUT_SCHEMA });
      assert.equal(put.status, 201, JSON.stringify(put.body));
    }
    const work: { tenant: keyof typeof bearer; path: string; text: string }[] = [
      { tenant: "acme", path: "/v1/summaries", text: "tokens 120/30" },
      { tenant: "acme", path: "/v1/summaries", text: "tokens 1000/250 FLAKY" },
      { tenant: "acme", path: "/v1/summaries", text: "tokens 77/13 SLOW" },
      { tenant: "acme", path: "/v1/tasks/extract/runs", text: "tokens 401/99" },
      { tenant: "acme", path: "/v1/tasks/extract/runs", text: "tokens 333/111 FLAKY" },
      { tenant: "acme", path: "/v1/tasks/tag/runs", text: "tokens 17/4" },
      { tenant: "globex", path: "/v1/summaries", text: "tokens 55/45 FLAKY" },
    ];
    const ids = await Promise.all(work.map(async ({ tenant, path, text }, i) => {
      const doc = `Document ${i} of tenant ${tenant} wants ${text}. The end.`;
      const body = path === "/v1/summaries" ? { text: doc, notify: "ops@example.com" } : { input: { text: doc } };
      const res = await send(tenant, "POST", path, body, `usage-api-key-${String(i).padStart(6, "0")}`);
      assert.equal(res.status, 202, JSON.stringify(res.body));
      return (res.body.job_id ?? res.body.run_id) as string;
    }));
    // Every run done, and every request the provider saw recorded (the record is written in batches).
    await waitFor("every run done", async () => {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM job_outcomes WHERE outcome = 'done'`;
      return row!.n === work.length;
    }, 15_000);
    await waitFor("every call recorded", async () => {
      const [row] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM model_attempts`;
      return row!.n === answers.length;
    }, 5_000);
    assert.equal(answers.length, work.length + 4, "three 503s and one held call, each called again");

    // Cache hits as the result cache records them: acme's two, and one of globex's.
    await recordCacheHit(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "acme",
      task: "extract",
      model: "gpt-big",
      savedPromptTokens: 401,
      savedCompletionTokens: 99,
      savedUsd: "0.0019925",
    });
    await recordCacheHit(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "acme",
      model: "gpt-test",
      savedPromptTokens: 120,
      savedCompletionTokens: 30,
      savedUsd: "0.000096",
    });
    await recordCacheHit(db.sql, {
      runId: crypto.randomUUID(),
      tenant: "globex",
      savedPromptTokens: 9_999,
      savedUsd: "9",
    });

    // The ledger: each call charged at its model's price, the held one its reservation, a 503 nothing.
    const charged = (a: Answer) => {
      const price = PRICES[a.model];
      if (!price) return null;
      if (a.kind === "503") return 0;
      if (a.kind === "held") return costNanos(price, worstCaseTokens(a.messages, a.maxTokens).prompt, a.maxTokens);
      return costNanos(price, a.usage!.prompt, a.usage!.completion);
    };
    const expect = (calls: Answer[]) => {
      const costs = calls.map(charged).filter((c): c is number => c !== null);
      return {
        calls: calls.length,
        failures: calls.filter((a) => a.kind !== "ok").length,
        tokens: {
          prompt: calls.reduce((n, a) => n + (a.usage?.prompt ?? 0), 0),
          completion: calls.reduce((n, a) => n + (a.usage?.completion ?? 0), 0),
        },
        cost_usd: costs.length === 0 ? null : nanosToUsd(costs.reduce((n, c) => n + c, 0)),
        unpriced_calls: calls.length - costs.length,
      };
    };
    const acmeCalls = answers.filter((a) => a.tenant === "acme");
    const pick = ({ calls, failures, tokens, cost_usd, unpriced_calls }: Record<string, unknown>) => ({
      calls,
      failures,
      tokens,
      cost_usd,
      unpriced_calls,
    });

    // GET /v1/usage: acme's own figures, to the token and the nano-dollar.
    const got = await send("acme", "GET", "/v1/usage?since=1h");
    assert.equal(got.status, 200, JSON.stringify(got.body));
    const usage = UsageDocument.parse(got.body);
    assert.equal(usage.since, "1h");
    assert.deepEqual(pick(usage.totals), expect(acmeCalls));
    assert.deepEqual(usage.totals.tokens, {
      prompt: 120 + 1000 + 77 + 401 + 333 + 17,
      completion: 30 + 250 + 13 + 99 + 111 + 4,
    });
    assert.deepEqual(
      usage.by_model.map((m) => [m.model, pick(m)]),
      ["gpt-big", "gpt-free", "gpt-test"].map((name) => [name, expect(acmeCalls.filter((a) => a.model === name))]),
    );
    assert.deepEqual(
      usage.by_task.map((t) => [t.task, t.version, pick(t)]),
      ["extract", "summarize", "tag"].map((name) => [name, 1, expect(acmeCalls.filter((a) => a.task === name))]),
    );
    assert.equal(usage.by_model.find((m) => m.model === "gpt-free")!.cost_usd, null, "no price, no cost");
    // Cache hits and what they saved: acme's only.
    assert.deepEqual([usage.totals.cache_hits, usage.totals.saved], [2, {
      tokens: { prompt: 521, completion: 129 },
      cost_usd: 0.0020885,
    }]);
    assert.deepEqual(usage.by_task.find((t) => t.task === "extract")!.saved.tokens, { prompt: 401, completion: 99 });
    assert.deepEqual(usage.budgets, [budget]);

    // The held call: recorded with no usage, charged its reservation (the worst case: its messages' bytes and
    // framing, and the output cap).
    const held = answers.find((a) => a.kind === "held")!;
    const [row] = await db.sql<{ cost: string; prompt_tokens: number | null; deployment: string; error: string }[]>`
      SELECT cost_usd::text AS cost, prompt_tokens, deployment, error FROM model_attempts
      WHERE prompt_tokens IS NULL AND outcome = 'retry' AND status IS NULL`;
    const reservation = costNanos(
      PRICES["gpt-test"]!,
      worstCaseTokens(held.messages, held.maxTokens).prompt,
      held.maxTokens,
    );
    assert.equal(Number(row!.cost), nanosToUsd(reservation));
    assert.ok(reservation > 0);
    assert.deepEqual([row!.prompt_tokens, row!.deployment, row!.error], [null, "gpt-test", "AttemptTimeout"]);
    // Its run's document: the reservation plus the answered call.
    const slow = await send("acme", "GET", `/v1/runs/${ids[2]}`);
    assert.equal(slow.body.cost_usd, nanosToUsd(reservation + costNanos(PRICES["gpt-test"]!, 77, 13)));
    const summary = await send("acme", "GET", `/v1/summaries/${ids[2]}`);
    assert.equal(summary.body.cost_usd, slow.body.cost_usd);
    const tagged = await send("acme", "GET", `/v1/runs/${ids[5]}`);
    assert.deepEqual([tagged.body.tokens, tagged.body.cost_usd], [{ prompt: 17, completion: 4 }, undefined]);

    // usage --json: the same lines, per task version and model, adding up to the same totals.
    const lines: string[] = [];
    assert.equal(
      await usageCommand(db.sql, ["--tenant", "acme", "--since", "1h", "--json"], { out: (l) => lines.push(l) }),
      0,
    );
    const cli = lines.map((l) => JSON.parse(l));
    for (const line of cli) {
      const mine = expect(acmeCalls.filter((a) => a.task === line.task && a.model === line.model));
      assert.deepEqual(
        [line.calls, line.failures, line.prompt_tokens, line.completion_tokens, line.cost_usd, line.unpriced_calls],
        [mine.calls, mine.failures, mine.tokens.prompt, mine.tokens.completion, mine.cost_usd, mine.unpriced_calls],
      );
    }
    assert.equal(cli.reduce((n, l) => n + l.calls, 0), usage.totals.calls);
    assert.equal(cli.reduce((n, l) => n + l.cache_hits, 0), 2);

    // globex sees its own call and cache hit, nothing of acme's, and no budgets.
    const theirs = UsageDocument.parse((await send("globex", "GET", "/v1/usage")).body);
    assert.equal(theirs.since, "24h");
    assert.deepEqual(pick(theirs.totals), expect(answers.filter((a) => a.tenant === "globex")));
    assert.deepEqual([theirs.totals.calls, theirs.totals.cache_hits, theirs.totals.saved.cost_usd], [2, 1, 9]);
    assert.deepEqual(theirs.by_task.map((t) => t.task), ["summarize"]);
    assert.deepEqual(theirs.budgets, []);
  } finally {
    stop.abort();
    await running;
    await worker.close();
    await model.close();
    await r.close();
    await db.close();
  }
});

Deno.test("GET /v1/usage refuses a bad window or an unknown parameter, and needs credentials", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, { authMode: "api-key" });
  const key = await createApiKey(db.sql, "acme");
  const get = async (query: string, auth = `Bearer ${key}`) => {
    const res = await handler(new Request(`http://api/v1/usage${query}`, { headers: { authorization: auth } }));
    return { status: res.status, type: res.headers.get("content-type"), body: await res.json() };
  };
  try {
    for (const query of ["?since=yesterday", "?since=401d", "?since=0s", "?since=1h&since=2h", "?tenant=globex"]) {
      const res = await get(query);
      assert.equal(res.status, 400, query);
      assert.equal(res.type, "application/problem+json");
      assert.ok(res.body.detail, query);
    }
    assert.match((await get("?since=401d")).body.detail, /from 1s to 400d/);
    assert.equal((await get("", "Bearer onc_nope")).status, 401);
    // Nothing used yet, and no budgets dependency: zeros, no cost, an empty list of budgets.
    const empty = await get("?since=400d");
    assert.equal(empty.status, 200);
    assert.deepEqual([empty.body.totals.calls, empty.body.totals.cost_usd, empty.body.by_task, empty.body.budgets], [
      0,
      null,
      [],
      [],
    ]);
  } finally {
    await r.close();
    await db.close();
  }
});
