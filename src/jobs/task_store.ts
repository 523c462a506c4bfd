/**
 * The task store: the one module that reads and writes `tasks`, every
 * version of every tenant's task definition. Versions never change; a
 * changed definition is the next version.
 */
import type { Queryable } from "../db/queryable.ts";
import type { Sql } from "postgres";

/**
 * How much one tenant may define: every version is kept (runs name them), so without a cap a tenant could
 * grow the table without bound.
 */
export const TASK_LIMITS = {
  /** Tasks (names) per tenant. */
  maxTasksPerTenant: 1_000,
  /** Versions per task. */
  maxVersionsPerTask: 1_000,
} as const;

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
}

/**
 * Stores `definition` as the task's next version, unless it equals the
 * latest one (jsonb equality: key order and spacing do not count). One PUT
 * of a task at a time decides (a transaction lock per tenant and name), so
 * two different bodies at once become two versions, never one number twice.
 * @returns the version now latest, and whether this call created it.
 * @throws {TaskLimitReached} when a new version or a new task would pass {@linkcode TASK_LIMITS}.
 */
export async function putTaskVersion(
  sql: Sql,
  tenant: string,
  name: string,
  definition: Record<string, unknown>,
): Promise<{ task: TaskVersion; created: boolean }> {
  return await sql.begin(async (tx) => {
    await tx`SELECT pg_advisory_xact_lock(hashtextextended(${`task/${tenant}/${name}`}, 0))`;
    const [latest] = await tx<(TaskVersion & { same: boolean })[]>`
      SELECT tenant, name, version, definition, created_at, definition = ${tx.json(definition as never)} AS same
      FROM tasks WHERE tenant = ${tenant} AND name = ${name} ORDER BY version DESC LIMIT 1`;
    if (latest?.same) {
      const { same: _, ...task } = latest;
      return { task, created: false };
    }
    if (latest && latest.version >= TASK_LIMITS.maxVersionsPerTask) {
      throw new TaskLimitReached(`Task ${name} has ${latest.version} versions, the most one task may have`);
    }
    if (!latest) {
      // Another new name PUT at the same moment may pass too: the cap can be exceeded by the PUTs in flight.
      const [count] = await tx<{ n: number }[]>`
        SELECT count(DISTINCT name)::int AS n FROM tasks WHERE tenant = ${tenant}`;
      const n = count?.n ?? 0;
      if (n >= TASK_LIMITS.maxTasksPerTenant) {
        throw new TaskLimitReached(`This tenant has ${n} tasks, the most one tenant may have`);
      }
    }
    const [task] = await tx<TaskVersion[]>`
      INSERT INTO tasks (tenant, name, version, definition)
      VALUES (${tenant}, ${name}, ${(latest?.version ?? 0) + 1}, ${tx.json(definition as never)})
      RETURNING tenant, name, version, definition, created_at`;
    return { task: task!, created: true };
  });
}

/** The task's latest version, or its version `version`; undefined when there is none. */
export async function taskVersion(
  sql: Queryable,
  tenant: string,
  name: string,
  version?: number,
): Promise<TaskVersion | undefined> {
  const [task] = await sql<TaskVersion[]>`
    SELECT tenant, name, version, definition, created_at FROM tasks
    WHERE tenant = ${tenant} AND name = ${name} ${version === undefined ? sql`` : sql`AND version = ${version}`}
    ORDER BY version DESC LIMIT 1`;
  return task;
}

/** Each task's latest version, by tenant and name; only `tenant`'s when given. */
export async function latestTasks(sql: Queryable, tenant?: string): Promise<TaskVersion[]> {
  return await sql<TaskVersion[]>`
    SELECT DISTINCT ON (tenant, name) tenant, name, version, definition, created_at FROM tasks
    ${tenant === undefined ? sql`` : sql`WHERE tenant = ${tenant}`}
    ORDER BY tenant, name, version DESC`;
}

/** Every version of a task, oldest first. */
export async function taskVersions(sql: Queryable, tenant: string, name: string): Promise<TaskVersion[]> {
  return await sql<TaskVersion[]>`
    SELECT tenant, name, version, definition, created_at FROM tasks
    WHERE tenant = ${tenant} AND name = ${name} ORDER BY version`;
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
}

/** A task at its latest version, with how many versions it has and when its first was stored. */
export interface TaskHead extends TaskVersionHead {
  versions: number;
  first_created_at: Date;
}

/**
 * Every tenant's tasks at their latest version, by tenant and name, at most
 * `limit` of them (definitions stay in the database: a task's prompt and
 * schemas may be hundreds of KiB), and how many tasks there are in all.
 */
export async function taskHeads(sql: Queryable, { limit }: { limit: number }): Promise<{
  tasks: TaskHead[];
  total: number;
}> {
  // Window functions run before DISTINCT ON: each row still counts every version of its task.
  const rows = await sql<(TaskHead & { total: number })[]>`
    SELECT *, count(*) OVER ()::int AS total FROM (
      SELECT DISTINCT ON (tenant, name) tenant, name, version, created_at, definition->'model' AS model,
        definition ? 'output_schema' AS has_output_schema,
        count(*) OVER (PARTITION BY tenant, name)::int AS versions,
        min(created_at) OVER (PARTITION BY tenant, name) AS first_created_at
      FROM tasks ORDER BY tenant, name, version DESC
    ) t
    ORDER BY tenant, name LIMIT ${limit}`;
  return { tasks: rows.map(({ total: _, ...task }) => task), total: rows[0]?.total ?? 0 };
}

/** Every version of a task without its prompt and schemas, newest first. */
export async function taskVersionHeads(sql: Queryable, tenant: string, name: string): Promise<TaskVersionHead[]> {
  return await sql<TaskVersionHead[]>`
    SELECT tenant, name, version, created_at, definition->'model' AS model,
      definition ? 'output_schema' AS has_output_schema
    FROM tasks WHERE tenant = ${tenant} AND name = ${name} ORDER BY version DESC`;
}

/** A task's newest `limit` versions, whole, newest first. */
export async function newestTaskVersions(
  sql: Queryable,
  tenant: string,
  name: string,
  limit: number,
): Promise<TaskVersion[]> {
  return await sql<TaskVersion[]>`
    SELECT tenant, name, version, definition, created_at FROM tasks
    WHERE tenant = ${tenant} AND name = ${name} ORDER BY version DESC LIMIT ${limit}`;
}
