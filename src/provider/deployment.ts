/**
 * One deployment: a model client and, for a provider with limits, its shared flow control. As
 * {@linkcode Models}, every call goes to it, and the worker reads as many jobs as its flow has permits coming.
 */
import type { LLM } from "../llm/llm.ts";
import type { Capacity, Models } from "../llm/models.ts";
import { FLOW_DEFAULTS, type ProviderFlow } from "./flow_control.ts";

/** Options for {@linkcode createDeployment}. */
export interface DeploymentOptions {
  llm: LLM;
  /** The provider's shared limiter and breaker; none for a model without limits (the local one). */
  flow?: ProviderFlow;
  /** The model `llm` asks for when a call names none (OPENAI_MODEL). */
  model: string;
  /** The deployment's name in the record of attempts; the model's name when unset. */
  name?: string;
}

/**
 * The single deployment as {@linkcode Models}: a call takes the first model it accepts, or the deployment's
 * own, and a permit of its flow.
 */
export function createDeployment({ llm, flow, model, name }: DeploymentOptions): Models {
  const gate = flow && tokenGate(flow);
  return {
    defaultModel: model,
    async acquire(models, estimate, { signal, jobId, tenant } = {}) {
      const asked = models[0] ?? model;
      const permit = await flow?.acquire(estimate, signal, jobId, tenant);
      return { llm, permit, model: asked, deployment: name ?? asked };
    },
    ...(gate && { capacity: gate }),
  };
}

/**
 * The provider's gate, bounded by its tokens as well as its requests. `flow.ready()` counts the calls that may
 * start within the booking horizon whatever their size, but under a tokens-per-minute limit one job of 5,000
 * estimated tokens books seconds of it: reading a second's worth of requests at once would hold a batch of one
 * tenant's large documents in memory, each waiting for its permit, ahead of every job another tenant posts
 * next. So a read takes only as many jobs of the recent average estimate as the token budget can book now
 * (less this process's jobs already waiting), and the lanes' fair share decides whose they are.
 */
export function tokenGate(flow: ProviderFlow): (averageTokens: number) => Promise<Capacity> {
  // Whether the provider has a tokens-per-minute limit, as last seen: without one, the status is asked for only
  // once a second (a high-rate worker reads often, and each look is a round trip).
  let unlimitedUntil = 0;
  return async (averageTokens) => {
    const gate = await flow.ready();
    if (gate.permits <= 1 || performance.now() < unlimitedUntil) return gate;
    const status = await flow.status();
    if (!status.tpm.limit) {
      unlimitedUntil = performance.now() + 1_000;
      return gate;
    }
    const msPerToken = 60_000 / (status.tpm.limit * FLOW_DEFAULTS.margin);
    // How far the next booking may still be from now, as the limiter allows it.
    const room = FLOW_DEFAULTS.maxAheadMs - (status.next_permit_at - status.now);
    if (room < 0) return { permits: 0, waitMs: Math.ceil(-room) };
    const fit = Math.floor(room / (averageTokens * msPerToken)) + 1 - flow.waiting;
    return fit > 0 ? { permits: Math.min(gate.permits, fit), waitMs: gate.waitMs } : { permits: 0, waitMs: 50 };
  };
}
