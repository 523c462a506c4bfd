import assert from "node:assert/strict";
import {
  createBatchPoller,
  type OnlineRun,
  POLLER_DEFAULTS,
  type PollerOptions,
} from "../../src/batches/batch_poller.ts";
import { createBatchOnline } from "../../src/batches/batch_online.ts";
import { createBatchSubmitter } from "../../src/batches/batch_submitter.ts";
import { leaseBatch } from "../../src/batches/batch_store.ts";
import { cancelJob } from "../../src/jobs/job_store.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { costNanos, createPrices } from "../../src/llm/prices.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import type { BatchScript, LineOutcome } from "../support/fake_batch_api.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestRedis, waitFor } from "../_support.ts";
import { batchStates, type BatchWorld, batchWorld, Crash, DEPLOYMENT, MODEL } from "./_fixture.ts";

const PRICE = { in: 2, out: 8, batch_in: 1, batch_out: 4 };

/** A world with `n` runs recorded, closed and submitted; and a poller (online runs collected in `online`). */
async function submitted(n: number, script: (i: number) => BatchScript, options: Partial<PollerOptions> = {}) {
  const world = await batchWorld({ script, maxRuns: n });
  const runIds = await world.recordRuns(n);
  await createBatchSubmitter(world, { maxWaitMs: 3_600_000 }).runOnce();
  const online: OnlineRun[] = [];
  const poller = (extra: Partial<PollerOptions> = {}) =>
    createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
      onExpiry: "online",
      online: (run) => Promise.resolve(void online.push(run)),
      prices: createPrices({ LLM_PRICES: { [MODEL]: PRICE } }),
      leaseMs: 0,
      ...options,
      ...extra,
    });
  return { world, runIds, online, poller };
}

/** Effect counts: outcomes by kind, outbox rows by topic, batch attempt rows, per run. */
async function effects(world: BatchWorld) {
  const outcomes = await world.sql<{ job_id: string; outcome: string }[]>`
    SELECT job_id::text, outcome FROM job_outcomes`;
  const outbox = await world.sql<{ dedupe_key: string }[]>`SELECT dedupe_key FROM outbox`;
  const attempts = await world.sql<
    { job_id: string; cost_usd: string | null; prompt_tokens: number | null; completion_tokens: number | null }[]
  >`
    SELECT job_id::text, cost_usd::text, prompt_tokens, completion_tokens FROM model_attempts WHERE batch_id IS NOT NULL`;
  const results = await world.sql<{ run_id: string }[]>`SELECT run_id::text FROM run_results`;
  return {
    outcome: new Map(outcomes.map((o) => [o.job_id, o.outcome])),
    outcomes: outcomes.length,
    outbox: outbox.map((r) => r.dedupe_key),
    attempts,
    results: results.length,
  };
}

/** Each run's `batch_runs.settled`, and its outcome's error (failed runs), by run id. */
async function settledOf(world: BatchWorld) {
  const rows = await world.sql<{ run_id: string; settled: string | null; error: string | null }[]>`
    SELECT r.run_id::text, r.settled, o.error FROM batch_runs r LEFT JOIN job_outcomes o ON o.job_id = r.run_id`;
  return {
    settled: new Map(rows.map((r) => [r.run_id, r.settled])),
    error: new Map(rows.map((r) => [r.run_id, r.error])),
  };
}

Deno.test("a completed batch: answers committed once with their notifications, 400s failed, 500s online", async () => {
  const lineOf = new Map<string, number>();
  const { world, runIds, online, poller } = await submitted(4, () => ({
    line: (id, _b, i) => {
      lineOf.set(id, i);
      return i === 2
        ? { kind: "error", status: 400, message: "bad request" }
        : i === 3
        ? { kind: "error", status: 500 }
        : { kind: "ok", usage: { prompt_tokens: 1000, completion_tokens: 500 } };
    },
  }));
  try {
    assert.equal(await poller().runOnce(), 1);
    const e = await effects(world);
    const byLine = (i: number) => [...lineOf].find(([, n]) => n === i)![0];
    assert.equal(e.outcome.get(byLine(0)), "done");
    assert.equal(e.outcome.get(byLine(1)), "done");
    assert.equal(e.outcome.get(byLine(2)), "failed");
    assert.equal(e.outcome.has(byLine(3)), false, "the transient one is not decided: it runs online");
    assert.deepEqual(online.map((r) => r.runId), [byLine(3)]);
    assert.equal(e.results, 2);
    assert.equal(e.outbox.length, 3, "two run.completed, one run.failed");
    assert.equal(e.attempts.length, 4, "one model_attempts row per line, marked with its batch");
    const ok = e.attempts.find((a) => a.job_id === byLine(0))!;
    assert.equal(Number(ok.cost_usd) * 1e9, costNanos(PRICE, 1000, 500, true), "priced at the batch prices");
    assert.equal(Number(ok.cost_usd), 0.003);
    assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), ["committed"]);
    assert.equal(runIds.length, 4);
  } finally {
    await world.close();
  }
});

Deno.test("a batch that completes with only an error file fails each of its runs, none left queued", async () => {
  const { world, runIds, poller } = await submitted(3, () => ({ line: () => ({ kind: "error", status: 400 }) }));
  try {
    await poller().runOnce();
    const e = await effects(world);
    assert.deepEqual(runIds.map((id) => e.outcome.get(id)), ["failed", "failed", "failed"]);
    assert.equal(e.outbox.length, 3);
    const [left] = await world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM batch_runs WHERE settled IS NULL`;
    assert.equal(left!.n, 0);
  } finally {
    await world.close();
  }
});

for (const onExpiry of ["online", "fail"] as const) {
  Deno.test(`an expired batch: its completed lines are committed, the rest ${onExpiry} (BATCH_ON_EXPIRY)`, async () => {
    const { world, runIds, online, poller } = await submitted(
      3,
      () => ({ end: "expired", line: (_id, _b, i) => (i === 0 ? { kind: "ok" } : { kind: "unfinished" }) }),
      { onExpiry },
    );
    try {
      await poller().runOnce();
      const e = await effects(world);
      const done = runIds.filter((id) => e.outcome.get(id) === "done");
      assert.equal(done.length, 1, "the completed line is collected, never dropped");
      const rest = runIds.filter((id) => !done.includes(id));
      if (onExpiry === "online") {
        assert.deepEqual(online.map((r) => r.runId).sort(), rest.sort());
        assert.equal(e.outcomes, 1);
      } else {
        assert.deepEqual(rest.map((id) => e.outcome.get(id)), ["failed", "failed"]);
        assert.equal(online.length, 0);
      }
    } finally {
      await world.close();
    }
  });
}

Deno.test("a poller stopped between two lines: the next one settles the rest; a line read twice commits once", async () => {
  const { world, runIds, poller } = await submitted(5, () => ({}));
  try {
    let settled = 0;
    const crashing = poller({
      fault: () => {
        if (++settled === 2) throw new Crash("line_settled");
      },
    });
    await assert.rejects(crashing.runOnce(), Crash);
    assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), ["ended"]);
    assert.equal(await poller().runOnce(), 1);
    // And the whole output read once more, as a process that died before recording `committed` would.
    await world.sql`UPDATE batches SET state = 'ended'`;
    await world.sql`UPDATE batch_runs SET settled = NULL`;
    assert.equal(await poller().runOnce(), 1);
    const e = await effects(world);
    assert.deepEqual(runIds.map((id) => e.outcome.get(id)), runIds.map(() => "done"));
    assert.equal(e.results, 5);
    assert.equal(e.outbox.length, 5, "one notification each");
    assert.equal(new Set(e.outbox).size, 5);
    assert.equal(e.attempts.length, 5, "one usage row each");
    assert.equal(world.server.batches.counts.creates, 1);
  } finally {
    await world.close();
  }
});

Deno.test("a run cancelled after its batch was uploaded: its line is discarded by the commit", async () => {
  const { world, runIds, poller } = await submitted(2, () => ({}));
  try {
    // Cancelled as DELETE /v1/runs/{id} decides it in Postgres (`cancelJob`, racing the commit on its key).
    assert.equal(await cancelJob(world.sql, runIds[0]!, "acme", { task: "summarize", version: 1 }), "cancelled");
    await poller().runOnce();
    const e = await effects(world);
    assert.equal(e.outcome.get(runIds[0]!), "cancelled");
    assert.equal(e.outcome.get(runIds[1]!), "done");
    assert.equal(e.results, 1);
    assert.equal(e.outbox.length, 1);
    // The provider ran (and billed) the cancelled line: its usage is still recorded.
    assert.equal(e.attempts.length, 2);
  } finally {
    await world.close();
  }
});

Deno.test("a batch still in progress is polled, not settled, until it ends", async () => {
  const { world, runIds, poller } = await submitted(2, () => ({ delayMs: 150 }));
  try {
    assert.equal(await poller({ pollMs: 0 }).runOnce(), 0);
    assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), ["submitted"]);
    await new Promise((r) => setTimeout(r, 200));
    assert.equal(await poller({ pollMs: 0 }).runOnce(), 1);
    const e = await effects(world);
    assert.deepEqual(runIds.map((id) => e.outcome.get(id)), ["done", "done"]);
  } finally {
    await world.close();
  }
});

Deno.test("the poll backs off: a quarter of the batch's age since its creation, from 1 s to 30 s", async () => {
  const world = await batchWorld({ maxRuns: 1 });
  try {
    await world.recordRuns(1);
    await createBatchSubmitter(world, { maxWaitMs: 3_600_000 }).runOnce();
    const leaseAfter = async (ageS: number) => {
      await world.sql`
        UPDATE batches SET creating_at = now() - make_interval(secs => ${ageS}), lease_until = NULL`;
      // The lease the poll pass takes (POLLER_DEFAULTS' bounds); no retrieve, so the batch stays in flight.
      const leased = await leaseBatch(world.sql, ["submitted"], {
        leaseMs: POLLER_DEFAULTS.pollMs,
        shortestMs: POLLER_DEFAULTS.firstPollMs,
      });
      assert.ok(leased, "the submitted batch is leased");
      const [row] = await world.sql<{ s: number }[]>`
        SELECT extract(epoch FROM lease_until - now())::float8 AS s FROM batches`;
      return row!.s;
    };
    const young = await leaseAfter(0);
    assert.ok(young > 0.9 && young <= 1.01, `a new batch is polled again in 1 s (${young})`);
    const minute = await leaseAfter(40);
    assert.ok(minute > 9.9 && minute <= 10.01, `a batch 40 s old in 10 s (${minute})`);
    const old = await leaseAfter(3600);
    assert.ok(old > 29.9 && old <= 30.01, `an hour-old batch in 30 s (${old})`);
  } finally {
    await world.close();
  }
});

Deno.test("BATCH_ON_EXPIRY=fail: transient error lines still go online and are done there; unfinished lines fail", async () => {
  // One expired batch: an answer, a 500, a 429, a 400 and a line left unfinished.
  const outcomes: LineOutcome[] = [
    { kind: "ok" },
    { kind: "error", status: 500 },
    { kind: "error", status: 429 },
    { kind: "error", status: 400 },
    { kind: "unfinished" },
  ];
  const lineOf = new Map<string, number>();
  const world = await batchWorld({
    maxRuns: 5,
    script: () => ({ end: "expired", line: (id, _b, i) => (lineOf.set(id, i), outcomes[i]!) }),
  });
  const r = await createTestRedis();
  try {
    const keys = serviceKeys(r.prefix);
    const runIds = await world.recordRuns(5);
    await createBatchSubmitter(world, { maxWaitMs: 3_600_000 }).runOnce();
    const poller = (crash: boolean) =>
      createBatchPoller({ ...world, committer: createGroupCommitter({ sql: world.sql, log: world.log }) }, {
        onExpiry: "fail",
        online: createBatchOnline({ redis: r.redis, keys }),
        leaseMs: 0,
        fault: (step) => {
          if (crash && step === "online_sent") throw new Crash(step);
        },
      });
    // Stopped right after its first online send (before the line is recorded `online`), then the next process.
    await assert.rejects(poller(true).runOnce(), Crash);
    assert.equal(await poller(false).runOnce(), 1);
    const byLine = (i: number) => [...lineOf].find(([, n]) => n === i)![0];
    const [ok, e500, e429, e400, expired] = [0, 1, 2, 3, 4].map(byLine) as [string, string, string, string, string];
    const { settled, error } = await settledOf(world);
    assert.deepEqual(
      [ok, e500, e429, e400, expired].map((id) => settled.get(id)),
      ["committed", "online", "online", "failed", "failed"],
      "transient lines go online whatever BATCH_ON_EXPIRY says; the unfinished one follows it",
    );
    assert.match(error.get(e400)!, /^UpstreamHttpError: 400/);
    assert.match(error.get(expired)!, /^BatchExpired: batch_expired/);
    const low = keys.lane("acme").streamOf("low");
    assert.equal(await r.redis.xlen(low), 2, "each transient run queued once, the one sent twice too");

    // A worker runs them online, against the same fake provider's Chat Completions.
    const llm = createOpenAiLlm({ apiKey: "k", model: MODEL, baseURL: world.server.url });
    const worker = summaryWorker({ redis: r.redis, sql: world.sql, llm, keys }, { consumer: "transient-test" });
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    try {
      await waitFor("5 runs decided", async () => {
        const [n] = await world.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM job_outcomes WHERE job_id = ANY(${runIds}::uuid[])`;
        return n!.n === 5;
      }, 10_000);
    } finally {
      stop.abort();
      await running;
      await worker.close();
    }
    const e = await effects(world);
    assert.deepEqual(
      [ok, e500, e429, e400, expired].map((id) => e.outcome.get(id)),
      ["done", "done", "done", "failed", "failed"],
    );
    assert.equal(world.server.requests, 2, "one online call for each transient run, none for the others");
    for (const id of [e500, e429]) {
      const doc = `Document ${runIds.indexOf(id)}.`;
      assert.equal(world.server.prompts.filter((p) => p.includes(doc)).length, 1, `one online call for ${doc}`);
    }
    assert.equal(e.outbox.length, 5, "one notification each");
    assert.equal(new Set(e.outbox).size, 5);
    assert.equal(world.server.batches.counts.creates, 1, "not batched again");
  } finally {
    await r.close();
    await world.close();
  }
});

for (const onExpiry of ["online", "fail"] as const) {
  Deno.test(`a batch the provider cancelled: its batch_cancelled lines ${onExpiry} (BATCH_ON_EXPIRY)`, async () => {
    const { world, runIds, online, poller } = await submitted(3, () => ({ delayMs: 60_000 }), { onExpiry });
    try {
      assert.equal(await poller({ pollMs: 0 }).runOnce(), 0, "still in progress");
      const [batch] = await batchStates(world.sql);
      await world.clients.get(DEPLOYMENT)!.cancel(batch!.provider_batch_id!);
      assert.equal(world.server.batches.counts.cancels, 1);
      assert.equal(await poller({ pollMs: 0 }).runOnce(), 1);
      const [row] = await world.sql<{ state: string; provider_status: string }[]>`
        SELECT state, provider_status FROM batches`;
      assert.deepEqual({ ...row }, { state: "committed", provider_status: "cancelled" });
      const e = await effects(world);
      const { settled, error } = await settledOf(world);
      assert.equal(e.attempts.length, 0, "no line was answered: no usage");
      if (onExpiry === "online") {
        assert.deepEqual(online.map((o) => o.runId).sort(), [...runIds].sort());
        assert.deepEqual(runIds.map((id) => settled.get(id)), ["online", "online", "online"]);
        assert.equal(e.outcomes, 0, "not decided: they run online");
      } else {
        assert.equal(online.length, 0);
        assert.deepEqual(runIds.map((id) => e.outcome.get(id)), ["failed", "failed", "failed"]);
        assert.deepEqual(runIds.map((id) => settled.get(id)), ["failed", "failed", "failed"]);
        assert.ok(runIds.every((id) => error.get(id) === "BatchExpired: batch_cancelled"));
        assert.equal(e.outbox.length, 3, "one run.failed each");
      }
    } finally {
      await world.close();
    }
  });

  Deno.test(`a batch that failed validation: its runs, in no file, ${onExpiry} (BATCH_ON_EXPIRY)`, async () => {
    const { world, runIds, online, poller } = await submitted(3, () => ({ end: "failed" }), { onExpiry });
    try {
      assert.equal(await poller().runOnce(), 1);
      const [row] = await world.sql<{ state: string; provider_status: string; files: number }[]>`
        SELECT state, provider_status, num_nonnulls(output_file_id, error_file_id)::int AS files FROM batches`;
      assert.deepEqual({ ...row }, { state: "committed", provider_status: "failed", files: 0 });
      const e = await effects(world);
      const { settled, error } = await settledOf(world);
      assert.equal(e.attempts.length, 0);
      if (onExpiry === "online") {
        assert.deepEqual(online.map((o) => o.runId).sort(), [...runIds].sort());
        assert.deepEqual(runIds.map((id) => settled.get(id)), ["online", "online", "online"]);
        assert.equal(e.outcomes, 0);
      } else {
        assert.equal(online.length, 0);
        assert.deepEqual(runIds.map((id) => e.outcome.get(id)), ["failed", "failed", "failed"]);
        assert.ok(runIds.every((id) => error.get(id) === "BatchExpired: batch failed"));
        assert.equal(e.outbox.length, 3);
      }
    } finally {
      await world.close();
    }
  });
}
