/**
 * The summary API: `POST /v1/summaries`, and `GET` and `DELETE
 * /v1/summaries/{job_id}`. The process mounts these routes beside the
 * console, `/metrics` and the health checks (`processes/api_process.ts`).
 */
import { readJsonBody } from "../http/body.ts";
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import { summaryPrompt } from "../llm/llm.ts";
import { SUMMARIZE_DEFINITION } from "../tasks/definition.ts";
import { jobDocument } from "../runs/job_document.ts";
import { currentTraceparent } from "../tracing.ts";
import { parseSummaryRequest } from "../runs/shapes.ts";
import { skipsCache } from "../cache/result_cache.ts";
import { summaryForms } from "../runs/run_payload.ts";
import {
  answerSubmission,
  budgetRefusal,
  cancelJobOf,
  checkNotify,
  FINISHED,
  idempotencyKeyFrom,
  type RunHttpDeps,
  waitIfPreferred,
  withBodyAdmitted,
} from "../runs/http.ts";

/** What the summary API needs: what every API that takes runs needs. */
export type SummaryApiDeps = RunHttpDeps;

/** The collection path: POSTs are scoped to it, and job documents live below it. */
export const SUMMARIES = "/v1/summaries";
/** A job document's path; its group is the job id. */
export const JOB_PATH = /^\/v1\/summaries\/([^/]+)$/;
/** The summary API's routes. */
export function summaryRoutes(deps: SummaryApiDeps): Router {
  const { log, authenticate, intake } = deps;

  async function postSummary(req: Request): Promise<Response> {
    const tenant = await authenticate(req);
    const key = idempotencyKeyFrom(req);
    return await withBodyAdmitted(deps, req, tenant, async (release) => {
      const raw = await readJsonBody(req, deps.maxBodyBytes, { deadlineMs: deps.bodyDeadlineMs });
      const parsed = parseSummaryRequest(raw);
      if (!parsed.success) {
        deps.metrics?.api.validationErrors.inc();
        const errors = parsed.error.issues.map((i) => ({ path: i.path.join("."), message: i.message }));
        throw new HttpError(422, "The request body failed validation", {}, { extra: { errors } });
      }
      await checkNotify(deps, tenant, parsed.data.notify);
      const scope = { tenant, method: "POST", path: SUMMARIES, key };
      const refuse = await budgetRefusal(deps, tenant, {
        messages: () => [summaryPrompt(parsed.data.text)],
        maxOutputTokens: SUMMARIZE_DEFINITION.max_output_tokens,
      });
      // With tracing on, the job's trace continues from this request's span (Deno.serve's) in the worker.
      return await answerSubmission(
        deps,
        req,
        tenant,
        () => {
          release();
          return intake.submit({
            scope,
            request: parsed.data,
            traceparent: currentTraceparent(),
            ...summaryForms(parsed.data, { noCache: skipsCache(req.headers) }),
            refuse,
          });
        },
        {
          enqueued: (jobId) => log.info("job_enqueued", { job_id: jobId, tenant }),
          finished: (_, waited) => Promise.resolve(waited.document),
        },
      );
    });
  }

  async function getSummary(req: Request, jobId: string): Promise<Response> {
    const tenant = await authenticate(req);
    const found = await jobDocument(deps, tenant, jobId);
    // A run of a task is not a summary job: it lives at /v1/runs/{id} only.
    if (!found?.run.summaryJob) throw new HttpError(404, `No job ${jobId} for this tenant`);
    const headers: Record<string, string> = deps.waiter ? { vary: "prefer" } : {};
    if (!FINISHED.has(found.document.status)) {
      const waited = await waitIfPreferred(deps, req, tenant, jobId);
      if (waited) return json(200, waited.document, { ...headers, "preference-applied": waited.applied });
    }
    return json(200, found.document, headers);
  }

  async function cancelSummary(req: Request, jobId: string): Promise<Response> {
    const tenant = await authenticate(req);
    return json(200, await cancelJobOf(deps, tenant, jobId, { summaryJobsOnly: true }));
  }

  return new Router()
    .on(SUMMARIES, { POST: postSummary })
    .on(JOB_PATH, {
      GET: (req, { params }) => getSummary(req, params[0]!),
      DELETE: (req, { params }) => cancelSummary(req, params[0]!),
    }, "/v1/summaries/{job_id}");
}
