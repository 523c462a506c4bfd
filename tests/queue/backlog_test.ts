/**
 * The summed backlog (`src/queue/backlog.ts`) and the queue gauges read from it
 * (`src/processes/metrics_wiring.ts`): right with many tenants (lanes read 64
 * to a script, one per script on a cluster), and a scrape's
 * cost in Redis commands flat between 10 and 10,000 lanes, counted by the
 * server itself (`INFO commandstats` of a private `redis-server`).
 */
import assert from "node:assert/strict";
import { createRegistry } from "../../src/metrics/metrics.ts";
import { createBacklogMonitor, measureBacklog, readBacklog } from "../../src/queue/backlog.ts";
import { installQueueGauges, queueGauges } from "../../src/processes/metrics_wiring.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createLogger } from "../../src/log/logger.ts";
import { startPrivateRedis } from "../support/private_redis.ts";
import { enqueueToLane } from "../support/enqueue.ts";
import { recordingLogger } from "../_support.ts";

const redisServer = await new Deno.Command("redis-server", { args: ["--version"], stdout: "null" }).output()
  .then((o) => o.success, () => false);

/** `name` -> value of the unlabelled and labelled samples of a Prometheus exposition. */
function samples(text: string): Map<string, number> {
  const out = new Map<string, number>();
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const at = line.lastIndexOf(" ");
    out.set(line.slice(0, at), Number(line.slice(at + 1)));
  }
  return out;
}

/** Fills `tenants` lanes: tenant i gets (i % 3) + 1 jobs; the ids are `t<i>`. @returns the jobs queued. */
async function fill(redis: Parameters<typeof enqueueToLane>[0], keys: ReturnType<typeof serviceKeys>, tenants: number) {
  let jobs = 0;
  for (let from = 0; from < tenants; from += 500) {
    const work: Promise<string>[] = [];
    for (let i = from; i < Math.min(tenants, from + 500); i++) {
      for (let j = 0; j <= i % 3; j++) {
        jobs++;
        work.push(enqueueToLane(redis, keys, {
          jobId: crypto.randomUUID(),
          tenant: `t${i}`,
          request: { text: "Revenue rose.", notify: "a@b.co" },
        }));
      }
    }
    await Promise.all(work);
  }
  return jobs;
}

Deno.test({
  name: "backlog",
  ignore: !redisServer,
  async fn(t) {
    if (!redisServer) console.warn("redis-server is not installed: the backlog test needs one of its own");
    const server = await startPrivateRedis();
    const { redis } = server;
    const log = createLogger({ level: "error", write: recordingLogger().write });
    try {
      await t.step(
        "the waiting runs and the oldest one's age are right over 10,000 tenants, delivered runs excluded",
        async () => {
          await redis.flushdb();
          const keys = serviceKeys("many");
          const queued = await fill(redis, keys, 10_000);
          const now = Date.now();
          // A run requeued with its first acceptance 900 s ago (as a deferral keeps it), in a lane of its own.
          const requeued = keys.lane("requeued");
          await redis.xadd(requeued.stream, "*", "job_id", "r", "tenant", "requeued", "accepted_ms", now - 900_000);
          await redis.sadd(keys.registry.active, "requeued");
          // An older run that a worker has taken: in flight, so not waiting, and not the oldest waiting one.
          const taken = keys.lane("taken");
          await redis.xadd(taken.stream, `${now - 1_200_000}-0`, "job_id", "x", "tenant", "taken");
          await redis.xadd(taken.stream, `${now - 300_000}-0`, "job_id", "y", "tenant", "taken");
          await redis.xgroup("CREATE", taken.stream, taken.group, "0");
          await redis.xreadgroup("GROUP", taken.group, "w1", "COUNT", 1, "STREAMS", taken.stream, ">");
          await redis.sadd(keys.registry.active, "taken");
          // A high-priority run in a lane's other stream counts too.
          await redis.xadd(keys.lane("t1").streamOf("high"), "*", "job_id", "h", "tenant", "t1");

          const snapshot = await measureBacklog(redis, {
            active: keys.registry.active,
            keys: keys.backlog,
            lane: (id) => keys.lane(id),
            lanesPerSecond: 1e9,
            now: () => now,
          });
          assert.equal(snapshot.lanes, 10_002);
          assert.equal(
            snapshot.waiting,
            queued + 1 + 1 + 1,
            "every queued run, the requeued, taken's second, the high",
          );
          assert.equal(snapshot.depth, queued + 1 + 2 + 1);
          assert.equal(snapshot.oldestAcceptedMs, now - 900_000);
          // Tenants 2, 5, 8 ... hold 3 runs; t1 holds 2 + 1 high: the deepest are all 3 deep.
          assert.equal(snapshot.deepest.length, 20);
          assert.ok(snapshot.deepest.every(([, depth]) => depth === 3));

          const registry = createRegistry();
          const later = now + 5_000;
          queueGauges(registry, { read: () => Promise.resolve({ ...snapshot, writer: "test" }) }, { now: () => later });
          const m = samples(await registry.metrics());
          assert.equal(m.get("oncely_queue_waiting"), queued + 3);
          assert.equal(m.get("oncely_queue_lag"), queued + 3);
          assert.equal(m.get("oncely_queue_pending"), 1);
          assert.equal(m.get("oncely_queue_oldest_waiting_seconds"), 905);
          assert.equal(m.get("oncely_queue_lanes_with_work"), 10_002);
          assert.equal(m.get("oncely_queue_snapshot_age_seconds"), 5);
          const depth = [...m.entries()].filter(([k]) => k.startsWith("oncely_queue_depth{"));
          assert.equal(depth.length, 21);
          assert.equal(depth.reduce((n, [, v]) => n + v, 0), queued + 4, "the named lanes and other sum to all");

          // An empty queue: nothing waits, and the oldest age is 0.
          await redis.flushdb();
          const empty = await measureBacklog(redis, {
            active: keys.registry.active,
            keys: keys.backlog,
            lane: (id) => keys.lane(id),
          });
          assert.deepEqual([empty.lanes, empty.waiting, empty.depth, empty.oldestAcceptedMs], [0, 0, 0, undefined]);
        },
      );

      await t.step(
        "a scrape makes the same Redis commands (one HGET) with 10 and with 10,000 lanes; the walk skips idle lanes",
        async () => {
          const costs: Record<string, unknown>[] = [];
          for (const tenants of [10, 10_000]) {
            await redis.flushdb();
            const keys = serviceKeys("cost");
            await fill(redis, keys, tenants);
            const registry = createRegistry();
            const monitor = installQueueGauges(registry, { redis, log }, { keys, writer: "test" })!;
            try {
              await monitor.close(); // its first tick has run, or stopped: the walk below is the test's
              await redis.del(keys.backlog.lease);
              await server.resetStats();
              const walked = createBacklogMonitor({ redis, log }, {
                active: keys.registry.active,
                keys: keys.backlog,
                lane: (id) => keys.lane(id),
                writer: "test",
                start: false,
              });
              const walkStarted = performance.now();
              assert.equal(await walked.refresh(), true);
              const walkMs = performance.now() - walkStarted;
              await walked.close();
              const walk = await server.commands();
              // The walk: one script per 64 lanes with work of each SSCAN's batch (one server), the SSCANs, the
              // lease and the write.
              const scans = walk.get("sscan")!.calls;
              const scripts = walk.get("evalsha")!.calls - 1;
              assert.ok(
                scripts >= Math.ceil(tenants / 64) && scripts <= Math.ceil(tenants / 64) + scans,
                `${scripts} scripts for ${tenants} lanes in ${scans} scans`,
              );
              // What the walker's own commands cost Redis (a script's time includes the commands it runs).
              const walkRedisUsec = ["evalsha", "sscan", "set"].reduce((n, c) => n + (walk.get(c)?.usec ?? 0), 0);

              await server.resetStats();
              const m = samples(await registry.metrics());
              const scrape = await server.commands();
              const calls = [...scrape.values()].reduce((n, c) => n + c.calls, 0);
              assert.deepEqual([...scrape.keys()], ["hget"], `a scrape asks only the snapshot (${tenants} lanes)`);
              assert.equal(calls, 1, `one command a scrape (${tenants} lanes)`);
              assert.equal(m.get("oncely_queue_lanes_with_work"), tenants);
              costs.push({
                tenants,
                scrape_commands: calls,
                walk_scripts: scripts,
                walk_redis_usec: walkRedisUsec,
                walk_ms: Math.round(walkMs),
              });
            } finally {
              await monitor.close();
            }
          }
          console.log(JSON.stringify(costs));

          // 10,000 lanes known, 10 with work: the walk reads the 10 (idle tenants cost nothing).
          await redis.flushdb();
          const keys = serviceKeys("idle");
          await fill(redis, keys, 10_000);
          const idle = [...Array(9_990).keys()].map((i) => `t${i + 10}`);
          await redis.srem(keys.registry.active, ...idle);
          await server.resetStats();
          const snapshot = await measureBacklog(redis, {
            active: keys.registry.active,
            keys: keys.backlog,
            lane: (id) => keys.lane(id),
          });
          assert.equal(snapshot.lanes, 10);
          const idleWalk = await server.commands();
          assert.ok(idleWalk.get("evalsha")!.calls <= idleWalk.get("sscan")!.calls, "a script per batch of lanes");
        },
      );

      await t.step(
        "one walk per interval over all processes; a snapshot is never replaced by an older one, nor written twice",
        async () => {
          await redis.flushdb();
          const keys = serviceKeys("lease");
          await fill(redis, keys, 30);
          const options = {
            active: keys.registry.active,
            keys: keys.backlog,
            lane: (id: string) => keys.lane(id),
            intervalMs: 3_600_000,
            start: false,
          };
          const a = createBacklogMonitor({ redis, log }, { ...options, writer: "a" });
          const b = createBacklogMonitor({ redis, log }, { ...options, writer: "b" });
          assert.deepEqual(await Promise.all([a.refresh(), b.refresh()]), [true, false], "one of the two walks");
          const first = (await readBacklog(redis, keys.backlog))!;
          assert.equal(first.waiting, 60);
          assert.equal(await a.refresh(), false, "the lease is held for the interval");
          assert.equal(await b.refresh(), false);
          await a.close();
          await b.close();
          // A walk that ended earlier than the stored one does not replace it.
          await redis.del(keys.backlog.lease);
          const stale = createBacklogMonitor({ redis, log }, { ...options, writer: "stale", now: () => 1 });
          assert.equal(await stale.refresh(), true);
          assert.deepEqual(await readBacklog(redis, keys.backlog), first);
          // The same walk's write resent (a lost reply) writes nothing more: the stored snapshot is the same.
          await redis.del(keys.backlog.lease);
          const fixed = Date.now() + 60_000;
          const again = createBacklogMonitor({ redis, log }, { ...options, writer: "c", now: () => fixed });
          await again.refresh();
          await redis.del(keys.backlog.lease);
          const resend = createBacklogMonitor({ redis, log }, { ...options, writer: "d", now: () => fixed });
          await resend.refresh();
          const stored = (await readBacklog(redis, keys.backlog))!;
          assert.equal(stored.writer, "c");
          assert.equal(stored.takenAtMs, fixed);
        },
      );
    } finally {
      await server.stop();
    }
  },
});
