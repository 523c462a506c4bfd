/**
 * What a job's stream message carries: a summary job's request as
 * `POST /v1/summaries` accepted it, or a task run's task, version, input and
 * notification target. Both read as one shape, a run, so the worker has one
 * path; `summary` says which notifications and tables the result goes to.
 */
import { z } from "zod";
import { SUMMARY_RUN } from "../jobs/job_store.ts";
import { SummaryRequest, WebhookTarget } from "../summaries/schemas.ts";
import type { Notify } from "../summaries/commit.ts";

/** The stream payload of a task run (a summary job's is its `SummaryRequest`). */
export const RunPayload = z.object({
  task: z.string().min(1),
  version: z.number().int().min(1),
  // Checked as an object, not copied key by key: a record would drop a key named __proto__ that intake accepted.
  input: z.custom<Record<string, unknown>>((v) => typeof v === "object" && v !== null && !Array.isArray(v)),
  notify: z.union([z.string(), WebhookTarget]).optional(),
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
}

/**
 * Reads a message's payload as a run.
 * @throws {Error} when it is neither a summary request nor a run payload (a malformed message).
 */
export function runOfPayload(payload: string): RunJob {
  const value: unknown = JSON.parse(payload);
  if (value !== null && typeof value === "object" && "task" in value) {
    return { ...RunPayload.parse(value), summary: false };
  }
  const request = SummaryRequest.parse(value);
  return { ...SUMMARY_RUN, input: { text: request.text }, notify: request.notify, summary: true };
}
