/**
 * One trace per job across three processes: the real api, worker and relay
 * tasks (each with its own permission set) run with `OTEL_DENO=true` and
 * export OTLP/HTTP JSON to a local receiver. The POST, the time queued, the
 * delivery, the model attempt (and the SDK's own HTTP call), the commit and
 * the relay's send all carry one trace id.
 */
import assert from "node:assert/strict";
import { createApiKey } from "../src/tenants/tenant_store.ts";
import { startFakeMail } from "./support/fake_mail_server.ts";
import { startFakeModel } from "./support/fake_model_server.ts";
import { createTestDatabase, freePort, REDIS_URL, waitFor } from "./_support.ts";
import { emptyRedisDatabase, releaseRedisDatabase } from "./support/scratch.ts";

const ROOT = decodeURIComponent(new URL("..", import.meta.url).pathname);

interface ReceivedSpan {
  service: string;
  name: string;
  traceId: string;
  spanId: string;
  parentSpanId: string;
  attributes: Record<string, unknown>;
}

/** A local OTLP/HTTP receiver (JSON encoding) that keeps every span it is sent. */
function startOtlpReceiver() {
  const spans: ReceivedSpan[] = [];
  type AnyValue = { stringValue?: string; intValue?: string | number; boolValue?: boolean; doubleValue?: number };
  const value = (v: AnyValue) => v.stringValue ?? v.intValue ?? v.boolValue ?? v.doubleValue;
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (req) => {
    const body = await req.json().catch(() => ({}));
    if (new URL(req.url).pathname === "/v1/traces") {
      for (const rs of body.resourceSpans ?? []) {
        const service = (rs.resource?.attributes ?? []).find((a: { key: string }) => a.key === "service.name")?.value
          ?.stringValue;
        for (const ss of rs.scopeSpans ?? []) {
          for (const s of ss.spans ?? []) {
            spans.push({
              service,
              name: s.name,
              traceId: s.traceId,
              spanId: s.spanId,
              parentSpanId: s.parentSpanId ?? "",
              attributes: Object.fromEntries(
                (s.attributes ?? []).map((a: { key: string; value: AnyValue }) => [a.key, value(a.value)]),
              ),
            });
          }
        }
      }
    }
    return Response.json({});
  });
  return { url: `http://127.0.0.1:${server.addr.port}`, spans, close: () => server.shutdown() };
}

Deno.test("one job is one trace across the api, worker and relay processes", async () => {
  const db = await createTestDatabase();
  const redisUrl = await emptyRedisDatabase(REDIS_URL);
  const otlp = startOtlpReceiver();
  const model = startFakeModel(() => ({ kind: "ok", usage: { prompt_tokens: 42, completion_tokens: 7 } }));
  const mail = startFakeMail();
  const port = freePort();
  const key = await createApiKey(db.sql, "acme");
  const env = (service: string) => ({
    DATABASE_URL: db.url,
    REDIS_URL: redisUrl,
    PORT: String(port),
    OPENAI_API_KEY: "sk-test",
    OPENAI_BASE_URL: model.url,
    RESEND_API_KEY: "re_test",
    RESEND_BASE_URL: mail.url,
    NO_COLOR: "1",
    OTEL_DENO: "true",
    OTEL_EXPORTER_OTLP_PROTOCOL: "http/json",
    OTEL_EXPORTER_OTLP_ENDPOINT: otlp.url,
    OTEL_SERVICE_NAME: `oncely-${service}`,
    OTEL_DENO_CONSOLE: "ignore",
  });
  // Through the real tasks: the launcher passes the OTEL_* variables on to the runtime of each process.
  const spawn = (task: string) =>
    new Deno.Command(Deno.execPath(), {
      args: ["task", task],
      cwd: ROOT,
      env: env(task),
      stdout: "null",
      stderr: "piped",
    }).spawn();
  const procs = [spawn("api"), spawn("worker"), spawn("relay")];
  let jobId = "";
  try {
    await waitFor("the API", () => fetch(`http://127.0.0.1:${port}/healthz`).then((r) => r.ok, () => false), 20_000);
    const res = await fetch(`http://127.0.0.1:${port}/v1/summaries`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${key}`,
        "idempotency-key": "tracing-test-000001",
        "content-type": "application/json",
      },
      body: JSON.stringify({ text: "Revenue rose. Costs fell. The plan passed.", notify: "ops@example.com" }),
    });
    assert.equal(res.status, 202);
    jobId = (await res.json()).job_id;
    await waitFor("the email", () => mail.delivered.length === 1, 20_000);
  } finally {
    // A graceful stop flushes each process's spans.
    for (const p of procs) p.kill("SIGTERM");
    await Promise.all(procs.map(async (p) => {
      await p.status;
      await p.stderr.cancel();
    }));
  }
  try {
    const delivery = await waitFor(
      "the worker's delivery span",
      () => otlp.spans.find((s) => s.name === "job.delivery" && s.attributes["job.id"] === jobId),
      10_000,
    );
    const trace = otlp.spans.filter((s) => s.traceId === delivery.traceId);
    const named = (name: string) => trace.filter((s) => s.name === name);
    const services = new Set(trace.map((s) => s.service));
    assert.deepEqual([...services].sort(), ["oncely-api", "oncely-relay", "oncely-worker"], "three processes");
    // The POST (Deno.serve's span in the api) is the root the others descend from.
    const post = trace.find((s) => s.service === "oncely-api" && s.parentSpanId === "");
    assert.ok(post, `the POST span is in the trace: ${JSON.stringify(trace.map((s) => [s.service, s.name]))}`);
    assert.equal(delivery.parentSpanId, post.spanId, "the delivery continues the POST");
    assert.equal(named("job.queued")[0]?.parentSpanId, post.spanId);
    const [attempt] = named("model.attempt");
    assert.equal(attempt?.parentSpanId, delivery.spanId);
    assert.equal(attempt?.attributes.outcome, "ok");
    assert.equal(Number(attempt?.attributes["gen_ai.usage.input_tokens"]), 42);
    assert.equal(Number(attempt?.attributes["gen_ai.usage.output_tokens"]), 7);
    assert.equal(named("job.commit")[0]?.parentSpanId, delivery.spanId);
    const send = named("outbox.send")[0];
    assert.equal(send?.service, "oncely-relay");
    // The SDK's HTTP call to the model and the relay's call to the mail provider are Deno's own fetch spans.
    assert.ok(trace.some((s) => s.service === "oncely-worker" && s.parentSpanId === delivery.spanId && s !== attempt));
    assert.ok(trace.some((s) => s.service === "oncely-relay" && s.parentSpanId === send!.spanId));
  } finally {
    await otlp.close();
    await model.close();
    await mail.close();
    // Give the database index back: the tests and the bench share Redis's sixteen.
    await releaseRedisDatabase(redisUrl).catch(() => {});
    await db.close();
  }
});
