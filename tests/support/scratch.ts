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

/** Where a database index's claim lives: database 0 of the same server, one key per index, with an expiry. */
const CLAIM_KEY = "scratch_redis_db:claim:";
/** Set, with no expiry, on an index once claimed: its keys are a test's, and flushed when it is claimed again. */
const USED_KEY = "scratch_redis_db:used:";
/** A claim lapses this long after its last renewal: a process killed holding it frees it within this. */
export const CLAIM_TTL_MS = 60_000;
/** How often a process renews the claims it holds. */
const RENEW_MS = 15_000;
/** The prefix of every key the service writes (`src/runs/keys.ts`'s `KEY_PREFIX`) and of the tests' own. */
const OURS = /^oncely/;

/** Renews the claim while it is still `token`'s; 0 once it is not (lapsed and claimed by another). */
const RENEW_SCRIPT = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])`;
/** Deletes the claim if it is still `token`'s. */
const RELEASE_SCRIPT = `
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`;

/** The claims this process holds, by the URL handed out, and the timer that renews them while there are any. */
const held = new Map<string, { index: number; token: string; admin: string }>();
let renewer: { timer: ReturnType<typeof setInterval>; redis: Map<string, Redis> } | undefined;

/** Database 0 of the server of `url`, where the claims live. */
function adminUrl(url: string): string {
  const u = new URL(url);
  u.pathname = "/0";
  return u.toString();
}

/** Starts renewing the claims held, or stops once none are. */
function renewHeld(): void {
  if (held.size > 0 && !renewer) {
    const redis = new Map<string, Redis>();
    const timer = setInterval(() => {
      for (const { index, token, admin } of held.values()) {
        if (!redis.has(admin)) redis.set(admin, new Redis(admin, { maxRetriesPerRequest: 1 }));
        redis.get(admin)!.eval(RENEW_SCRIPT, 1, `${CLAIM_KEY}${index}`, token, CLAIM_TTL_MS).catch(() => {});
      }
    }, RENEW_MS);
    // A run that ends holding a claim (a failed bench) still exits: its claim then lapses.
    Deno.unrefTimer(timer);
    renewer = { timer, redis };
  } else if (held.size === 0 && renewer) {
    clearInterval(renewer.timer);
    for (const redis of renewer.redis.values()) redis.disconnect();
    renewer = undefined;
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
 * Redis outlives any test run, and a run can be killed before it cleans up. So a claim is a key in database 0,
 * set with `NX` and an expiry of {@linkcode CLAIM_TTL_MS} that the claiming process renews while it holds the
 * index: a killed process's claim lapses within a minute. An index with no claim is free; its leftovers are
 * flushed when they are ours (a test used it before, which a key without expiry records, or every key is the
 * service's). An index holding anyone else's keys is never touched.
 * @returns the URL of that database, empty.
 * @throws {Error} when no index is free.
 */
export async function emptyRedisDatabase(url: string): Promise<string> {
  const admin = new Redis(adminUrl(url), { maxRetriesPerRequest: 1 });
  const probe = new Redis(url, { maxRetriesPerRequest: 1 });
  const token = `${Deno.pid}|${Date.now()}|${randomId()}`;
  try {
    for (let i = 15; i >= 1; i--) {
      const key = `${CLAIM_KEY}${i}`;
      if (await admin.set(key, token, "PX", CLAIM_TTL_MS, "NX") !== "OK") continue;
      await probe.select(i);
      if ((await probe.dbsize()) > 0) {
        if (!(await admin.exists(`${USED_KEY}${i}`)) && !(await holdsOnlyOurs(probe))) {
          await admin.eval(RELEASE_SCRIPT, 1, key, token);
          continue;
        }
        await probe.flushdb();
      }
      await admin.set(`${USED_KEY}${i}`, "1");
      const u = new URL(url);
      u.pathname = `/${i}`;
      held.set(u.toString(), { index: i, token, admin: adminUrl(url) });
      renewHeld();
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
  renewHeld();
  const db = new Redis(url, { maxRetriesPerRequest: 1 });
  const admin = new Redis(claim.admin, { maxRetriesPerRequest: 1 });
  try {
    await db.flushdb();
    await admin.eval(RELEASE_SCRIPT, 1, `${CLAIM_KEY}${claim.index}`, claim.token);
  } finally {
    db.disconnect();
    admin.disconnect();
  }
}
