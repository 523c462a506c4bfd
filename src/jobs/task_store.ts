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
