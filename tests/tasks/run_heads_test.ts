/**
 * Intake keeps the script's head (the status record's change, with the task and its version) per tenant and
 * task version: a run of each version, in any order, gets a status record naming its own version. And a
 * `Prefer: wait` leaves nothing on the API's shutdown signal once it has answered.
 */
import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { apiHandler, jsonClient } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const TASK = {
  prompt: "Classify:\n\n{{input.ticket}}",
  input_schema: { type: "object", properties: { ticket: { type: "string" } }, required: ["ticket"] },
};

Deno.test("runs of two versions of a task, in any order, each queue a record naming their own version", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const shutdown = new AbortController();
  const listeners = { added: 0, removed: 0 };
  const add = shutdown.signal.addEventListener.bind(shutdown.signal) as (...a: unknown[]) => void;
  const remove = shutdown.signal.removeEventListener.bind(shutdown.signal) as (...a: unknown[]) => void;
  Object.assign(shutdown.signal, {
    addEventListener(...a: unknown[]) {
      listeners.added++;
      add(...a);
    },
    removeEventListener(...a: unknown[]) {
      listeners.removed++;
      remove(...a);
    },
  });
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    waiter,
    shutdown: shutdown.signal,
  });
  const acme = await createApiKey(db.sql, "acme");
  const call = jsonClient(api, acme);
  const versionOf = async (runId: string) =>
    await r.redis.hmget(keys.lane("acme").job(runId), "task", "version", "tenant", "status");
  try {
    assert.equal((await call("PUT", "/v1/tasks/triage", TASK)).status, 201);
    let n = 0;
    const post = async (body: Record<string, unknown>) => {
      const res = await call("POST", "/v1/tasks/triage/runs", body, { "idempotency-key": `run-heads-key-000${n++}` });
      assert.equal(res.status, 202, JSON.stringify(res.body));
      return res.body.run_id as string;
    };
    const first = await post({ input: { ticket: "a" } });
    assert.equal((await call("PUT", "/v1/tasks/triage", { ...TASK, prompt: `${TASK.prompt}!` })).status, 201);
    const second = await post({ input: { ticket: "b" } });
    const pinned = await post({ input: { ticket: "c" }, version: 1 });
    const latest = await post({ input: { ticket: "d" }, version: 2 });
    // Each names its task and version, and its tenant; none a status (a queued run's record has none).
    assert.deepEqual(await versionOf(first), ["triage", "1", "acme", null]);
    assert.deepEqual(await versionOf(second), ["triage", "2", "acme", null]);
    assert.deepEqual(await versionOf(pinned), ["triage", "1", "acme", null]);
    assert.deepEqual(await versionOf(latest), ["triage", "2", "acme", null]);

    // Three waits that end unfinished (nothing runs the jobs): each links the shutdown signal while it waits only.
    for (const runId of [first, second, pinned]) {
      const res = await api(
        new Request(`http://api/v1/runs/${runId}`, { headers: { authorization: `Bearer ${acme}`, prefer: "wait=1" } }),
      );
      assert.equal(res.status, 200);
      assert.equal((await res.json()).status, "queued");
    }
    assert.ok(listeners.added >= 3, `the waits linked the shutdown signal ${listeners.added} times`);
    assert.equal(listeners.removed, listeners.added, "every listener a wait added is removed");
  } finally {
    shutdown.abort();
    await waiter.close?.();
    await r.close();
    await db.close();
  }
});
