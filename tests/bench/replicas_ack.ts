/**
 * What REDIS_MIN_REPLICAS_ACK=1 costs a POST with a healthy replica: the API
 * handler in this process (no HTTP), a local primary and replica
 * (`tests/support/redis_replication.ts`), Postgres for auth. Sequential POSTs
 * (one at a time: the latency a client sees) and 64 in flight (what a busy
 * process sees), each key unique, N=0 and N=1 alternating in rounds so both
 * meet the same machine noise. The tenant lookup is cached, as in the API.
 *
 *   deno run --allow-net=127.0.0.1 --allow-env --allow-read --allow-write --allow-run --allow-sys \
 *     tests/bench/replicas_ack.ts [--rounds 5] [--per-round 400] [--connections 8]
 */
import { parseArgs } from "node:util";
import type { Redis } from "ioredis";
import { connectRedis } from "../../src/clients.ts";
import { createReplicaAck, type ReplicaAck } from "../../src/redis/replica_ack.ts";
import { defineScript } from "../../src/redis/script.ts";
import { createIntake } from "../../src/runs/intake.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase } from "../_support.ts";
import { apiHandler } from "../support/fixtures.ts";
import { startLocalReplication } from "../support/redis_replication.ts";
import { fmt, median, quantile } from "./stats.ts";

const { values } = parseArgs({
  args: Deno.args,
  options: {
    rounds: { type: "string", default: "5" },
    "per-round": { type: "string", default: "400" },
    connections: { type: "string" },
  },
});
const rounds = Number(values.rounds), perRound = Number(values["per-round"]);
const BODY = JSON.stringify({
  text: "Quarterly revenue rose. Costs fell. The board approved the plan.",
  notify: "a@b.co",
});

const db = await createTestDatabase();
await createApiKey(db.sql, "acme");
const local = await startLocalReplication();
const redis = await connectRedis(local.primary, { failFast: true }) as Redis;
const ack: ReplicaAck = createReplicaAck(redis, {
  replicas: 1,
  timeoutMs: 500,
  connections: values.connections ? Number(values.connections) : undefined,
});
const keys = serviceKeys(`oncely_bench_${crypto.randomUUID().slice(0, 8)}`);
const handlers = {
  "N=0": apiHandler({ redis, sql: db.sql, keys }, {
    authCacheTtlMs: 60_000,
    intake: createIntake({ redis }, { keys, resultTtlS: 600, path: "/v1/summaries" }),
  }),
  "N=1": apiHandler({ redis, sql: db.sql, keys }, {
    authCacheTtlMs: 60_000,
    intake: createIntake({ redis, ack }, { keys, resultTtlS: 600, path: "/v1/summaries" }),
  }),
};
type Variant = keyof typeof handlers;
let n = 0;
const post = async (variant: Variant) => {
  const start = performance.now();
  const res = await handlers[variant](
    new Request("http://api/v1/summaries", {
      method: "POST",
      headers: {
        "x-tenant-id": "acme",
        "content-type": "application/json",
        "idempotency-key": `bench-key-${++n}-padding`,
      },
      body: BODY,
    }),
  );
  await res.body?.cancel();
  if (res.status !== 202) throw new Error(`${variant}: ${res.status}`);
  return performance.now() - start;
};

const sequential: Record<Variant, number[]> = { "N=0": [], "N=1": [] };
const concurrent: Record<Variant, { ms: number[]; rate: number[] }> = {
  "N=0": { ms: [], rate: [] },
  "N=1": { ms: [], rate: [] },
};
try {
  for (const variant of ["N=0", "N=1"] as Variant[]) for (let i = 0; i < 200; i++) await post(variant); // warm up
  for (let round = 0; round < rounds; round++) {
    for (const variant of (round % 2 ? ["N=1", "N=0"] : ["N=0", "N=1"]) as Variant[]) {
      for (let i = 0; i < perRound; i++) sequential[variant].push(await post(variant));
      const started = performance.now();
      let left = perRound * 4;
      const lane = async () => {
        while (left-- > 0) concurrent[variant].ms.push(await post(variant));
      };
      await Promise.all(Array.from({ length: 64 }, lane));
      concurrent[variant].rate.push((perRound * 4) / ((performance.now() - started) / 1000));
    }
  }
  const row = (label: string, v: Variant, ms: number[]) =>
    `| ${label} | ${v} | ${fmt(median(ms), 3)} | ${fmt(quantile(ms, 0.99), 3)} |`;
  console.log(
    `${rounds} rounds; sequential: ${rounds * perRound} POSTs each; 64 in flight: ${rounds * perRound * 4} each`,
  );
  console.log("| load | REDIS_MIN_REPLICAS_ACK | p50 ms | p99 ms |\n| --- | --- | --- | --- |");
  for (const v of ["N=0", "N=1"] as Variant[]) console.log(row("sequential", v, sequential[v]));
  for (const v of ["N=0", "N=1"] as Variant[]) console.log(row("64 in flight", v, concurrent[v].ms));
  for (const v of ["N=0", "N=1"] as Variant[]) {
    console.log(`64 in flight, ${v}: ${fmt(median(concurrent[v].rate))} POSTs/s (median of rounds)`);
  }
  // The WAIT alone: one script that writes, in a pipeline on a connection of its own, with and without WAIT.
  const raw: Record<Variant, number[]> = { "N=0": [], "N=1": [] };
  const conn = redis.duplicate();
  const script = defineScript("return redis.call('SET', KEYS[1], ARGV[1])");
  await conn.eval(script.lua, 1, `${keys.prefix}:raw`, "0");
  for (let round = 0; round < rounds; round++) {
    for (const variant of ["N=0", "N=1"] as Variant[]) {
      for (let i = 0; i < perRound; i++) {
        const start = performance.now();
        const p = conn.pipeline().evalsha(script.sha, 1, `${keys.prefix}:raw`, String(i));
        await (variant === "N=1" ? p.wait(1, 500) : p).exec();
        raw[variant].push(performance.now() - start);
      }
    }
  }
  conn.disconnect();
  for (const v of ["N=0", "N=1"] as Variant[]) console.log(row("script round trip alone", v, raw[v]));
  const added = (q: number) => quantile(sequential["N=1"], q) - quantile(sequential["N=0"], q);
  console.log(`added per sequential POST: p50 ${fmt(added(0.5), 3)} ms, p99 ${fmt(added(0.99), 3)} ms`);
  const addedRaw = (q: number) => quantile(raw["N=1"], q) - quantile(raw["N=0"], q);
  console.log(
    `added by WAIT to the script's round trip: p50 ${fmt(addedRaw(0.5), 3)} ms, p99 ${fmt(addedRaw(0.99), 3)} ms`,
  );
} finally {
  await ack.close();
  await redis.quit();
  await local.stop();
  await db.close();
}
