/**
 * Runs of a task end to end: the real API handler, a worker calling the fake
 * model through the real openai SDK with structured outputs, the commit with
 * its outbox row, and the relay delivering run.completed / run.failed
 * webhooks and emails that carry the output.
 */
import assert from "node:assert/strict";
import { createOpenAiLlm } from "../../src/llm/openai_llm.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createJobWaiter } from "../../src/runs/job_waiter.ts";
import { compileSchema } from "../../src/tasks/json_schema.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { rotateWebhookSecret } from "../../src/tenants/webhook_secrets.ts";
import { silentLogger } from "../../src/log/logger.ts";
import { startFakeModel, STRUCTURED_MARKERS } from "../support/fake_model_server.ts";
import { startFakeMail } from "../support/fake_mail_server.ts";
import { startFakeWebhookReceiver } from "../support/fake_webhook_receiver.ts";
import { apiHandler, jsonClient, relayTo, summaryWorker } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis, waitFor } from "../_support.ts";

const TRIAGE = {
  system: "You triage support tickets for {{input.product}}.",
  prompt: "Classify this ticket:\n\n{{input.ticket}}",
  model: ["triage-model", "fallback-model"],
  input_schema: {
    type: "object",
    properties: { ticket: { type: "string", minLength: 1 }, product: { type: "string" } },
    required: ["ticket"],
    additionalProperties: false,
  },
  output_schema: {
    type: "object",
    properties: {
      category: { type: "string", enum: ["bug", "billing", "question"] },
      urgent: { type: "boolean" },
      summary: { type: "string" },
    },
    required: ["category", "urgent", "summary"],
    additionalProperties: false,
  },
  max_output_tokens: 200,
  temperature: 0,
};

Deno.test("runs of a task: structured output, repair, failures, notifications", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const model = startFakeModel();
  const mail = startFakeMail();
  const secrets = new Map<string, string>();
  const hooks = startFakeWebhookReceiver(secrets);
  const waiter = await createJobWaiter({ sql: db.sql, log: silentLogger });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys }, { authMode: "api-key", waiter });
  const acme = await createApiKey(db.sql, "acme");
  secrets.set("acme", await rotateWebhookSecret(db.sql, "acme"));
  const llm = createOpenAiLlm({ apiKey: "sk-test", model: "default-model", baseURL: model.url });
  const worker = summaryWorker({ redis: r.redis, sql: db.sql, llm, keys }, { concurrency: 32 });
  const relay = relayTo({ sql: db.sql, mailUrl: mail.url });
  const stop = new AbortController();
  const running = [worker.run(stop.signal), relay.run(stop.signal)];
  const call = jsonClient(api, acme);
  const run = (key: string, body: unknown, wait = 10) =>
    call("POST", "/v1/tasks/triage/runs", body, { "idempotency-key": key, prefer: `wait=${wait}` });
  // Entries ever added to the tenant's lane (acknowledged ones included).
  const queued = async () => {
    const info = await r.redis.xinfo("STREAM", keys.lane("acme").stream) as unknown[];
    return Number(info[info.indexOf("entries-added") + 1]);
  };
  const output = compileSchema(TRIAGE.output_schema);
  try {
    await t.step("PUT: identical body is a 200 with the same version, a changed one a 201 with the next", async () => {
      const first = await call("PUT", "/v1/tasks/triage", { ...TRIAGE, temperature: 1 });
      assert.equal(first.status, 201);
      const second = await call("PUT", "/v1/tasks/triage", TRIAGE);
      assert.equal(second.status, 201);
      assert.equal(second.body.version, 2);
      const again = await call("PUT", "/v1/tasks/triage", TRIAGE);
      assert.equal(again.status, 200);
      assert.equal(again.body.version, 2);
    });

    await t.step("100 runs with Prefer: wait=10 all answer 200 with an output valid against the schema", async () => {
      const answers = await Promise.all(
        Array.from({ length: 100 }, (_, i) =>
          run(`triage-run-${String(i).padStart(6, "0")}`, {
            input: { ticket: `Ticket ${i}: the export button crashes`, product: "Acme CRM" },
          })),
      );
      for (const a of answers) {
        assert.equal(a.status, 200, JSON.stringify(a.body));
        assert.equal(a.headers.get("preference-applied"), "wait=10");
        assert.equal(a.body.status, "done");
        assert.equal(a.body.task, "triage");
        assert.equal(a.body.version, 2);
        assert.equal(a.body.model, "triage-model");
        assert.deepEqual(output.validate(a.body.output), []);
      }
      // Each run made one call, as the task says: its first model, system and prompt rendered, strict schema.
      assert.equal(model.requests, 100);
      const sent = model.bodies[0] as {
        model: string;
        messages: { role: string; content: string }[];
        response_format: { type: string; json_schema: { name: string; strict: boolean; schema: unknown } };
        temperature: number;
      };
      assert.equal(sent.model, "triage-model");
      assert.equal(sent.messages[0]!.content, "You triage support tickets for Acme CRM.");
      assert.match(sent.messages[1]!.content, /^Classify this ticket:\n\nTicket \d+: the export button crashes$/);
      assert.equal(sent.response_format.type, "json_schema");
      assert.equal(sent.response_format.json_schema.strict, true);
      assert.deepEqual(sent.response_format.json_schema.schema, TRIAGE.output_schema);
      assert.equal(sent.temperature, 0);
      const [row] = await db.sql<{ n: number; outbox: number }[]>`
        SELECT (SELECT count(*) FROM runs WHERE task = 'triage' AND version = 2 AND status = 'done')::int AS n,
          (SELECT count(*) FROM outbox)::int AS outbox`;
      assert.equal(row!.n, 100);
      assert.equal(row!.outbox, 0, "runs without notify write no outbox row");
    });

    await t.step("the same body again is a replay; the same key on another path is another run", async () => {
      const body = { input: { ticket: "Ticket 0: the export button crashes", product: "Acme CRM" } };
      const before = model.requests;
      const replay = await run("triage-run-000000", body);
      assert.equal(replay.headers.get("idempotent-replayed"), "true");
      assert.equal(replay.status, 200);
      assert.equal(replay.body.status, "done");
      const reused = await run("triage-run-000000", { input: { ticket: "another ticket" } });
      assert.equal(reused.status, 422, "a reused key with another body");
      assert.equal(model.requests, before);
      await call("PUT", "/v1/tasks/other", TRIAGE);
      const other = await call("POST", "/v1/tasks/other/runs", body, { "idempotency-key": "triage-run-000000" });
      assert.equal(other.status, 202);
      assert.notEqual(other.body.run_id, replay.body.run_id);
      assert.equal(other.headers.get("location"), `/v1/runs/${other.body.run_id}`);
    });

    await t.step("a bad input is a 422 naming the pointer, and nothing is queued", async () => {
      const before = await queued();
      const missing = await run("triage-bad-000001", { input: { product: "Acme CRM" } });
      assert.equal(missing.status, 422);
      assert.equal(missing.body.errors[0].pointer, "/input");
      const wrong = await run("triage-bad-000002", { input: { ticket: 42 } });
      assert.equal(wrong.status, 422);
      assert.equal(wrong.body.errors[0].pointer, "/input/ticket");
      const extra = await run("triage-bad-000003", { input: { ticket: "x", colour: "red" } });
      assert.equal(extra.status, 422);
      const nul = await run("triage-bad-000004", { input: { ticket: "a\u0000b" } });
      assert.equal(nul.status, 422);
      assert.equal(nul.body.errors[0].pointer, "/input/ticket");
      // A priority outside the four, and an expiry that is not whole seconds from 1 to 7 days, are refused.
      const refusals = [{ priority: "urgent" }, { expires_in: 0 }, { expires_in: 1.5 }, { expires_in: 604_801 }];
      for (const [i, extra] of refusals.entries()) {
        const refused = await run(`triage-bad-extra-0${i}`, { input: { ticket: "x" }, ...extra });
        assert.equal(refused.status, 422);
        assert.equal(refused.body.errors[0].pointer, `/${Object.keys(extra)[0]}`);
      }
      assert.equal((await run("triage-bad-000005", { input: { ticket: "x" }, version: 9 })).status, 404);
      assert.equal(
        (await call("POST", "/v1/tasks/nope/runs", { input: {} }, { "idempotency-key": "x".repeat(16) }))
          .status,
        404,
      );
      assert.equal(await queued(), before);
    });

    await t.step("a run's priority queues it on its lane's stream: high on high, batch on low", async () => {
      const added = async (stream: string) => {
        const info = await r.redis.xinfo("STREAM", stream).catch(() => null) as unknown[] | null;
        return info ? Number(info[info.indexOf("entries-added") + 1]) : 0;
      };
      const lane = keys.lane("acme");
      const before = await Promise.all([lane.streamOf("high"), lane.streamOf("low")].map(added));
      for (const [i, priority] of ["high", "batch", "low"].entries()) {
        const done = await run(`triage-priority-0${i}`, { input: { ticket: `printer ${i}` }, priority });
        assert.equal(done.status, 200);
        assert.equal(done.body.status, "done");
      }
      const after = await Promise.all([lane.streamOf("high"), lane.streamOf("low")].map(added));
      assert.deepEqual([after[0]! - before[0]!, after[1]! - before[1]!], [1, 2]);
    });

    await t.step("an answer that breaks the schema once succeeds after two calls", async () => {
      const before = model.requests;
      const a = await run("triage-repair-0001", { input: { ticket: `crash ${STRUCTURED_MARKERS.breaksOnce}` } });
      assert.equal(a.status, 200);
      assert.equal(a.body.status, "done");
      assert.deepEqual(output.validate(a.body.output), []);
      assert.equal(model.requests - before, 2);
      // Attempts are recorded in batches, within a second of the call.
      const got = await waitFor("both attempts recorded", async () => {
        const doc = await call("GET", `/v1/runs/${a.body.run_id}`);
        return doc.body.attempts === 2 ? doc : undefined;
      });
      assert.deepEqual(got.body.tokens, { prompt: 2, completion: 2 });
      // The repair call's attempt follows the first call's in the record: one row per call.
      const rows = await db.sql<{ attempt: number }[]>`
        SELECT attempt FROM model_attempts WHERE job_id = ${a.body.run_id} ORDER BY started_at`;
      assert.deepEqual(rows.map((r) => r.attempt), [1, 2]);
      // The repair call sent the first answer back, then what was wrong with it.
      const repair = model.bodies.at(-1) as { messages: { role: string; content: string }[] };
      assert.equal(repair.messages.at(-2)!.role, "assistant");
      assert.match(repair.messages.at(-1)!.content, /is not valid JSON/);
    });

    await t.step("an answer that breaks the schema twice fails the run after exactly two calls", async () => {
      const before = model.requests;
      const a = await run("triage-broken-0001", {
        input: { ticket: `crash ${STRUCTURED_MARKERS.breaksAlways}` },
        notify: { webhook: `${hooks.url}/acme` },
      });
      assert.equal(a.status, 200);
      assert.equal(a.body.status, "failed");
      assert.equal(a.body.error, 'output_invalid: at ""');
      assert.equal(model.requests - before, 2);
      const runId = a.body.run_id;
      const [row] = await db.sql<{ error: string }[]>`SELECT error FROM job_outcomes WHERE job_id = ${runId}`;
      assert.match(row!.error, /output_invalid: at "": the answer does not match the output schema/);
      const hook = await waitFor("the run.failed webhook", () => hooks.bodies.find((b) => b.run_id === runId));
      assert.deepEqual(hook, {
        type: "run.failed",
        run_id: runId,
        task: "triage",
        version: 2,
        status: "failed",
        error: 'output_invalid: at ""',
      });
    });

    await t.step("notifications: run.completed carries the output, the email the pretty-printed JSON", async () => {
      const a = await run("triage-notify-0001", {
        input: { ticket: "refund please" },
        notify: { webhook: `${hooks.url}/acme` },
      });
      const b = await run("triage-notify-0002", { input: { ticket: "refund please" }, notify: "ops@example.com" });
      assert.equal(a.body.status, "done");
      assert.equal(b.body.status, "done");
      const hook = await waitFor(
        "the run.completed webhook",
        () => hooks.bodies.find((x) => x.run_id === a.body.run_id),
      );
      assert.deepEqual(hook, {
        type: "run.completed",
        run_id: a.body.run_id,
        task: "triage",
        version: 2,
        status: "done",
        output: a.body.output,
      });
      const email = await waitFor("the run email", () => mail.delivered.find((e) => e.text.includes(b.body.run_id)));
      assert.equal(email.idempotencyKey, `run_done:${b.body.run_id}`);
      assert.ok(email.text.includes(JSON.stringify(b.body.output, null, 2)), email.text);
      assert.equal(hooks.badSignatures, 0);
    });

    await t.step("a run is a run: /v1/summaries does not show it; DELETE of a done run is 409", async () => {
      const a = await run("triage-where-00001", { input: { ticket: "where" } });
      assert.equal((await call("GET", `/v1/summaries/${a.body.run_id}`)).status, 404);
      assert.equal((await call("DELETE", `/v1/summaries/${a.body.run_id}`)).status, 404);
      assert.equal((await call("DELETE", `/v1/runs/${a.body.run_id}`)).status, 409);
      const got = await call("GET", `/v1/runs/${a.body.run_id}`);
      assert.equal(got.body.status, "done");
      assert.equal(got.body.task, "triage");
    });

    await t.step("every effect once: one run row, one result and one outbox row per notified run", async () => {
      const [row] = await db.sql<{ dup: number }[]>`
        SELECT (SELECT count(*) FROM (SELECT dedupe_key FROM outbox GROUP BY 1 HAVING count(*) > 1) d)::int AS dup`;
      assert.equal(row!.dup, 0);
      // Every model call is recorded with its task and version (in batches, within a second).
      const attempts = async () =>
        (await db.sql<{ n: number }[]>`
          SELECT count(*)::int AS n FROM model_attempts
          WHERE (task, version) IN (('triage', 2), ('other', 1))`)[0]!.n;
      await waitFor("every attempt recorded", async () => (await attempts()) >= model.requests);
      assert.equal(await attempts(), model.requests);
    });
  } finally {
    stop.abort();
    await Promise.all(running);
    await worker.close();
    await waiter.close();
    await Promise.all([model.close(), mail.close(), hooks.close()]);
    await r.close();
    await db.close();
  }
});
