/** The model, flow control and deployments the configuration picks. */
import type { RedisClient } from "../clients.ts";
import type { Config } from "../config.ts";
import { createExtractiveLlm } from "../llm/extractive.ts";
import type { LLM } from "../llm/llm.ts";
import type { Models } from "../llm/models.ts";
import { createOpenAiLlm } from "../llm/openai_llm.ts";
import type { Logger } from "../log/logger.ts";
import { createDeployment } from "../provider/deployment.ts";
import { createRouter } from "../provider/deployments.ts";
import { defaultModel, deploymentSpecs } from "../llm/deployment_specs.ts";
import { createProviderFlow, type FlowEvents, type ProviderFlow, providerStateKey } from "../provider/flow_control.ts";
import { KEY_PREFIX } from "../runs/keys.ts";

const DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1";

/** The configured model; `log` hears of usage the provider reported and we refused. */
export function buildLlm(config: Config, log?: Logger): LLM {
  if (config.LLM_PROVIDER === "extractive") return createExtractiveLlm();
  return createOpenAiLlm({
    apiKey: config.OPENAI_API_KEY!,
    model: config.OPENAI_MODEL,
    baseURL: config.OPENAI_BASE_URL,
    log,
  });
}

/** The model a call that accepts any is asked of: OPENAI_MODEL (or a deployment's first model), or `extractive`. */
export function modelName(config: Config): string {
  return defaultModel(config);
}

/** One shared flow control: a deployment's for one model it serves (or the single provider's, for all). */
export interface FlowEntry {
  /** The deployment's name; undefined for the single one configured by OPENAI_* (recorded by model name). */
  deployment: string | undefined;
  /** The model it paces; every model of the single deployment shares one flow. */
  model: string;
  /** How `provider status` and the breaker gauge name it (never the key). */
  label: string;
  flow: ProviderFlow;
}

/**
 * The shared limiters and breakers of the configured deployments: without LLM_DEPLOYMENTS, the one provider's
 * (none for the local model); with it, one for each model of each deployment, as providers limit a key per model.
 * `events` is asked for the events of each deployment (by name; undefined for the single one).
 */
export function buildFlows(
  config: Config,
  redis: RedisClient,
  log: Logger,
  events?: (deployment: string | undefined) => FlowEvents,
): FlowEntry[] {
  if (!config.LLM_DEPLOYMENTS) {
    const flow = buildFlow(config, redis, log, events?.(undefined));
    return flow ? [{ deployment: undefined, model: config.OPENAI_MODEL, label: providerLabel(config), flow }] : [];
  }
  return deploymentSpecs(config).flatMap((spec) =>
    spec.models.map((model) => ({
      deployment: spec.name,
      model,
      label: `${spec.name} ${spec.baseURL} ${model}`,
      flow: createProviderFlow({ redis, log }, {
        key: providerStateKey(KEY_PREFIX, { baseURL: spec.baseURL, model, apiKey: spec.apiKey }),
        rpm: spec.rpm,
        tpm: spec.tpm,
        ...flowTimings(config),
        events: events?.(spec.name),
      }),
    }))
  );
}

/**
 * The deployments the worker's model calls go to: without LLM_DEPLOYMENTS, the one the configuration names (its
 * model under its `flow`, none for the local model); with it, the router over every deployment's flows.
 */
export function buildModels(config: Config, { flows, log }: { flows: readonly FlowEntry[]; log?: Logger }): Models {
  if (!config.LLM_DEPLOYMENTS) {
    return createDeployment({ llm: buildLlm(config, log), flow: flows[0]?.flow, model: modelName(config) });
  }
  const deployments = deploymentSpecs(config).map((spec) => ({
    name: spec.name!,
    weight: spec.weight,
    llm: createOpenAiLlm({ apiKey: spec.apiKey, model: spec.models[0]!, baseURL: spec.baseURL, log }),
    flows: new Map(flows.filter((f) => f.deployment === spec.name).map((f) => [f.model, f.flow])),
  }));
  return createRouter({
    deployments,
    defaultModel: modelName(config),
    fallbackAfterMs: config.LLM_FALLBACK_AFTER_S * 1000,
    fellBack: (from, to) => log?.info("model_fallback", { from, to }),
  });
}

/** The provider as people name it: base URL and model (never the key). */
export function providerLabel(config: Config): string {
  if (config.LLM_PROVIDER === "extractive") return "extractive";
  return `${config.OPENAI_BASE_URL ?? DEFAULT_OPENAI_BASE_URL} ${config.OPENAI_MODEL}`;
}

/**
 * The shared limiter and breaker of the configured provider; none for the
 * local extractive model, which has no limits and cannot be down.
 */
export function buildFlow(
  config: Config,
  redis: RedisClient,
  log: Logger,
  events?: FlowEvents,
): ProviderFlow | undefined {
  if (config.LLM_PROVIDER === "extractive") return undefined;
  return createProviderFlow({ redis, log }, {
    key: providerStateKey(KEY_PREFIX, {
      baseURL: config.OPENAI_BASE_URL ?? DEFAULT_OPENAI_BASE_URL,
      model: config.OPENAI_MODEL,
      apiKey: config.OPENAI_API_KEY!,
    }),
    rpm: config.LLM_RPM,
    tpm: config.LLM_TPM,
    ...flowTimings(config),
    events,
  });
}

/** The breaker's and the probe's timings, the same for every deployment. */
function flowTimings(config: Config) {
  return {
    cooldownMs: config.LLM_BREAKER_COOLDOWN_S * 1000,
    // A probe holds the single slot for at most one call's timeout, plus slack.
    probeLeaseMs: config.LLM_CALL_TIMEOUT_S * 1000 + 5_000,
    // A worker's configuration counts while it runs, even while all its callers wait (it says so from a timer).
    keepAlive: true,
  };
}
