/** Test helpers: real Redis and Postgres, isolated per test file. */
import type { Sql } from "postgres";
import {
  createScratchDatabase,
  createScratchRedis,
  type ScratchDatabase,
  type ScratchRedis,
} from "./support/scratch.ts";

export { deleteByPrefix } from "./support/scratch.ts";
import { startLocalCluster } from "./support/redis_cluster.ts";
import { connectRedis } from "../src/clients.ts";
export { seededRandom } from "./support/random.ts";
export { freePort } from "./support/free_port.ts";
export const ADMIN_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres";
export const REDIS_URL = "redis://127.0.0.1:6379/0";
export type TestDatabase = ScratchDatabase;
export type TestRedis = ScratchRedis;

/** Creates `oncely_test_<random>` from the migrations; `close` drops it. */
export function createTestDatabase(options: { migrate?: boolean } = {}): Promise<TestDatabase> {
  return createScratchDatabase(ADMIN_DATABASE_URL, options);
}

/**
 * Connects to the local Redis with a random key prefix; `close` deletes its
 * keys. With `ONCELY_TEST_CLUSTER=1` the test file gets a three-master Redis
 * Cluster of its own instead (the client is the cluster client), so the
 * Redis-facing tests run on both (`deno task test:cluster`).
 */
export async function createTestRedis(): Promise<TestRedis> {
  if (Deno.env.get("ONCELY_TEST_CLUSTER") !== "1") return await createScratchRedis(REDIS_URL);
  const cluster = await startLocalCluster();
  const redis = await connectRedis(cluster.nodes[0]!);
  return {
    redis,
    url: cluster.nodes.join(","),
    prefix: `oncely_test_${crypto.randomUUID().slice(0, 8)}`,
    async close() {
      await redis.quit().catch(() => redis.disconnect());
      await cluster.stop();
    },
  };
}

/**
 * Polls `check` until it returns a truthy value, or fails after `timeoutMs`.
 * @throws {Error} describing what was awaited.
 */
export async function waitFor<T>(
  what: string,
  check: () => T | Promise<T>,
  timeoutMs = 5_000,
): Promise<NonNullable<T>> {
  const end = performance.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value as NonNullable<T>;
    if (performance.now() > end) throw new Error(`Timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** A logger that records lines, for tests that assert on logs. */
export function recordingLogger() {
  const lines: Record<string, unknown>[] = [];
  return { lines, write: (line: string) => lines.push(JSON.parse(line)) };
}

/** A clock whose time moves only when the code under test sleeps; timers never fire. */
export function fakeClock(start = 0) {
  let now = start;
  const sleeps: number[] = [];
  return {
    sleeps,
    now: () => now,
    epochNow: () => 1_800_000_000_000 + now,
    sleep(ms: number) {
      sleeps.push(ms);
      now += ms;
      return Promise.resolve();
    },
    timer: () => ({ signal: new AbortController().signal, cancel() {} }),
    advance(ms: number) {
      now += ms;
    },
  };
}

/** A client that counts the queries sent through it as a tagged template (`sql\`...\``), and runs them on `sql`. */
export function countingSql(sql: Sql): { sql: Sql; queries: () => number } {
  let queries = 0;
  const counting = ((...args: unknown[]) => {
    queries++;
    return (sql as unknown as (...a: unknown[]) => unknown)(...args);
  }) as unknown as Sql;
  return { sql: counting, queries: () => queries };
}
