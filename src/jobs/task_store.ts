/**
 * The task store: the one module that reads and writes `tasks`, every
 * version of every tenant's task definition, `task_heads`, one row per task
 * (its latest version, its count of versions and their bytes, kept by a
 * trigger on `tasks`), and `task_put_tokens`, each tenant's bucket of PUTs.
 * Versions never change; a changed definition is the next version.
 *
 * A definition may be up to 256 KiB, so only a read of one version returns
 * one: lists, quotas and start-up read columns.
 */
import type { Sql } from "postgres";
import type { Queryable } from "../db/queryable.ts";
import { sha256Hex } from "../crypto/digest.ts";
import { canonicalJson } from "../idempotency/fingerprint.ts";

/**
 * How much one tenant may define: every version is kept (runs name them), so without a cap a tenant could
 * grow the table without bound.
 */
export const TASK_LIMITS = {
  /** Tasks (names) per tenant. */
  maxTasksPerTenant: 1_000,
  /** Versions per task. */
  maxVersionsPerTask: 1_000,
  /**
   * Bytes of definitions (compact canonical JSON, every version of every task) per tenant: 256 versions at the
   * largest size a version may have, tens of thousands of usual ones. `TASK_TENANT_MAX_BYTES` sets it.
   */
  maxBytesPerTenant: 64 * 1024 * 1024,
} as const;

/**
 * Each tenant's PUTs that would store a new version: a bucket of `burst` tokens that refills at `perMinute`
 * (`TASK_PUTS_PER_MINUTE`, `TASK_PUT_BURST`). A deploy may change 20 tasks at once, and then one a second;
 * each such PUT compiles its schemas on the checking Worker (its CPU is in the README, "Defining a task") and may
 * store 256 KiB.
 */
export const TASK_PUT_RATE = { perMinute: 60, burst: 20 } as const;

/** The largest version a row holds (`tasks.version` is a Postgres integer): none above it exists. */
export const MAX_TASK_VERSION = 2 ** 31 - 1;

/** A PUT that would pass one of {@linkcode TASK_LIMITS}; nothing was stored. */
export class TaskLimitReached extends Error {
  constructor(message: string) {
    super(message);
    this.name = "TaskLimitReached";
  }
}

/** One stored version of a task. */
export interface TaskVersion {
  tenant: string;
  name: string;
  version: number;
  definition: Record<string, unknown>;
  created_at: Date;
  /** Its definition's size: UTF-8 bytes of compact canonical JSON. */
  bytes: number;
  /** SHA-256 hex of its definition's canonical JSON; null for versions stored before digests were. */
  digest: string | null;
}

/**
 * A definition's canonical JSON (keys sorted, no spacing), and its size and digest as the store keeps them:
 * that JSON's UTF-8 bytes and SHA-256. Equal definitions (as JSON values) have equal digests.
 */
export function measureDefinition(
  definition: Record<string, unknown>,
): { json: string; bytes: number; digest: string } {
  const json = canonicalJson(definition);
  const encoded = new TextEncoder().encode(json);
  return { json, bytes: encoded.length, digest: sha256Hex(encoded) };
}

/** The task's latest version number, and that version when its definition equals the one asked about. */
export interface LatestVersion {
  version: number;
  same?: TaskVersion;
}

/**
 * Whether `definition` (whose size and digest are `measured`) equals the task's latest version, from the
 * digests: no definition is read (a version stored before digests were is compared as jsonb, in Postgres).
 * Equal, the version is returned with `definition` as its definition (equal as a JSON value to the stored one).
 * @returns undefined when the task has no version yet.
 */
export async function latestIfSame(
  sql: Queryable,
  tenant: string,
  name: string,
  definition: Record<string, unknown>,
  measured: { bytes: number; digest: string },
): Promise<LatestVersion | undefined> {
  const [head] = await sql<{ version: number; digest: string | null; created_at: Date }[]>`
    SELECT version, digest, created_at FROM task_heads WHERE tenant = ${tenant} AND name = ${name}`;
  if (!head) return undefined;
  let same = head.digest === measured.digest;
  if (head.digest === null) {
    const [row] = await sql<{ same: boolean }[]>`
      SELECT definition = ${sql.json(definition as never)} AS same FROM tasks
      WHERE tenant = ${tenant} AND name = ${name} AND version = ${head.version}`;
    same = row?.same === true;
  }
  if (!same) return { version: head.version };
  const { version, created_at } = head;
  const { bytes, digest } = measured;
  return { version, same: { tenant, name, version, definition, created_at, bytes, digest } };
}

/** What one tenant's tasks hold: how many tasks, and the bytes of all their versions' definitions. */
export async function tenantTaskUsage(sql: Queryable, tenant: string): Promise<{ tasks: number; bytes: number }> {
  const [usage] = await sql<{ tasks: number; bytes: number }[]>`
    SELECT count(*)::int AS tasks, coalesce(sum(total_bytes), 0)::float8 AS bytes
    FROM task_heads WHERE tenant = ${tenant}`;
  return usage ?? { tasks: 0, bytes: 0 };
}

/** Options of {@linkcode putTaskVersion}. */
export interface PutOptions {
  /** The definition's size and digest, when the caller has measured it ({@linkcode measureDefinition}). */
  measured?: { bytes: number; digest: string };
  /** Bytes of definitions the tenant may store in all; {@linkcode TASK_LIMITS}' when unset. */
  maxBytesPerTenant?: number;
}

/**
 * Stores `definition` as the task's next version, unless it equals the
 * latest one (by digest; as jsonb for a version stored before digests). One
 * PUT of a tenant at a time decides (transaction locks per tenant and
 * name), so two different bodies at once become two versions, never one
 * number twice, and the tenant's task count and bytes are exact.
 * @returns the version now latest, and whether this call created it.
 * @throws {TaskLimitReached} when a new version or a new task would pass {@linkcode TASK_LIMITS} or the
 * tenant's byte quota.
 */
export async function putTaskVersion(
  sql: Sql,
  tenant: string,
  name: string,
  definition: Record<string, unknown>,
  { measured = measureDefinition(definition), maxBytesPerTenant = TASK_LIMITS.maxBytesPerTenant }: PutOptions = {},
): Promise<{ task: TaskVersion; created: boolean }> {
  return await sql.begin(async (tx) => {
    // The name's lock is the one releases before this took: with it first, an older API process PUTting the
    // same task during an upgrade still waits its turn. The tenant's makes its count and bytes exact.
    await tx`SELECT pg_advisory_xact_lock(hashtextextended(${`task/${tenant}/${name}`}, 0))`;
    await tx`SELECT pg_advisory_xact_lock(hashtextextended(${`task-tenant/${tenant}`}, 0))`;
    const latest = await latestIfSame(tx, tenant, name, definition, measured);
    if (latest?.same) return { task: latest.same, created: false };
    if (latest && latest.version >= TASK_LIMITS.maxVersionsPerTask) {
      throw new TaskLimitReached(`Task ${name} has ${latest.version} versions, the most one task may have`);
    }
    const usage = await tenantTaskUsage(tx, tenant);
    if (!latest && usage.tasks >= TASK_LIMITS.maxTasksPerTenant) {
      throw new TaskLimitReached(`This tenant has ${usage.tasks} tasks, the most one tenant may have`);
    }
    if (usage.bytes + measured.bytes > maxBytesPerTenant) {
      throw new TaskLimitReached(quotaMessage(usage.bytes, measured.bytes, maxBytesPerTenant));
    }
    const { bytes, digest } = measured;
    const version = (latest?.version ?? 0) + 1;
    const [row] = await tx<{ created_at: Date }[]>`
      INSERT INTO tasks (tenant, name, version, definition, definition_bytes, digest)
      VALUES (${tenant}, ${name}, ${version}, ${tx.json(definition as never)}, ${bytes}, ${digest})
      RETURNING created_at`;
    return {
      task: { tenant, name, version, definition, created_at: row!.created_at, bytes, digest },
      created: true,
    };
  });
}

/** Why a version of `bytes` does not fit a tenant that stores `stored` of `quota`. */
export function quotaMessage(stored: number, bytes: number, quota: number): string {
  const n = (x: number) => x.toLocaleString("en-US");
  return `This tenant's task versions take ${n(stored)} bytes; this one's ${n(bytes)} more would pass the ` +
    `${n(quota)} bytes one tenant may store`;
}

/**
 * Takes one of the tenant's PUT tokens (see {@linkcode TASK_PUT_RATE}): the bucket holds `burst` and refills at
 * `perMinute`. A refused take leaves the bucket as it was.
 * @returns 0 when a token was taken, else the whole seconds until one will be there (at least 1).
 */
export async function takePutToken(
  sql: Queryable,
  tenant: string,
  { perMinute, burst }: { perMinute: number; burst: number },
): Promise<number> {
  const perSecond = perMinute / 60;
  // Postgres's clock, so that every API process fills the same bucket at the same pace. A stamp in the future
  // (the clock stepped back, a failover to a primary whose clock is behind) counts as a full bucket: otherwise the
  // tenant could PUT nothing until the clock caught up.
  const available = (b: string) =>
    sql`CASE WHEN ${sql(b)}.at > clock_timestamp() THEN ${burst}::float8 ELSE least(${burst}::float8,
      ${sql(b)}.tokens + ${perSecond}::float8 * extract(epoch FROM clock_timestamp() - ${sql(b)}.at)::float8) END`;
  const taken = await sql`
    INSERT INTO task_put_tokens AS b (tenant, tokens, at) VALUES (${tenant}, ${burst - 1}::float8, clock_timestamp())
    ON CONFLICT (tenant) DO UPDATE SET tokens = ${available("b")} - 1, at = clock_timestamp()
    WHERE ${available("b")} >= 1
    RETURNING tokens`;
  if (taken.count > 0) return 0;
  const [wait] = await sql<{ s: number }[]>`
    SELECT ceil((1 - ${available("t")}) / ${perSecond}::float8)::float8 AS s FROM task_put_tokens t
    WHERE tenant = ${tenant}`;
  return Math.max(1, wait?.s ?? 1);
}

/**
 * Whether the tenant's bucket of PUTs (see {@linkcode takePutToken}) has a token now, without taking it.
 * @returns 0 when it has one, else the whole seconds until it will (at least 1).
 */
export async function putTokenWait(
  sql: Queryable,
  tenant: string,
  { perMinute, burst }: { perMinute: number; burst: number },
): Promise<number> {
  const perSecond = perMinute / 60;
  const [row] = await sql<{ available: number }[]>`
    SELECT CASE WHEN at > clock_timestamp() THEN ${burst}::float8 ELSE least(${burst}::float8,
      tokens + ${perSecond}::float8 * extract(epoch FROM clock_timestamp() - at)::float8) END AS available
    FROM task_put_tokens WHERE tenant = ${tenant}`;
  if (!row || row.available >= 1) return 0;
  return Math.max(1, Math.ceil((1 - row.available) / perSecond));
}

/** The task's latest version, or its version `version`; undefined when there is none. */
export async function taskVersion(
  sql: Queryable,
  tenant: string,
  name: string,
  version?: number,
): Promise<TaskVersion | undefined> {
  // A number no row can hold names no version (and Postgres would refuse it as out of range).
  if (version !== undefined && !(Number.isInteger(version) && version >= 1 && version <= MAX_TASK_VERSION)) {
    return undefined;
  }
  const [task] = await sql<TaskVersion[]>`
    SELECT tenant, name, version, definition, created_at, definition_bytes AS bytes, digest FROM tasks
    WHERE tenant = ${tenant} AND name = ${name} ${version === undefined ? sql`` : sql`AND version = ${version}`}
    ORDER BY version DESC LIMIT 1`;
  return task;
}

/** Versions `versions` of a task, whole, newest first (those that exist). */
export async function taskVersionsNumbered(
  sql: Queryable,
  tenant: string,
  name: string,
  versions: readonly number[],
): Promise<TaskVersion[]> {
  if (versions.length === 0) return [];
  return await sql<TaskVersion[]>`
    SELECT tenant, name, version, definition, created_at, definition_bytes AS bytes, digest FROM tasks
    WHERE tenant = ${tenant} AND name = ${name} AND version = ANY(${versions as number[]}::int[])
    ORDER BY version DESC`;
}

/** A task at its latest version, without its definition: what `GET /v1/tasks` lists. */
export interface TaskListEntry {
  name: string;
  version: number;
  created_at: Date;
  /** The latest version's definition, in bytes of compact JSON. */
  bytes: number;
  versions: number;
  /** Every version's definition, in bytes, added up. */
  total_bytes: number;
}

/** One page of a tenant's tasks by name: at most `limit` of those named after `after`. */
export async function taskList(
  sql: Queryable,
  tenant: string,
  { after, limit }: { after?: string; limit: number },
): Promise<TaskListEntry[]> {
  return await sql<TaskListEntry[]>`
    SELECT name, version, created_at, definition_bytes AS bytes, versions, total_bytes::float8 AS total_bytes
    FROM task_heads WHERE tenant = ${tenant} ${after === undefined ? sql`` : sql`AND name > ${after}`}
    ORDER BY name LIMIT ${limit}`;
}

/** A version of a task without its prompt and schemas: what lists of tasks and versions show. */
export interface TaskVersionHead {
  tenant: string;
  name: string;
  version: number;
  created_at: Date;
  /** The definition's `model`: a name, names in order of preference, or null for the deployment's default. */
  model: string | string[] | null;
  has_output_schema: boolean;
  /** Its definition, in bytes of compact JSON. */
  bytes: number;
}

/** A task at its latest version, with how many versions it has, their bytes, and when its first was stored. */
export interface TaskHead extends TaskVersionHead {
  versions: number;
  total_bytes: number;
  first_created_at: Date;
}

/**
 * Tasks at their latest version, by tenant and name (only `tenant`'s when given), at most `limit` of them
 * after `after` (a tenant and a name). Reads `task_heads` alone.
 */
export async function taskHeads(
  sql: Queryable,
  { limit, tenant, after }: { limit: number; tenant?: string; after?: { tenant: string; name: string } },
): Promise<TaskHead[]> {
  return await sql<TaskHead[]>`
    SELECT tenant, name, version, created_at, model, has_output_schema, definition_bytes AS bytes, versions,
      total_bytes::float8 AS total_bytes, first_created_at
    FROM task_heads
    WHERE ${tenant === undefined ? sql`true` : sql`tenant = ${tenant}`}
      ${after === undefined ? sql`` : sql`AND (tenant, name) > (${after.tenant}, ${after.name})`}
    ORDER BY tenant, name LIMIT ${limit}`;
}

/** How many tasks there are (only `tenant`'s when given). */
export async function taskCount(sql: Queryable, tenant?: string): Promise<number> {
  const [count] = await sql<{ n: number }[]>`
    SELECT count(*)::int AS n FROM task_heads ${tenant === undefined ? sql`` : sql`WHERE tenant = ${tenant}`}`;
  return count?.n ?? 0;
}

/** Every version of a task without its definition, newest first. */
export async function taskVersionHeads(sql: Queryable, tenant: string, name: string): Promise<TaskVersionHead[]> {
  return await sql<TaskVersionHead[]>`
    SELECT tenant, name, version, created_at, model, has_output_schema, definition_bytes AS bytes
    FROM tasks WHERE tenant = ${tenant} AND name = ${name} ORDER BY version DESC`;
}

/** Every model any version of any task names, from the `model` column (no definition is read). */
export async function taskModels(sql: Queryable): Promise<string[]> {
  const rows = await sql<{ model: string }[]>`
    SELECT DISTINCT m AS model FROM (SELECT DISTINCT model FROM tasks WHERE model IS NOT NULL) t,
      jsonb_array_elements_text(CASE jsonb_typeof(t.model)
        WHEN 'array' THEN t.model WHEN 'string' THEN jsonb_build_array(t.model) ELSE '[]'::jsonb END) AS m`;
  return rows.map((r) => r.model);
}
