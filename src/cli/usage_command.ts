import type { Sql } from "postgres";
import { type TaskAttemptUsage, taskAttemptUsage } from "../jobs/job_store.ts";
import { printRows } from "./table.ts";

const USAGE = "Usage: deno task usage [--tenant T] [--since 24h|7d|30m|90s] [--json]";
const UNITS: Record<string, number> = { s: 1, m: 60, h: 3600, d: 86400 };

/** Prices per million tokens (LLM_PRICE_IN_PER_MTOK / LLM_PRICE_OUT_PER_MTOK); without both, no cost. */
export interface Prices {
  inPerMTok?: number;
  outPerMTok?: number;
}

/**
 * One line of the report: a tenant's calls to one model for one task version, with their estimated cost when
 * prices are set.
 */
export interface UsageRow extends TaskAttemptUsage {
  cost?: number;
}

/** Reads the report from `model_attempts`: per tenant, task, task version and model, since `sinceS` seconds ago. */
export async function usageReport(
  sql: Sql,
  { tenant, sinceS, prices = {} }: { tenant?: string; sinceS: number; prices?: Prices },
): Promise<UsageRow[]> {
  const rows = await taskAttemptUsage(sql, { tenant, sinceS });
  if (prices.inPerMTok === undefined || prices.outPerMTok === undefined) return rows;
  const { inPerMTok, outPerMTok } = prices;
  return rows.map((r) => ({
    ...r,
    cost: (r.prompt_tokens * inPerMTok + r.completion_tokens * outPerMTok) / 1e6,
  }));
}

/** Parses `24h`, `7d`, `30m`, `90s`. @throws TypeError for anything else. */
export function parseSince(text: string): number {
  const match = /^(\d+)([smhd])$/.exec(text);
  if (!match) throw new TypeError(`--since takes a number and a unit, such as 24h, 7d, 30m or 90s (got ${text})`);
  return Number(match[1]) * UNITS[match[2]!]!;
}

/**
 * `usage [--tenant T] [--since 24h] [--json]`: per tenant, task, task
 * version and model (a summary job's calls are `summarize` version 1), the
 * calls, tokens, failures, retries and p50/p99 latency of model attempts,
 * and their estimated cost when prices are set.
 * @returns the process exit code.
 */
export async function usageCommand(
  sql: Sql,
  args: string[],
  { prices = {}, out = console.log }: { prices?: Prices; out?: (line: string) => void } = {},
): Promise<number> {
  let tenant: string | undefined, since = "24h", json = false;
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
    console.error((error as Error).message);
    return 2;
  }
  const rows = await usageReport(sql, { tenant, sinceS, prices });
  // JSON keeps the exact estimate; the table shows it to the cent's hundredth.
  const shown = json ? rows : rows.map((r) => (r.cost === undefined ? r : { ...r, cost: r.cost.toFixed(4) }));
  printRows(shown as unknown as Record<string, unknown>[], {
    json,
    out,
    empty: `No model calls in the last ${since}${tenant ? ` for tenant ${tenant}` : ""}.`,
  });
  return 0;
}
