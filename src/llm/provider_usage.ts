/**
 * The usage a provider reports, checked before anything trusts it. Budgets,
 * `model_attempts`, the flow control's token count, metrics and the result
 * cache all read these numbers; a negative count would decrement a counter
 * (and fail the run the provider already answered), and `1e15` or `0.5`
 * cannot be stored in an integer column. A usage that is not three counts in
 * range is *unknown usage*: the call is charged its reservation, as one that
 * answered without usage is (`src/budgets/charge.ts`).
 */
import type { Usage } from "./llm.ts";

/**
 * The most tokens one call may report in any count (prompt, completion, total): ten times the largest context
 * windows offered today (about a million tokens), and far inside Postgres's `integer` and exact float sums.
 */
export const MAX_REPORTED_TOKENS = 10_000_000;

/** The most characters of a refused value kept for the log line: a provider could send a megabyte as a count. */
const LOGGED_VALUE_CHARS = 100;

/** A usage refused: which field was wrong, and its value as sent (in JSON, cut to a hundred characters). */
export interface UsageRefusal {
  field: string;
  value: string;
}

/** What a provider's usage came to: the counts when they are valid, else why not (both absent: none was sent). */
export interface CheckedUsage {
  usage?: Usage;
  refused?: UsageRefusal;
}

const FIELDS = ["prompt_tokens", "completion_tokens", "total_tokens"] as const;

/** Whether `value` is a token count we can use: an integer from 0 to {@linkcode MAX_REPORTED_TOKENS}. */
export function isTokenCount(value: unknown): value is number {
  return typeof value === "number" && Number.isInteger(value) && value >= 0 && value <= MAX_REPORTED_TOKENS;
}

/**
 * Checks a completion's `usage` as the provider sent it. Absent (`undefined` or `null`): no usage and no
 * refusal. Otherwise `prompt_tokens`, `completion_tokens` and `total_tokens` must each be an integer from 0 to
 * {@linkcode MAX_REPORTED_TOKENS}; a missing `total_tokens` is their sum.
 */
export function checkUsage(raw: unknown): CheckedUsage {
  if (raw === undefined || raw === null) return {};
  if (typeof raw !== "object" || Array.isArray(raw)) return { refused: { field: "usage", value: shown(raw) } };
  const counts = raw as Record<string, unknown>;
  const total = counts.total_tokens ?? sum(counts.prompt_tokens, counts.completion_tokens);
  for (const field of FIELDS) {
    const value = field === "total_tokens" ? total : counts[field];
    if (!isTokenCount(value)) return { refused: { field, value: shown(counts[field]) } };
  }
  return {
    usage: {
      prompt_tokens: counts.prompt_tokens as number,
      completion_tokens: counts.completion_tokens as number,
      total_tokens: total as number,
    },
  };
}

function sum(a: unknown, b: unknown): unknown {
  return typeof a === "number" && typeof b === "number" ? a + b : undefined;
}

function shown(value: unknown): string {
  const text = value === undefined ? "undefined" : JSON.stringify(value) ?? String(value);
  return text.length > LOGGED_VALUE_CHARS ? `${text.slice(0, LOGGED_VALUE_CHARS)}...` : text;
}
