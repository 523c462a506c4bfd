/**
 * Task versions as the API and the worker read them: a version never
 * changes, so a version once read is kept (up to a bound); which version is
 * the latest is read again after a second (and at once after this process
 * stored one), so a run that names no version gets one at most a second old
 * when another process stored it.
 */
import type { Sql } from "postgres";
import { taskVersion } from "../jobs/task_store.ts";
import { BUILT_IN_TASK, SUMMARIZE_DEFINITION, TaskDefinition } from "./definition.ts";

/** A task version ready to run. */
export interface LoadedTask {
  name: string;
  version: number;
  definition: TaskDefinition;
  /** Names this version across tenants: the validators' cache key. */
  key: string;
}

/** Bounds of the cache. */
export const TASK_CACHE = { maxVersions: 10_000, latestTtlMs: 1_000 };

/** Reads task versions through a cache. */
export interface TaskCache {
  /** The task's version `version`, or its latest; undefined when there is none. */
  get(tenant: string, name: string, version?: number): Promise<LoadedTask | undefined>;
  /**
   * Without a wait: the version `version` if this process has read it already (a worker's usual case), or
   * without `version` the latest as last read within `TASK_CACHE.latestTtlMs`; undefined otherwise (call `get`).
   */
  peek(tenant: string, name: string, version?: number): LoadedTask | undefined;
  /** Forgets which version of the task is the latest (this process has just stored one). */
  forgetLatest(tenant: string, name: string): void;
}

/** The built-in summarize task (version 1), for every tenant. */
export const SUMMARIZE_TASK: LoadedTask = {
  name: BUILT_IN_TASK,
  version: 1,
  definition: SUMMARIZE_DEFINITION,
  key: `/${BUILT_IN_TASK}/1`,
};

/** A cache of `sql`'s task versions. */
export function createTaskCache(sql: Sql): TaskCache {
  const versions = new Map<string, LoadedTask>();
  const latest = new Map<string, { version: number; at: number }>();
  const remember = (tenant: string, task: LoadedTask) => {
    if (versions.size >= TASK_CACHE.maxVersions) versions.delete(versions.keys().next().value!);
    versions.set(`${tenant}/${task.name}/${task.version}`, task);
  };
  return {
    async get(tenant, name, version) {
      if (name === BUILT_IN_TASK) return version === undefined || version === 1 ? SUMMARIZE_TASK : undefined;
      const wanted = version ?? fresh(latest.get(`${tenant}/${name}`))?.version;
      if (wanted !== undefined) {
        const known = versions.get(`${tenant}/${name}/${wanted}`);
        if (known) return known;
      }
      const row = await taskVersion(sql, tenant, name, wanted);
      if (!row) return undefined;
      const task: LoadedTask = {
        name,
        version: row.version,
        definition: TaskDefinition.parse(row.definition),
        key: `${tenant}/${name}/${row.version}`,
      };
      remember(tenant, task);
      if (version === undefined) {
        if (latest.size >= TASK_CACHE.maxVersions) latest.clear();
        latest.set(`${tenant}/${name}`, { version: task.version, at: performance.now() });
      }
      return task;
    },
    peek(tenant, name, version) {
      if (name === BUILT_IN_TASK) return version === undefined || version === 1 ? SUMMARIZE_TASK : undefined;
      const wanted = version ?? fresh(latest.get(`${tenant}/${name}`))?.version;
      return wanted === undefined ? undefined : versions.get(`${tenant}/${name}/${wanted}`);
    },
    forgetLatest(tenant, name) {
      latest.delete(`${tenant}/${name}`);
    },
  };
}

function fresh(entry: { version: number; at: number } | undefined) {
  return entry && performance.now() - entry.at < TASK_CACHE.latestTtlMs ? entry : undefined;
}
