/**
 * The door's answer when intake fails in a way that may have recorded the run all the same: too few replicas
 * acknowledged it (`NotReplicated`), or an error intake did not expect. With an Idempotency-Key the SDK's retry
 * is safe (the key replays the run) and is left to the SDK; without one it would start a second run, so the answer
 * says `x-should-retry: false`. A full queue wrote nothing: its 503 stays retryable either way.
 */
import assert from "node:assert/strict";
import { QueueFull } from "../../src/runs/intake.ts";
import type { Intake } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { NotReplicated } from "../../src/redis/replica_ack.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("the door: a failed intake that may have recorded the run is retried by the SDK only with a key", async () => {
  const r = await createTestRedis();
  const db = await createTestDatabase();
  try {
    const keys = serviceKeys(r.prefix);
    let failure: Error = new Error("unexpected");
    const failing: Intake = {
      submit: () => Promise.reject(failure),
      submitRun: () => Promise.reject(failure),
      hasRecord: () => Promise.resolve(false),
      forget: () => Promise.resolve(),
    };
    const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
      authMode: "api-key",
      intake: failing,
      models: new Set(["fake-model"]),
    });
    const key = await createApiKey(db.sql, "acme");
    const post = async (idempotencyKey?: string) => {
      const res = await handler(
        new Request("http://api/v1/chat/completions", {
          method: "POST",
          headers: {
            authorization: `Bearer ${key}`,
            "content-type": "application/json",
            ...(idempotencyKey ? { "idempotency-key": idempotencyKey } : {}),
          },
          body: JSON.stringify({ model: "fake-model", messages: [{ role: "user", content: "hi" }] }),
        }),
      );
      await res.body?.cancel();
      return { status: res.status, retry: res.headers.get("x-should-retry") };
    };
    failure = new NotReplicated("too few replicas", { acked: 0, wanted: 1, timeoutMs: 10, ran: true });
    assert.deepEqual(await post(), { status: 503, retry: "false" }, "no key: the run may exist, no retry");
    assert.deepEqual(await post("door-retry-key-0001"), { status: 503, retry: null }, "a key replays: retry");
    failure = new Error("something intake did not expect");
    assert.deepEqual(await post(), { status: 500, retry: "false" });
    assert.equal((await post("door-retry-key-0002")).retry, null);
    failure = new QueueFull("the queue is full", 5);
    assert.deepEqual(await post(), { status: 503, retry: null }, "a full queue wrote nothing: retryable");
  } finally {
    await r.close();
    await db.close();
  }
});
