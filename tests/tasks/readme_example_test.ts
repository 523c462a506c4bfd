/**
 * The README's worked example for tasks, run as written (its import made
 * absolute) against the real API over HTTP, a worker calling the fake model
 * through the openai SDK, and the relay sending the webhook.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { rotateWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { startFakeModel } from "../support/fake_model_server.ts";
import { apiHandler, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

type Example = (baseUrl: string, apiKey: string, webhookSecret: string) => Promise<{
  version: number;
  run: { run_id: string; status: string; task: string; output: unknown };
  event: unknown;
}>;

/** The README's block after the tasks-example marker, written to a file and imported. */
async function readmeExample(): Promise<Example> {
  const readme = await Deno.readTextFile(new URL("../../README.md", import.meta.url));
  const marker = readme.indexOf("<!-- tasks-example:");
  assert.ok(marker > 0, "the README has the worked example");
  const start = readme.indexOf("```ts\n", marker) + "```ts\n".length;
  const client = new URL("../../src/client/client.ts", import.meta.url).href;
  const code = readme.slice(start, readme.indexOf("```", start)).replace("./src/client/client.ts", client);
  const file = await Deno.makeTempFile({ suffix: ".ts" });
  await Deno.writeTextFile(file, code);
  try {
    return (await import(new URL(`file://${file}`).href)).triageExample as Example;
  } finally {
    await Deno.remove(file);
  }
}

Deno.test("the README's worked example defines, runs, waits and receives the webhook", async () => {
  const example = await readmeExample();
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel();
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, handler);
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys });
  const relay = relayTo({ sql: db.sql });
  const stop = new AbortController();
  const running = [worker.run(stop.signal), relay.run(stop.signal)];
  try {
    const apiKey = await createApiKey(db.sql, "acme");
    const secret = await rotateWebhookSecret(db.sql, "acme");
    const { version, run, event } = await example(`http://127.0.0.1:${server.addr.port}`, apiKey, secret);
    assert.equal(version, 1);
    assert.equal(run.status, "done");
    assert.equal(run.task, "triage");
    assert.deepEqual(run.output, { category: "bug", urgent: true });
    assert.deepEqual(event, {
      type: "run.completed",
      run_id: run.run_id,
      task: "triage",
      version: 1,
      status: "done",
      output: run.output,
    });
    assert.equal(model.requests, 1);
    const [rows] = await db.sql<{ runs: number; outbox: number }[]>`
      SELECT (SELECT count(*) FROM runs WHERE status = 'done')::int AS runs, (SELECT count(*) FROM outbox)::int AS outbox`;
    assert.deepEqual({ ...rows }, { runs: 1, outbox: 1 });
  } finally {
    stop.abort();
    await Promise.all(running);
    await worker.close();
    await waiter.close();
    await server.shutdown();
    await model.close();
    await r.close();
    await db.close();
  }
});
