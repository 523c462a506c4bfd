/**
 * Redis key names of the summary pipeline. Every key that takes part in one
 * MULTI or script shares the `{jobs}` hash tag, so each such operation stays
 * on one Redis Cluster slot. (Partitioned streams will use `{jobs.N}`.)
 */
export interface JobKeys {
  stream: string;
  dead: string;
  group: string;
  /** Hash with the job's tenant and status, read by `GET /v1/summaries/{id}`. */
  job(jobId: string): string;
  /** The stored answer for an Idempotency-Key scope (by its hash), in the same slot as the stream it enqueues to. */
  idempotency(scopeHash: string): string;
}

/** The prefix of every Redis key the service writes. */
export const KEY_PREFIX = "oncely";

/** Key names under a prefix: {@linkcode KEY_PREFIX} in the service, a random one in tests. */
export function jobKeys(prefix: string): JobKeys {
  const tag = `${prefix}:{jobs}`;
  return {
    stream: `${tag}:stream`,
    dead: `${tag}:dead`,
    group: "summarisers",
    job: (jobId) => `${tag}:job:${jobId}`,
    idempotency: (scopeHash) => `${tag}:idem:${scopeHash}`,
  };
}

/** How long a job's status record lives in Redis (the summary itself lives in Postgres). */
export const JOB_RECORD_TTL_S = 7 * 24 * 3600;
