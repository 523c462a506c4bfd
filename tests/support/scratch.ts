/** Scratch Postgres databases and Redis key prefixes, for tests, benchmarks and the chaos run. */
import { Redis } from "ioredis";
import type { RedisClient } from "../../src/clients.ts";
import postgres, { type Sql } from "postgres";
import { migrate, readMigrations } from "../../src/db/migrate.ts";
import { silentLogger } from "../../src/log/logger.ts";

/** A fresh database with the migrations applied; `close` drops it. */
export interface ScratchDatabase {
  sql: Sql;
  url: string;
  name: string;
  close(): Promise<void>;
}

function randomId(): string {
  return crypto.randomUUID().replaceAll("-", "").slice(0, 12);
}

/** The database URL with another database name. */
export function withDatabase(url: string, name: string): string {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}

/** Creates `<prefix>_<random>` on the server of `adminUrl`, migrated unless told otherwise. */
export async function createScratchDatabase(
  adminUrl: string,
  { prefix = "oncely_test", migrate: doMigrate = true, max = 10 }: {
    prefix?: string;
    migrate?: boolean;
    max?: number;
  } = {},
): Promise<ScratchDatabase> {
  const name = `${prefix}_${randomId()}`;
  const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
  await admin.unsafe(`CREATE DATABASE ${name}`);
  await admin.end();
  const url = withDatabase(adminUrl, name);
  const sql = postgres(url, { max, onnotice: () => {} });
  if (doMigrate) await migrate({ sql, log: silentLogger }, await readMigrations());
  return {
    sql,
    url,
    name,
    async close() {
      await sql.end({ timeout: 1 });
      const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
      await admin.unsafe(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      await admin.end();
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

/** A Redis client plus a key prefix nobody else uses; `close` deletes the prefix's keys. */
export interface ScratchRedis {
  redis: RedisClient;
  /** The URL (or seed list) the client connected to, for clients a test opens itself. */
  url: string;
  prefix: string;
  close(): Promise<void>;
}

/** Connects with a random key prefix. */
export async function createScratchRedis(url: string, prefix = "oncely_test"): Promise<ScratchRedis> {
  const redis = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 1 });
  await redis.connect();
  const p = `${prefix}_${randomId()}`;
  return {
    redis,
    url,
    prefix: p,
    async close() {
      await deleteByPrefix(redis, p);
      await redis.quit();
    },
  };
}

/**
 * Finds an empty Redis database index (15 down to 1) on the server of `url`,
 * for running real service processes, whose key names are fixed, in
 * isolation. @returns the URL of that database.
 * @throws {Error} when every index holds keys.
 */
export async function emptyRedisDatabase(url: string): Promise<string> {
  const probe = new Redis(url, { maxRetriesPerRequest: 1 });
  try {
    for (let i = 15; i >= 1; i--) {
      await probe.select(i);
      if ((await probe.dbsize()) === 0) {
        const u = new URL(url);
        u.pathname = `/${i}`;
        return u.toString();
      }
    }
  } finally {
    await probe.quit();
  }
  throw new Error(`no empty Redis database index (1-15) on ${url}`);
}
