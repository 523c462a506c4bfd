/**
 * Usage and throughput as time series, for the console's charts: the same
 * rows and definitions as `GET /v1/usage` and `deno task usage` (a call is a
 * `model_attempts` row, tokens are its prompt and completion tokens, cost is
 * the sum of its `cost_usd`, NULL being unpriced; a cache hit is a
 * `cache_hits` row), cut into buckets of equal width. A bucket is
 * `floor((t - fromMs) / widthMs)`: rows before `fromMs` (read only for a
 * running total since midnight) are bucket -1. A task's figures are the
 * rows naming it (`task`, which the worker writes on every attempt and cache
 * hit), read on the tenant's `(tenant, started_at)` or `(tenant, created_at)`
 * index.
 */
import type { Queryable } from "../db/queryable.ts";

/** A window of equal buckets: `[fromMs, fromMs + count * widthMs)`. */
export interface Window {
  fromMs: number;
  widthMs: number;
  count: number;
}

/** One bucket's model calls (of one UTC day, when a bucket spans midnight). */
export interface UsageBucketRow {
  bucket: number;
  /** Days since the epoch (UTC) of the calls. */
  day: number;
  calls: number;
  prompt_tokens: number;
  completion_tokens: number;
  /** The sum of the priced calls' `cost_usd`, as Postgres adds it up (numeric, as text); null when none was priced. */
  cost_usd: string | null;
  /** Calls with no price (`cost_usd` NULL). */
  unpriced: number;
}

const MS_PER_DAY = 86_400_000;

/**
 * Model calls per bucket and UTC day, of `tenant` (all tenants when unset) and, with `task`, of that task's runs
 * alone, from `sinceMs` (at most the window's start; earlier for a running total since midnight) to the window's
 * end.
 */
export async function usagePerBucket(
  sql: Queryable,
  { tenant, task, window, sinceMs = window.fromMs }: {
    tenant?: string;
    task?: string;
    window: Window;
    sinceMs?: number;
  },
): Promise<UsageBucketRow[]> {
  const { fromMs, widthMs, count } = window;
  // The calls before the window add up to one row per day, whatever the buckets' width (1,440 minutes a day).
  return await sql<UsageBucketRow[]>`
    SELECT greatest(floor((extract(epoch FROM started_at) * 1000 - ${fromMs}) / ${widthMs}), -1)::int AS bucket,
      floor(extract(epoch FROM started_at) * 1000 / ${MS_PER_DAY})::int AS day,
      count(*)::int AS calls,
      coalesce(sum(prompt_tokens), 0)::bigint::float8 AS prompt_tokens,
      coalesce(sum(completion_tokens), 0)::bigint::float8 AS completion_tokens,
      sum(cost_usd)::text AS cost_usd,
      (count(*) FILTER (WHERE cost_usd IS NULL))::int AS unpriced
    FROM model_attempts
    WHERE started_at >= to_timestamp(${sinceMs}::float8 / 1000)
      AND started_at < to_timestamp(${fromMs + count * widthMs}::float8 / 1000)
      ${tenant === undefined ? sql`` : sql`AND tenant = ${tenant}`}
      ${task === undefined ? sql`` : sql`AND task = ${task}`}
    GROUP BY 1, 2
    ORDER BY 1, 2`;
}

/** One bucket's cache hits and what they saved. */
export interface CacheBucketRow {
  bucket: number;
  hits: number;
  saved_tokens: number;
  /** As text (numeric); null when no hit had a price. */
  saved_usd: string | null;
}

/** Cache hits per bucket of `window`, of `tenant` (all tenants when unset) and, with `task`, of that task alone. */
export async function cacheHitsPerBucket(
  sql: Queryable,
  { tenant, task, window }: { tenant?: string; task?: string; window: Window },
): Promise<CacheBucketRow[]> {
  const { fromMs, widthMs, count } = window;
  return await sql<CacheBucketRow[]>`
    SELECT floor((extract(epoch FROM created_at) * 1000 - ${fromMs}) / ${widthMs})::int AS bucket,
      count(*)::int AS hits,
      coalesce(sum(saved_prompt_tokens::bigint + saved_completion_tokens), 0)::float8 AS saved_tokens,
      sum(saved_usd)::text AS saved_usd
    FROM cache_hits
    WHERE created_at >= to_timestamp(${fromMs}::float8 / 1000)
      AND created_at < to_timestamp(${fromMs + count * widthMs}::float8 / 1000)
      ${tenant === undefined ? sql`` : sql`AND tenant = ${tenant}`}
      ${task === undefined ? sql`` : sql`AND task = ${task}`}
    GROUP BY 1
    ORDER BY 1`;
}

/** One bucket's decided jobs: how many ended which way, and the latency from acceptance to outcome. */
export interface OutcomeBucketRow {
  bucket: number;
  done: number;
  failed: number;
  cancelled: number;
  /** Runs whose model call had not started by their expiry. */
  expired: number;
  /** Outcomes that know when their job was accepted (`accepted_at`), which the percentiles are over. */
  timed: number;
  /** Milliseconds from acceptance to outcome (interpolated percentiles); null when none is timed. */
  p50_ms: number | null;
  p99_ms: number | null;
}

/**
 * Jobs decided per bucket of `window` (by `decided_at`), of `tenant` (all tenants when unset), by outcome,
 * with the p50 and p99 of `decided_at - accepted_at`.
 */
export async function outcomesPerBucket(
  sql: Queryable,
  { tenant, window }: { tenant?: string; window: Window },
): Promise<OutcomeBucketRow[]> {
  const { fromMs, widthMs, count } = window;
  return await sql<OutcomeBucketRow[]>`
    SELECT floor((extract(epoch FROM decided_at) * 1000 - ${fromMs}) / ${widthMs})::int AS bucket,
      (count(*) FILTER (WHERE outcome = 'done'))::int AS done,
      (count(*) FILTER (WHERE outcome = 'failed'))::int AS failed,
      (count(*) FILTER (WHERE outcome = 'cancelled'))::int AS cancelled,
      (count(*) FILTER (WHERE outcome = 'expired'))::int AS expired,
      count(accepted_at)::int AS timed,
      round((percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM decided_at - accepted_at) * 1000)
        FILTER (WHERE accepted_at IS NOT NULL))::numeric, 1)::float8 AS p50_ms,
      round((percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM decided_at - accepted_at) * 1000)
        FILTER (WHERE accepted_at IS NOT NULL))::numeric, 1)::float8 AS p99_ms
    FROM job_outcomes
    WHERE decided_at >= to_timestamp(${fromMs}::float8 / 1000)
      AND decided_at < to_timestamp(${fromMs + count * widthMs}::float8 / 1000)
      ${tenant === undefined ? sql`` : sql`AND tenant = ${tenant}`}
    GROUP BY 1
    ORDER BY 1`;
}

/** What `tenant`'s calls since `sinceMs` came to: tokens (prompt and completion) and cost (numeric, as text). */
export async function spentSince(
  sql: Queryable,
  tenant: string,
  sinceMs: number,
): Promise<{ tokens: number; cost_usd: string | null }> {
  const [row] = await sql<{ tokens: number; cost_usd: string | null }[]>`
    SELECT coalesce(sum(coalesce(prompt_tokens, 0)::bigint + coalesce(completion_tokens, 0)), 0)::float8 AS tokens,
      sum(cost_usd)::text AS cost_usd
    FROM model_attempts
    WHERE tenant = ${tenant} AND started_at >= to_timestamp(${sinceMs}::float8 / 1000)`;
  return row!;
}

/**
 * The tenants worth listing in the console's usage selector: every tenant with a key, and any other that made
 * a model call or had a cache hit since `sinceMs` (trusted-header tenants have no row), by name, at most `limit`.
 */
export async function usageTenants(sql: Queryable, { sinceMs, limit }: { sinceMs: number; limit: number }) {
  const rows = await sql<{ tenant: string }[]>`
    SELECT tenant FROM (
      SELECT name AS tenant FROM tenants
      UNION SELECT DISTINCT tenant FROM model_attempts WHERE started_at >= to_timestamp(${sinceMs}::float8 / 1000)
      UNION SELECT DISTINCT tenant FROM cache_hits WHERE created_at >= to_timestamp(${sinceMs}::float8 / 1000)
    ) t ORDER BY tenant LIMIT ${limit}`;
  return rows.map((r) => r.tenant);
}
