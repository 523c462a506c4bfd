/** Test helpers: real Redis and Postgres, isolated per test file. */
import { Redis } from "ioredis";
import postgres, { type Sql } from "postgres";
import { migrate, readMigrations } from "../src/db/migrate.ts";
import { silentLogger } from "../src/log/logger.ts";

export const ADMIN_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres";
export const REDIS_URL = "redis://127.0.0.1:6379/0";

function randomId(): string {
  return crypto.randomUUID().replaceAll("-", "").slice(0, 12);
}

/** A fresh Postgres database with the migrations applied; `close` drops it. */
export interface TestDatabase {
  sql: Sql;
  url: string;
  name: string;
  close(): Promise<void>;
}

/** Creates `oncely_test_<random>` from the migrations. */
export async function createTestDatabase(options: { migrate?: boolean } = {}): Promise<TestDatabase> {
  const name = `oncely_test_${randomId()}`;
  const admin = postgres(ADMIN_DATABASE_URL, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${name}`);
  await admin.end();
  const url = `postgres://postgres@127.0.0.1:5432/${name}`;
  const sql = postgres(url, { max: 10, onnotice: () => {} });
  if (options.migrate ?? true) await migrate({ sql, log: silentLogger }, await readMigrations());
  return {
    sql,
    url,
    name,
    async close() {
      await sql.end({ timeout: 1 });
      const admin = postgres(ADMIN_DATABASE_URL, { max: 1, onnotice: () => {} });
      await admin.unsafe(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      await admin.end();
    },
  };
}

/** A Redis client plus a key prefix no other test uses; `close` deletes the prefix's keys. */
export interface TestRedis {
  redis: Redis;
  prefix: string;
  close(): Promise<void>;
}

/** Connects to the local Redis with a random key prefix. */
export async function createTestRedis(): Promise<TestRedis> {
  const redis = new Redis(REDIS_URL, { lazyConnect: true, maxRetriesPerRequest: 1 });
  await redis.connect();
  const prefix = `oncely_test_${randomId()}`;
  return {
    redis,
    prefix,
    async close() {
      await deleteByPrefix(redis, prefix);
      await redis.quit();
    },
  };
}

/** Deletes every key that starts with `prefix`. */
export async function deleteByPrefix(redis: Redis, prefix: string): Promise<void> {
  let cursor = "0";
  do {
    const [next, keys] = await redis.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 1000);
    cursor = next;
    if (keys.length) await redis.del(...keys);
  } while (cursor !== "0");
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

/** A seeded PRNG (mulberry32) returning [0, 1). */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
