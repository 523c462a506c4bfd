/**
 * What a job's stream message carries: a summary job's request as
 * `POST /v1/summaries` accepted it, or a task run's task, version, input and
 * notification target. Both read as one shape, a run, so the worker has one
 * path; `summary` says which notifications and tables the result goes to.
 */
import { z } from "zod";
import { SUMMARY_RUN } from "../jobs/job_store.ts";
import { parseSummaryRequest, SummaryRequest, WebhookTarget } from "./shapes.ts";
import type { Notify } from "./commit.ts";
import { canonicalJson } from "../idempotency/fingerprint.ts";

/** The stream payload of a task run (a summary job's is its `SummaryRequest`). */
export const RunPayload = z.object({
  task: z.string().min(1),
  version: z.number().int().min(1),
  // Checked as an object, not copied key by key: a record would drop a key named __proto__ that intake accepted.
  input: z.custom<Record<string, unknown>>((v) => typeof v === "object" && v !== null && !Array.isArray(v)),
  notify: z.union([z.string(), WebhookTarget]).optional(),
  /** `Cache-Control: no-cache` on the POST: the run skips the result cache's lookup. Absent in older payloads. */
  no_cache: z.literal(true).optional(),
  /** The run's `priority` when not `normal` (a normal run's payload, like every older one, has none). */
  priority: z.enum(["high", "low", "batch"]).optional(),
  /**
   * When the run expires (epoch ms: its acceptance plus `expires_in`): a model call not started by then never
   * starts, and the run ends `expired`. Absent: it never expires.
   */
  expires_at: z.number().int().positive().optional(),
});
export type RunPayload = z.infer<typeof RunPayload>;

/** A job as the worker runs it. */
export interface RunJob {
  task: string;
  version: number;
  input: Record<string, unknown>;
  notify?: Notify;
  /** A job of `POST /v1/summaries`: its result is a summary (the `summaries` table, `summary.ready`). */
  summary: boolean;
  /** The POST said `Cache-Control: no-cache`: no result-cache lookup. */
  noCache?: boolean;
  /** The run's priority when not `normal`. */
  priority?: "high" | "low" | "batch";
  /** Epoch ms after which no model call of the run starts (see `run_expiry.ts`); unset: never. */
  expiresAt?: number;
}

/**
 * The stream payload of a summary job: its request, plus `no_cache` only when the POST said
 * `Cache-Control: no-cache` (so every other payload is the request alone, as releases before the cache wrote it).
 */
export function summaryPayload(request: SummaryRequest, { noCache = false } = {}): string {
  return JSON.stringify(noCache ? { ...request, no_cache: true } : request);
}

/**
 * A summary job's stream payload (as {@linkcode summaryPayload} writes it) and its request's canonical JSON (as
 * `canonicalJson` writes it: what the job id hashes), each field serialised once for both.
 */
export function summaryForms(
  request: SummaryRequest,
  { noCache = false } = {},
): { payload: string; canonical: string } {
  const keys = Object.keys(request);
  if (typeof request.notify !== "string" || keys.length !== 2 || keys[0] !== "text" || keys[1] !== "notify") {
    return { payload: summaryPayload(request, { noCache }), canonical: canonicalJson(request) };
  }
  const text = JSON.stringify(request.text);
  const notify = JSON.stringify(request.notify);
  return {
    payload: `{"text":${text},"notify":${notify}${noCache ? ',"no_cache":true' : ""}}`,
    canonical: `{"notify":${notify},"text":${text}}`,
  };
}

/**
 * Reads a message's payload as a run.
 * @throws {Error} when it is neither a summary request nor a run payload (a malformed message).
 */
export function runOfPayload(payload: string): RunJob {
  const value: unknown = JSON.parse(payload);
  if (value !== null && typeof value === "object" && "task" in value) {
    const { no_cache, expires_at, ...run } = RunPayload.parse(value);
    return {
      ...run,
      summary: false,
      ...(no_cache ? { noCache: true } : {}),
      ...(expires_at === undefined ? {} : { expiresAt: expires_at }),
    };
  }
  // The request is checked as strictly as at intake, without the one field intake may add.
  const { no_cache, ...rest } = (value ?? {}) as { no_cache?: unknown };
  const parsed = parseSummaryRequest(no_cache === true ? rest : value);
  if (!parsed.success) throw parsed.error;
  const request = parsed.data;
  return {
    ...SUMMARY_RUN,
    input: { text: request.text },
    notify: request.notify,
    summary: true,
    ...(no_cache === true ? { noCache: true } : {}),
  };
}
