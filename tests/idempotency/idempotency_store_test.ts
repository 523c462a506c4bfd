import assert from "node:assert/strict";
import { KeyReused, RequestInProgress } from "../../src/idempotency/errors.ts";
import { createIdempotencyStore } from "../../src/idempotency/idempotency_store.ts";
import { createLogger } from "../../src/log/logger.ts";
import { createTestRedis, recordingLogger, waitFor } from "../_support.ts";

Deno.test("IdempotencyStore", async (t) => {
  const { redis, prefix, close } = await createTestRedis();
  const logs = recordingLogger();
  const store = createIdempotencyStore({ redis, log: createLogger({ write: logs.write }) }, {
    prefix,
    lockTtlS: 30,
    resultTtlS: 86_400,
  });
  let n = 0;
  const scope = () => `scope-${++n}`;
  try {
    await t.step("run() runs the first request and stores its response with the result TTL", async () => {
      const s = scope();
      let calls = 0;
      const out = await store.run(s, "fp", () => {
        calls++;
        return Promise.resolve({ status: 202, body: { ok: 1 } });
      });
      assert.deepEqual(out, { response: { status: 202, body: { ok: 1 } }, replayed: false });
      assert.equal(calls, 1);
      const key = store.keyFor(s);
      const record = JSON.parse((await redis.get(key))!);
      assert.equal(record.state, "done");
      const ttl = await redis.ttl(key);
      assert.ok(ttl > 86_390 && ttl <= 86_400, `result TTL is the configured one (got ${ttl})`);
    });

    await t.step("run() replays a finished request without calling the handler", async () => {
      const s = scope();
      let calls = 0;
      const handler = () => {
        calls++;
        return Promise.resolve({ status: 202, body: { n: calls }, headers: { location: "/x" } });
      };
      await store.run(s, "fp", handler);
      const again = await store.run(s, "fp", handler);
      assert.deepEqual(again, {
        response: { status: 202, body: { n: 1 }, headers: { location: "/x" } },
        replayed: true,
      });
      assert.equal(calls, 1);
    });

    await t.step(
      "run() holds an in-progress marker with the lock TTL and answers duplicates with RequestInProgress",
      async () => {
        const s = scope();
        const key = store.keyFor(s);
        let release!: () => void;
        const gate = new Promise<void>((r) => (release = r));
        const first = store.run(s, "fp", async () => {
          await gate;
          return { status: 202, body: {} };
        });
        const marker = JSON.parse(await waitFor("the in-progress marker", () => redis.get(key)));
        assert.equal(marker.state, "in_progress");
        assert.equal(typeof marker.token, "string");
        const ttl = await redis.ttl(key);
        assert.ok(ttl > 25 && ttl <= 30, `lock TTL is the configured one (got ${ttl})`);
        await assert.rejects(
          () => store.run(s, "fp", () => Promise.resolve({ status: 202, body: {} })),
          RequestInProgress,
        );
        release();
        await first;
      },
    );

    await t.step("run() rejects the same key with another fingerprint as KeyReused, in progress or done", async () => {
      const s = scope();
      await store.run(s, "fp-a", () => Promise.resolve({ status: 202, body: {} }));
      await assert.rejects(() => store.run(s, "fp-b", () => Promise.resolve({ status: 202, body: {} })), KeyReused);
    });

    await t.step("run() releases the key after a 5xx so the client can retry", async () => {
      const s = scope();
      const out = await store.run(s, "fp", () => Promise.resolve({ status: 503, body: {} }));
      assert.equal(out.response.status, 503);
      assert.equal(await redis.exists(store.keyFor(s)), 0);
      const retry = await store.run(s, "fp", () => Promise.resolve({ status: 202, body: { second: true } }));
      assert.deepEqual(retry.response.body, { second: true });
    });

    await t.step("run() releases the key when the handler throws, and rethrows", async () => {
      const s = scope();
      await assert.rejects(() => store.run(s, "fp", () => Promise.reject(new Error("boom"))), /boom/);
      assert.equal(await redis.exists(store.keyFor(s)), 0);
    });

    await t.step("a request that overran its lock never overwrites or deletes a newer request's result", async () => {
      const s = scope();
      const key = store.keyFor(s);
      // A's lock "expires" while A runs; B takes the key and finishes first.
      const a = store.run(s, "fp", async () => {
        await redis.del(key);
        const b = await store.run(s, "fp", () => Promise.resolve({ status: 202, body: { by: "B" } }));
        assert.equal(b.replayed, false);
        return { status: 202, body: { by: "A" } };
      });
      await a;
      assert.equal(JSON.parse((await redis.get(key))!).body.by, "B");
      assert.ok(logs.lines.some((l) => l.event === "idempotency_lock_lost"), "lost lock is logged as a warning");
      // Nor may a failing overrun delete B's record.
      const s2 = scope();
      const key2 = store.keyFor(s2);
      await assert.rejects(() =>
        store.run(s2, "fp", async () => {
          await redis.del(key2);
          await store.run(s2, "fp", () => Promise.resolve({ status: 202, body: { by: "B" } }));
          throw new Error("A failed late");
        })
      );
      assert.equal(JSON.parse((await redis.get(key2))!).body.by, "B");
    });
  } finally {
    await close();
  }
});
