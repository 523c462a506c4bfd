/**
 * A task's definition is part of its result-cache key (as a digest), not
 * only its name and version: the built-in `summarize` is version 1 in every
 * release, so a release that changes its prompt must miss instead of serving
 * the old prompt's summaries for up to a year, while an unchanged definition
 * still hits. The cache alone, and a worker of each "release" calling the
 * fake model through the real openai SDK.
 */
import assert from "node:assert/strict";
import { cacheKeyHash, createResultCache, definitionDigest } from "../../src/cache/result_cache.ts";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { Deadline } from "../../src/retry/deadline.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { BUILT_IN_TASK, SUMMARIZE_DEFINITION } from "../../src/tasks/definition.ts";
import { createTaskCache, SUMMARIZE_TASK, type TaskCache } from "../../src/tasks/task_cache.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { enqueueRunToLane, enqueueToLane } from "../support/enqueue.ts";
import { summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

/** The built-in definition as a later release might change it: the prompt alone differs. */
const CHANGED = { ...SUMMARIZE_DEFINITION, prompt: `Summarise this in one line.\n\n{{input.text}}` };

Deno.test("definitionDigest() is the content, whatever its key order; another prompt, another digest", () => {
  const reordered = Object.fromEntries(Object.entries(SUMMARIZE_DEFINITION).reverse());
  assert.equal(definitionDigest(reordered), definitionDigest(SUMMARIZE_DEFINITION));
  assert.equal(definitionDigest(structuredClone(SUMMARIZE_DEFINITION)), definitionDigest(SUMMARIZE_DEFINITION));
  assert.notEqual(definitionDigest(CHANGED), definitionDigest(SUMMARIZE_DEFINITION));
  assert.notEqual(
    definitionDigest({ ...SUMMARIZE_DEFINITION, system: "Be brief." }),
    definitionDigest(SUMMARIZE_DEFINITION),
  );
  assert.equal(definitionDigest(undefined), null);
  const run = { tenant: "acme", task: BUILT_IN_TASK, version: 1, model: "m", input: { text: "x" } };
  assert.notEqual(
    cacheKeyHash({ ...run, definition: CHANGED }),
    cacheKeyHash({ ...run, definition: SUMMARIZE_DEFINITION }),
  );
});

Deno.test("two definitions of one task version differing only in the prompt do not share a cache entry", async () => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const cache = createResultCache({ redis: r.redis, log: silentLogger }, {
    defaultTtlS: 60,
    keys: (tenant) => keys.cache(tenant),
  });
  const signal = new AbortController().signal;
  const run = (runId: string, definition: unknown) =>
    cache.forRun({
      tenant: "acme",
      runId,
      task: BUILT_IN_TASK,
      version: 1,
      definition,
      model: "m",
      input: { text: "The quarter closed well." },
      noCache: false,
    })!;
  try {
    const first = run("run-1", SUMMARIZE_DEFINITION);
    assert.deepEqual(await first.claim(signal, Deadline.after(5_000)), { held: true, waited: false });
    await first.fill({ output: "Old summary.", model: "m", promptTokens: 10, completionTokens: 3 });
    // The changed prompt misses (and holds its own entry's lock at once: it waits for no one).
    const changed = run("run-2", CHANGED);
    assert.deepEqual(await changed.claim(signal, Deadline.after(5_000)), { held: true, waited: false });
    await changed.release();
    // The unchanged definition (an equal copy, as another process loads it) still hits.
    const same = run("run-3", structuredClone(SUMMARIZE_DEFINITION));
    const hit = await same.claim(signal, Deadline.after(5_000));
    assert.equal(hit.hit?.sourceRunId, "run-1");
    assert.equal(hit.hit && hit.output, "Old summary.");
  } finally {
    await r.close();
  }
});

Deno.test("a release that changes summarize's prompt misses the old entries; unchanged, it hits", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel();
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "m", baseURL: model.url });
  const stored = createTaskCache(db.sql);
  // The next release: the same built-in task, version 1, with another prompt. (A summary job takes the built-in
  // definition from the module itself; a run of `summarize` through the runs API reads it here.)
  const changedTask = { ...SUMMARIZE_TASK, definition: CHANGED };
  const nextRelease: TaskCache = {
    get: (tenant, name, version) =>
      name === BUILT_IN_TASK ? Promise.resolve(changedTask) : stored.get(tenant, name, version),
    peek: (tenant, name, version) => name === BUILT_IN_TASK ? changedTask : stored.peek(tenant, name, version),
    forgetLatest: stored.forgetLatest,
  };
  const text = "Revenue rose by a tenth. Costs fell. The board approved the plan.";
  /**
   * Runs `summarize` on `text` once, as a task run or as a summary job, on a worker with `tasks` and the cache
   * on. @returns its id, and the run it reused if any.
   */
  const summarise = async (tasks: TaskCache, { summary = false } = {}) => {
    const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys, tasks }, { cache: { defaultTtlS: 3600 } });
    const jobId = crypto.randomUUID();
    const tenant = "acme";
    if (summary) await enqueueToLane(r.redis, keys, { jobId, tenant, request: { text, notify: "ops@example.com" } });
    else {await enqueueRunToLane(r.redis, keys, {
        jobId,
        tenant,
        run: { task: BUILT_IN_TASK, version: 1, input: { text } },
      });}
    const stop = new AbortController();
    const running = worker.run(stop.signal);
    try {
      await waitFor("the run done", async () => {
        const [row] = await db.sql`SELECT 1 FROM job_outcomes WHERE job_id = ${jobId} AND outcome = 'done'`;
        return row !== undefined;
      });
    } finally {
      stop.abort();
      await running;
      await worker.close();
    }
    const [hit] = await db.sql<{ source_run_id: string }[]>`
      SELECT source_run_id::text FROM cache_hits WHERE run_id = ${jobId}`;
    return { jobId, reused: hit?.source_run_id };
  };
  try {
    const first = await summarise(stored);
    assert.equal(first.reused, undefined);
    assert.equal(model.requests, 1);
    // The same release: a hit, no model call; a summary job of the same text too (the same definition).
    assert.equal((await summarise(stored)).reused, first.jobId);
    assert.equal((await summarise(stored, { summary: true })).reused, first.jobId);
    assert.equal(model.requests, 1);
    // The next release's prompt: a miss, a model call with the new prompt, and an entry of its own.
    const changed = await summarise(nextRelease);
    assert.equal(changed.reused, undefined, "a changed definition must not reuse the old prompt's summary");
    assert.equal(model.requests, 2);
    assert.ok(model.prompts[1]!.startsWith("Summarise this in one line."), model.prompts[1]);
    assert.equal((await summarise(nextRelease)).reused, changed.jobId);
    // A worker still on the old release keeps its own entry.
    assert.equal((await summarise(stored)).reused, first.jobId);
    assert.equal(model.requests, 2);
  } finally {
    await model.close();
    await r.close();
    await db.close();
  }
});
