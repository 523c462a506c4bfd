/**
 * The limits of input validation at intake: validations that need a
 * validation Worker are capped per tenant (and in all), so a tenant's flood
 * past its cap is answered `503` with `Retry-After` at once and records
 * nothing, while another tenant's run is accepted, and a refused request sent
 * again later is accepted as a new run; an input whose validation is
 * estimated past a Worker's bound is a `422` on `/input`, and never runs.
 */
import assert from "node:assert/strict";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createSchemaValidators } from "../../src/tasks/validator.ts";
import { apiHandler, jsonClient } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("a tenant's flood of validations past its cap is a 503 with Retry-After, and another tenant is served", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  // One Worker, every validation on it, at most two of a tenant's waiting for it or running.
  const validators = createSchemaValidators({ workers: 1, fastPathUnits: 0, maxPendingPerTenant: 2 });
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    validate: validators.validate,
  });
  const acme = jsonClient(api, await createApiKey(db.sql, "acme"));
  const globex = jsonClient(api, await createApiKey(db.sql, "globex"));
  const task = {
    prompt: "Sum {{input.items}}",
    input_schema: {
      type: "object",
      properties: { items: { type: "array", items: { type: "object", properties: { a: { type: "string" } } } } },
    },
  };
  // Tens of milliseconds on the Worker each.
  const input = { items: Array.from({ length: 10_000 }, () => ({ a: "x" })) };
  try {
    for (const client of [acme, globex]) assert.equal((await client("PUT", "/v1/tasks/bulk", task)).status, 201);
    const post = (client: typeof acme, key: string) =>
      client("POST", "/v1/tasks/bulk/runs", { input }, { "idempotency-key": key });
    const [flood, other] = await Promise.all([
      Promise.all(Array.from({ length: 8 }, (_, i) => post(acme, `flood-${i}-000000000000`))),
      post(globex, "other-0-000000000000"),
    ]);
    const refused = flood.flatMap((res, i) => (res.status === 503 ? [i] : []));
    assert.ok(refused.length >= 1, `statuses: ${flood.map((res) => res.status).join(", ")}`);
    for (const res of flood) assert.ok(res.status === 202 || res.status === 503, JSON.stringify(res.body));
    for (const i of refused) {
      assert.equal(flood[i]!.headers.get("retry-after"), "1");
      assert.match(flood[i]!.body.detail, /Too many schema validations are waiting for a Worker \(2 of this tenant's/);
    }
    assert.equal(other.status, 202, "another tenant has a cap of its own");
    // A refused request recorded nothing: sent again, it is a new run, not a replay.
    for (const i of refused) {
      const again = await post(acme, `flood-${i}-000000000000`);
      assert.equal(again.status, 202, JSON.stringify(again.body));
      assert.equal(again.headers.get("idempotent-replayed"), null);
    }
    assert.equal(validators.pool().pending, 0);
  } finally {
    await validators.close();
    await r.close();
    await db.close();
  }
});

Deno.test("an input estimated past a Worker's bound is a 422 on /input, and never runs", async () => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const validators = createSchemaValidators();
  const api = apiHandler({ redis: r.redis, sql: db.sql, keys: serviceKeys(r.prefix) }, {
    authMode: "api-key",
    validate: validators.validate,
    validateNow: validators.validateNow,
  });
  const acme = jsonClient(api, await createApiKey(db.sql, "acme"));
  // Both branches recurse into the same property: a tree of depth d is 2^d evaluations.
  const node = { anyOf: [0, 1].map(() => ({ properties: { a: { $ref: "#/$defs/node" } } })) };
  const task = {
    prompt: "Walk {{input.tree}}",
    input_schema: { type: "object", properties: { tree: { $ref: "#/$defs/node" } }, $defs: { node } },
  };
  const nested = (depth: number): unknown => (depth === 0 ? {} : { a: nested(depth - 1) });
  try {
    assert.equal((await acme("PUT", "/v1/tasks/tree", task)).status, 201);
    const deep = await acme("POST", "/v1/tasks/tree/runs", { input: { tree: nested(40) } }, {
      "idempotency-key": "tree-deep-000000000000",
    });
    assert.equal(deep.status, 422, JSON.stringify(deep.body));
    assert.equal(deep.body.errors[0].pointer, "/input");
    // Refused by its estimate; on a loaded machine the estimate itself (stopped at 200,000 units, about 20 ms)
    // may run past the 250 ms deadline first: a 422 on /input either way, and the validation never runs.
    assert.match(
      deep.body.errors[0].message,
      /would take too long \(estimated at more than 200000 units|took longer than 250 ms/,
    );
    const shallow = await acme("POST", "/v1/tasks/tree/runs", { input: { tree: nested(4) } }, {
      "idempotency-key": "tree-shallow-000000000",
    });
    assert.equal(shallow.status, 202, JSON.stringify(shallow.body));
  } finally {
    await validators.close();
    await r.close();
    await db.close();
  }
});
