/**
 * The cache-hit store: the one module that writes and deletes `cache_hits`,
 * one row per run answered from the result cache (what it reused and what it
 * saved). The commit writes the rows in its statement, through
 * {@linkcode insertCacheHitsOf}; retention deletes old ones.
 */
import { deleteBatch, type ExpiryBatch, type Fragment, olderThan, type Queryable } from "../db/queryable.ts";

/** A run answered from the cache: the done run whose output it reused, and what that run's calls cost. */
export interface CacheHit {
  sourceRunId: string;
  /** The model the source asked (part of the cache key). */
  model: string | null;
  promptTokens: number;
  completionTokens: number;
  /** The saved tokens at the model's price; null when the model has no price. */
  savedUsd: number | null;
}

/** One `cache_hits` row: the hit, and the run it answered. */
export interface CacheHitRow extends CacheHit {
  runId: string;
  tenant: string;
  task: string;
  version: number;
}

/**
 * The part of another store's statement that inserts the cache-hit rows of the runs it decided: only rows whose
 * run is in `decided` (a relation of that statement with a `job_id uuid` column); a row already there (a run
 * committed once) is left as it is.
 */
export function insertCacheHitsOf(sql: Queryable, rows: CacheHitRow[], decided: Fragment): Fragment {
  const col = <K extends keyof CacheHitRow>(k: K) => rows.map((r) => r[k]);
  return sql`
    INSERT INTO cache_hits (run_id, tenant, task, version, model, source_run_id, saved_prompt_tokens,
      saved_completion_tokens, saved_usd)
    SELECT * FROM unnest(
      ${col("runId")}::uuid[], ${col("tenant")}::text[], ${col("task")}::text[], ${col("version")}::int[],
      ${col("model") as (string | null)[]}::text[], ${col("sourceRunId")}::uuid[], ${col("promptTokens")}::int[],
      ${col("completionTokens")}::int[], ${col("savedUsd").map((u) => u === null ? null : String(u))}::numeric[]
    ) AS t(run_id, tenant, task, version, model, source_run_id, saved_prompt_tokens, saved_completion_tokens,
      saved_usd)
    WHERE t.run_id IN (SELECT job_id FROM ${decided})
    ON CONFLICT (run_id) DO NOTHING`;
}

/** Deletes up to `limit` cache-hit rows written more than `olderThanMs` ago. @returns rows deleted. */
export function deleteExpiredCacheHits(sql: Queryable, { olderThanMs, limit }: ExpiryBatch): Promise<number> {
  return deleteBatch(sql, {
    table: "cache_hits",
    key: "run_id",
    where: olderThan(sql, "created_at", olderThanMs),
    limit,
  });
}
