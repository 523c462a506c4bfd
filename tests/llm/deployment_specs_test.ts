/**
 * The deployments the configuration names (`LLM_DEPLOYMENTS`, else the implicit one of OPENAI_*, else none), the
 * models they serve (the only ones a task or request may name) and the default model.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../../src/config.ts";
import { defaultModel, deploymentSpecs } from "../../src/llm/deployment_specs.ts";
import { servedModels } from "../../src/llm/prices.ts";
import { deployment, deploymentsEnv, keyOf } from "../support/deployments_env.ts";

Deno.test("deploymentSpecs() without LLM_DEPLOYMENTS: the implicit deployment of OPENAI_*, unnamed", () => {
  const config = parseConfig({
    OPENAI_API_KEY: "sk-test",
    OPENAI_MODEL: "gpt-4.1",
    LLM_PRICES: '{"gpt-4.1-mini": {"in": 0.4, "out": 1.6}, "gpt-4.1": {"in": 2, "out": 8}}',
    LLM_RPM: "600",
    LLM_TPM: "60000",
  });
  assert.deepEqual(deploymentSpecs(config), [{
    name: undefined,
    baseURL: "https://api.openai.com/v1",
    apiKeyEnv: "OPENAI_API_KEY",
    apiKey: "sk-test",
    // OPENAI_MODEL first, then the priced ones, each once.
    models: ["gpt-4.1", "gpt-4.1-mini"],
    weight: 1,
    rpm: 600,
    tpm: 60000,
    batch: false,
  }]);
  assert.equal(defaultModel(config), "gpt-4.1");
  const bare = deploymentSpecs(parseConfig({ OPENAI_API_KEY: "sk-test", OPENAI_BASE_URL: "http://127.0.0.1:9/v1" }));
  assert.deepEqual(bare.map((s) => [s.baseURL, s.models, s.rpm, s.tpm]), [
    ["http://127.0.0.1:9/v1", ["gpt-4.1-mini"], undefined, undefined],
  ]);
  assert.ok(!("rpm" in bare[0]!), "no limit configured: none in the spec (learned from headers)");
});

Deno.test("deploymentSpecs() for the embedded model: none, and the default model is extractive", () => {
  const config = parseConfig({});
  assert.deepEqual(deploymentSpecs(config), []);
  assert.equal(defaultModel(config), "extractive");
  assert.deepEqual([...servedModels(config)], ["extractive"]);
});

Deno.test("deploymentSpecs() with LLM_DEPLOYMENTS: one spec each, in order, with its key and its defaults", () => {
  const config = parseConfig(deploymentsEnv([
    deployment("east", { weight: 3, rpm: 900, tpm: 90_000, batch: true }),
    deployment("west", { base_url: "http://10.0.0.5:8080/v1", models: ["gpt-4.1-mini", "gpt-4.1"] }),
  ], { OPENAI_API_KEY: "sk-unused", OPENAI_BASE_URL: "https://ignored.example.com/v1", OPENAI_MODEL: "gpt-4.1" }));
  assert.deepEqual(deploymentSpecs(config), [
    {
      name: "east",
      baseURL: "https://east.example.com/v1",
      apiKeyEnv: "LLM_KEY_EAST",
      apiKey: keyOf("LLM_KEY_EAST"),
      models: ["gpt-4.1-mini"],
      weight: 3,
      rpm: 900,
      tpm: 90_000,
      batch: true,
    },
    {
      name: "west",
      baseURL: "http://10.0.0.5:8080/v1",
      apiKeyEnv: "LLM_KEY_WEST",
      apiKey: keyOf("LLM_KEY_WEST"),
      models: ["gpt-4.1-mini", "gpt-4.1"],
      weight: 1,
      batch: false,
    },
  ]);
  // OPENAI_MODEL is served by a deployment: it is the default.
  assert.equal(defaultModel(config), "gpt-4.1");
});

Deno.test("defaultModel() with LLM_DEPLOYMENTS: OPENAI_MODEL when a deployment serves it, else the first one's first", () => {
  const env = deploymentsEnv([
    deployment("local", { models: ["llama-3.1-8b", "qwen-2.5"] }),
    deployment("cloud", { models: ["gpt-4.1-mini"] }),
  ]);
  // OPENAI_MODEL's default, gpt-4.1-mini, is served by the second deployment.
  assert.equal(defaultModel(parseConfig(env)), "gpt-4.1-mini");
  assert.equal(defaultModel(parseConfig({ ...env, OPENAI_MODEL: "gpt-5" })), "llama-3.1-8b");
});

Deno.test("servedModels() with LLM_DEPLOYMENTS: the deployments' models only, not OPENAI_MODEL nor the priced ones", () => {
  const config = parseConfig(deploymentsEnv([
    deployment("east", { models: ["gpt-4.1-mini", "gpt-4.1"] }),
    deployment("west", { models: ["gpt-4.1", "o4-mini"] }),
  ], { OPENAI_MODEL: "gpt-5", LLM_PRICES: '{"gpt-4o": {"in": 2.5, "out": 10}}' }));
  assert.deepEqual([...servedModels(config)].sort(), ["gpt-4.1", "gpt-4.1-mini", "o4-mini"]);
});
