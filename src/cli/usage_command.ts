import type { Sql } from "postgres";
import { type TaskAttemptUsage, taskAttemptUsage } from "../jobs/job_store.ts";
import { nanosToUsd } from "../llm/prices.ts";
import { DEFAULT_SINCE, parseSince } from "../usage/since.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task usage [--tenant T] [--since 24h|7d|30m|90s] [--json]";

/**
 * One line of the report: a tenant's calls to one model for one task version, what they were charged (the sum
 * of their `cost_usd`, null when none had a price), and the runs the result cache answered instead with what
 * those hits saved.
 */
export interface UsageRow extends Omit<TaskAttemptUsage, "cost_nanos" | "saved_nanos"> {
  cost_usd: number | null;
  saved_usd: number | null;
}

/**
 * Reads the report from `model_attempts` and `cache_hits`: per tenant, task, task version and model, since
 * `sinceS` seconds ago. The cost is what each call was charged when it was recorded, at its model's price.
 */
export async function usageReport(
  sql: Sql,
  { tenant, sinceS }: { tenant?: string; sinceS: number },
): Promise<UsageRow[]> {
  const lines = await taskAttemptUsage(sql, { tenant, sinceS });
  const usd = (nanos: number | null) => (nanos === null ? null : nanosToUsd(nanos));
  // Spelled out, for the columns' order: calls and latency, then cost, then the cache.
  return lines.map((
    {
      cost_nanos,
      unpriced_calls,
      batch_calls,
      cache_hits,
      saved_prompt_tokens,
      saved_completion_tokens,
      saved_nanos,
      ...line
    },
  ) => ({
    ...line,
    cost_usd: usd(cost_nanos),
    unpriced_calls,
    batch_calls,
    cache_hits,
    saved_prompt_tokens,
    saved_completion_tokens,
    saved_usd: usd(saved_nanos),
  }));
}

export { parseSince };

/**
 * `usage [--tenant T] [--since 24h] [--json]`: per tenant, task, task
 * version and model (a summary job's calls are `summarize` version 1), the
 * calls, tokens, failures, retries and p50/p99 latency of model attempts,
 * what they were charged, and the cache hits with their savings.
 * @returns the process exit code.
 */
export async function usageCommand(
  sql: Sql,
  args: string[],
  { out = console.log }: { out?: (line: string) => void } = {},
): Promise<number> {
  let tenant: string | undefined, since = DEFAULT_SINCE, json = false;
  for (let i = 0; i < args.length; i++) {
    const arg = args[i];
    if (arg === "--json") json = true;
    else if (arg === "--tenant" && args[i + 1]) tenant = args[++i];
    else if (arg === "--since" && args[i + 1]) since = args[++i]!;
    else {
      console.error(USAGE);
      return 2;
    }
  }
  let sinceS: number;
  try {
    sinceS = parseSince(since);
  } catch (error) {
    console.error(`--${(error as Error).message}`);
    return 2;
  }
  const rows = await usageReport(sql, { tenant, sinceS });
  // JSON keeps the exact cost; the table shows it to the cent's hundredth.
  const usd = (v: number | null) => (v === null ? null : v.toFixed(4));
  const shown = json ? rows : rows.map((r) => ({ ...r, cost_usd: usd(r.cost_usd), saved_usd: usd(r.saved_usd) }));
  printRows(shown as unknown as Record<string, unknown>[], {
    json,
    out,
    empty: `No model calls in the last ${since}${tenant ? ` for tenant ${tenant}` : ""}.`,
  });
  return 0;
}
