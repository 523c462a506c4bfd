/**
 * The deployments model calls may go to, as the configuration names them: those of `LLM_DEPLOYMENTS`, or the one
 * implicit deployment of `OPENAI_BASE_URL` / `OPENAI_API_KEY` / `OPENAI_MODEL`, or none for the embedded model.
 */
import { type ModelPrice, servedModels } from "./prices.ts";

const DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1";

/** One deployment: an OpenAI-compatible server with its own key, models, weight and limits. */
export interface DeploymentSpec {
  /** As model_attempts.deployment, metrics and `provider status` name it; undefined for the implicit one (OPENAI_*), whose calls are recorded under the model name as today. */
  name: string | undefined;
  baseURL: string; // OPENAI_BASE_URL ?? "https://api.openai.com/v1" for the implicit one
  apiKeyEnv: string;
  apiKey: string;
  models: readonly string[]; // implicit: OPENAI_MODEL then the models LLM_PRICES prices (deduplicated)
  weight: number; // default 1
  rpm?: number; // implicit: LLM_RPM
  tpm?: number; // implicit: LLM_TPM
  batch: boolean; // default false
}

/** One deployment of `LLM_DEPLOYMENTS` as the configuration parsed it, its key read from `api_key_env`. */
export interface ConfiguredDeployment {
  name: string;
  base_url: string;
  api_key_env: string;
  /** The value of `api_key_env`: a secret, never logged. */
  api_key: string;
  models: readonly string[];
  weight: number;
  rpm?: number;
  tpm?: number;
  batch: boolean;
}

/**
 * The fields of the parsed configuration (`Config` of src/config.ts) the deployments come from. Named here rather
 * than imported: config.ts imports this folder, and folders do not import each other in a cycle.
 */
type DeploymentsConfig = {
  LLM_PROVIDER: "openai" | "extractive";
  LLM_DEPLOYMENTS?: readonly ConfiguredDeployment[];
  OPENAI_API_KEY?: string;
  OPENAI_BASE_URL?: string;
  OPENAI_MODEL: string;
  LLM_PRICES?: Record<string, ModelPrice>;
  LLM_RPM?: number;
  LLM_TPM?: number;
};

/** [] for LLM_PROVIDER=extractive. */
export function deploymentSpecs(config: DeploymentsConfig): DeploymentSpec[] {
  if (config.LLM_PROVIDER === "extractive") return [];
  if (config.LLM_DEPLOYMENTS) {
    return config.LLM_DEPLOYMENTS.map((d) => ({
      name: d.name,
      baseURL: d.base_url,
      apiKeyEnv: d.api_key_env,
      apiKey: d.api_key,
      models: [...d.models],
      weight: d.weight,
      ...(d.rpm === undefined ? {} : { rpm: d.rpm }),
      ...(d.tpm === undefined ? {} : { tpm: d.tpm }),
      batch: d.batch,
    }));
  }
  return [{
    name: undefined,
    baseURL: config.OPENAI_BASE_URL ?? DEFAULT_OPENAI_BASE_URL,
    apiKeyEnv: "OPENAI_API_KEY",
    // parseConfig refuses LLM_PROVIDER=openai without it.
    apiKey: config.OPENAI_API_KEY!,
    models: [...servedModels(config)],
    weight: 1,
    ...(config.LLM_RPM === undefined ? {} : { rpm: config.LLM_RPM }),
    ...(config.LLM_TPM === undefined ? {} : { tpm: config.LLM_TPM }),
    batch: false,
  }];
}

/** The model a call naming none is asked of: OPENAI_MODEL when a deployment serves it, else the first deployment's first model; "extractive" for the embedded model. */
export function defaultModel(config: DeploymentsConfig): string {
  if (config.LLM_PROVIDER === "extractive") return "extractive";
  const specs = deploymentSpecs(config);
  if (specs.some((spec) => spec.models.includes(config.OPENAI_MODEL))) return config.OPENAI_MODEL;
  // parseConfig refuses an empty LLM_DEPLOYMENTS and a deployment without models.
  return specs[0]!.models[0]!;
}
