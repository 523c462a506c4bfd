/**
 * The task store: the one module that reads and writes `tasks`, every
 * version of every tenant's task definition. Versions never change; a
 * changed definition is the next version.
 */
import type { Queryable } from "../db/queryable.ts";
import type { Sql } from "postgres";

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
