/** The model, flow control and deployments the configuration picks. */
import type { RedisClient } from "../clients.ts";
import type { Config } from "../config.ts";
import { createExtractiveLlm } from "../llm/extractive.ts";
import type { LLM } from "../llm/llm.ts";
import type { Models } from "../llm/models.ts";
import { createOpenAiLlm } from "../llm/openai_llm.ts";
import type { Logger } from "../log/logger.ts";
import { createDeployment } from "../provider/deployment.ts";
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

/** The configured model's name: OPENAI_MODEL, or `extractive`. */
export function modelName(config: Config): string {
  return config.LLM_PROVIDER === "openai" ? config.OPENAI_MODEL : "extractive";
}

/**
 * The deployments the worker's model calls go to: today the one the configuration names, its model under its
 * `flow` (none for the local model). A second deployment is added here, as another implementation of `Models`.
 */
export function buildModels(config: Config, { llm, flow }: { llm: LLM; flow?: ProviderFlow }): Models {
  return createDeployment({ llm, flow, model: modelName(config) });
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
    cooldownMs: config.LLM_BREAKER_COOLDOWN_S * 1000,
    // A probe holds the single slot for at most one call's timeout, plus slack.
    probeLeaseMs: config.LLM_CALL_TIMEOUT_S * 1000 + 5_000,
    // A worker's configuration counts while it runs, even while all its callers wait (it says so from a timer).
    keepAlive: true,
    events,
  });
}
