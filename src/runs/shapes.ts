/**
 * The shapes every run shares: a job id, where a result goes (an email
 * recipient or a webhook), the `Idempotency-Key`, a job's document and the
 * webhooks' bodies. A summary job's request is here too: it is also the
 * summary job's stream payload, which the worker, the dead-letter replay and
 * a failed job's decision read (`run_payload.ts`), so the run pipeline owns
 * its schema and the summary API (`summaries/api.ts`) validates its body with it.
 */
import { z } from "zod";
import { isStorable, storableText, unstorable } from "../db/storable_text.ts";

/** A job id as the API writes it: a lowercase UUID. Anything else names no job (and would fail a uuid cast). */
export const JOB_ID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

/** Where a webhook goes; the API also checks its scheme and address (see `webhooks/addresses.ts`). */
export const WebhookTarget = z.strictObject({
  webhook: z.url().max(2048).refine(isStorable, unstorable("webhook")).describe(
    "An https URL (http only with WEBHOOK_ALLOW_HTTP) that receives the result as a signed Standard Webhook",
  ),
});

/**
 * Body of `POST /v1/summaries`, and a summary job's stream payload (with `no_cache` when the POST skipped the
 * result cache). Unknown fields are rejected.
 */
export const SummaryRequest = z.strictObject({
  text: storableText("text").min(1).max(200_000).describe("The document to summarise, 1 to 200,000 characters"),
  notify: z.union([
    z.email().max(320).refine(isStorable, unstorable("notify")).describe(
      "An address to email the summary to when it is ready",
    ),
    WebhookTarget,
  ]).describe('Where the result goes: an email address, or {"webhook": URL}'),
});
export type SummaryRequest = z.infer<typeof SummaryRequest>;

/** zod's pattern for `z.email()` (no global flag: `test` keeps no state). */
const EMAIL = z.regexes.email;

/** Whether `notify` is an email recipient the `notify` schema accepts, checked directly (no zod). */
export function isPlainEmail(notify: string): boolean {
  return notify.length <= 320 && EMAIL.test(notify) && isStorable(notify);
}

/**
 * Parses a `POST /v1/summaries` body as {@linkcode SummaryRequest} does, answering the common case (an email
 * recipient) with a few checks: zod's own email pattern, the lengths and the storability, on a plain object
 * with exactly the two fields. Anything else, every refusal included, is zod's to answer, so the answers
 * (and the errors) are zod's. zod's parse showed in the API's profile under load, for a body of two strings
 * (see README, "Intake against both baselines, its profile, and all cores (issue 26)").
 */
export function parseSummaryRequest(raw: unknown): z.ZodSafeParseResult<SummaryRequest> {
  if (typeof raw === "object" && raw !== null && !Array.isArray(raw)) {
    const { text, notify } = raw as Record<string, unknown>;
    if (
      typeof text === "string" && typeof notify === "string" && Object.keys(raw).length === 2 &&
      Object.hasOwn(raw, "text") && Object.hasOwn(raw, "notify") &&
      text.length >= 1 && text.length <= 200_000 && isStorable(text) &&
      isPlainEmail(notify)
    ) {
      return { success: true, data: { text, notify } };
    }
  }
  return SummaryRequest.safeParse(raw);
}

/**
 * Body of `GET /v1/summaries/{job_id}` (and of a finished `Prefer: wait`, and of `DELETE`). The job read model
 * (`job_document.ts`) builds it for every job, and the runs API makes a run's document from it.
 */
export const SummaryStatus = z.object({
  job_id: z.uuid(),
  // `expired` only for a run that set `expires_in` (a summary job's POST cannot).
  status: z.enum(["queued", "done", "failed", "cancelled", "expired"]),
  summary: z.string().optional(),
  error: z.string().optional(),
  attempts: z.number().int().optional().describe("Model calls made for this job so far (recorded within a second)"),
  tokens: z.number().int().optional().describe("Prompt and completion tokens of those calls, as the provider counted"),
  cost_usd: z.number().optional().describe(
    "What those calls were charged at the model's price (LLM_PRICES), when it has one",
  ),
  cached: z.literal(true).optional().describe(
    "The summary was reused from an earlier identical job (the result cache): no model call, no tokens",
  ),
});
export type SummaryStatus = z.infer<typeof SummaryStatus>;

/** An `Idempotency-Key`'s characters: 16 to 128 visible ASCII characters. */
export const IDEMPOTENCY_KEY = /^[\x21-\x7e]{16,128}$/;

/** `Idempotency-Key`: 16 to 128 visible ASCII characters. */
export const IdempotencyKey = z.string().regex(IDEMPOTENCY_KEY);

/**
 * The key an `Idempotency-Key` header names. The IETF draft defines the
 * header as a Structured Field string (`"abc..."`), and most clients send
 * it bare: both spellings name the same key, so a client that switches
 * between them never gets a second job. A quoted key is unquoted (with its
 * `\"` and `\\` escapes); what remains must be a valid bare key.
 */
export function idempotencyKeyOf(header: string): string {
  if (header.charCodeAt(0) !== 0x22 /* " */) return header;
  const quoted = /^"((?:[^"\\]|\\["\\])*)"$/.exec(header);
  return quoted ? quoted[1]!.replace(/\\(["\\])/g, "$1") : header;
}

/** The body of a `summary.ready` webhook (Standard Webhooks' `type`, then the finished job's document). */
export const SummaryWebhook = z.object({
  type: z.literal("summary.ready"),
  job_id: z.uuid(),
  status: z.literal("done"),
  summary: z.string(),
});
export type SummaryWebhook = z.infer<typeof SummaryWebhook>;

/**
 * The body of a run's webhook: `run.completed` with its output, `run.failed` with its error, or `run.expired`
 * (its model call had not started by its expiry) with neither.
 */
export const RunWebhook = z.object({
  type: z.enum(["run.completed", "run.failed", "run.expired"]),
  run_id: z.uuid(),
  task: z.string(),
  version: z.number().int().min(1),
  status: z.enum(["done", "failed", "expired"]),
  output: z.unknown().optional().describe("The parsed JSON when the task has an output schema, else the text"),
  error: z.string().optional(),
});
export type RunWebhook = z.infer<typeof RunWebhook>;

/** The outbox topic of a finished run's email (done, failed or expired). */
export const RUN_EMAIL_TOPIC = "email.run_finished";
/** The outbox topic of a finished run's webhook (`run.completed`, `run.failed` or `run.expired`). */
export const RUN_WEBHOOK_TOPIC = "webhook.run_finished";
/**
 * Dedupe-key prefixes of run notifications, plus the run id: one per run and outcome, so a run's done and
 * failed notifications are distinct rows (a failed run replayed from its dead letter may still complete). An
 * expired run has one, once: `expired` is final.
 */
export const RUN_KEY_PREFIX = {
  email: { done: "run_done:", failed: "run_failed:", expired: "run_expired:" },
  webhook: { done: "run_done_webhook:", failed: "run_failed_webhook:", expired: "run_expired_webhook:" },
} as const;

/** The outbox topic of a summary's notification email. */
export const SUMMARY_READY_TOPIC = "email.summary_ready";
/** Its dedupe key is this prefix plus the job id; the relay passes it to the provider as Idempotency-Key. */
export const SUMMARY_READY_KEY_PREFIX = "summary_ready:";
/** The outbox topic of a summary's webhook. */
export const SUMMARY_WEBHOOK_TOPIC = "webhook.summary_ready";
/** Its dedupe key is this prefix plus the job id, sent as `webhook-id` so a receiver can deduplicate. */
export const SUMMARY_WEBHOOK_KEY_PREFIX = "summary_webhook:";
