/**
 * Each tenant's share of request bodies in flight: past it, a POST is refused (503, Retry-After) before its
 * body is read; other tenants are not affected; the share comes back when a run is handed to intake, or the
 * request fails.
 */
import assert from "node:assert/strict";
import { createBodyAdmission, declaredBytes } from "../../src/http/body_admission.ts";
import { serviceKeys } from "../../src/runs/keys.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { apiHandler } from "../support/fixtures.ts";
import { createTestDatabase, createTestRedis } from "../_support.ts";

Deno.test("a body admission counts each tenant's bytes, admits one large body alone, and gives back once", () => {
  const bodies = createBodyAdmission(1_000);
  const a = bodies.admit("acme", 600)!;
  assert.ok(a);
  assert.equal(bodies.admit("acme", 600), undefined, "past the share");
  assert.ok(bodies.admit("globex", 600), "another tenant's share is its own");
  const b = bodies.admit("acme", 400)!;
  assert.equal(bodies.inFlight("acme"), 1_000);
  a();
  a();
  assert.equal(bodies.inFlight("acme"), 400, "a release given twice counts once");
  b();
  assert.equal(bodies.inFlight("acme"), 0);
  const alone = bodies.admit("acme", 5_000);
  assert.ok(alone, "a body over the share is admitted when the tenant has nothing else in flight");
  assert.equal(bodies.admit("acme", 1), undefined);
  alone!();
  assert.ok(createBodyAdmission(0).admit("acme", 1e9), "0: no bound");
  const req = (length?: string) =>
    new Request("http://api/", { method: "POST", headers: length === undefined ? {} : { "content-length": length } });
  assert.equal(declaredBytes(req("120"), 4096), 120);
  assert.equal(declaredBytes(req(), 4096), 4096, "undeclared: the largest a body may be");
  assert.equal(declaredBytes(req("nonsense"), 4096), 4096);
});

Deno.test("a tenant past its share of bodies in flight is answered 503 before its body is read", async (t) => {
  const db = await createTestDatabase();
  const r = await createTestRedis();
  const keys = serviceKeys(r.prefix);
  const acme = await createApiKey(db.sql, "acme");
  const globex = await createApiKey(db.sql, "globex");
  const handler = apiHandler({ redis: r.redis, sql: db.sql, keys }, {
    authMode: "api-key",
    maxBodyBytes: 4096,
    bodies: createBodyAdmission(300),
  });
  const body = (text: string) => JSON.stringify({ text, notify: "ops@example.com" });
  let n = 0;
  const post = (key: string, payload: BodyInit, length: number) =>
    handler(
      new Request("http://api/v1/summaries", {
        method: "POST",
        headers: {
          authorization: `Bearer ${key}`,
          "idempotency-key": `admission-key-${String(++n).padStart(6, "0")}`,
          "content-type": "application/json",
          "content-length": String(length),
        },
        body: payload,
      }),
    );
  try {
    await t.step("while one of acme's bodies is being read, a second is refused unread; globex's passes", async () => {
      const first = body("Revenue rose. ".repeat(10));
      const bytes = new TextEncoder().encode(first);
      let send!: ReadableStreamDefaultController<Uint8Array>;
      const dripping = new ReadableStream<Uint8Array>({ start: (c) => void (send = c) });
      send.enqueue(bytes.slice(0, 10));
      const reading = post(acme, dripping, bytes.length);
      await new Promise((resolve) => setTimeout(resolve, 50));

      let pulled = false;
      // Pulled only when read (no high-water mark: nothing is pulled ahead).
      const second = new ReadableStream<Uint8Array>({
        pull(c) {
          pulled = true;
          c.enqueue(bytes);
          c.close();
        },
      }, { highWaterMark: 0 });
      const refused = await post(acme, second, bytes.length);
      assert.equal(refused.status, 503);
      assert.equal(refused.headers.get("retry-after"), "1");
      assert.match((await refused.json()).detail, /share/);
      assert.equal(pulled, false, "the refused body was never read");

      const other = await post(globex, body("Costs fell."), body("Costs fell.").length);
      assert.equal(other.status, 202, "another tenant's POST is not held by acme's");

      send.enqueue(bytes.slice(10));
      send.close();
      assert.equal((await reading).status, 202);
      const again = await post(acme, body("Costs fell."), body("Costs fell.").length);
      assert.equal(again.status, 202, "the share came back once the run went to intake");
    });

    await t.step("a body refused after it was read gives its share back", async () => {
      const bad = await post(acme, "{not json", 9);
      assert.equal(bad.status, 400);
      const ok = await post(acme, body("Revenue rose."), body("Revenue rose.").length);
      assert.equal(ok.status, 202);
    });
  } finally {
    await r.close();
    await db.close();
  }
});
