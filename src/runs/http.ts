/**
 * What both APIs that take runs share (`/v1/summaries` in `summaries/api.ts`, `/v1/tasks/{name}/runs` and
 * `/v1/runs/{id}` in `runs_api.ts`): their dependencies, the budget's refusal at intake, the `notify` check,
 * `Prefer: wait`, cancelling, the `Idempotency-Key` header, and answering a submission.
 */
import { linkedSignal } from "../async/linked_signal.ts";
import type { RedisClient } from "../clients.ts";
import type { Sql } from "postgres";
import { HttpError } from "../http/problem.ts";
import { json } from "../http/router.ts";
import { KeyReused } from "../idempotency/errors.ts";
import type { Logger } from "../log/logger.ts";
import type { ApiMetrics } from "../metrics/metrics.ts";
import type { Authenticate } from "../tenants/authenticator.ts";
import { type Intake, type IntakeResult, QueueFull } from "./intake.ts";
import { BudgetExhausted, type Budgets, BudgetTooSmall, ModelUnpriced, worstCaseTokens } from "../budgets/budgets.ts";
import { NotReplicated } from "../redis/replica_ack.ts";
import { cancelJob } from "../jobs/job_store.ts";
import { jobDocument, type JobFound } from "./job_document.ts";
import { markCancelled } from "./job_status.ts";
import { type BodyAdmission, type BodyRelease, declaredBytes } from "../http/body_admission.ts";
import { type JobWaiter, preferredWaitS } from "./job_waiter.ts";
import { checkWebhookUrl, WebhookRefused } from "../webhooks/addresses.ts";
import type { ServiceKeys } from "./keys.ts";
import { IDEMPOTENCY_KEY, idempotencyKeyOf, type SummaryRequest, type SummaryStatus } from "./shapes.ts";

/**
 * Runs `handle` with `tenant`'s request body admitted to its share of this process (`http/body_admission.ts`);
 * `handle` gets the release, to give the share back once the run is handed to intake (it is given back at the
 * end in any case).
 * @throws {HttpError} 503 with `Retry-After: 1` when the tenant's share is full: the body is never read.
 */
export async function withBodyAdmitted<T>(
  deps: RunHttpDeps,
  req: Request,
  tenant: string,
  handle: (release: BodyRelease) => Promise<T>,
): Promise<T> {
  if (!deps.bodies) return await handle(() => {});
  const release = deps.bodies.admit(tenant, declaredBytes(req, deps.maxBodyBytes));
  if (!release) {
    throw new HttpError(
      503,
      "This tenant's requests already being read hold its share of this server; try again",
      { "retry-after": "1" },
    );
  }
  try {
    return await handle(release);
  } finally {
    release();
  }
}

/** The problem type of a 429 for a spent budget. */
export const BUDGET_EXHAUSTED = "urn:oncely:problem:budget-exhausted";

/** What the APIs that take runs need. */
export interface RunHttpDeps {
  redis: RedisClient;
  sql: Sql;
  log: Logger;
  authenticate: Authenticate;
  intake: Intake;
  keys: ServiceKeys;
  maxBodyBytes: number;
  /** Each tenant's share of request bodies in flight (`TENANT_BODY_BYTES_IN_FLIGHT`); unbounded when unset. */
  bodies?: BodyAdmission;
  /** Whether a tenant may email an address (its allowed domains); every address when unset. */
  recipients?: (tenant: string, address: string) => Promise<boolean>;
  /** How long a POST body may take to arrive; default 10 s (`BODY_DEADLINE_MS` in `http/body.ts`). */
  bodyDeadlineMs?: number;
  /** The process's listener for finished jobs; without it, `Prefer: wait` is ignored. */
  waiter?: JobWaiter;
  /** Aborts on shutdown: waiting requests then answer at once with the job's current status. */
  shutdown?: AbortSignal;
  /**
   * Webhook targets: WEBHOOK_ALLOW_HTTP / WEBHOOK_ALLOW_PRIVATE, and whether a
   * tenant has a signing secret. Without it, `notify: {"webhook": ...}` is refused.
   */
  webhooks?: {
    allowHttp: boolean;
    allowPrivate: boolean;
    hasSecret: (tenant: string) => Promise<boolean>;
    /** Whether the tenant may send webhooks to the URL's host (`tenant allow-webhook-host`); any when unset. */
    hosts?: (tenant: string, url: string) => Promise<boolean>;
  };
  /** The API's counters (replays, key reuse, validation errors). */
  metrics?: { api: ApiMetrics };
  /** Tenant budgets: a tenant whose budget a new run's worst case no longer fits is answered 429. */
  budgets?: Budgets;
  /** The model a task without one (and every summary) is asked (OPENAI_MODEL), for the budget's price. */
  defaultModel?: string;
  /**
   * The provider batch a run is recorded in and waits for (not yet committed), if any: a queued run's
   * `waiting_for: "batch"` (issue 43). Without it, no run is said to wait for a batch.
   */
  batchOf?: (runId: string) => Promise<string | undefined>;
}

/**
 * The refusal a new job of `tenant` gets from its budgets, if any: its worst case (the rendered messages and
 * the output cap, at `model`'s price) no longer fits what the tenant has spent. Undefined without a budget.
 */
export async function budgetRefusal(
  deps: RunHttpDeps,
  tenant: string,
  { model, messages, maxOutputTokens }: {
    model?: string;
    /** The job's messages, rendered only when the tenant has a budget. */
    messages: () => readonly string[];
    maxOutputTokens: number;
  },
): Promise<Error | undefined> {
  if (!deps.budgets || !(await deps.budgets.of(tenant))) return undefined;
  const name = model ?? deps.defaultModel ?? "unknown";
  // Each refusal is returned, not thrown: the intake script applies it only to a new job, so a replay of an
  // accepted key is answered as stored whatever the budget says now.
  try {
    const refusal = await deps.budgets.check(tenant, name, worstCaseTokens(messages(), maxOutputTokens));
    if (refusal instanceof BudgetTooSmall) {
      return new HttpError(422, `${refusal.message}; raise the budget or lower max_output_tokens`);
    }
    return refusal;
  } catch (error) {
    if (error instanceof ModelUnpriced) return new HttpError(422, `${error.message}: the run could never be priced`);
    // Redis did not answer: the workers still enforce the budget before every call.
    deps.log.warn("budget_check_failed", { tenant, error });
    return undefined;
  }
}

/** What a `Prefer: wait` came to: the job's document, and whether it finished within the wait. */
export interface Waited {
  document: SummaryStatus;
  /** The job as the wait's last look found it (`document` is its document): its output and tokens by kind. */
  found: JobFound;
  /** The `Preference-Applied` value. */
  applied: string;
  finished: boolean;
}

/** Statuses after which a job never changes. */
export const FINISHED: ReadonlySet<SummaryStatus["status"]> = new Set(["done", "failed", "cancelled", "expired"]);

function invalid(path: string, message: string): HttpError {
  return new HttpError(422, "The request body failed validation", {}, { extra: { errors: [{ path, message }] } });
}

/** Refuses (422) a `notify` the tenant may not use: a recipient outside its domains, or a webhook it cannot send. */
export async function checkNotify(
  deps: RunHttpDeps,
  tenant: string,
  notify: SummaryRequest["notify"],
): Promise<void> {
  if (typeof notify === "string") {
    if (deps.recipients && !(await deps.recipients(tenant, notify))) {
      throw invalid("notify", `this tenant may not email ${notify.slice(notify.lastIndexOf("@") + 1)}`);
    }
  } else {
    if (!deps.webhooks) throw invalid("notify.webhook", "webhooks are not enabled on this server");
    try {
      checkWebhookUrl(notify.webhook, deps.webhooks);
    } catch (error) {
      if (error instanceof WebhookRefused) throw invalid("notify.webhook", error.message);
      throw error;
    }
    if (deps.webhooks.hosts && !(await deps.webhooks.hosts(tenant, notify.webhook))) {
      throw invalid("notify.webhook", `this tenant may not send webhooks to ${new URL(notify.webhook).hostname}`);
    }
    if (!(await deps.webhooks.hasSecret(tenant))) {
      throw invalid(
        "notify.webhook",
        "this tenant has no webhook signing secret yet (deno task tenant rotate-webhook-secret NAME makes one)",
      );
    }
  }
}

/**
 * `Prefer: wait=N`: waits up to N seconds for the job to finish, woken by
 * its outcome's notification. @returns the document when it finished
 * (`finished`), the latest one when the wait ran out, or null when waiting
 * is not possible here (or was not asked for).
 */
export async function waitIfPreferred(
  deps: RunHttpDeps,
  req: Request,
  tenant: string,
  jobId: string,
  /** How long to wait; the request's `Prefer: wait` when unset (the OpenAI-compatible endpoints pass their own). */
  waitS: number | undefined = preferredWaitS(req.headers),
): Promise<Waited | null> {
  const waiter = deps.waiter;
  if (waitS === undefined || !waiter?.listening || deps.shutdown?.aborted) return null;
  try {
    return await waitFor(deps, req, tenant, jobId, waiter, waitS);
  } catch (error) {
    // The job is accepted (or known) all the same: a failed wait falls back to the usual answer, never a 5xx.
    deps.log.warn("wait_failed", { job_id: jobId, tenant, error });
    return null;
  }
}

async function waitFor(
  deps: RunHttpDeps,
  req: Request,
  tenant: string,
  jobId: string,
  waiter: JobWaiter,
  waitS: number,
): Promise<Waited | null> {
  const deadline = performance.now() + waitS * 1000;
  const applied = `wait=${waitS}`;
  // Subscribe before looking, so a finish between the look and the wait still wakes us.
  const subscription = waiter.subscribe(jobId);
  try {
    for (;;) {
      const found = await jobDocument(deps, tenant, jobId);
      if (found && FINISHED.has(found.document.status)) {
        return { document: found.document, found, applied, finished: true };
      }
      const left = deadline - performance.now();
      if (!found) return null;
      if (left <= 0 || deps.shutdown?.aborted) return { document: found.document, found, applied, finished: false };
      // Linked for this wait only: the shutdown signal outlives every request (see linkedSignal).
      const stop = linkedSignal(req.signal, ...(deps.shutdown ? [deps.shutdown] : []));
      try {
        await subscription.next(left, stop.signal);
      } finally {
        stop.unlink();
      }
      if (req.signal.aborted) return null;
    }
  } finally {
    subscription.close();
  }
}

/**
 * Cancels a queued job (`DELETE /v1/summaries/{id}` and `/v1/runs/{id}`). Postgres decides (the same
 * primary key the commit inserts into), then the Redis record follows, so GET and the worker's pre-check
 * both see it. Cancelling twice gives the same answer.
 * @throws {HttpError} 404 for an unknown job or another tenant's, 409 for one already done, failed or expired.
 */
export async function cancelJobOf(
  deps: RunHttpDeps,
  tenant: string,
  jobId: string,
  { summaryJobsOnly = false } = {},
): Promise<SummaryStatus> {
  const found = await jobDocument(deps, tenant, jobId);
  if (!found || (summaryJobsOnly && !found.run.summaryJob)) throw new HttpError(404, `No job ${jobId} for this tenant`);
  const { status } = found.document;
  if (status === "done" || status === "failed" || status === "expired") {
    throw new HttpError(409, `Job ${jobId} is already ${status} and cannot be cancelled`);
  }
  // Races the commit, a dead letter and the worker's expiry on the outcome's primary key: the first decision stands.
  const cancelled = status === "cancelled"
    ? "already_cancelled"
    : await cancelJob(deps.sql, jobId, tenant, { task: found.run.task, version: found.run.version });
  if (cancelled === "done" || cancelled === "failed" || cancelled === "expired") {
    throw new HttpError(409, `Job ${jobId} is already ${cancelled} and cannot be cancelled`);
  }
  if (found.recordKey) await markCancelled(deps.redis, found.recordKey);
  if (status !== "cancelled") deps.log.info("job_cancel_requested", { job_id: jobId, tenant });
  return { job_id: jobId, status: "cancelled" };
}

/**
 * The `Idempotency-Key` of a keyed POST, bare or as a Structured Field string.
 * @throws {HttpError} 400 when it is missing or not 16 to 128 visible ASCII characters.
 */
export function idempotencyKeyFrom(req: Request): string {
  const header = req.headers.get("idempotency-key");
  if (header === null) throw new HttpError(400, "Idempotency-Key header is required");
  const key = idempotencyKeyOf(header);
  if (!IDEMPOTENCY_KEY.test(key)) {
    throw new HttpError(400, "Idempotency-Key must be 16 to 128 visible ASCII characters");
  }
  return key;
}

/**
 * Submits a validated POST through the intake and answers it: the stored `202` (with `Idempotent-Replayed`
 * on a replay), or with `Prefer: wait=N` the `finished` document when the job finishes in time. A full
 * queue, or a job too few replicas acknowledged in time, is a `503` with `Retry-After`, a key reused with
 * another body a `422`.
 */
export async function answerSubmission(
  deps: RunHttpDeps,
  req: Request,
  tenant: string,
  submit: () => Promise<IntakeResult>,
  { enqueued, finished }: {
    /** Logs a new job (not a replay). */
    enqueued: (jobId: string) => void;
    /** The document a finished wait answers with. */
    finished: (jobId: string, waited: Waited) => Promise<unknown>;
  },
): Promise<Response> {
  try {
    const { response, replayed, jobId } = await submit();
    const headers: Record<string, string> = { ...response.headers };
    if (replayed) {
      headers["idempotent-replayed"] = "true";
      deps.metrics?.api.replays.inc();
    } else {
      enqueued(jobId);
    }
    if (deps.waiter) headers.vary = "prefer";
    // `get`, not `has`: on a request of Deno.serve, `has` copies every header into JavaScript first.
    const waited = deps.waiter && req.headers.get("prefer") !== null
      ? await waitIfPreferred(deps, req, tenant, jobId)
      : null;
    if (waited?.finished) {
      return json(200, await finished(jobId, waited), { ...headers, "preference-applied": waited.applied });
    }
    // A wait that ran out still applied the preference: the client can tell "waited" from "ignored".
    if (waited) headers["preference-applied"] = waited.applied;
    return json(response.status, response.body, headers);
  } catch (error) {
    throw submissionRefusal(deps, error);
  }
}

/**
 * What a refused submission answers: a spent budget `429`, a full queue or a job too few replicas acknowledged
 * `503` with `Retry-After`, a key reused with another body `422`; any other error as it is.
 */
export function submissionRefusal(deps: Pick<RunHttpDeps, "metrics">, error: unknown): unknown {
  if (error instanceof BudgetExhausted) {
    return new HttpError(
      429,
      `${error.message}; it is whole again when the ${error.budget.period} ends (UTC), or when it is raised`,
      { "retry-after": String(error.retryAfterS) },
      { type: BUDGET_EXHAUSTED, extra: { title: "Budget exhausted", budget: error.budget } },
    );
  }
  if (error instanceof QueueFull) {
    return new HttpError(503, `${error.message}; try again later`, { "retry-after": String(error.retryAfterS) });
  }
  if (error instanceof NotReplicated) {
    // The job may be recorded on the primary: the same key replays it or enqueues it, never a second job.
    return new HttpError(
      503,
      "The job is not yet confirmed on enough replicas; retry with the same Idempotency-Key",
      { "retry-after": String(error.retryAfterS) },
      { cause: error },
    );
  }
  if (error instanceof KeyReused) {
    deps.metrics?.api.keyReuse.inc();
    return new HttpError(422, error.message);
  }
  return error;
}
