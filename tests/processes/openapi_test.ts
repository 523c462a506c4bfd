import assert from "node:assert/strict";
import { z } from "zod";
import { silentLogger } from "../../src/log/logger.ts";
import { createApiHandler } from "../../src/processes/api_process.ts";
import { openApiDocument, ROUTES } from "../../src/processes/openapi.ts";
import { MAX_EXPIRES_IN_S, RunDocument, RunRequest } from "../../src/runs/run_schemas.ts";
import { RunWebhook, SummaryRequest } from "../../src/runs/shapes.ts";
import { type Intake, QueueFull } from "../../src/runs/intake.ts";
import { NotReplicated } from "../../src/redis/replica_ack.ts";
import type { Redis } from "ioredis";
import type { Sql } from "postgres";

// Routing needs no Redis or Postgres until a handler runs; these stand-ins are never called.
const unused = new Proxy({}, {
  get() {
    throw new Error("not used");
  },
});

Deno.test("openapi.json documents exactly the routes the handler serves", async () => {
  const handler = createApiHandler({
    redis: unused as Redis,
    sql: unused as Sql,
    log: silentLogger,
    authenticate: () => Promise.reject(Object.assign(new Error("no"), { status: 401 })),
    intake: unused as never,
    keys: unused as never,
    maxBodyBytes: 1024,
  });
  const res = await handler(new Request("http://api/openapi.json"));
  assert.equal(res.status, 200);
  const doc = await res.json();
  assert.equal(doc.openapi, "3.1.0");
  assert.deepEqual(doc, JSON.parse(JSON.stringify(openApiDocument())));
  const documented = Object.entries(doc.paths as Record<string, Record<string, unknown>>)
    .flatMap(([path, ops]) => Object.keys(ops).map((method) => `${method} ${path}`)).sort();
  assert.deepEqual(documented, ROUTES.map((r) => `${r.method} ${r.path}`).sort());
  for (const { method, path } of ROUTES) {
    const url = `http://api${path.replace("{job_id}", crypto.randomUUID())}`;
    const r = await handler(new Request(url, { method: method.toUpperCase() }));
    const body = await r.text();
    assert.doesNotMatch(body, /No route for/, `${method} ${path} is served`);
    assert.notEqual(r.status, 405, `${method} ${path} accepts ${method}`);
  }
  const missing = await handler(new Request("http://api/v2/nothing"));
  assert.equal(missing.status, 404);
  await missing.body?.cancel();
});

Deno.test("openapi.json's request schema is the zod schema that validates requests", () => {
  const doc = openApiDocument() as { components: { schemas: Record<string, Record<string, unknown>> } };
  const { $schema: _, ...expected } = z.toJSONSchema(SummaryRequest, { io: "input" }) as Record<string, unknown>;
  assert.deepEqual(doc.components.schemas.SummaryRequest, expected);
  const schema = doc.components.schemas.SummaryRequest as { required: string[]; additionalProperties: boolean };
  assert.deepEqual(schema.required.sort(), ["notify", "text"]);
  assert.equal(schema.additionalProperties, false);
});

Deno.test("openapi.json is clean under redocly lint's recommended rules (tests/openapi/redocly.yaml)", async () => {
  const dir = await Deno.makeTempDir({ prefix: "oncely-openapi-" });
  try {
    const file = `${dir}/openapi.json`;
    await Deno.writeTextFile(file, JSON.stringify(openApiDocument(), null, 2));
    const config = decodeURIComponent(new URL("../openapi/redocly.yaml", import.meta.url).pathname);
    // Run from the temporary directory without the project's config or lock: a tool only this test uses.
    const { code, stdout, stderr } = await new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "--allow-all",
        "--no-config",
        "--no-lock",
        "npm:@redocly/cli@2.77.0",
        "lint",
        "--config",
        config,
        "--format",
        "stylish",
        file,
      ],
      cwd: dir,
      env: { NO_COLOR: "1", REDOCLY_TELEMETRY: "off", REDOCLY_SUPPRESS_UPDATE_NOTICE: "true" },
    }).output();
    const out = new TextDecoder().decode(stdout) + new TextDecoder().decode(stderr);
    assert.equal(code, 0, out);
    assert.doesNotMatch(out, /\b(error|warning)\b/, out);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("a run's input is an object of any properties, so generated types accept a real input", () => {
  const doc = openApiDocument() as { components: { schemas: Record<string, { properties: Record<string, unknown> }> } };
  const input = doc.components.schemas.RunRequest!.properties.input as Record<string, unknown>;
  assert.equal(input.type, "object");
  // Without it, openapi-typescript types `input` as Record<string, never>.
  assert.deepEqual(input.additionalProperties, {});
});

Deno.test("every body the document describes refers to one of its components by name, and each component is used", () => {
  const doc = openApiDocument() as {
    components: { schemas: Record<string, unknown> };
    paths: Record<string, Record<string, unknown>>;
    webhooks: Record<string, unknown>;
  };
  const refs: string[] = [];
  const walk = (node: unknown): void => {
    if (Array.isArray(node)) return node.forEach(walk);
    if (typeof node !== "object" || node === null) return;
    for (const [key, value] of Object.entries(node)) {
      if (key === "content") {
        for (const media of Object.values(value as Record<string, { schema?: { $ref?: string } }>)) {
          // A body without a schema (/metrics' text, this document) says only its media type.
          if (media.schema) refs.push(media.schema.$ref ?? `inline: ${JSON.stringify(media.schema)}`);
        }
      } else walk(value);
    }
  };
  walk([doc.paths, doc.webhooks]);
  assert.ok(refs.length > 20, `${refs.length} bodies`);
  for (const ref of refs) {
    const name = /^#\/components\/schemas\/(\w+)$/.exec(ref)?.[1];
    assert.ok(name !== undefined && name in doc.components.schemas, ref);
  }
  assert.deepEqual(
    Object.keys(doc.components.schemas).filter((name) => !refs.includes(`#/components/schemas/${name}`)),
    [],
    "every component is used",
  );
});

Deno.test("openapi.json describes priority and expiry: the request fields, expired, the 409, run.expired", () => {
  type Schema = { type?: string; enum?: string[]; minimum?: number; maximum?: number; $ref?: string };
  type Body = { description?: string; content: Record<string, { schema: Schema }> };
  type Operation = { operationId: string; summary: string; requestBody: Body; responses: Record<string, Body> };
  const doc = openApiDocument() as {
    components: { schemas: Record<string, { properties: Record<string, Schema>; required?: string[] }> };
    paths: Record<string, Record<string, Operation>>;
    webhooks: Record<string, { post: Operation }>;
  };
  const { schemas } = doc.components;
  const refOf = (body: Body, media = "application/json") => body.content[media]!.schema.$ref;

  // The run request: the zod schema that validates it, both fields optional.
  const { $schema: _, ...expected } = z.toJSONSchema(RunRequest, { io: "input", unrepresentable: "any" });
  assert.deepEqual(schemas.RunRequest, expected);
  assert.equal(refOf(doc.paths["/v1/tasks/{name}/runs"]!.post!.requestBody), "#/components/schemas/RunRequest");
  const { priority, expires_in } = schemas.RunRequest!.properties;
  assert.deepEqual(priority!.enum, RunRequest.shape.priority.unwrap().options);
  assert.deepEqual([priority!.type, priority!.enum], ["string", ["high", "normal", "low", "batch"]], "README's four");
  assert.deepEqual(
    { type: expires_in!.type, minimum: expires_in!.minimum, maximum: expires_in!.maximum },
    { type: "integer", minimum: 1, maximum: MAX_EXPIRES_IN_S },
  );
  assert.equal(MAX_EXPIRES_IN_S, 604_800, "7 days, as the README says");
  const required = schemas.RunRequest!.required ?? [];
  assert.ok(!required.includes("priority") && !required.includes("expires_in"), "both optional");

  // A run's status, as GET, DELETE and a finished wait answer it: expired is one.
  const status = schemas.Run!.properties.status!;
  assert.deepEqual(status.enum, RunDocument.shape.status.options);
  assert.ok(status.enum!.includes("expired"));
  const run = doc.paths["/v1/runs/{run_id}"]!;
  assert.equal(refOf(run.get!.responses["200"]!), "#/components/schemas/Run");

  // Cancelling a finished run, an expired one included, is a 409 problem.
  const conflict = run.delete!.responses["409"]!;
  assert.match(conflict.description!, /expired/);
  assert.equal(refOf(conflict, "application/problem+json"), "#/components/schemas/Problem");

  // The run.expired webhook: named by its event type, as the document's other webhooks are, its body a
  // RunWebhook whose type and status name it.
  const hook = doc.webhooks["run.expired"]!.post;
  assert.equal(hook.operationId, "runExpired");
  assert.match(hook.summary, /expires_in/);
  assert.equal(refOf(hook.requestBody), "#/components/schemas/RunWebhook");
  const webhook = schemas.RunWebhook!.properties;
  assert.deepEqual(webhook.type!.enum, RunWebhook.shape.type.options);
  assert.ok(webhook.type!.enum!.includes("run.expired"));
  assert.deepEqual(webhook.status!.enum, RunWebhook.shape.status.options);
  assert.ok(webhook.status!.enum!.includes("expired"));
  // Every run event the webhook body names is a webhook of the document.
  for (const type of webhook.type!.enum!) assert.ok(type in doc.webhooks, type);
});

Deno.test("openapi.json: the door's POSTs document the 400, 413, 415 and 503 their handlers answer, in OpenAI's shape", async () => {
  type Reply = { content?: Record<string, { schema?: { $ref?: string } }>; headers?: Record<string, unknown> };
  const doc = openApiDocument() as { paths: Record<string, Record<string, { responses: Record<string, Reply> }>> };
  const OPENAI_ERROR = "#/components/schemas/OpenAIError";
  const valid: Record<string, unknown> = {
    "/v1/chat/completions": { model: "fake-model", messages: [{ role: "user", content: "hi" }] },
    "/v1/responses": { model: "fake-model", input: "hi" },
  };

  // What is documented: each error is OpenAI's JSON error, not a problem document (the door's own 500 included).
  for (const path of Object.keys(valid)) {
    const { responses } = doc.paths[path]!.post!;
    for (const status of ["400", "401", "404", "408", "413", "415", "422", "429", "500", "503"]) {
      const content = responses[status]?.content ?? {};
      assert.deepEqual(Object.keys(content), ["application/json"], `${path} ${status}`);
      assert.equal(content["application/json"]!.schema!.$ref, OPENAI_ERROR, `${path} ${status}`);
    }
    assert.ok(responses["503"]!.headers?.["Retry-After"], `${path} 503 says when to retry`);
    assert.ok(responses["503"]!.headers?.["x-should-retry"], `${path} 503 says whether the SDK may retry`);
  }
  assert.equal(
    doc.paths["/v1/chat/completions"]!.post!.responses["409"]!.content!["application/json"]!.schema!.$ref,
    OPENAI_ERROR,
  );
  for (
    const [path, method] of [
      ["/v1/responses/{response_id}", "get"],
      ["/v1/responses/{response_id}/cancel", "post"],
    ] as const
  ) {
    for (const status of ["401", "404", "500"]) {
      const reply = doc.paths[path]![method]!.responses[status]!;
      assert.equal(reply.content?.["application/json"]?.schema?.$ref, OPENAI_ERROR, `${method} ${path} ${status}`);
    }
  }
  // A chat completion may be a stream; a response may not (stream: true is a 422 there).
  const ok = (path: string) => Object.keys(doc.paths[path]!.post!.responses["200"]!.content!);
  assert.deepEqual(ok("/v1/chat/completions"), ["application/json", "text/event-stream"]);
  assert.deepEqual(ok("/v1/responses"), ["application/json"]);

  // What is answered: the real handler, before any store is reached (intake and body admission are stand-ins).
  let intakeFailure: Error = new QueueFull("the queue is full", 5);
  let bodiesFull = false;
  const intake: Intake = {
    submit: () => Promise.reject(intakeFailure),
    submitRun: () => Promise.reject(intakeFailure),
    hasRecord: () => Promise.resolve(false),
    forget: () => Promise.resolve(),
  };
  const handler = createApiHandler({
    redis: unused as Redis,
    sql: unused as Sql,
    log: silentLogger,
    authenticate: () => Promise.resolve("acme"),
    intake,
    keys: unused as never,
    maxBodyBytes: 1024,
    bodies: { admit: () => bodiesFull ? undefined : () => {}, inFlight: () => 0 },
  });
  const answered: string[] = [];
  const post = async (path: string, body: string, headers: Record<string, string> = {}) => {
    const res = await handler(
      new Request(`http://api${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", ...headers },
        body,
      }),
    );
    const error = (await res.json()).error;
    const documented = doc.paths[path]!.post!.responses[String(res.status)];
    assert.ok(documented, `${path} answered an undocumented ${res.status}`);
    assert.equal(res.headers.get("content-type"), "application/json", `${path} ${res.status}`);
    assert.deepEqual(Object.keys(error).sort(), ["code", "message", "param", "type"], `${path} ${res.status}`);
    answered.push(`${path} ${res.status}`);
    return { status: res.status, headers: res.headers, error };
  };
  for (const [path, body] of Object.entries(valid)) {
    const json = JSON.stringify(body);
    assert.equal((await post(path, json, { "content-type": "text/plain" })).status, 415);
    assert.equal((await post(path, JSON.stringify({ ...body as object, pad: "x".repeat(2048) }))).status, 413);
    assert.equal((await post(path, "{not json")).status, 400);
    const badKey = await post(path, json, { "idempotency-key": "short" });
    assert.deepEqual([badKey.status, badKey.error.param], [400, "Idempotency-Key"]);
    intakeFailure = new QueueFull("the queue is full", 5);
    const full = await post(path, json);
    assert.deepEqual([full.status, full.headers.get("retry-after")], [503, "5"]);
    intakeFailure = new NotReplicated("too few replicas", { acked: 0, wanted: 1, timeoutMs: 10, ran: true });
    const unconfirmed = await post(path, json);
    assert.deepEqual([unconfirmed.status, unconfirmed.headers.get("x-should-retry")], [503, "false"]);
    bodiesFull = true;
    const share = await post(path, json);
    assert.deepEqual([share.status, share.headers.get("retry-after")], [503, "1"]);
    bodiesFull = false;
  }
  assert.equal(answered.length, 14);
});
