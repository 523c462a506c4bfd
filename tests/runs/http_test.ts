/**
 * `Prefer: wait` (`waitIfPreferred` in `runs/http.ts`): a finished wait hands back the run as its last look found
 * it, output and tokens by kind included, so the API answers without reading the run a second time.
 */
import assert from "node:assert/strict";
import { commitResults } from "../../src/runs/commit.ts";
import { type RunHttpDeps, waitIfPreferred } from "../../src/runs/http.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

Deno.test("waitIfPreferred", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  // The run's reads, counted once answered: the look before the wait is over before the run is committed.
  let looks = 0;
  const reads = ((...args: unknown[]) => {
    const query = (db.sql as unknown as (...a: unknown[]) => Promise<unknown>)(...args);
    query.then(() => looks++, () => {});
    return query;
  }) as unknown as typeof db.sql;
  const deps = {
    redis: r.redis,
    sql: reads,
    keys,
    log: silentLogger,
    waiter,
    authenticate: () => Promise.reject(new Error("not used")),
    intake: undefined as unknown as RunHttpDeps["intake"],
    maxBodyBytes: 1 << 20,
  } satisfies RunHttpDeps;
  const prefer = new Request("http://api/", { headers: { prefer: "wait=10" } });
  const run = (jobId: string) => ({
    jobId,
    tenant: "acme",
    task: "chat",
    version: 1,
    input: { messages: [] },
    output: "the answer",
    model: "m",
    tokens: { prompt: 12, completion: 3 },
  });
  /** A queued run as intake leaves it: its status record in its tenant's lane. */
  const queue = async (jobId: string) =>
    await r.redis.hset(keys.lane("acme").job(jobId), { tenant: "acme", task: "chat", version: "1" });
  try {
    await t.step("a run finished before the wait: its output and tokens, from the one look", async () => {
      const jobId = crypto.randomUUID();
      await queue(jobId);
      await commitResults(db.sql, [run(jobId)]);
      const before = looks;
      const waited = await waitIfPreferred(deps, prefer, "acme", jobId);
      assert.equal(waited?.finished, true);
      assert.equal(waited.found.document.status, "done");
      assert.equal(waited.found.run.output, "the answer");
      assert.deepEqual(waited.found.tokens, { prompt: 12, completion: 3 });
      assert.equal(looks - before, 1);
    });

    await t.step("a run that finishes during the wait: woken, then one look for its output and tokens", async () => {
      const jobId = crypto.randomUUID();
      await queue(jobId);
      const before = looks;
      const waiting = waitIfPreferred(deps, prefer, "acme", jobId);
      await waitFor("the look before the wait", () => looks - before === 1);
      await commitResults(db.sql, [run(jobId)]);
      const waited = await waiting;
      assert.equal(waited?.finished, true);
      assert.equal(waited.document, waited.found.document);
      assert.equal(waited.found.run.output, "the answer");
      assert.deepEqual(waited.found.tokens, { prompt: 12, completion: 3 });
      assert.equal(looks - before, 2, "the look before the wait and the one after its wake-up");
    });
  } finally {
    await waiter.close();
    await r.close();
    await db.close();
  }
});
