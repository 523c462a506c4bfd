import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { createAuthenticator } from "../../src/tenants/authenticator.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase } from "../_support.ts";

Deno.test("API-key lookups: unknown ids are cached apart and a flood of them never evicts a good key", async () => {
  const db = await createTestDatabase();
  try {
    let queries = 0;
    const counting = ((...args: Parameters<Sql>) => {
      queries++;
      return (db.sql as unknown as (...a: unknown[]) => unknown)(...args);
    }) as unknown as Sql;
    const auth = createAuthenticator({ sql: counting }, { mode: "api-key", cacheSize: 10, cacheTtlMs: 60_000 });
    const good = await createApiKey(db.sql, "acme");
    const as = (key: string) => auth(new Request("http://api/", { headers: { authorization: `Bearer ${key}` } }));
    assert.equal(await as(good), "acme");
    assert.equal(queries, 1);
    const invented = () => `onc_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}_${"A".repeat(43)}`;
    const flood = Array.from({ length: 50 }, invented);
    for (const key of flood) await assert.rejects(as(key), /not valid/);
    assert.equal(queries, 51, "one query per unknown id");
    await assert.rejects(as(flood[49]!), /not valid/);
    assert.equal(queries, 51, "a repeated unknown id is answered from its cache");
    assert.equal(await as(good), "acme");
    assert.equal(queries, 51, "the good key was not evicted by 50 misses in a cache of 10");
  } finally {
    await db.close();
  }
});
