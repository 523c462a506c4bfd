import assert from "node:assert/strict";
import { SUMMARIZE_TASK } from "../../src/tasks/task_cache.ts";
import { createBatchOnline } from "../../src/batches/batch_online.ts";
import { createBatchPoller } from "../../src/batches/batch_poller.ts";
import { createBatchSubmitter, REFUSED_STATUS, type SubmitStep } from "../../src/batches/batch_submitter.ts";
import { createLogger } from "../../src/log/logger.ts";
import { UpstreamHttpError } from "../../src/retry/errors.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import type { Models } from "../../src/llm/models.ts";
import type { TaskCache } from "../../src/tasks/task_cache.ts";
import { createTestRedis, recordingLogger } from "../_support.ts";
import { batchPayload, batchStates, type BatchWorld, batchWorld, Crash, DEPLOYMENT, MODEL } from "./_fixture.ts";

const LONG_LEASE = 60_000;

Deno.test("a worker's delivery of a batch run records it into the open batch; a redelivery finds it recorded", async () => {
  const world = await batchWorld();
  try {
    const committer = createGroupCommitter({ sql: world.sql, log: world.log });
    const models: Models = {
      defaultModel: MODEL,
      acquire: () => Promise.reject(new Error("a batch run makes no online call")),
    };
    const tasks = { peek: () => SUMMARIZE_TASK, get: () => Promise.resolve(SUMMARIZE_TASK) } as unknown as TaskCache;
    const job = createSummaryJob(
      { sql: world.sql, models, log: world.log, committer, tasks, batches: world.intake },
      { budgetMs: 5_000, perCallTimeoutMs: 1_000, maxAttempts: 1 },
    );
    const runId = crypto.randomUUID();
    const message = (deliveries: number) => ({
      id: `${Date.now()}-0`,
      fields: { job_id: runId, tenant: "acme", payload: batchPayload("Some text. More text.") },
      deliveries,
    });
    const signal = new AbortController().signal;
    assert.equal(await job(message(1), signal), "batched");
    // The worker died before its XACK: the message comes again.
    assert.equal(await job(message(2), signal), "batched");
    const rows = await world.sql`SELECT run_id::text, request FROM batch_runs`;
    assert.equal(rows.length, 1);
    assert.equal(rows[0]!.run_id, runId);
    assert.equal(rows[0]!.request.model, MODEL);
    assert.deepEqual(await batchStates(world.sql), [{ state: "open", runs: 1, provider_batch_id: null }]);
    assert.equal(world.server.requests, 0, "no online call");
    // A run of priority low runs online (here: the model is asked for, and refuses).
    const low = { ...message(1), fields: { ...message(1).fields, job_id: crypto.randomUUID() } };
    low.fields.payload = JSON.stringify({ ...JSON.parse(low.fields.payload), priority: "low" });
    await assert.rejects(job(low, signal));
  } finally {
    await world.close();
  }
});

Deno.test("a batch closes at BATCH_MAX_RUNS, the next runs open another; the submitter uploads and creates each once", async () => {
  const world = await batchWorld({ maxRuns: 3 });
  try {
    await world.recordRuns(7);
    assert.deepEqual((await batchStates(world.sql)).map((b) => [b.state, b.runs]), [
      ["closed", 3],
      ["closed", 3],
      ["open", 1],
    ]);
    const submitter = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
    assert.equal(await submitter.runOnce(), 2);
    assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), ["submitted", "submitted", "open"]);
    assert.equal(await submitter.runOnce(), 0, "nothing more to do");
    assert.equal(world.server.batches.counts.uploads, 2);
    assert.equal(world.server.batches.counts.creates, 2);
    assert.equal(world.server.batches.linesSent, 6);
    // The metadata names our batch.
    const ours = (await world.sql`SELECT id::text FROM batches WHERE state = 'submitted'`).map((r) => r.id).sort();
    assert.deepEqual(world.server.batches.batches.map((b) => b.metadata?.oncely_batch).sort(), ours);
  } finally {
    await world.close();
  }
});

Deno.test("a batch closes after BATCH_MAX_WAIT_S of collecting", async () => {
  const world = await batchWorld();
  try {
    await world.recordRuns(2);
    const submitter = createBatchSubmitter(world, { maxWaitMs: 50, leaseMs: LONG_LEASE });
    assert.equal(await submitter.runOnce(), 0, "not yet");
    await new Promise((r) => setTimeout(r, 80));
    assert.equal(await submitter.runOnce(), 1);
    assert.deepEqual((await batchStates(world.sql)).map((b) => [b.state, b.runs]), [["submitted", 2]]);
  } finally {
    await world.close();
  }
});

const STEPS: SubmitStep[] = ["lines_fixed", "uploaded", "upload_recorded", "creating", "created"];

for (const step of STEPS) {
  Deno.test(`a submitter stopped after "${step}": the next one finishes, one batch created, every line sent once`, async () => {
    const world = await batchWorld({ maxRuns: 4 });
    try {
      const runIds = await world.recordRuns(4);
      const crashing = createBatchSubmitter(world, {
        maxWaitMs: 3_600_000,
        // The crashed process's lease has run out by the time the next one looks.
        leaseMs: 0,
        fault: (at) => {
          if (at === step) throw new Crash(at);
        },
      });
      await assert.rejects(crashing.runOnce(), Crash);
      const next = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
      assert.equal(await next.runOnce(), 1);
      const [batch] = await batchStates(world.sql);
      assert.equal(batch!.state, "submitted");
      const api = world.server.batches;
      assert.equal(api.counts.creates, 1, "the batch is created once");
      assert.equal(api.batches.length, 1);
      assert.equal(api.batches[0]!.id, batch!.provider_batch_id, "the one created is the one recorded");
      assert.equal(api.linesSent, runIds.length, "each line sent once");
      // Uploaded twice only when the stop came between the upload and its record (the first file is an orphan).
      assert.equal(api.counts.uploads, step === "uploaded" ? 2 : 1);
      // Searched for only when the stop came after the intent to create.
      assert.equal(api.counts.lists > 0, step === "creating" || step === "created");
    } finally {
      await world.close();
    }
  });
}

Deno.test("a batch whose create answer was lost is found by its metadata, not created twice", async () => {
  const world = await batchWorld({ maxRuns: 2 });
  try {
    await world.recordRuns(2);
    world.server.batches.loseCreateReplies(1);
    const first = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: 0 });
    await assert.rejects(first.runOnce(), (e: Error) => e.name === "UpstreamHttpError");
    assert.equal((await batchStates(world.sql))[0]!.state, "creating");
    const next = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
    assert.equal(await next.runOnce(), 1);
    assert.equal(world.server.batches.counts.creates, 1);
    assert.equal((await batchStates(world.sql))[0]!.provider_batch_id, world.server.batches.batches[0]!.id);
  } finally {
    await world.close();
  }
});

Deno.test("a run cancelled while its batch collects is left out of the file; a batch of only such runs sends nothing", async () => {
  const world = await batchWorld({ maxRuns: 3 });
  try {
    const [a, b, c] = await world.recordRuns(3);
    for (const id of [a!, b!]) {
      await world.sql`INSERT INTO job_outcomes (job_id, tenant, outcome) VALUES (${id}::uuid, 'acme', 'cancelled')`;
    }
    const submitter = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
    await submitter.runOnce();
    assert.equal(world.server.batches.linesSent, 1);
    const settled = await world.sql`SELECT run_id::text, in_file, settled FROM batch_runs ORDER BY in_file`;
    assert.deepEqual(
      settled.map((r) => [r.run_id, r.in_file, r.settled]).sort(),
      [
        [a, false, "left_out"],
        [b, false, "left_out"],
        [c, true, null],
      ].sort(),
    );
    const [d] = await world.recordRuns(3);
    await world.sql`
      INSERT INTO job_outcomes (job_id, tenant, outcome)
      SELECT run_id, 'acme', 'cancelled' FROM batch_runs WHERE in_file IS NULL`;
    await submitter.runOnce();
    assert.ok(d);
    assert.equal(world.server.batches.counts.uploads, 1, "an empty batch uploads nothing");
    assert.deepEqual((await batchStates(world.sql)).map((s) => s.state), ["submitted", "committed"]);
  } finally {
    await world.close();
  }
});

Deno.test("many workers recording at once: every run in exactly one batch, each closed at its size", async () => {
  const world = await batchWorld({ maxRuns: 25 });
  try {
    await Promise.all(Array.from({ length: 10 }, () => world.recordRuns(20)));
    const batches = await batchStates(world.sql);
    assert.equal(batches.reduce((n, b) => n + b.runs, 0), 200);
    assert.deepEqual(batches.map((b) => [b.state, b.runs]), Array.from({ length: 8 }, () => ["closed", 25]));
    const [count] = await world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM batch_runs`;
    assert.equal(count!.n, 200);
    assert.equal(DEPLOYMENT, "east");
  } finally {
    await world.close();
  }
});

/** A poller of `world` under `onExpiry` (BATCH_ON_EXPIRY), sending runs online through `online`. */
function pollerOf(world: BatchWorld, onExpiry: "online" | "fail", online: ReturnType<typeof createBatchOnline>) {
  const committer = createGroupCommitter({ sql: world.sql, log: world.log });
  return createBatchPoller({ ...world, committer }, { onExpiry, online, leaseMs: 0 });
}

const REFUSALS = [{ step: "upload", status: 400 }, { step: "create", status: 403 }] as const;

for (const { step, status } of REFUSALS) {
  for (const onExpiry of ["online", "fail"] as const) {
    const title = `${step === "upload" ? "an" : "a"} ${step} refused with ${status} ends the batch, sent once`;
    Deno.test(`${title}; a poller pass settles its runs per BATCH_ON_EXPIRY=${onExpiry}`, async () => {
      const world = await batchWorld({ maxRuns: 3 });
      const r = await createTestRedis();
      try {
        const keys = serviceKeys(r.prefix);
        const runIds = await world.recordRuns(3);
        const api = world.server.batches;
        api.failNext(step, { status, message: `scripted: ${step} refused`, code: "invalid_request" });
        const lines = recordingLogger();
        const log = createLogger({ write: lines.write, level: "debug" });
        const submitter = createBatchSubmitter({ ...world, log }, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
        assert.equal(await submitter.runOnce(), 1);
        const [row] = await world.sql<
          { state: string; provider_status: string; provider_batch_id: string | null; file: boolean; leased: boolean }[]
        >`
          SELECT state, provider_status, provider_batch_id, input_file_id IS NOT NULL AS file,
            lease_until IS NOT NULL AS leased
          FROM batches`;
        assert.deepEqual({ ...row }, {
          state: "ended",
          provider_status: REFUSED_STATUS,
          provider_batch_id: null,
          file: step === "create",
          leased: false,
        });
        // A later pass finds nothing to do: the refusal is not sent again.
        assert.equal(await submitter.runOnce(), 0);
        assert.equal(api.counts.uploads, 1, "exactly one upload attempt");
        assert.equal(api.counts.creates, step === "create" ? 1 : 0, "one create attempt, none after a refused upload");
        assert.equal(api.batches.length, 0, "no batch created at the provider");
        assert.equal(api.linesSent, 0);
        const refused = lines.lines.filter((l) => l.event === "batch_refused");
        assert.equal(refused.length, 1);
        assert.deepEqual(
          [refused[0]!.level, refused[0]!.step, refused[0]!.status, refused[0]!.provider_message, refused[0]!.ended],
          ["error", step, status, `scripted: ${step} refused`, true],
        );
        assert.ok(!JSON.stringify(lines.lines).includes("Document 0"), "no line of the file is logged");

        // The poller settles the ended batch as one that failed validation: no file, every line unfinished.
        const poller = pollerOf(world, onExpiry, createBatchOnline({ redis: r.redis, keys }));
        assert.equal(await poller.runOnce(), 1);
        assert.equal(await poller.runOnce(), 0, "settled once");
        assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), ["committed"]);
        const settled = await world.sql<{ run_id: string; settled: string }[]>`
          SELECT run_id::text, settled FROM batch_runs`;
        const outcomes = await world.sql<{ job_id: string; outcome: string; error: string | null }[]>`
          SELECT job_id::text, outcome, error FROM job_outcomes`;
        const [outbox] = await world.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM outbox`;
        const lane = keys.lane("acme");
        const entries = await r.redis.xrange(lane.streamOf("low"), "-", "+");
        const queued = entries.map(([, fields]) => fields[fields.indexOf("job_id") + 1]);
        if (onExpiry === "online") {
          assert.deepEqual(queued.sort(), [...runIds].sort(), "each run back on its lane's low stream, once");
          assert.ok(settled.every((s) => s.settled === "online"));
          assert.equal(outcomes.length, 0, "not decided: they run online");
          assert.equal(outbox!.n, 0);
          for (const id of runIds) {
            const record = await r.redis.hgetall(lane.job(id));
            assert.deepEqual([record.status, record.priority], ["queued", "low"]);
            const entry = entries.find(([, f]) => f[f.indexOf("job_id") + 1] === id)!;
            assert.equal(JSON.parse(entry[1][entry[1].indexOf("payload") + 1]!).priority, "low");
          }
        } else {
          assert.equal(queued.length, 0);
          assert.ok(settled.every((s) => s.settled === "failed"));
          assert.deepEqual(
            outcomes.map((o) => [o.job_id, o.outcome, o.error]).sort(),
            runIds.map((id) => [id, "failed", "BatchExpired: batch refused"]).sort(),
          );
          assert.equal(outbox!.n, 3, "one run.failed each");
        }
        assert.equal(world.server.requests, 0, "no online call made by the poller");
      } finally {
        await r.close();
        await world.close();
      }
    });
  }
}

Deno.test("a create refused after a restart in creating: the search by metadata runs first, then the batch ends", async () => {
  const world = await batchWorld({ maxRuns: 2 });
  try {
    await world.recordRuns(2);
    const crashing = createBatchSubmitter(world, {
      maxWaitMs: 3_600_000,
      leaseMs: 0,
      fault: (at) => {
        if (at === "creating") throw new Crash(at);
      },
    });
    await assert.rejects(crashing.runOnce(), Crash);
    const api = world.server.batches;
    api.failNext("create", { status: 422 });
    const next = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
    assert.equal(await next.runOnce(), 1);
    assert.ok(api.counts.lists > 0, "searched before it created");
    assert.equal(api.counts.creates, 1);
    assert.equal(api.batches.length, 0);
    const [row] = await world.sql<{ state: string; provider_status: string }[]>`
      SELECT state, provider_status FROM batches`;
    assert.deepEqual({ ...row }, { state: "ended", provider_status: REFUSED_STATUS });
  } finally {
    await world.close();
  }
});

const TRANSIENT = [{ step: "upload", status: 500 }, { step: "create", status: 429 }] as const;

for (const { step, status } of TRANSIENT) {
  Deno.test(`a ${status} on ${step} is retried on the next pass: the batch is then submitted and done, one batch`, async () => {
    const world = await batchWorld({ maxRuns: 2 });
    try {
      const runIds = await world.recordRuns(2);
      const api = world.server.batches;
      api.failNext(step, { status });
      // A failed step keeps its lease to its end: here at once, so the next pass may take the batch.
      const first = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: 0 });
      await assert.rejects(first.runOnce(), (e: unknown) => e instanceof UpstreamHttpError && e.status === status);
      assert.deepEqual((await batchStates(world.sql)).map((b) => b.state), [
        step === "upload" ? "uploading" : "creating",
      ]);
      const next = createBatchSubmitter(world, { maxWaitMs: 3_600_000, leaseMs: LONG_LEASE });
      assert.equal(await next.runOnce(), 1);
      const [batch] = await batchStates(world.sql);
      assert.equal(batch!.state, "submitted");
      assert.equal(api.counts.uploads, step === "upload" ? 2 : 1);
      assert.equal(api.counts.creates, step === "create" ? 2 : 1);
      assert.equal(api.batches.length, 1, "one batch");
      assert.equal(api.batches[0]!.id, batch!.provider_batch_id);
      assert.equal(api.linesSent, 2);
      const poller = pollerOf(world, "fail", () => Promise.reject(new Error("no run goes online")));
      assert.equal(await poller.runOnce(), 1);
      const outcomes = await world.sql<{ job_id: string; outcome: string }[]>`
        SELECT job_id::text, outcome FROM job_outcomes`;
      assert.deepEqual(outcomes.map((o) => [o.job_id, o.outcome]).sort(), runIds.map((id) => [id, "done"]).sort());
    } finally {
      await world.close();
    }
  });
}
