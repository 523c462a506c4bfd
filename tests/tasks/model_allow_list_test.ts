/**
 * A task may name only a model a deployment serves (the contract's model rules): without LLM_DEPLOYMENTS,
 * OPENAI_MODEL and those LLM_PRICES prices (issue 37); with it, the models its deployments list (issue 40). Any
 * other name was stored and charged at the flat default price.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../../src/config.ts";
import { servedModels } from "../../src/llm/prices.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler, jsonClient } from "../support/fixtures.ts";
import { smallDefinition } from "../support/task_definitions.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("the served models are OPENAI_MODEL (or the embedded one) and the priced ones", () => {
  const openai = parseConfig({
    LLM_PROVIDER: "openai",
    OPENAI_API_KEY: "sk-test",
    OPENAI_MODEL: "gpt-4.1-mini",
    LLM_PRICES: '{"gpt-4.1": {"in": 2, "out": 8}}',
  });
  assert.deepEqual([...servedModels(openai)].sort(), ["gpt-4.1", "gpt-4.1-mini"]);
  assert.deepEqual([...servedModels(parseConfig({}))], ["extractive"]);
});

Deno.test("a PUT naming a model not served is a 422 on /model, whichever place it has in the list", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    models: new Set(["gpt-4.1-mini", "gpt-4.1"]),
  });
  try {
    const call = jsonClient(api, await createApiKey(db.sql, "acme"));
    const one = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model: "gpt-9-ultra" });
    assert.equal(one.status, 422);
    assert.equal(one.body.errors[0].pointer, "/model");
    assert.match(one.body.detail, /"gpt-9-ultra" is not served here; the models served are gpt-4\.1, gpt-4\.1-mini/);
    const listed = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model: ["gpt-4.1", "mystery"] });
    assert.equal(listed.status, 422);
    assert.equal(listed.body.errors[0].pointer, "/model/1");
    assert.equal((await call("GET", "/v1/tasks/triage")).status, 404, "nothing was stored");
    const served = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model: ["gpt-4.1", "gpt-4.1-mini"] });
    assert.equal(served.status, 201);
    // Unset, the deployment's default model: always served.
    assert.equal((await call("PUT", "/v1/tasks/other", smallDefinition())).status, 201);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("with LLM_DEPLOYMENTS, a PUT naming a model no deployment lists is a 422 on /model, a priced one too", async () => {
  const config = parseConfig(deploymentsEnv([
    deployment("east", { models: ["gpt-4.1-mini", "gpt-4.1"] }),
    deployment("local", { base_url: "http://127.0.0.1:9/v1", models: ["llama-3.1-8b"] }),
  ], { OPENAI_MODEL: "gpt-5", LLM_PRICES: '{"gpt-4o": {"in": 2.5, "out": 10}}' }));
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    models: servedModels(config),
  });
  try {
    const call = jsonClient(api, await createApiKey(db.sql, "acme"));
    // Priced, and OPENAI_MODEL, but served by no deployment.
    for (const model of ["gpt-4o", "gpt-5"]) {
      const refused = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model });
      assert.equal(refused.status, 422, model);
      assert.equal(refused.body.errors[0].pointer, "/model");
      assert.equal(
        refused.body.detail,
        `Model "${model}" is not served here; the models served are gpt-4.1, gpt-4.1-mini, llama-3.1-8b`,
      );
    }
    const listed = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model: ["llama-3.1-8b", "gpt-4o"] });
    assert.equal(listed.status, 422);
    assert.equal(listed.body.errors[0].pointer, "/model/1");
    assert.equal((await call("GET", "/v1/tasks/triage")).status, 404, "nothing was stored");
    const served = await call("PUT", "/v1/tasks/triage", { ...smallDefinition(), model: ["llama-3.1-8b", "gpt-4.1"] });
    assert.equal(served.status, 201);
    assert.deepEqual(served.body.model, ["llama-3.1-8b", "gpt-4.1"]);
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a run request cannot name a model: 422, and nothing is queued under its key", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    models: new Set(["gpt-4.1-mini"]),
  });
  try {
    const call = jsonClient(api, await createApiKey(db.sql, "acme"));
    assert.equal((await call("PUT", "/v1/tasks/triage", smallDefinition())).status, 201);
    const key = { "idempotency-key": "run-naming-a-model-0001" };
    const named = await call("POST", "/v1/tasks/triage/runs", { input: { body: "x" }, model: "gpt-9-ultra" }, key);
    assert.equal(named.status, 422);
    // The same key without the field is a new run, not a replay: the refused request stored nothing.
    const run = await call("POST", "/v1/tasks/triage/runs", { input: { body: "x" } }, key);
    assert.equal(run.status, 202);
    assert.equal(run.headers.get("idempotent-replayed"), null);
  } finally {
    await r.close();
    await db.close();
  }
});
