/**
 * Task versions as the API and the worker read them: a version never
 * changes, so a version once read is kept (up to a bound in versions and in
 * bytes, the least recently used going first); which version is the latest
 * is read again after a second (and at once after this process stored one),
 * so a run that names no version gets one at most a second old when another
 * process stored it.
 */
import type { Sql } from "postgres";
import { taskVersion } from "../jobs/task_store.ts";
import { BUILT_IN_TASK, SUMMARIZE_DEFINITION, TaskDefinition } from "./definition.ts";
import { Lru } from "./_lru.ts";
import { CHAT_DEFINITION, CHAT_TASK } from "./chat_task.ts";

/** A task version ready to run. */
export interface LoadedTask {
  name: string;
  version: number;
  definition: TaskDefinition;
  /** Names this version across tenants: the validators' cache key. */
  key: string;
}

/**
 * Bounds of the cache, in every API and worker process. `maxBytes` counts each version's definition as the
 * store measures it (UTF-8 bytes of compact JSON, at most 256 KiB a version): 64 versions at the largest size,
 * thousands of usual ones. Parsed, a definition takes less or more than its bytes on the heap, within a small
 * factor, so the heap the cache holds stays near `maxBytes`; the ratios measured, and what the cache's earlier
 * 32 MiB left an API holding, are in the README, "Defining a task".
 */
export const TASK_CACHE = { maxVersions: 10_000, maxBytes: 16 * 1024 * 1024, latestTtlMs: 1_000 };

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

/** The built-in chat task (version 1), for every tenant: what the OpenAI-compatible endpoints run. */
export const CHAT_TASK_V1: LoadedTask = {
  name: CHAT_TASK,
  version: 1,
  definition: CHAT_DEFINITION,
  key: `/${CHAT_TASK}/1`,
};

/** A built-in task's version, for any tenant; undefined for a tenant's task (or a version that does not exist). */
function builtIn(name: string, version: number | undefined): LoadedTask | undefined {
  if (version !== undefined && version !== 1) return undefined;
  return name === BUILT_IN_TASK ? SUMMARIZE_TASK : CHAT_TASK_V1;
}

/** Whether `name` is a built-in task's. */
export function isBuiltIn(name: string): boolean {
  return name === BUILT_IN_TASK || name === CHAT_TASK;
}

/** A cache of `sql`'s task versions, within `bounds` ({@linkcode TASK_CACHE}'s when unset). */
export function createTaskCache(
  sql: Sql,
  bounds: Partial<Pick<typeof TASK_CACHE, "maxVersions" | "maxBytes">> = {},
): TaskCache {
  const versions = new Lru<string, { task: LoadedTask; bytes: number }>(
    bounds.maxVersions ?? TASK_CACHE.maxVersions,
    { maxWeight: bounds.maxBytes ?? TASK_CACHE.maxBytes, weigh: (entry) => entry.bytes },
  );
  const latest = new Map<string, { version: number; at: number }>();
  const remember = (tenant: string, task: LoadedTask, bytes: number) => {
    versions.set(`${tenant}/${task.name}/${task.version}`, { task, bytes });
  };
  return {
    async get(tenant, name, version) {
      if (isBuiltIn(name)) return builtIn(name, version);
      const wanted = version ?? fresh(latest.get(`${tenant}/${name}`))?.version;
      if (wanted !== undefined) {
        const known = versions.get(`${tenant}/${name}/${wanted}`);
        if (known) return known.task;
      }
      const row = await taskVersion(sql, tenant, name, wanted);
      if (!row) return undefined;
      const task: LoadedTask = {
        name,
        version: row.version,
        definition: TaskDefinition.parse(row.definition),
        key: `${tenant}/${name}/${row.version}`,
      };
      remember(tenant, task, row.bytes);
      if (version === undefined) {
        if (latest.size >= TASK_CACHE.maxVersions) latest.clear();
        latest.set(`${tenant}/${name}`, { version: task.version, at: performance.now() });
      }
      return task;
    },
    peek(tenant, name, version) {
      if (isBuiltIn(name)) return builtIn(name, version);
      const wanted = version ?? fresh(latest.get(`${tenant}/${name}`))?.version;
      return wanted === undefined ? undefined : versions.get(`${tenant}/${name}/${wanted}`)?.task;
    },
    forgetLatest(tenant, name) {
      latest.delete(`${tenant}/${name}`);
    },
  };
}

function fresh(entry: { version: number; at: number } | undefined) {
  return entry && performance.now() - entry.at < TASK_CACHE.latestTtlMs ? entry : undefined;
}
