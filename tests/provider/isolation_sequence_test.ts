/**
 * The isolation cases one after another, as a service lives them (issue 36): one Redis, one provider (one model
 * server, so one shared flow-control key), one set of lanes, workers stopped and started between cases with the
 * configuration each case names. First each poison case alone (its own provider key and lanes), then the whole
 * sequence back to back; the healthy jobs' figures must agree within 1 s.
 *
 * A real summary worker with the shared flow control, the real `openai` SDK and a local provider whose answer
 * depends on the document: `HANG-ME` never answers, `FAIL-ME` always gets a 500, anything else takes one second;
 * it can send OpenAI's rate-limit headers, or stop, or answer 503 to everything (an outage). The worker runs the
 * isolation issue's settings (LLM_CALL_TIMEOUT_S=2, LLM_MAX_ATTEMPTS=2, MAX_DELIVERIES=3, CLAIM_IDLE_MS=1500) and
 * the default LLM_BREAKER_COOLDOWN_S of 30 s. Times are measured from outside: each job's POST (its enqueue) to
 * its summary row, read by polling Postgres.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createProviderFlow, providerStateKey, type ProviderStatus } from "../../src/provider/flow_control.ts";
import { listDeadLetters } from "../../src/queue/dead_letter.ts";
import { type ServiceKeys, serviceKeys } from "../../src/runs/keys.ts";
import { createSummaryWorker } from "../../src/runs/worker.ts";
import { createDeployment } from "../../src/provider/deployment.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { errorBody, type FakeModelServer, startFakeModel } from "../support/fake_model_server.ts";
import { createTestDatabase, createTestRedis, type TestDatabase, type TestRedis, waitFor } from "../_support.ts";

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const healthy = (i: number) => `Revenue rose ${i}% in Q3. Costs fell. The board approved the plan.`;
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

/** The provider: its answers depend on the document and on what the case switched it to. */
interface Provider {
  model: FakeModelServer;
  /** Send OpenAI's x-ratelimit-* headers with these limits (a provider that reports them), or none. */
  limits: { rpm: number; tpm: number } | null;
  /** Answer 503 to every call. */
  down: boolean;
  callsOf(marker: string): number;
}

function startProvider(): Provider {
  const provider: Provider = {
    limits: null,
    down: false,
    callsOf: (marker) => provider.model.prompts.filter((p) => p.includes(marker)).length,
    model: startFakeModel((_, prompt) => {
      if (provider.down) {
        return { kind: "status", status: 503, body: errorBody("The server is overloaded.", "server_error") };
      }
      if (prompt.includes("HANG-ME")) return { kind: "hang" };
      if (prompt.includes("FAIL-ME")) {
        return { kind: "status", status: 500, body: errorBody("The server had an error", "server_error") };
      }
      if (prompt.includes("QUICK")) return { kind: "ok", delayMs: 250 };
      const l = provider.limits;
      const headers = l && {
        "x-ratelimit-limit-requests": String(l.rpm),
        "x-ratelimit-remaining-requests": String(l.rpm - 1),
        "x-ratelimit-reset-requests": "60ms",
        "x-ratelimit-limit-tokens": String(l.tpm),
        "x-ratelimit-remaining-tokens": String(l.tpm - 2_000),
        "x-ratelimit-reset-tokens": "2s",
      };
      return { kind: "ok", delayMs: 1_000, ...(headers ? { headers } : {}) };
    }),
  };
  return provider;
}

/** One Redis, one database, one provider and one set of lanes: what a case runs against. */
interface Service {
  r: TestRedis;
  db: TestDatabase;
  provider: Provider;
  keys: ServiceKeys;
  stateKey: string;
  posted: Map<string, number>;
  workers: number;
}

function serviceOn(r: TestRedis, db: TestDatabase, name: string): Service {
  const provider = startProvider();
  const keys = serviceKeys(`${r.prefix}:${name}`);
  return {
    r,
    db,
    provider,
    keys,
    stateKey: providerStateKey(keys.prefix, { baseURL: provider.model.url, model: "m", apiKey: "sk-test" }),
    posted: new Map(),
    workers: 0,
  };
}

/** Starts a worker process's worth (its own flow, as a process has) with `tpm` configured or not. */
function startWorker(s: Service, { tpm, concurrency = 40 }: { tpm?: number; concurrency?: number } = {}) {
  const flow = createProviderFlow({ redis: s.r.redis, log: silentLogger }, {
    key: s.stateKey,
    tpm,
    cooldownMs: 30_000,
    probeLeaseMs: 7_000,
  });
  const worker = createSummaryWorker({
    redis: s.r.redis,
    sql: s.db.sql,
    models: createDeployment({
      llm: createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: s.provider.model.url }),
      flow,
      model: "m",
    }),
    log: silentLogger,
  }, {
    keys: s.keys,
    consumer: `w${s.workers++}`,
    claimIdleMs: 1_500,
    maxDeliveries: 3,
    concurrency,
    blockMs: 50,
    job: { budgetMs: 10_000, perCallTimeoutMs: 2_000, maxAttempts: 2, backoffBaseMs: 100, backoffCapMs: 500 },
  });
  const stop = new AbortController();
  const running = worker.run(stop.signal);
  return {
    flow,
    /** Stops as worker_process does: the last reports land, and its configuration is withdrawn. */
    async stop() {
      stop.abort();
      await running;
      await worker.close();
      await flow.settled();
      await flow.withdraw();
    },
  };
}

async function post(s: Service, tenant: string, text: string) {
  const jobId = crypto.randomUUID();
  s.posted.set(jobId, Date.now());
  await enqueueToLane(s.r.redis, s.keys, { jobId, tenant, request: { text, notify: "ops@example.com" } });
  return jobId;
}

/** Milliseconds from each job's POST to its summary row; absent while not done. */
async function latencies(s: Service, ids: string[]) {
  const rows = await s.db.sql<{ job_id: string; at: Date }[]>`
    SELECT job_id::text, created_at AS at FROM summaries WHERE job_id = ANY(${ids}::uuid[])`;
  return new Map(rows.map((row) => [row.job_id, row.at.getTime() - s.posted.get(row.job_id)!]));
}

/** When each of `ids` was dead-lettered in tenant `tenant`'s lane (epoch ms), for those that were. */
async function deadAt(s: Service, tenant: string, ids: string[]) {
  const dead = await listDeadLetters(s.r.redis, s.keys.lane(tenant), 1_000);
  return new Map(
    dead.filter((d) => ids.includes(d.fields.job_id!)).map((d) => [d.fields.job_id!, Number(d.id.split("-")[0])]),
  );
}

/** What one poison case measured. */
interface Figures {
  p50: number;
  max: number;
}

/**
 * `count` poison documents of tenant "bad", posted `leadMs` before another tenant's 36 healthy one-second jobs
 * (three a second for 12 s): every healthy job within 5 s of its POST, each poison document dead-lettered after at
 * most 6 calls (MAX_DELIVERIES × LLM_MAX_ATTEMPTS) within 60 s of its POST.
 */
async function poisonCase(
  s: Service,
  { poison, count, leadMs, tpm }: { poison: "FAIL-ME" | "HANG-ME"; count: number; leadMs: number; tpm?: number },
): Promise<Figures> {
  const worker = startWorker(s, { tpm });
  try {
    const tag = `${poison}-${crypto.randomUUID().slice(0, 8)}`;
    const bad: string[] = [];
    for (let i = 0; i < count; i++) bad.push(await post(s, "bad", `${tag}-${i} document.`));
    await sleep(leadMs);
    const good: string[] = [];
    for (let i = 0; i < 36; i++) {
      good.push(await post(s, "good", healthy(i)));
      await sleep(333);
    }
    await waitFor("every healthy job done", async () => (await latencies(s, good)).size === 36, 20_000);
    const took = [...(await latencies(s, good)).values()];
    const figures = { p50: median(took), max: Math.max(...took) };
    assert.ok(
      figures.max <= 5_000,
      `the slowest healthy job took ${figures.max} ms from its POST (p50 ${figures.p50})`,
    );
    await waitFor(
      "every poison document dead-lettered",
      async () => (await deadAt(s, "bad", bad)).size === count,
      60_000,
    );
    for (const [id, at] of await deadAt(s, "bad", bad)) {
      const after = at - s.posted.get(id)!;
      assert.ok(after <= 60_000, `dead-lettered ${after} ms after its POST`);
    }
    for (let i = 0; i < count; i++) {
      const calls = s.provider.callsOf(`${tag}-${i}`);
      assert.ok(calls <= 6, `${tag}-${i}: ${calls} model calls (MAX_DELIVERIES × LLM_MAX_ATTEMPTS = 6)`);
    }
    console.log(`${count} ${poison}: healthy p50 ${figures.p50} ms, max ${figures.max} ms`);
    return figures;
  } finally {
    await worker.stop();
  }
}

/**
 * Tenant A's 240 queued 250 ms jobs on one worker with 8 slots; tenant B posts 8 jobs, three times: each time
 * B's 8 are done within 1 s of their POSTs, while A still has a backlog.
 */
async function backlogCase(s: Service): Promise<Figures> {
  const worker = startWorker(s, { concurrency: 8 });
  try {
    const backlog: string[] = [];
    for (let i = 0; i < 240; i++) backlog.push(await post(s, "heavy", `QUICK report ${i}. Revenue rose.`));
    await waitFor("A under way", async () => (await latencies(s, backlog)).size >= 16, 10_000);
    const took: number[] = [];
    for (let round = 0; round < 3; round++) {
      const ids = await Promise.all(Array.from({ length: 8 }, (_, i) => post(s, "light", `QUICK note ${round}-${i}.`)));
      await waitFor("B's 8 done", async () => (await latencies(s, ids)).size === 8, 10_000);
      took.push(Math.max(...(await latencies(s, ids)).values()));
      await sleep(200);
    }
    assert.ok((await latencies(s, backlog)).size < 240, "A still had a backlog when B was done");
    const figures = { p50: median(took), max: Math.max(...took) };
    for (const x of took) assert.ok(x <= 1_000, `B's 8 jobs took ${x} ms (bound 1 s)`);
    console.log(`behind a 240-job backlog: B's 8 done after ${took.join(", ")} ms`);
    await waitFor("A's backlog drained", async () => (await latencies(s, backlog)).size === 240, 30_000);
    return figures;
  } finally {
    await worker.stop();
  }
}

/** `jobs` healthy jobs through a worker (with `tpm` configured or not); returns the shared state after. */
async function plainRun(s: Service, jobs: number, options: { tpm?: number } = {}): Promise<ProviderStatus> {
  const worker = startWorker(s, options);
  try {
    const ids: string[] = [];
    for (let i = 0; i < jobs; i++) ids.push(await post(s, "plain", healthy(i)));
    await waitFor(`${jobs} jobs done`, async () => (await latencies(s, ids)).size === jobs, 30_000);
    return await worker.flow.status();
  } finally {
    await worker.stop();
  }
}

/** The figures of each case alone, for the sequence to compare with. */
const alone = new Map<string, Figures>();

Deno.test("isolation cases, each alone", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  try {
    for (
      const [name, poison, count, leadMs] of [
        ["three always-500 documents 4 s ahead", "FAIL-ME", 3, 4_000],
        ["two hanging documents", "HANG-ME", 2, 0],
      ] as const
    ) {
      await t.step(name, async () => {
        const s = serviceOn(r, db, `alone-${alone.size}`);
        try {
          alone.set(name, await poisonCase(s, { poison, count, leadMs }));
        } finally {
          await s.provider.model.close();
        }
      });
    }
    await t.step("a tenant behind another's 240-job backlog", async () => {
      const s = serviceOn(r, db, "alone-backlog");
      try {
        alone.set("a tenant behind another's backlog", await backlogCase(s));
      } finally {
        await s.provider.model.close();
      }
    });
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("isolation cases back to back on one Redis and one provider", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const s = serviceOn(r, db, "sequence");
  const figures = new Map<string, Figures>();
  /** The limits in force for a process configured with none, as `provider status` shows them. */
  const noLimit = async () => {
    const flow = createProviderFlow({ redis: r.redis, log: silentLogger }, {
      key: s.stateKey,
      cooldownMs: 30_000,
      probeLeaseMs: 7_000,
    });
    const status = await flow.status();
    return { rpm: status.rpm.limit, tpm: status.tpm.limit };
  };
  try {
    await t.step("three documents that always get a 500, posted 4 s before another tenant's traffic", async () => {
      figures.set(
        "three always-500 documents 4 s ahead",
        await poisonCase(s, { poison: "FAIL-ME", count: 3, leadMs: 4_000 }),
      );
    });

    await t.step("a tenant behind another's 240-job backlog, after the poison documents", async () => {
      figures.set("a tenant behind another's backlog", await backlogCase(s));
    });

    await t.step("a worker with LLM_TPM=60000 runs and stops; one without it sees no limit", async () => {
      const during = await plainRun(s, 4, { tpm: 60_000 });
      assert.equal(during.tpm.limit, 60_000);
      assert.equal(during.tpm.source, "config");
      assert.deepEqual(await noLimit(), { rpm: null, tpm: null });
    });

    await t.step("two hanging documents beside another tenant's traffic, after that", async () => {
      figures.set("two hanging documents", await poisonCase(s, { poison: "HANG-ME", count: 2, leadMs: 0 }));
      assert.deepEqual(await noLimit(), { rpm: null, tpm: null });
    });

    await t.step("the provider reports 60,000 tokens a minute in its headers, then stops", async () => {
      s.provider.limits = { rpm: 5_000, tpm: 60_000 };
      const learned = await plainRun(s, 4);
      assert.equal(learned.tpm.limit, 60_000);
      assert.equal(learned.tpm.source, "headers");
      s.provider.limits = null;
    });

    await t.step("two hanging documents again, under the learned limit the provider no longer reports", async () => {
      const after = await poisonCase(s, { poison: "HANG-ME", count: 2, leadMs: 0 });
      figures.set("two hanging documents, after a learned limit", after);
      assert.deepEqual(await noLimit(), { rpm: null, tpm: null });
    });

    await t.step("a real outage, every call 503: the breaker opens, calls stay bounded, nothing dead", async () => {
      const worker = startWorker(s);
      try {
        // (Up again whatever happens here: the cases after it need the provider.)
        // Down before the jobs come: a call that reached it first would succeed, and the outage might see no call.
        s.provider.down = true;
        const before = s.provider.model.requests;
        const ids: string[] = [];
        for (let i = 0; i < 20; i++) ids.push(await post(s, i % 2 ? "outage-a" : "outage-b", healthy(i)));
        await waitFor("the breaker open", async () => (await worker.flow.status()).breaker.state !== "closed", 10_000);
        await sleep(8_000);
        const during = s.provider.model.requests - before;
        s.provider.down = false;
        const recovered = Date.now();
        await waitFor("every job done", async () => (await latencies(s, ids)).size === 20, 40_000);
        const after = Date.now() - recovered;
        // The jobs' first calls (nothing limits them: up to all 20 at once, before the third failure lands), then
        // probes after 1, 2, 4 and 8 s.
        assert.ok(during <= 20 + 4, `${during} calls during the outage`);
        assert.ok(after <= 30_000, `done ${after} ms after the provider came back (LLM_BREAKER_COOLDOWN_S=30)`);
        for (const tenant of ["outage-a", "outage-b"]) assert.equal((await deadAt(s, tenant, ids)).size, 0);
        console.log(`503 outage: ${during} calls during it, all done ${after} ms after recovery`);
      } finally {
        s.provider.down = false;
        await worker.stop();
      }
    });

    await t.step("three always-500 documents again, after the outage", async () => {
      figures.set(
        "three always-500 documents, after an outage",
        await poisonCase(s, { poison: "FAIL-ME", count: 3, leadMs: 4_000 }),
      );
    });

    // Not compared: the hanging documents under a limit the provider reported seconds before. Its first calls are
    // paced at that limit until an answer without the headers ends it (two of them the hanging documents' calls),
    // which is right for a limit just reported; it is held to the 5 s bound above, and to no limit after.
    await t.step("each case gives the figures it gives alone, within 1 s", () => {
      const pairs: [string, string][] = [
        ["three always-500 documents 4 s ahead", "three always-500 documents 4 s ahead"],
        ["two hanging documents", "two hanging documents"],
        ["three always-500 documents, after an outage", "three always-500 documents 4 s ahead"],
        ["a tenant behind another's backlog", "a tenant behind another's backlog"],
      ];
      for (const [inSequence, single] of pairs) {
        const a = figures.get(inSequence)!, b = alone.get(single);
        if (!b) continue; // the alone test was filtered out
        for (const k of ["p50", "max"] as const) {
          assert.ok(Math.abs(a[k] - b[k]) <= 1_000, `${inSequence}: ${k} ${a[k]} ms in sequence, ${b[k]} ms alone`);
        }
      }
    });
  } finally {
    await s.provider.model.close();
    await r.close();
    await db.close();
  }
});
