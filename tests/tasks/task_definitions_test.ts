/**
 * Task definitions over the real API handler and Postgres: versions by
 * content, tenants' isolation, and what a definition may not hold (schemas
 * too large, not compilable, with a pathological pattern; placeholders the
 * input schema does not allow).
 */
import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { compileSchema, SchemaRefused } from "../../src/tasks/json_schema.ts";
import { checkDefinition, DefinitionRefused, renderTemplate } from "../../src/tasks/definition.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { tasksCommand } from "../../src/cli/tasks_command.ts";
import { TASK_LIMITS } from "../../src/jobs/task_store.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

const TICKET = {
  system: "You sort support tickets.",
  prompt: "Classify this ticket from {{input.customer.name}}:\n\n{{input.body}}",
  input_schema: {
    type: "object",
    properties: {
      body: { type: "string", maxLength: 20_000 },
      customer: { type: "object", properties: { name: { type: "string" } } },
    },
    required: ["body"],
  },
  output_schema: {
    type: "object",
    properties: { category: { enum: ["billing", "bug", "other"] }, urgent: { type: "boolean" } },
    required: ["category", "urgent"],
    additionalProperties: false,
  },
  max_output_tokens: 200,
};

Deno.test("task definitions", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, { authMode: "api-key" });
  const acme = await createApiKey(db.sql, "acme");
  const beta = await createApiKey(db.sql, "beta");
  const call = async (key: string, method: string, path: string, body?: unknown) => {
    const res = await api(
      new Request(`http://api${path}`, {
        method,
        headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
      }),
    );
    return { status: res.status, headers: res.headers, body: await res.json() };
  };
  try {
    await t.step(
      "PUT creates version 1 (201); the same body again is 200 with version 1; a change is 201 with 2",
      async () => {
        const first = await call(acme, "PUT", "/v1/tasks/ticket", TICKET);
        assert.equal(first.status, 201);
        assert.equal(first.body.version, 1);
        assert.equal(first.headers.get("location"), "/v1/tasks/ticket/versions/1");
        assert.equal(first.body.prompt, TICKET.prompt);
        assert.ok(Date.parse(first.body.created_at) > 0);
        // The same definition, its keys in another order: the same version.
        const reordered = Object.fromEntries(Object.entries(TICKET).reverse());
        const again = await call(acme, "PUT", "/v1/tasks/ticket", reordered);
        assert.equal(again.status, 200);
        assert.equal(again.body.version, 1);
        const changed = await call(acme, "PUT", "/v1/tasks/ticket", { ...TICKET, temperature: 0 });
        assert.equal(changed.status, 201);
        assert.equal(changed.body.version, 2);
        assert.equal((await call(acme, "GET", "/v1/tasks/ticket")).body.version, 2);
        assert.equal((await call(acme, "GET", "/v1/tasks/ticket/versions/1")).body.temperature, undefined);
        assert.equal((await call(acme, "GET", "/v1/tasks/ticket/versions/3")).status, 404);
      },
    );

    await t.step("two different bodies at once become versions 3 and 4, never one number twice", async () => {
      const [a, b] = await Promise.all([
        call(acme, "PUT", "/v1/tasks/ticket", { ...TICKET, temperature: 0.5 }),
        call(acme, "PUT", "/v1/tasks/ticket", { ...TICKET, temperature: 1 }),
      ]);
      assert.deepEqual([a.status, b.status], [201, 201]);
      assert.deepEqual([a.body.version, b.body.version].sort(), [3, 4]);
    });

    await t.step("another tenant's task is unknown; summarize is built in for everyone and cannot be put", async () => {
      assert.equal((await call(beta, "GET", "/v1/tasks/ticket")).status, 404);
      const listed = await call(beta, "GET", "/v1/tasks");
      assert.deepEqual(listed.body.tasks.map((x: { name: string }) => x.name), ["summarize"]);
      const acmeList = await call(acme, "GET", "/v1/tasks");
      assert.deepEqual(acmeList.body.tasks.map((x: { name: string; version: number }) => [x.name, x.version]), [
        ["summarize", 1],
        ["ticket", 4],
      ]);
      assert.equal((await call(acme, "GET", "/v1/tasks/summarize")).body.built_in, true);
      assert.equal((await call(acme, "PUT", "/v1/tasks/summarize", TICKET)).status, 409);
    });

    await t.step("a bad definition is a 422 naming where, and nothing is stored", async () => {
      const refused = async (body: unknown, pointer: string, says: RegExp) => {
        const res = await call(acme, "PUT", "/v1/tasks/bad", body);
        assert.equal(res.status, 422, JSON.stringify(res.body));
        assert.equal(res.body.errors[0].pointer, pointer, JSON.stringify(res.body));
        assert.match(res.body.detail + res.body.errors[0].message, says);
      };
      await refused({ ...TICKET, prompt: "Hi {{input.nobody}}" }, "/prompt", /input\.nobody/);
      await refused({ ...TICKET, system: "{{input.customer.age}}" }, "/system", /input\.customer\.age/);
      await refused({ ...TICKET, input_schema: { type: "array" } }, "/input_schema/type", /describe an object/);
      await refused({ ...TICKET, input_schema: { type: "objekt" } }, "/input_schema/type", /2020-12/);
      await refused(
        { ...TICKET, output_schema: { type: "string", pattern: "^(a+)+$" } },
        "/output_schema/pattern",
        /unbounded time/,
      );
      await refused(
        { ...TICKET, input_schema: { ...TICKET.input_schema, description: "x".repeat(70_000) } },
        "/input_schema",
        /65536/,
      );
      await refused({ ...TICKET, output_schema: { $ref: "https://example.com/s.json" } }, "/output_schema/$ref", /#/);
      await refused({ ...TICKET, max_output_tokens: 0 }, "/max_output_tokens", /./);
      await refused({ ...TICKET, colour: "blue" }, "", /colour/);
      assert.equal((await call(acme, "GET", "/v1/tasks/bad")).status, 404);
      // What is stored: the four versions of ticket, nothing of the refused PUTs, nothing of summarize.
      const rows = await db.sql<{ tenant: string; name: string; n: number }[]>`
        SELECT tenant, name, count(*)::int AS n FROM tasks GROUP BY tenant, name ORDER BY tenant, name`;
      assert.deepEqual(rows.map((r) => [r.tenant, r.name, r.n]), [["acme", "ticket", 4]]);
    });

    await t.step("a task at its version cap, or a tenant at its task cap, gets 409 and stores nothing", async () => {
      await db.sql`
        INSERT INTO tasks (tenant, name, version, definition)
        SELECT 'capped', 'full', v, ${
        db.sql.json({ v: 0 })
      } FROM generate_series(1, ${TASK_LIMITS.maxVersionsPerTask}) AS v`;
      await db.sql`
        INSERT INTO tasks (tenant, name, version, definition)
        SELECT 'capped', 't' || i, 1, ${
        db.sql.json({})
      } FROM generate_series(2, ${TASK_LIMITS.maxTasksPerTenant}) AS i`;
      const capped = await createApiKey(db.sql, "capped");
      const full = await call(capped, "PUT", "/v1/tasks/full", TICKET);
      assert.equal(full.status, 409, JSON.stringify(full.body));
      assert.match(full.body.detail, /versions/);
      const another = await call(capped, "PUT", "/v1/tasks/another", TICKET);
      assert.equal(another.status, 409, JSON.stringify(another.body));
      assert.match(another.body.detail, /tasks/);
      const [stored] = await db.sql<{ n: number }[]>`SELECT count(*)::int AS n FROM tasks WHERE tenant = 'capped'`;
      assert.equal(stored!.n, TASK_LIMITS.maxVersionsPerTask + TASK_LIMITS.maxTasksPerTenant - 1);
    });

    await t.step("deno task tasks list and show print the definitions", async () => {
      const lines: string[] = [];
      assert.equal(await tasksCommand(db.sql, ["list", "--tenant", "acme", "--json"], (l) => lines.push(l)), 0);
      const rows = lines.map((l) => JSON.parse(l));
      assert.deepEqual(rows.map((x) => [x.tenant, x.name, x.version, x.output]), [["acme", "ticket", 4, "json"]]);
      lines.length = 0;
      assert.equal(await tasksCommand(db.sql, ["show", "acme", "ticket", "--version", "1"], (l) => lines.push(l)), 0);
      const shown = JSON.parse(lines.join("\n"));
      assert.equal(shown.version, 1);
      assert.deepEqual(shown.output_schema, TICKET.output_schema);
      assert.equal(await tasksCommand(db.sql, ["show", "beta", "ticket"], () => {}), 1);
      assert.equal(await tasksCommand(db.sql, ["show", "acme"], () => {}), 2);
    });
  } finally {
    await r.close();
    await db.close();
  }
});

Deno.test("a tenant's pathological pattern is refused before it can run, and a safe one validates at once", () => {
  for (const pattern of ["^(a+)+$", "^(a|a)*$", "^(a|aa)+$", "(x)\\1", "^(?=a)a$", "a{1,9}".repeat(11)]) {
    assert.throws(() => compileSchema({ type: "string", pattern }), SchemaRefused, pattern);
  }
  const safe = compileSchema({ type: "string", pattern: "^[a-z0-9._-]+@[a-z0-9.-]+$", maxLength: 300_000 });
  const started = performance.now();
  assert.equal(safe.validate("a".repeat(200_000) + "!").length, 1);
  // Not a speed check: a catastrophic pattern on this input would not return at all.
  assert.ok(performance.now() - started < 5_000);
});

Deno.test("schemas that would stall or crash a validation are refused where they break the rules", () => {
  const refused = (schema: unknown, pointer: string | null, says: RegExp) => {
    assert.throws(() => compileSchema(schema), (e: unknown) => {
      assert.ok(e instanceof SchemaRefused, String(e));
      if (pointer !== null) assert.equal(e.pointer, pointer, e.message);
      assert.match(e.message, says);
      return true;
    });
  };
  // Nested keywords are checked against the meta-schema too.
  refused(
    { type: "object", properties: { a: { type: "string", pattern: ["^(a+)+$"] } } },
    "/properties/a/pattern",
    /2020-12/,
  );
  refused({ type: "object", properties: { a: { enum: 5 } } }, "/properties/a/enum", /2020-12/);
  refused({ type: "object", properties: { a: { type: "foo" } } }, "/properties/a/type", /2020-12/);
  // References: cycles that never go into the value, names that resolve to nothing, dynamic scope.
  refused({ type: "object", $ref: "#" }, "/$ref", /cycle/);
  refused(
    { $defs: { a: { $ref: "#/$defs/b" }, b: { $ref: "#/$defs/a" } }, $ref: "#/$defs/a" },
    "/$defs/b/$ref",
    /cycle/,
  );
  refused({ $ref: "#/$defs/nope" }, "/$ref", /names nothing/);
  refused({ $ref: "#/%" }, "/$ref", /2020-12|names nothing/);
  refused({ $dynamicRef: "#/nope" }, "/$dynamicRef", /not supported/);
  // Older drafts' keywords the validator would still follow: a moved base URI, uncounted subschemas.
  refused({ type: "object", properties: { a: { id: "http://x/", $ref: "#" } } }, "/properties/a/id", /2020-12/);
  refused({ type: "object", dependencies: { a: { $ref: "#" } } }, "/dependencies", /dependentSchemas/);
  // A property named id is a name, not the keyword.
  compileSchema({ type: "object", properties: { id: { type: "string" } } });
  // An anyOf of five references to an anyOf of five... : exponential work without a regex.
  const defs: Record<string, unknown> = { d0: { type: "integer" } };
  for (let i = 1; i <= 10; i++) {
    defs[`d${i}`] = { anyOf: Array.from({ length: 5 }, () => ({ $ref: `#/$defs/d${i - 1}` })) };
  }
  refused({ $defs: defs, $ref: "#/$defs/d10" }, null, /more than 1000 subschemas/);
  // The JSON itself: too deep, unstorable text, a number JSON cannot round-trip.
  let deep: Record<string, unknown> = { type: "string" };
  for (let i = 0; i < 100; i++) deep = { type: "object", properties: { a: deep } };
  assert.throws(() => compileSchema(deep), /nested more than 64/);
  refused({ type: "string", description: "a\u0000b" }, "/description", /NUL/);
  refused({ type: "number", maximum: JSON.parse("1e400") }, "/maximum", /too large/);
  // A recursive schema that does go into the value is fine.
  compileSchema({ type: "object", properties: { child: { $ref: "#" } } });
});

Deno.test("a placeholder check never runs a tenant's pattern, and stays bounded", () => {
  const base = { prompt: "{{input.a}}", max_output_tokens: 10 };
  const slow = "\\d+\\d+\\d+$";
  assert.throws(
    () =>
      checkDefinition({
        ...base,
        prompt: `{{input.${"1".repeat(1200)}x}}`,
        input_schema: { type: "object", patternProperties: { [slow]: {} } },
      }),
    DefinitionRefused,
  );
  assert.throws(
    () => checkDefinition({ ...base, input_schema: { type: "object" }, output_schema: { type: "string" } }),
    /output_schema must describe an object/,
  );
  assert.throws(
    () =>
      checkDefinition({
        ...base,
        input_schema: { type: "object", properties: { a: { type: "string" } } },
        output_schema: { type: "object", properties: { x: { type: "string" } } },
      }),
    /additionalProperties/,
  );
});

Deno.test("templates substitute {{input.path}} values and nothing else", () => {
  const input = { body: "It broke {{input.body}}", customer: { name: "Ada" }, n: 3, list: [1, 2] };
  assert.equal(
    renderTemplate(
      "{{input.customer.name}}: {{input.body}} ({{input.n}}, {{input.list}}, {{input.none}}, {{other}})",
      input,
    ),
    "Ada: It broke {{input.body}} (3, [1,2], , {{other}})",
  );
  assert.equal(renderTemplate("[{{input.constructor}}][{{input.toString}}]", {}), "[][]", "own properties only");
});

Deno.test("a violation's pointer is a JSON pointer into the value, not the validator's encoded URI fragment", () => {
  const schema = compileSchema({
    type: "object",
    properties: { "a b/é": { type: "object", properties: { "x%y": { type: "integer" } } } },
  });
  assert.deepEqual(schema.validate({ "a b/é": { "x%y": "no" } }).map((v) => v.pointer), ["/a b~1é/x%y"]);
});
