/** `LLM_DEPLOYMENTS` environments for tests: deployments by name, with their key variables set. */

/** One element of `LLM_DEPLOYMENTS`, as an operator writes it. */
export interface DeploymentEntry {
  name: string;
  base_url: string;
  api_key_env: string;
  models: string[];
  weight?: number;
  rpm?: number;
  tpm?: number;
  batch?: boolean;
}

/**
 * A deployment named `name` at `https://<name>.example.com/v1`, its key in `LLM_KEY_<NAME>`, serving `gpt-4.1-mini`
 * unless `overrides` say otherwise.
 */
export function deployment(name: string, overrides: Partial<DeploymentEntry> = {}): DeploymentEntry {
  return {
    name,
    base_url: `https://${name}.example.com/v1`,
    api_key_env: `LLM_KEY_${name.toUpperCase().replace(/[^A-Z0-9]/g, "_")}`,
    models: ["gpt-4.1-mini"],
    ...overrides,
  };
}

/** The key a test environment gives the variable `name`. */
export const keyOf = (name: string): string => `sk-test-${name.toLowerCase()}`;

/**
 * `LLM_DEPLOYMENTS` holding `entries` (as given: an entry may be anything, to be refused), each named key variable
 * set to {@linkcode keyOf} it, and `extra` over them.
 */
export function deploymentsEnv(entries: unknown[], extra: Record<string, string> = {}): Record<string, string> {
  const keys = entries.map((entry) => (entry as { api_key_env?: unknown } | null)?.api_key_env)
    .filter((name): name is string => typeof name === "string");
  return {
    LLM_DEPLOYMENTS: JSON.stringify(entries),
    ...Object.fromEntries(keys.map((name) => [name, keyOf(name)])),
    ...extra,
  };
}
