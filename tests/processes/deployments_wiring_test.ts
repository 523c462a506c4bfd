/**
 * `LLM_DEPLOYMENTS` as the worker builds it (`src/processes/_model.ts`): one shared flow per model of each
 * deployment, keyed apart, the router over them, `provider status` listing each, and the flow metrics labelled by
 * deployment. Two real local providers; the configuration parsed as a process parses its environment.
 */
import assert from "node:assert/strict";
import { parseConfig } from "../../src/config.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { createRegistry, workerMetrics } from "../../src/metrics/metrics.ts";
import { buildFlows, buildModels, modelName } from "../../src/processes/_model.ts";
import { flowEvents } from "../../src/processes/metrics_wiring.ts";
import { providerCommand } from "../../src/cli/provider_command.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { deployment, deploymentsEnv } from "../support/deployments_env.ts";
import { createTestRedis } from "../_support.ts";

Deno.test("LLM_DEPLOYMENTS builds a flow per deployment and model, a router over them, and labelled metrics", async () => {
  const r = await createTestRedis();
  const east = startFakeModel();
  const west = startFakeModel();
  const config = parseConfig(deploymentsEnv([
    deployment("east", { base_url: east.url, models: ["gpt-4.1-mini", "gpt-4.1"], weight: 3 }),
    deployment("west", { base_url: west.url, models: ["gpt-4.1-mini"], weight: 1, rpm: 600 }),
  ], { OPENAI_MODEL: "gpt-4.1-mini" }));
  const registry = createRegistry();
  const metrics = workerMetrics(registry, { unlabelledFlows: false });
  const flows = buildFlows(config, r.redis, silentLogger, (d) => flowEvents(metrics, d));
  try {
    assert.deepEqual(flows.map((f) => [f.deployment, f.model]), [
      ["east", "gpt-4.1-mini"],
      ["east", "gpt-4.1"],
      ["west", "gpt-4.1-mini"],
    ]);
    assert.equal(flows[0]!.label, `east ${east.url} gpt-4.1-mini`);
    const keys = new Set(await Promise.all(flows.map(async (f) => (await f.flow.status()).key)));
    assert.equal(keys.size, 3, "each has its own state in Redis");
    assert.equal((await flows[2]!.flow.status()).rpm.configured, null, "configured once the worker asks");

    const models = buildModels(config, { flows, log: silentLogger });
    assert.equal(models.defaultModel, modelName(config));
    assert.equal(models.defaultModel, "gpt-4.1-mini");
    // Weights 3 and 1: of eight calls that accept any model, six go east and two west, each answered there.
    const served: string[] = [];
    for (let i = 0; i < 8; i++) {
      const got = await models.acquire([], 10, { jobId: `job-${i}`, tenant: "acme" });
      const answer = await got.llm.complete(`Revenue rose ${i}%.`, {
        model: got.model,
        signal: AbortSignal.timeout(5_000),
      });
      await got.permit!.settle({ value: answer });
      served.push(got.deployment);
      assert.equal(answer.model, "gpt-4.1-mini");
    }
    assert.deepEqual(served.filter((d) => d === "east").length, 6);
    assert.equal(east.requests, 6);
    assert.equal(west.requests, 2);
    // A call that accepts only gpt-4.1 goes to the one deployment serving it.
    const only = await models.acquire(["gpt-4.1"], 10, { jobId: "job-x", tenant: "acme" });
    assert.deepEqual([only.deployment, only.model], ["east", "gpt-4.1"]);
    await only.permit!.settle({ aborted: true });
    await Promise.all(flows.map((f) => f.flow.settled()));
    assert.equal((await flows[2]!.flow.status()).rpm.configured, 600);

    const text = await registry.metrics();
    const permits = (d: string) =>
      [...text.matchAll(new RegExp(`oncely_llm_permits_total\\{kind="\\w+",deployment="${d}"\\} (\\d+)`, "g"))]
        .reduce((n, m) => n + Number(m[1]), 0);
    // Each a permit or, while a flow still learns its limits from the headers, its probe.
    assert.equal(permits("east"), 7);
    assert.equal(permits("west"), 2);
    assert.match(text, /oncely_llm_429_total\{kind="quota",deployment="west"\} 0/);
    // No series of a single provider that is not there: every flow series names its deployment.
    assert.doesNotMatch(text, /oncely_llm_(permits|429|tokens|breaker_transitions)_total\{kind="\w+"\}/);
    assert.doesNotMatch(text, /oncely_llm_breaker_transitions_total\{to="\w+"\}/);

    const lines: string[] = [];
    assert.equal(await providerCommand(flows, "unused", ["status", "--json"], (l) => lines.push(l)), 0);
    const listed = JSON.parse(lines[0]!) as { deployment: string; model: string; breaker: { state: string } }[];
    assert.deepEqual(listed.map((s) => [s.deployment, s.model, s.breaker.state]), [
      ["east", "gpt-4.1-mini", "closed"],
      ["east", "gpt-4.1", "closed"],
      ["west", "gpt-4.1-mini", "closed"],
    ]);
    const human: string[] = [];
    assert.equal(await providerCommand(flows, "unused", ["status"], (l) => human.push(l)), 0);
    assert.equal(human.filter((l) => l.startsWith("provider ")).length, 3);
  } finally {
    await Promise.all(flows.map((f) => f.flow.withdraw()));
    await east.close();
    await west.close();
    await r.close();
  }
});
