/**
 * Group intake: POSTs that arrive together share one call of the intake script, and each is answered exactly
 * as it would be alone (a new job, a replay, a reused key, a refusal, a full lane, a broken key).
 */
import assert from "node:assert/strict";
import type { RedisClient } from "../../src/clients.ts";
import { KeyReused } from "../../src/idempotency/errors.ts";
import { createReplicaAck, NotReplicated, type ReplicaAck } from "../../src/redis/replica_ack.ts";
import { createIntake, INTAKE_SHA, QueueFull } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createTestRedis, waitFor } from "../_support.ts";

const PATH = "/v1/summaries";
const request = (text: string) => ({ text, notify: "ops@example.com" });

function valueOf<T>(result: PromiseSettledResult<T> | undefined): T {
  assert.equal(result?.status, "fulfilled", `rejected: ${result?.status === "rejected" ? result.reason : ""}`);
  return (result as PromiseFulfilledResult<T>).value;
}

function reasonOf(result: PromiseSettledResult<unknown> | undefined): unknown {
  assert.equal(result?.status, "rejected");
  return (result as PromiseRejectedResult).reason;
}

/** `redis` with its calls of the intake script counted (the commands still go to the real server). */
function counted(redis: RedisClient): { redis: RedisClient; calls: () => number } {
  let calls = 0;
  const proxy = new Proxy(redis, {
    get(target, name, receiver) {
      const value = Reflect.get(target, name, receiver);
      if (name !== "evalsha" || typeof value !== "function") return value;
      return (...args: unknown[]) => {
        if (args[0] === INTAKE_SHA) calls++;
        return value.apply(target, args);
      };
    },
  });
  return { redis: proxy, calls: () => calls };
}

Deno.test("intake: submissions that arrive together share one script call", async (t) => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const scope = (tenant: string, key: string) => ({ tenant, method: "POST", path: PATH, key });
  try {
    await t.step("50 at once from two tenants: one call per tenant at most, each answered as if alone", async () => {
      const { redis, calls } = counted(r.redis);
      const intake = createIntake({ redis }, { keys, resultTtlS: 600, path: PATH });
      // A key used before the batch: the batch's copy with the same body is a replay, another body a reuse.
      const first = await intake.submit({ scope: scope("acme", "key-0000000000000000"), request: request("doc 0") });
      const before = calls();
      const refusal = new Error("budget spent");
      const submissions = [
        intake.submit({ scope: scope("acme", "key-0000000000000000"), request: request("doc 0") }),
        intake.submit({ scope: scope("acme", "key-0000000000000000"), request: request("another body") }),
        intake.submit({ scope: scope("acme", "key-refused-00000000"), request: request("doc r"), refuse: refusal }),
        // The same new key twice in one batch: the second finds the first's record.
        intake.submit({ scope: scope("globex", "key-twice-0000000000"), request: request("doc t") }),
        intake.submit({ scope: scope("globex", "key-twice-0000000000"), request: request("doc t") }),
      ];
      for (let i = 1; i <= 45; i++) {
        const tenant = i % 2 ? "acme" : "globex";
        submissions.push(
          intake.submit({ scope: scope(tenant, `key-${String(i).padStart(16, "0")}`), request: request(`doc ${i}`) }),
        );
      }
      const results = await Promise.allSettled(submissions);
      // One call on one server (every lane's known sets are the same); one per tenant on a cluster.
      assert.ok(calls() - before <= (r.redis.isCluster ? 2 : 1), `${calls() - before} calls for 50 submissions`);

      const [replay, reused, refused, twiceFirst, twiceSecond, ...fresh] = results;
      assert.equal(valueOf(replay).replayed, true);
      assert.equal(valueOf(replay).jobId, first.jobId);
      assert.ok(reasonOf(reused) instanceof KeyReused);
      assert.equal(reasonOf(refused), refusal);
      assert.equal(valueOf(twiceFirst).replayed, false);
      assert.equal(valueOf(twiceSecond).replayed, true);
      assert.equal(valueOf(twiceSecond).jobId, valueOf(twiceFirst).jobId);
      const ids = new Set<string>();
      for (const result of fresh) {
        assert.equal(valueOf(result).replayed, false);
        ids.add(valueOf(result).jobId);
      }
      assert.equal(ids.size, 45);
      // acme: doc 0 before the batch, and 23 new ones; globex: doc t once, and 22 new ones. The refused and
      // the reused wrote nothing.
      assert.equal(await r.redis.xlen(keys.lane("acme").stream), 1 + 23);
      assert.equal(await r.redis.xlen(keys.lane("globex").stream), 1 + 22);
      assert.equal(await intake.hasRecord(scope("acme", "key-refused-00000000")), false);
      // Every new job has its status record.
      for (const result of fresh) {
        const { jobId } = valueOf(result);
        const tenant = await r.redis.hget(keys.lane("acme").job(jobId), "tenant") ??
          await r.redis.hget(keys.lane("globex").job(jobId), "tenant");
        assert.ok(tenant === "acme" || tenant === "globex");
      }
    });

    await t.step(
      "a lane that fills inside a batch: the first fit, the rest are refused and leave nothing",
      async () => {
        const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH, maxQueuedPerTenant: 5 });
        const results = await Promise.allSettled(
          Array.from({ length: 8 }, (_, i) =>
            intake.submit({
              scope: scope("capped", `capped-key-${String(i).padStart(8, "0")}`),
              request: request(`c${i}`),
            })),
        );
        assert.deepEqual(
          results.map((x) => x.status),
          [...Array(5).fill("fulfilled"), ...Array(3).fill("rejected")],
        );
        for (const result of results.slice(5)) {
          assert.ok(result.status === "rejected" && result.reason instanceof QueueFull);
        }
        assert.equal(await r.redis.xlen(keys.lane("capped").stream), 5);
        for (let i = 5; i < 8; i++) {
          assert.equal(await intake.hasRecord(scope("capped", `capped-key-${String(i).padStart(8, "0")}`)), false);
        }
      },
    );

    await t.step("a broken key fails only its own submission, not the others of its batch", async () => {
      const intake = createIntake({ redis: r.redis }, { keys, resultTtlS: 600, path: PATH });
      // The lane's stream is a string: XADD fails with WRONGTYPE for this tenant's job only.
      await r.redis.set(keys.lane("broken").stream, "not a stream");
      const tenants = r.redis.isCluster ? ["broken", "broken"] : ["broken", "healthy"];
      const results = await Promise.allSettled([
        intake.submit({ scope: scope(tenants[0]!, "broken-key-00000000"), request: request("b") }),
        intake.submit({ scope: scope(tenants[1]!, "healthy-key-0000000"), request: request("h") }),
      ]);
      assert.match(String(reasonOf(results[0])), /WRONGTYPE/);
      if (!r.redis.isCluster) {
        assert.equal(valueOf(results[1]).replayed, false);
        assert.equal(await r.redis.xlen(keys.lane("healthy").stream), 1);
      }
    });
    await t.step(
      "with a replica acknowledgement every POST keeps its own call (its wait bounded by the runner)",
      async () => {
        // No replica answers here: each call comes back NotReplicated after the runner's timeout.
        const runner = createReplicaAck(r.redis, { replicas: 1, timeoutMs: 50 });
        let runs = 0;
        const ack: ReplicaAck = { ...runner, run: (...args) => (runs++, runner.run(...args)) };
        try {
          const intake = createIntake({ redis: r.redis, ack }, { keys, resultTtlS: 600, path: PATH });
          const results = await Promise.allSettled(
            Array.from({ length: 20 }, (_, i) =>
              intake.submit({
                scope: scope("acked", `acked-key-${String(i).padStart(8, "0")}`),
                request: request(`a${i}`),
              })),
          );
          // Batched, a queue in front of the runner let the later POSTs wait for the earlier calls' timeouts.
          assert.equal(runs, 20);
          for (const result of results) {
            assert.ok(reasonOf(result) instanceof NotReplicated);
          }
        } finally {
          await runner.close();
        }
      },
    );
  } finally {
    await r.close();
  }
});

Deno.test("intake: one call announces its lanes in one message, and adds to the sets only the lanes they lack", async () => {
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const listener = r.redis.duplicate();
  const heard: string[] = [];
  listener.on("message", (_channel: string, message: string) => heard.push(message));
  try {
    await listener.subscribe(keys.registry.wake);
    const { redis, calls } = counted(r.redis);
    const intake = createIntake({ redis }, { keys, resultTtlS: 600, path: PATH });
    const scope = (tenant: string, key: string) => ({ tenant, method: "POST", path: PATH, key });
    // A lane already among those with work: the call adds only the others to the registry's sets.
    await r.redis.sadd(keys.registry.active, "beta");
    const before = calls();
    await Promise.all(
      ["alpha", "beta", "gamma", "alpha"].map((tenant, i) =>
        intake.submit({ scope: scope(tenant, `key-lanes-${i}-0000000000`), request: request(`doc ${i}`) })
      ),
    );
    // On a cluster a call holds one slot's submissions, one tenant's, and its lane is made known in its home key,
    // with no wake-up from the script (the API announces it after: tests/runs/intake_test.ts).
    if (r.redis.isCluster) return assert.equal(calls() - before, 3, "one script call per tenant");
    assert.equal(calls() - before, 1, "one script call");
    await waitFor("the wake-up", () => heard.length > 0, 2_000);
    assert.deepEqual(heard, ["alpha beta gamma"], "one message naming each lane once");
    assert.deepEqual((await r.redis.smembers(keys.registry.active)).sort(), ["alpha", "beta", "gamma"]);
    // `all` got the lanes `active` lacked (beta was put in `active` alone, by hand, above).
    assert.deepEqual((await r.redis.smembers(keys.registry.all)).sort(), ["alpha", "gamma"]);
  } finally {
    listener.disconnect();
    await r.close();
  }
});
