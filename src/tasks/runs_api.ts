/**
 * Runs: `GET /v1/runs/{run_id}` and `DELETE /v1/runs/{run_id}`. Every
 * summary job is a run of the built-in `summarize` task, so its id works
 * here too, with the run document's shape (`output` is the summary).
 */
import { HttpError } from "../http/problem.ts";
import { json, Router } from "../http/router.ts";
import { cancelJobOf, FINISHED, type SummaryApiDeps, waitIfPreferred } from "../summaries/api.ts";
import { jobDocument, type JobFound } from "../summaries/job_document.ts";
import { BUILT_IN_TASK } from "./definition.ts";
import type { RunDocument } from "./run_schemas.ts";

const RUN_PATH = /^\/v1\/runs\/([^/]+)$/;

/** A summary job's document as a run of `summarize`. */
function runOfSummary({ document, tokens }: Pick<JobFound, "document" | "tokens">): RunDocument {
  return {
    run_id: document.job_id,
    task: BUILT_IN_TASK,
    version: 1,
    status: document.status,
    ...(document.summary === undefined ? {} : { output: document.summary }),
    ...(document.error === undefined ? {} : { error: document.error }),
    attempts: document.attempts ?? 0,
    tokens,
  };
}

/** The run routes. */
export function runRoutes(deps: SummaryApiDeps): Router {
  async function getRun(req: Request, runId: string): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const found = await jobDocument(deps, tenant, runId);
    if (!found) throw new HttpError(404, `No run ${runId} for this tenant`);
    const headers: Record<string, string> = deps.waiter ? { vary: "prefer" } : {};
    if (!FINISHED.has(found.document.status)) {
      const waited = await waitIfPreferred(deps, req, tenant, runId);
      if (waited?.finished) {
        // The wait ended on the job's outcome: read it once more for its tokens by kind.
        const now = await jobDocument(deps, tenant, runId);
        const run = runOfSummary(now ?? { document: waited.document, tokens: found.tokens });
        return json(200, run, { ...headers, "preference-applied": waited.applied });
      }
      if (waited) headers["preference-applied"] = waited.applied;
    }
    return json(200, runOfSummary(found), headers);
  }

  async function cancelRun(req: Request, runId: string): Promise<Response> {
    const tenant = await deps.authenticate(req);
    const cancelled = await cancelJobOf(deps, tenant, runId);
    const found = await jobDocument(deps, tenant, runId);
    return json(200, runOfSummary(found ?? { document: cancelled, tokens: { prompt: 0, completion: 0 } }));
  }

  return new Router().on(RUN_PATH, {
    GET: (req, { params }) => getRun(req, params[0]!),
    DELETE: (req, { params }) => cancelRun(req, params[0]!),
  }, "/v1/runs/{run_id}");
}
