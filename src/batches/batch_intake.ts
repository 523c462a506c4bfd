/**
 * The worker's side of the Batch API: which runs a batch deployment takes, and their recording into the open
 * batch of that deployment and model (`batch_store.ts`), with the Chat Completions request of their line.
 */
import type { Sql } from "postgres";
import { chatCompletionBody } from "../llm/openai_llm.ts";
import type { DeploymentSpec } from "../llm/deployment_specs.ts";
import type { BatchIntake, ModelCall } from "../runs/run_deps.ts";
import { BatchClosedMeanwhile, batchOfRun, recordBatchRun } from "./batch_store.ts";

/**
 * The Chat Completions request a run's line carries: the body the online call sends (`chatCompletionBody`), its
 * output schema's `response_format` included, so a batch answer is the answer the run would have had.
 */
export function chatRequest(call: ModelCall, model: string): Record<string, unknown> {
  return { ...chatCompletionBody(call.prompt, call.options, model) };
}

/**
 * The Batch API's intake over the deployments marked `"batch": true`: a run goes to the first of them serving its
 * first model (the default model when it names none); runs of other models run online.
 */
export function createBatchIntake(
  { sql }: { sql: Sql },
  { specs, defaultModel, maxRuns }: { specs: readonly DeploymentSpec[]; defaultModel: string; maxRuns: number },
): BatchIntake | undefined {
  const byModel = new Map<string, string>();
  for (const spec of specs) {
    if (!spec.batch || spec.name === undefined) continue;
    for (const model of spec.models) if (!byModel.has(model)) byModel.set(model, spec.name);
  }
  if (byModel.size === 0) return undefined;
  return {
    target(models) {
      const model = models[0] ?? defaultModel;
      const deployment = byModel.get(model);
      return deployment === undefined ? undefined : { deployment, model };
    },
    recorded: (runId) => batchOfRun(sql, runId).then((batch) => batch !== undefined),
    async record({ runId, tenant, payload, acceptedMs, call, target, held }) {
      const run = { runId, tenant, payload, acceptedMs, request: chatRequest(call, target.model), held, ...target };
      for (let attempt = 1;; attempt++) {
        try {
          const { recorded } = await recordBatchRun(sql, run, { maxRuns });
          return recorded ? "recorded" : "already";
        } catch (error) {
          // Closed by its wait while this run was being recorded: the next try opens the next batch.
          if (!(error instanceof BatchClosedMeanwhile) || attempt >= 5) throw error;
        }
      }
    },
  };
}
