import assert from "node:assert/strict";
import { SUMMARIZE_TASK } from "../../src/tasks/task_cache.ts";
import { createBatchSubmitter, type SubmitStep } from "../../src/batches/batch_submitter.ts";
import { createGroupCommitter } from "../../src/runs/commit.ts";
import { createSummaryJob } from "../../src/runs/run_job.ts";
import type { Models } from "../../src/llm/models.ts";
import type { TaskCache } from "../../src/tasks/task_cache.ts";
import { batchPayload, batchStates, batchWorld, Crash, DEPLOYMENT, MODEL } from "./_fixture.ts";

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
