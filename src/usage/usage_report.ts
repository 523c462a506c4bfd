/**
 * A tenant's usage as `GET /v1/usage` shows it: the lines of the usage report (per task version and model,
 * from `model_attempts` and `cache_hits`) added up into totals, per task version and per model. Costs are
 * added in whole nano-dollars and turned into USD last, so the totals are exact sums of the recorded costs.
 */
import type { Sql } from "postgres";
import { type TaskAttemptUsage, taskAttemptUsage } from "../jobs/job_store.ts";
import { nanosToUsd } from "../llm/prices.ts";
import type { BudgetView } from "../budgets/budget_view.ts";
import type { UsageDocument, UsageFigures } from "./usage_schemas.ts";

/** Figures being added up: costs in nano-dollars, null until a priced line is added. */
interface Sum {
  calls: number;
  failures: number;
  prompt: number;
  completion: number;
  costNanos: number | null;
  unpriced: number;
  batch: number;
  hits: number;
  savedPrompt: number;
  savedCompletion: number;
  savedNanos: number | null;
}

const empty = (): Sum => ({
  calls: 0,
  failures: 0,
  prompt: 0,
  completion: 0,
  costNanos: null,
  unpriced: 0,
  batch: 0,
  hits: 0,
  savedPrompt: 0,
  savedCompletion: 0,
  savedNanos: null,
});

const plus = (a: number | null, b: number | null) => (a === null && b === null ? null : (a ?? 0) + (b ?? 0));

function add(sum: Sum, line: TaskAttemptUsage): void {
  sum.calls += line.calls;
  sum.failures += line.failures;
  sum.prompt += line.prompt_tokens;
  sum.completion += line.completion_tokens;
  sum.costNanos = plus(sum.costNanos, line.cost_nanos);
  sum.unpriced += line.unpriced_calls;
  sum.batch += line.batch_calls;
  sum.hits += line.cache_hits;
  sum.savedPrompt += line.saved_prompt_tokens;
  sum.savedCompletion += line.saved_completion_tokens;
  sum.savedNanos = plus(sum.savedNanos, line.saved_nanos);
}

function figures(sum: Sum): UsageFigures {
  return {
    calls: sum.calls,
    failures: sum.failures,
    tokens: { prompt: sum.prompt, completion: sum.completion },
    cost_usd: sum.costNanos === null ? null : nanosToUsd(sum.costNanos),
    unpriced_calls: sum.unpriced,
    batch_calls: sum.batch,
    cache_hits: sum.hits,
    saved: {
      tokens: { prompt: sum.savedPrompt, completion: sum.savedCompletion },
      cost_usd: sum.savedNanos === null ? null : nanosToUsd(sum.savedNanos),
    },
  };
}

/** Adds up `lines` into totals, per task version and per model (each list in the lines' order). */
export function summarizeUsage(lines: TaskAttemptUsage[]): Pick<UsageDocument, "totals" | "by_task" | "by_model"> {
  const total = empty();
  const tasks = new Map<string, { task: string; version: number; sum: Sum }>();
  const models = new Map<string | null, Sum>();
  for (const line of lines) {
    add(total, line);
    const key = `${line.version}/${line.task}`;
    const task = tasks.get(key) ?? { task: line.task, version: line.version, sum: empty() };
    tasks.set(key, task);
    add(task.sum, line);
    const model = models.get(line.model) ?? empty();
    models.set(line.model, model);
    add(model, line);
  }
  return {
    totals: figures(total),
    by_task: [...tasks.values()].map(({ task, version, sum }) => ({ task, version, ...figures(sum) })),
    by_model: [...models.entries()]
      .sort(([a], [b]) => (a ?? "").localeCompare(b ?? ""))
      .map(([model, sum]) => ({ model, ...figures(sum) })),
  };
}

/**
 * The usage document of `tenant` over the last `sinceS` seconds (`since` as asked): its own calls and cache
 * hits only, and its budgets when `budgets` is given.
 */
export async function tenantUsage(
  { sql, budgets }: { sql: Sql; budgets?: (tenant: string) => Promise<BudgetView[]> },
  tenant: string,
  { since, sinceS, now = Date.now() }: { since: string; sinceS: number; now?: number },
): Promise<UsageDocument> {
  const [lines, views] = await Promise.all([
    taskAttemptUsage(sql, { tenant, sinceS }),
    budgets ? budgets(tenant) : Promise.resolve([]),
  ]);
  return {
    since,
    from: new Date(now - sinceS * 1000).toISOString(),
    ...summarizeUsage(lines),
    budgets: views,
  };
}
