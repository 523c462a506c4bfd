import assert from "node:assert/strict";
import type { Sql } from "postgres";
import { allowValue } from "../../src/tenants/allow_list.ts";
import { createRecipientPolicy, MAIL_DOMAINS } from "../../src/tenants/mail_domains.ts";
import { createApiKey } from "../../src/tenants/tenant_store.ts";
import { createTestDatabase, waitFor } from "../_support.ts";

Deno.test("recipient policy: the lists in use are read in bulk, and a change shows within the TTL", async () => {
  const db = await createTestDatabase();
  try {
    const tenants = Array.from({ length: 50 }, (_, i) => `t${i}`);
    for (const tenant of tenants) await createApiKey(db.sql, tenant);
    await allowValue(db.sql, MAIL_DOMAINS, "t0", "example.com");
    let queries = 0;
    const counting = new Proxy(db.sql, {
      apply(target, self, args) {
        // The table's and column's names are helper calls of their own; only the query counts.
        if (Array.isArray(args[0])) queries++;
        return Reflect.apply(target as unknown as (...a: unknown[]) => unknown, self, args);
      },
    }) as unknown as Sql;
    let t = 0;
    const may = createRecipientPolicy({ sql: counting }, { ttlMs: 10_000, now: () => t });
    const first = await Promise.all(tenants.map((tenant) => may(tenant, "ops@other.org")));
    assert.deepEqual(first, tenants.map((tenant) => tenant !== "t0"), "t0 may email its domain only");
    assert.ok(queries <= 2, `the tenants asked for together were read together (${queries} queries)`);
    queries = 0;
    await allowValue(db.sql, MAIL_DOMAINS, "t0", "other.org");
    await allowValue(db.sql, MAIL_DOMAINS, "t1", "example.com");
    let shown = false;
    for (t = 1_000; t <= 10_000; t += 1_000) {
      const now = await Promise.all(tenants.map((tenant) => may(tenant, "ops@other.org")));
      if (now[0] && !now[1]) shown = true;
      // The bulk read started at 5 s: let it land before the clock moves on (a real one would not wait).
      if (t === 5_000) {
        await waitFor("the bulk read", async () => (await may("t0", "ops@other.org")) && !(await may("t1", "x@y.org")));
      }
    }
    assert.ok(shown, "both changes showed within the TTL");
    assert.equal(queries, 2, "a bulk read of the 50 lists every half TTL (at 5 s and 10 s), no request's own");
  } finally {
    await db.close();
  }
});
