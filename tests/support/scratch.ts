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

/** Where a database index's claim lives: database 0 of the same server, one key per index. */
const CLAIM_KEY = "oncely_test:redis_db_claim:";
/** A claim whose process cannot be checked (another machine's) lapses after this long. */
const CLAIM_LAPSE_MS = 12 * 60 * 60 * 1000;
/** The prefix of every key the service writes (`src/runs/keys.ts`'s `KEY_PREFIX`) and of the tests' own. */
const OURS = /^oncely/;

/** Claims this process holds, by the URL handed out, for {@linkcode releaseRedisDatabase}. */
const held = new Map<string, { index: number; token: string }>();

/** Sets the claim to `token` if it still reads `expected` (false: absent); one step. */
const CLAIM_SCRIPT = `
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1`;

/** Deletes the claim if it is still `token`'s. */
const RELEASE_SCRIPT = `
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`;

/** Database 0 of the server of `url`, where the claims live. */
function adminUrl(url: string): string {
  const u = new URL(url);
  u.pathname = "/0";
  return u.toString();
}

/** Whether the process that wrote a claim may still run: its pid is alive here, or the claim is young. */
function claimLive(claim: string): boolean {
  const [host, pid, at] = claim.split("|");
  if (Date.now() - Number(at) > CLAIM_LAPSE_MS) return false;
  if (host !== hostName()) return true;
  try {
    Deno.statSync(`/proc/${pid}`);
    return true;
  } catch {
    return false;
  }
}

function hostName(): string {
  try {
    return Deno.hostname();
  } catch {
    return "unknown";
  }
}

/** Whether every key of the selected database (a sample of up to 1,000) is one the service or a test writes. */
async function holdsOnlyOurs(probe: Redis): Promise<boolean> {
  const [, keys] = await probe.scan("0", "COUNT", 1000);
  return keys.every((k) => OURS.test(k));
}

/**
 * Claims a Redis database index (15 down to 1) on the server of `url` for this process, for running real service
 * processes, whose key names are fixed, in isolation; hand it back with {@linkcode releaseRedisDatabase}.
 *
 * Redis outlives any test run, and a run can be killed before it cleans up. So a claim is a key in database 0 naming
 * the claiming process (host, pid, time): an index is free when it has no claim or its claimant is gone. A free
 * index's leftovers are flushed when they are ours (it was claimed before, or every key is the service's); an index
 * holding anyone else's keys is never touched. Two processes racing for an index: the claim is a compare-and-set.
 * @returns the URL of that database, empty.
 * @throws {Error} when no index is free.
 */
export async function emptyRedisDatabase(url: string): Promise<string> {
  const admin = new Redis(adminUrl(url), { maxRetriesPerRequest: 1 });
  const probe = new Redis(url, { maxRetriesPerRequest: 1 });
  const token = `${hostName()}|${Deno.pid}|${Date.now()}|${randomId()}`;
  try {
    for (let i = 15; i >= 1; i--) {
      const key = `${CLAIM_KEY}${i}`;
      const before = await admin.get(key);
      if (before !== null && claimLive(before)) continue;
      if (await admin.eval(CLAIM_SCRIPT, 1, key, before ?? "", token) !== 1) continue;
      await probe.select(i);
      if ((await probe.dbsize()) > 0) {
        if (before === null && !(await holdsOnlyOurs(probe))) {
          await admin.eval(RELEASE_SCRIPT, 1, key, token);
          continue;
        }
        await probe.flushdb();
      }
      const u = new URL(url);
      u.pathname = `/${i}`;
      held.set(u.toString(), { index: i, token });
      return u.toString();
    }
  } finally {
    admin.disconnect();
    probe.disconnect();
  }
  throw new Error(`no free Redis database index (1-15) on ${url}: each holds another's keys or a live claim`);
}

/** Flushes a database {@linkcode emptyRedisDatabase} handed out and gives its index back. Safe to call twice. */
export async function releaseRedisDatabase(url: string): Promise<void> {
  const claim = held.get(url);
  if (!claim) return;
  held.delete(url);
  const db = new Redis(url, { maxRetriesPerRequest: 1 });
  const admin = new Redis(adminUrl(url), { maxRetriesPerRequest: 1 });
  try {
    await db.flushdb();
    await admin.eval(RELEASE_SCRIPT, 1, `${CLAIM_KEY}${claim.index}`, claim.token);
  } finally {
    db.disconnect();
    admin.disconnect();
  }
}
