/**
 * Redis key names of the summary pipeline. Each tenant has a lane: its
 * stream, dead letters, job status records and idempotency records share the
 * tag `{t:<tenant>}`, so every MULTI or script stays in one Redis Cluster
 * slot while lanes spread over all of them. (A very large tenant could later
 * be split over `{t:<tenant>:N}` lanes with the same code.)
 */
import { type LaneRegistryKeys, laneRegistryKeys } from "../queue/lanes.ts";

export interface JobKeys {
  stream: string;
  dead: string;
  group: string;
  /** Hash with the job's tenant and status, read by `GET /v1/summaries/{id}`. */
  job(jobId: string): string;
  /** The stored answer for an Idempotency-Key scope (by its hash), in the same slot as the stream it enqueues to. */
  idempotency(scopeHash: string): string;
  /** Marks that the pre-lane stream's entry `entryId` was moved into this lane (see `legacy_drain.ts`). */
  movedFromLegacy(entryId: string): string;
  /** A result cache entry (`cache/result_cache.ts`), by its key's hash: in the tenant's slot. */
  cacheEntry(keyHash: string): string;
  /** The lock of the one run computing a cache entry (in-flight dedupe), beside the entry. */
  cacheLock(keyHash: string): string;
}

/** The prefix of every Redis key the service writes. */
export const KEY_PREFIX = "oncely";

/** Every key name the service uses under a prefix. */
export interface ServiceKeys {
  prefix: string;
  /** Tenant `tenant`'s lane. */
  lane(tenant: string): JobKeys;
  /** The registry of lanes with work. */
  registry: LaneRegistryKeys;
  /** Tenant `tenant`'s budget hash (`budgets/`), under its lane's tag. */
  budget(tenant: string): string;
}

/** The service's keys under a prefix: {@linkcode KEY_PREFIX} in the service, a random one in tests. */
export function serviceKeys(prefix: string): ServiceKeys {
  const lanes = new Map<string, JobKeys>();
  return {
    prefix,
    lane(tenant) {
      let keys = lanes.get(tenant);
      if (!keys) {
        keys = keysUnder(`${prefix}:{t:${tenant}}`);
        if (lanes.size < 10_000) lanes.set(tenant, keys);
      }
      return keys;
    },
    registry: laneRegistryKeys(prefix),
    budget: (tenant) => `${prefix}:{t:${tenant}}:budget`,
  };
}

/** The status record of `jobId` in the lane whose stream is `stream` (lanes keep both under one tag). */
export function jobKeyBeside(stream: string, jobId: string): string {
  return `${stream.slice(0, stream.lastIndexOf(":stream"))}:job:${jobId}`;
}

/**
 * The single `{jobs}` stream's keys: a one-stream queue for tests and tools. Under the service's prefix it is
 * the stream of releases before lanes, which the workers' legacy drain empties into the lanes (see
 * `legacy_drain.ts`); nothing else reads or writes it there.
 */
export function jobKeys(prefix: string): JobKeys {
  return keysUnder(`${prefix}:{jobs}`);
}

function keysUnder(tag: string): JobKeys {
  return {
    stream: `${tag}:stream`,
    dead: `${tag}:dead`,
    group: "summarisers",
    job: (jobId) => `${tag}:job:${jobId}`,
    idempotency: (scopeHash) => `${tag}:idem:${scopeHash}`,
    movedFromLegacy: (entryId) => `${tag}:moved:${entryId}`,
    cacheEntry: (keyHash) => `${tag}:cache:${keyHash}`,
    cacheLock: (keyHash) => `${tag}:cache_lock:${keyHash}`,
  };
}

/** How long a job's status record lives in Redis (the summary itself lives in Postgres). */
export const JOB_RECORD_TTL_S = 7 * 24 * 3600;
